"""Query jobs: submit (202, idempotent), follow, cancel.  Another tenant's id is simply not found."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Header, Query, Response, status

from rlm_workers.engine import cancel_query, get_job, submit_query

from ..deps import ConnDep, ParseOffLoop, TenantDep, found_or_404
from ..schemas import JobList, JobStatusName, JobView, QueryAccepted, QueryRequest
from ..ui.render import report_html
from ..views import job_page, job_view

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.engine import JobRow

router = APIRouter(prefix="/v1/queries", tags=["queries"], route_class=ParseOffLoop)
#: typed as FastAPI's ``responses`` takes it (a dict is invariant: an inferred ``dict[int, …]`` does not fit)
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no such job for this tenant"}}


def _job_or_404(conn: psycopg.Connection, job_id: str, tenant: str) -> JobRow:
    return found_or_404(lambda i: get_job(conn, job_id=i, tenant=tenant), job_id, "query job")


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=QueryAccepted,
    responses={
        404: {"description": "a named buffer does not exist for this tenant"},
        422: {
            "description": "invalid body: missing query, unknown option, query over 10 KB, …; or an "
            "Idempotency-Key already used for a different request"
        },
        429: {"description": "the tenant already has RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT queries queued or running"},
    },
)
def submit(
    body: QueryRequest,
    response: Response,
    conn: ConnDep,
    tenant: TenantDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=200,
            description=(
                "Retrying with the same key (per tenant) returns the job the first request made, with the "
                "same 202, instead of starting another.  The same key with a different query, buffers or "
                "options is refused with 422 (idempotency_key_reused)."
            ),
        ),
    ] = None,
) -> QueryAccepted:
    """Queue a query; poll ``status_url`` (also the ``Location`` header) until its status is final."""
    job_id, _ = submit_query(
        conn,
        tenant=tenant,
        query=body.query,
        buffers=body.buffers,
        options=body.options.stored(),
        idempotency_key=idempotency_key,
    )
    # Relative like the batches' URLs: right behind any proxy, whatever Host the client used.
    url = f"{router.prefix}/{job_id}"
    response.headers["Location"] = url
    return QueryAccepted(job_id=job_id, status_url=url)


@router.get("", response_model=JobList, responses={422: {"description": "unknown status or cursor"}})
def list_queries(
    conn: ConnDep,
    tenant: TenantDep,
    status: Annotated[JobStatusName | None, Query(description="Only jobs in this status.")] = None,
    buffer: Annotated[str | None, Query(max_length=128, description="Only jobs over this buffer.")] = None,
    q: Annotated[str | None, Query(max_length=200, description="Only jobs whose query contains this text.")] = None,
    children: Annotated[bool, Query(description="Also list follow-up (child) jobs.")] = False,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=64, description="``next_cursor`` of the previous page.")] = None,
) -> JobList:
    """The tenant's query jobs, newest first, a page at a time."""
    return job_page(
        conn, tenant=tenant, status=status, buffer=buffer, text=q, children=children, limit=limit, cursor=cursor
    )


@router.get("/{job_id}", response_model=JobView, responses=NOT_FOUND, name="get_query")
def get_query(job_id: str, conn: ConnDep, tenant: TenantDep) -> JobView:
    """Status, stage and batch progress; ``result`` once done (kept, partial, when synthesis failed)."""
    return job_view(conn, _job_or_404(conn, job_id, tenant))


@router.get("/{job_id}/report", responses=NOT_FOUND)
def get_report(job_id: str, conn: ConnDep, tenant: TenantDep) -> dict[str, str]:
    """The report as HTML safe to insert in a page (docs/web-view.md#security); empty until the job has one."""
    job = _job_or_404(conn, job_id, tenant)
    response = job.result.response if job.result else ""
    return {"html": report_html(response) if response else ""}


@router.delete("/{job_id}", response_model=JobView, responses=NOT_FOUND)
def cancel(job_id: str, conn: ConnDep, tenant: TenantDep) -> JobView:
    """Cancel: the job is marked cancelled (its tasks see that and stop) and its queued tasks are revoked."""
    job = _job_or_404(conn, job_id, tenant)
    if not job.terminal:
        job = cancel_query(conn, job_id=job_id, tenant=tenant) or job
    return job_view(conn, job)
