"""Uploads handed to the ingest workers (``POST /v1/buffers?wait=false``): follow one until it is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter

from rlm_workers.engine import get_upload as stored_upload

from ..deps import ConnDep, TenantDep, found_or_404
from ..schemas import ErrorBody, UploadView

if TYPE_CHECKING:
    from rlm_workers.engine import UploadRow

router = APIRouter(prefix="/v1/uploads", tags=["buffers"])


def upload_view(up: UploadRow) -> UploadView:
    return UploadView(
        upload_id=up.id,
        buffer=up.buffer,
        status=up.status,
        files=up.files,
        bytes=up.bytes,
        attempts=up.attempts,
        created_at=up.created_at,
        finished_at=up.finished_at,
        report=up.report,
        error=ErrorBody.from_record(up.error),
        groups=up.groups,
        groups_done=up.groups_done,
    )


@router.get(
    "/{upload_id}",
    response_model=UploadView,
    responses={404: {"description": "no such upload for this tenant"}},
)
def get_upload(upload_id: str, conn: ConnDep, tenant: TenantDep) -> UploadView:
    """``queued`` → ``running`` → ``done`` (with the loader's report) or ``failed`` (with the reason)."""
    return upload_view(found_or_404(lambda i: stored_upload(conn, upload_id=i, tenant=tenant), upload_id, "upload"))
