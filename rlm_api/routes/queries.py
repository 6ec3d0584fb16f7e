"""Query jobs: submit (202, idempotent), follow, cancel.  Another tenant's id is simply not found."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Header, Query, Response, status

from rlm_workers.models import QueryResult

from ..deps import ConnDep, ParseOffLoop, TenantDep, found_or_404
from ..schemas import (
    BatchView,
    ChildView,
    ErrorBody,
    JobList,
    JobStatusName,
    JobSummary,
    JobView,
    Progress,
    QueryAccepted,
    QueryRequest,
    StageTiming,
    Usage,
)

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.store.jobs import JobRow, TreeUsage

router = APIRouter(prefix="/v1/queries", tags=["queries"], route_class=ParseOffLoop)
NOT_FOUND = {404: {"description": "no such job for this tenant"}}


def usage_of(u: TreeUsage | None) -> Usage:
    if u is None:
        return Usage()
    return Usage(
        llm_calls=u.calls,
        tokens_in=u.tokens_in,
        tokens_out=u.tokens_out,
        cached_tokens=u.cached_tokens,
        cost_usd=round(u.cost_usd, 6),
    )


def _timings(job: JobRow) -> list[StageTiming]:
    from rlm_workers.pipeline.flow import ORDER

    order = [s.value for s in ORDER]
    names = sorted(job.timings, key=lambda s: (order.index(s) if s in order else len(order), s))
    return [StageTiming(stage=s, seconds=round(float(job.timings[s]), 3)) for s in names]


def _child_tree(rows: list[JobRow], parent: str) -> list[ChildView]:
    return [
        ChildView(
            job_id=r.id,
            status=r.status,
            stage=r.stage,
            query=r.query,
            depth=r.depth,
            children=_child_tree(rows, r.id),
        )
        for r in rows
        if r.parent_id == parent
    ]


def job_view(conn: psycopg.Connection, job: JobRow) -> JobView:
    """Everything a person watching the job sees (docs/contract.md#job-view): one job, its batches, its
    calls, the jobs below it."""
    from rlm_workers.store import jobs as store

    states = store.batch_states(conn, job_id=job.id)
    # the whole tree by its indexed root; _child_tree keeps only what hangs below this job
    below = store.tree_of(conn, root_id=job.tree)
    return JobView(
        job_id=job.id,
        status=job.status,
        stage=job.stage,
        progress=Progress(batches_done=sum(b.state in ("done", "failed") for b in states), batches_total=len(states)),
        result=QueryResult.model_validate(job.result) if job.result else None,
        error=ErrorBody.from_record(job.error),
        query=job.query,
        buffers=list(job.buffers),
        options=dict(job.options or {}),
        parent_id=job.parent_id,
        root_id=job.root_id,
        depth=job.depth,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        timings=_timings(job),
        batches=[
            BatchView(
                batch_no=b.batch_no,
                chunks=b.chunks,
                state=b.state,
                attempts=b.attempts,
                error=ErrorBody.from_record(b.error),
            )
            for b in states
        ],
        calls=store.llm_calls_of(conn, job_id=job.id),
        children=_child_tree(below, job.id),
        usage=usage_of(store.job_usage(conn, job_ids=[job.id]).get(job.id)),
        task_ids=list(job.task_ids),
        spec=job.spec,
    )


def job_summaries(conn: psycopg.Connection, jobs: list[JobRow]) -> list[JobSummary]:
    from rlm_workers.store.jobs import job_usage

    usage = job_usage(conn, job_ids=[j.id for j in jobs])
    return [
        JobSummary(
            job_id=j.id,
            status=j.status,
            stage=j.stage,
            query=j.query,
            buffers=list(j.buffers),
            mode=str((j.options or {}).get("mode") or "auto"),
            parent_id=j.parent_id,
            created_at=j.created_at,
            finished_at=j.finished_at,
            usage=usage_of(usage.get(j.id)),
        )
        for j in jobs
    ]


def job_page(
    conn: psycopg.Connection,
    *,
    tenant: str,
    status: str | None = None,
    buffer: str | None = None,
    text: str | None = None,
    children: bool = False,
    limit: int = 50,
    cursor: str | None = None,
) -> JobList:
    """One page of the tenant's jobs, newest first (``GET /v1/queries`` and ``rlm jobs``)."""
    from rlm_workers.errors import InvalidInput
    from rlm_workers.store.jobs import get_job, list_jobs

    for name, value in (("buffer", buffer), ("q", text), ("cursor", cursor)):
        if value and "\x00" in value:  # PostgreSQL text cannot hold one: no job can match
            raise InvalidInput(f"{name}: contains a NUL character")
    if cursor is not None and get_job(conn, job_id=cursor, tenant=tenant) is None:
        raise InvalidInput(f"unknown cursor {cursor[:64]!r}: pass the next_cursor of the previous page")
    # one row past the page says whether there is a next one
    rows = list_jobs(
        conn,
        tenant=tenant,
        status=status,
        buffer=buffer,
        text=text,
        roots_only=not children,
        limit=limit + 1,
        before=cursor,
    )
    page = rows[:limit]
    return JobList(jobs=job_summaries(conn, page), next_cursor=page[-1].id if len(rows) > limit else None)


def _job_or_404(conn: psycopg.Connection, job_id: str, tenant: str) -> JobRow:
    from rlm_workers.store.jobs import get_job

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
    from rlm_workers.submit import submit_query

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
    from ..ui.render import report_html

    job = _job_or_404(conn, job_id, tenant)
    response = (job.result or {}).get("response") or ""
    return {"html": report_html(response) if response else ""}


@router.delete("/{job_id}", response_model=JobView, responses=NOT_FOUND)
def cancel(job_id: str, conn: ConnDep, tenant: TenantDep) -> JobView:
    """Cancel: the job is marked cancelled (its tasks see that and stop) and its queued tasks are revoked."""
    from rlm_workers.submit import cancel_query

    job = _job_or_404(conn, job_id, tenant)
    if not job.terminal:
        job = cancel_query(conn, job_id=job_id, tenant=tenant) or job
    return job_view(conn, job)
