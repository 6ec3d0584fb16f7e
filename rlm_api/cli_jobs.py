"""`rlm jobs` and `rlm job show|result|cancel`: the query jobs of one tenant, as the API shows them.

The JSON is built by the API's own builders (rlm_api.views ``job_page`` / ``job_view``), so
``rlm jobs --format json`` is a ``GET /v1/queries`` page and ``rlm job show ID --format json`` is exactly
``GET /v1/queries/{id}`` (docs/contract.md#cli-jobs).  Another tenant's job is "not found", as over HTTP.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from rlm_workers.engine import InvalidInput, JobStatus, QueryResult, RLMError, cite_of

from .cli_output import print_json, print_result
from .cli_types import Fmt, TenantOpt, new_typer, open_db, resolve_tenant, unique_prefix

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.engine import CodeRound, JobRow

    from .schemas import ChildView, JobSummary, JobView

job_app = new_typer(help="One query job: show it, print its result, cancel it.")


def _job(conn: psycopg.Connection, job_id: str, tenant: str) -> JobRow:
    """The tenant's job by its id or a unique prefix of it (``1e96c35a``)."""
    # the job store, the views and submit pull in psycopg: each command loads what it uses, so `rlm --help`
    # does not (cli_types)
    from rlm_workers.engine import get_job, job_ids_starting

    job = get_job(conn, job_id=job_id, tenant=tenant) if len(job_id) <= 64 else None
    if job is None:
        found = unique_prefix(job_id, lambda p: job_ids_starting(conn, tenant=tenant, prefix=p), what="job")
        job = get_job(conn, job_id=found, tenant=tenant) if found else None
    conn.commit()
    if job is None:
        raise InvalidInput(f"no query job {job_id[:64]!r}; list jobs with `rlm jobs`")
    return job


