"""The JSON views of jobs and chunks, built once for every surface: the HTTP API (``GET /v1/queries``,
``GET /v1/chunks``), the CLI (``rlm jobs``, ``rlm job show``, ``rlm chunk show`` with ``--format json``) and
the MCP tools, so each shows exactly what the others do (docs/contract.md#job-view)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlm_workers import engine
from rlm_workers.engine import MAX_BIGINT, ORDER, ChunkView, InvalidInput, QueryResult, get_chunks
from rlm_workers.engine import citation_fields as fields

from .schemas import BatchView, ChildView, ErrorBody, JobList, JobSummary, JobView, Progress, StageTiming, Usage

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.engine import JobRow, TreeUsage


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
    states = engine.batch_states(conn, job_id=job.id)
    # the whole tree by its indexed root; _child_tree keeps only what hangs below this job
    below = engine.tree_of(conn, root_id=job.tree)
    return JobView(
        job_id=job.id,
        status=job.status,
        stage=job.stage,
        progress=Progress(batches_done=sum(b.state in ("done", "failed") for b in states), batches_total=len(states)),
        result=QueryResult.model_validate(job.result) if job.result else None,
        error=ErrorBody.from_record(job.error),
        query=job.query,
        buffers=list(job.buffers),
        options=job.options.stored(),
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
        calls=engine.llm_calls_of(conn, job_id=job.id),
        children=_child_tree(below, job.id),
        code_rounds=engine.code_rounds_of(conn, job_id=job.id) if job.route == "code" else [],
        usage=usage_of(engine.job_usage(conn, job_ids=[job.id]).get(job.id)),
        task_ids=list(job.task_ids),
        spec=job.spec.stored() if job.spec else None,
    )


def job_summaries(conn: psycopg.Connection, jobs: list[JobRow]) -> list[JobSummary]:
    usage = engine.job_usage(conn, job_ids=[j.id for j in jobs])
    return [
        JobSummary(
            job_id=j.id,
            status=j.status,
            stage=j.stage,
            query=j.query,
            buffers=list(j.buffers),
            mode=str(j.options.mode or "auto"),
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
    for name, value in (("buffer", buffer), ("q", text), ("cursor", cursor)):
        if value and "\x00" in value:  # PostgreSQL text cannot hold one: no job can match
            raise InvalidInput(f"{name}: contains a NUL character")
    if cursor is not None and engine.get_job(conn, job_id=cursor, tenant=tenant) is None:
        raise InvalidInput(f"unknown cursor {cursor[:64]!r}: pass the next_cursor of the previous page")
    # one row past the page says whether there is a next one
    rows = engine.list_jobs(
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


def chunk_views(conn: psycopg.Connection, *, tenant: str, ids: list[int]) -> list[ChunkView]:
    """The tenant's chunks among ``ids``, in the order asked; unknown ids are left out, and so are ids no
    chunk can have (a bigint is what PostgreSQL would be asked to compare them with)."""
    rows = get_chunks(conn, tenant=tenant, chunk_ids=[i for i in ids if 0 < i <= MAX_BIGINT])
    return [
        ChunkView(
            chunk_id=r.id,
            buffer=r.buffer,
            path=r.path,
            start_line=r.start_line,
            end_line=r.end_line,
            text=r.text,
            **fields(r.page_start, r.page_end, r.heading_path),
        )
        for r in (rows.get(i) for i in dict.fromkeys(ids))
        if r is not None
    ]
