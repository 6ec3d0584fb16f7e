"""Chunks by id: what a citation ``[chunk 12, path:10-58]`` points at.  Another tenant's chunk is not found."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from rlm_workers.engine import MAX_BIGINT, ChunkView, InvalidInput

from ..deps import ConnDep, TenantDep
from ..views import chunk_views

router = APIRouter(prefix="/v1/chunks", tags=["chunks"])

#: most chunks one ``GET /v1/chunks?ids=`` returns
MAX_IDS = 200


def parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(p) for p in raw.split(",") if p.strip()]
    except ValueError:
        raise InvalidInput(f"ids: expected chunk ids separated by commas, got {raw[:80]!r}") from None
    if not ids:
        raise InvalidInput("ids: give at least one chunk id")
    if len(ids) > MAX_IDS:
        raise InvalidInput(f"ids: at most {MAX_IDS} chunk ids per request, got {len(ids)}")
    if any(i < 1 or i > MAX_BIGINT for i in ids):
        raise InvalidInput("ids: chunk ids are positive integers")
    return ids


@router.get("", response_model=list[ChunkView])
def get_many(
    conn: ConnDep,
    tenant: TenantDep,
    ids: Annotated[str, Query(max_length=4000, description="Chunk ids separated by commas, e.g. 12,40,41.")],
) -> list[ChunkView]:
    """Several chunks at once, in the order given; ids that are not the caller's are left out."""
    return chunk_views(conn, tenant=tenant, ids=parse_ids(ids))


@router.get("/{chunk_id}", response_model=ChunkView, responses={404: {"description": "no such chunk"}})
def get_one(chunk_id: int, conn: ConnDep, tenant: TenantDep) -> ChunkView:
    """One chunk's text, buffer, path and lines."""
    found = chunk_views(conn, tenant=tenant, ids=[chunk_id])
    if not found:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no chunk {chunk_id}")
    return found[0]