def _age(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "-"
    s = max(0.0, (now - when).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def jobs_command(
    status: Annotated[JobStatus | None, typer.Option("--status", help="Only jobs in this status.")] = None,
    buffer: Annotated[str | None, typer.Option("--buffer", "-b", help="Only jobs over this buffer.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=200, help="At most this many, newest first.")] = 20,
    all_: Annotated[bool, typer.Option("--all", help="Also list follow-up (child) jobs.")] = False,
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """The tenant's query jobs, newest first: id, status, stage, mode, age, tokens, cost, query."""
    from .views import job_page

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        page = job_page(
            conn, tenant=tenant, status=status.value if status else None, buffer=buffer, children=all_, limit=limit
        )
    if fmt == Fmt.json:
        print_json(json.loads(page.model_dump_json()))
        return
    summaries = page.jobs
    if not summaries:
        typer.echo("no query jobs" + (" match" if status or buffer else " yet: ask one with `rlm query`"))
        return
    _print_table(summaries)


def _print_table(jobs: list[JobSummary]) -> None:
    now = datetime.now(UTC)
    typer.echo(f"{'id':<36}  {'status':<9} {'stage':<12} {'mode':<8} {'age':>5} {'tokens':>8} {'cost':>8}  query")
    for j in jobs:
        tokens = j.usage.tokens_in + j.usage.tokens_out
        kid = "  ↳ " if j.parent_id else ""
        typer.echo(
            f"{j.job_id:<36}  {j.status:<9} {j.stage[:12]:<12} {j.mode[:8]:<8} {_age(j.created_at, now):>5} "
            f"{tokens:>8} {'$' + format(j.usage.cost_usd, '.4f'):>8}  {kid}{_one_line(j.query, 60)}"
        )


@job_app.command("show")
def show(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job id (`rlm jobs` lists them).")],
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """Everything about one job: stages with timings, batches, LLM calls, child jobs (JSON: the API's JobView)."""
    from .views import job_view

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        view = job_view(conn, _job(conn, job_id, tenant))
    if fmt == Fmt.json:
        typer.echo(view.model_dump_json())
        return
    _print_view(view)


def _print_view(v: JobView) -> None:
    typer.echo(f"job {v.job_id}  {v.status}  stage {v.stage}")
    typer.echo(f"  query:    {_one_line(v.query, 200)}")
    typer.echo(f"  buffers:  {', '.join(v.buffers)}")
    if v.parent_id:
        typer.echo(f"  parent:   {v.parent_id} (depth {v.depth})")
    typer.echo(f"  created:  {v.created_at}   finished: {v.finished_at or '-'}")
    if v.timings:
        typer.echo("  stages:   " + "  ".join(f"{t.stage} {t.seconds:.2f}s" for t in v.timings))
    if v.batches:
        counts: dict[str, int] = {}
        for b in v.batches:
            counts[b.state] = counts.get(b.state, 0) + 1
        retried = sum(1 for b in v.batches if b.attempts > 1)
        extra = f", {retried} retried" if retried else ""
        typer.echo(f"  batches:  {len(v.batches)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}{extra})")
        for b in v.batches:
            if b.error is not None:
                typer.echo(f"    batch {b.batch_no}: {b.error.type}: {_one_line(b.error.message, 150)}")
    u = v.usage
    typer.echo(
        f"  calls:    {u.llm_calls} LLM calls, {u.tokens_in} tokens in, {u.tokens_out} out "
        f"({u.cached_tokens} cached), ${u.cost_usd:.4f}"
    )
    by_stage: dict[str, list[int]] = {}
    for c in v.calls:
        agg = by_stage.setdefault(c.stage, [0, 0, 0, 0])
        agg[0] += 1
        agg[1] += c.tokens_in + c.tokens_out
        agg[2] += c.status != "ok"
        agg[3] += c.parse_ok is False  # docs/contract.md#structured-outputs
    for stage, (n, tokens, bad, unparsed) in by_stage.items():
        typer.echo(
            f"    {stage:<12} {n} calls, {tokens} tokens"
            + (f", {bad} not ok" if bad else "")
            + (f", {unparsed} replies unusable as they came" if unparsed else "")
        )
    if v.error is not None:
        typer.echo(f"  error:    {v.error.type}: {_one_line(v.error.message, 200)}")
    for r in v.code_rounds:
        _print_round(r)
    if v.children:
        typer.echo("  children:")
        _print_children(v.children, "    ")


def _print_round(r: CodeRound) -> None:
    """One round of code mode: its program, then what it printed (cut as the model saw it) and its error."""
    sub = f", {r.sub_calls} sub-model calls" if r.sub_calls else ""
    ended = ", sandbox restarted after it" if r.ended else ""
    look = " (the stage's look at the data, no model call)" if r.round == 0 else ""
    typer.echo(f"  round {r.round}{look}: {r.calls} calls{sub}, {r.seconds:.2f}s{ended}")
    for line in (r.code or "(no program)").splitlines():
        typer.echo(f"    | {line}")
    if r.output:
        cut = f" (first {len(r.output)} of {r.output_chars} characters)" if r.output_chars > len(r.output) else ""
        typer.echo(f"    output{cut}:")
        for line in r.output.rstrip("\n").splitlines():
            typer.echo(f"      {line}")
    if r.error:
        typer.echo("    error:")
        for line in r.error.splitlines():
            typer.echo(f"      {line}")


def _print_children(kids: list[ChildView], indent: str) -> None:
    for k in kids:
        typer.echo(f"{indent}{k.job_id}  {k.status:<9} {k.stage:<10} {_one_line(k.query, 80)}")
        _print_children(k.children, indent + "  ")


@job_app.command("result")
def result(
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """The report of a finished job (JSON: its QueryResult); exit 1 while it is not done."""
    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        job = _job(conn, job_id, tenant)
    if job.status != "done" or not job.result:
        why = f" ({job.error.type}: {_one_line(job.error.message, 150)})" if job.error else ""
        raise RLMError(f"job {job.id} is {job.status}, stage {job.stage}{why}: no result to print")
    print_result(QueryResult.model_validate(job.result), fmt)


@job_app.command("cancel")
def cancel(job_id: Annotated[str, typer.Argument(metavar="ID")], tenant: TenantOpt = None) -> None:
    """Cancel a queued or running job (its tasks stop at their next check; queued ones are revoked)."""
    from rlm_workers.engine import cancel_query

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        job = _job(conn, job_id, tenant)
        if job.terminal:
            typer.echo(f"job {job.id} already {job.status}: nothing to cancel")
            return
        job = cancel_query(conn, job_id=job.id, tenant=tenant) or job
        conn.commit()
    typer.echo(f"job {job.id} {job.status}")


chunk_app = new_typer(help="Chunks by id: what a citation [chunk 12, path:10-58] points at.")


@chunk_app.command("show")
def chunk_show(
    chunk_id: Annotated[int, typer.Argument(metavar="ID", help="The chunk id a citation or `rlm search` names.")],
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """Print one chunk: a `buffer path:start-end` header (`buffer spec.pdf p. 4 § Intro` for a document), then
    its text (JSON: the API's ChunkView)."""
    from .views import chunk_views

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        found = chunk_views(conn, tenant=tenant, ids=[chunk_id])
    if not found:
        raise InvalidInput(f"no chunk {chunk_id}; chunk ids come from citations and `rlm search`")
    c = found[0]
    if fmt == Fmt.json:
        typer.echo(c.model_dump_json())
        return
    typer.echo(f"{c.buffer} {cite_of(c)}  (chunk {c.chunk_id})")
    typer.echo("")
    typer.echo(c.text.rstrip("\n"))
