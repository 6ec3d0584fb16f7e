"""`rlm query`: submit a question, follow it to its end and print the report (docs/contract.md#modes).

Registered in cli.py as the ``query`` command.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from rlm_workers.engine import InvalidInput, LLMCall, Mode, NoChunks, QueryResult, RLMError, Scope, allowed_values

from .cli_local import prepare_local_model
from .cli_output import Ticker, err, print_result
from .cli_types import Fmt, SearchModeOpt, TenantOpt, open_db, resolve_tenant
from .cli_wait import Interrupted, sigint_as_flag, timed_out

if TYPE_CHECKING:
    import psycopg
    from rich.console import Console

    from rlm_workers.engine import JobRow


def _range(option: str) -> str:
    """An option's accepted values for its help text, read from the same type that checks them."""
    return allowed_values(option).removeprefix("must be ")


def query(
    text: Annotated[str, typer.Argument(metavar="QUERY", help="The question.")],
    buffer: Annotated[list[str], typer.Option("--buffer", "-b", help="Buffer(s) to query; repeatable.")],
    skip_plan: Annotated[bool, typer.Option("--skip-plan", help="Do not ask the planner LLM.")] = False,
    search_mode: SearchModeOpt = None,
    threshold: Annotated[
        float | None,
        typer.Option(
            "--threshold",
            help=f"Similarity cut of the semantic arm, {_range('threshold')} (default: the plan, else RLM_THRESHOLD).",
        ),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option("--top-k", help=f"Chunks the search keeps, {_range('top_k')} (default: plan, scaling tier)."),
    ] = None,
    max_chunks: Annotated[
        int | None,
        typer.Option("--max-chunks", help=f"Most chunks analysed, {_range('max_chunks')} (default: plan, tier)."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help=f"Chunks per analyst call, {_range('batch_size')} (default: plan, tier)."),
    ] = None,
    num_agents: Annotated[
        int | None,
        typer.Option("--num-agents", help=f"Split chunks evenly over N analysts, {_range('num_agents')}."),
    ] = None,
    fmt: Annotated[
        Fmt, typer.Option("--format", help="text: the report and a status line; json: the QueryResult.")
    ] = Fmt.text,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show plan, parameters, timings and LLM calls.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds, a number above 0.")] = 3600.0,
    mode: Annotated[
        Mode | None,
        typer.Option(
            "--mode",
            help="instant: one call; auto (default): routed by size and question; thinking: follow-up rounds; "
            "code: the model writes programs that read the buffers.",
        ),
    ] = None,
    depth: Annotated[
        int | None,
        typer.Option(
            "--depth",
            help=f"Most rounds of child jobs, {_range('depth')} (default RLM_MAX_DEPTH; in mode code 0, and 1 or more "
            "lets its programs start child jobs).",
        ),
    ] = None,
    scope: Annotated[
        Scope | None, typer.Option("--scope", help="search: the search picks chunks; all: every chunk is analysed.")
    ] = None,
    max_llm_calls: Annotated[
        int | None,
        typer.Option(
            "--max-llm-calls",
            help=f"Budget: most LLM calls (HTTP attempts) for the whole tree, {_range('max_llm_calls')}.",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help=f"Budget: most tokens (in + out), {_range('max_tokens')}.")
    ] = None,
    max_cost: Annotated[
        float | None, typer.Option("--max-cost", help=f"Budget: most USD (RLM_PRICES), {_range('max_cost')}.")
    ] = None,
    deadline: Annotated[
        float | None,
        typer.Option(
            "--deadline", help=f"Budget: seconds after submission, {_range('deadline')}; no call starts later."
        ),
    ] = None,
    tenant: TenantOpt = None,
) -> None:
    """Ask a question: plan, search, fan out to analysts, collect, synthesize (docs/contract.md#modes)."""
    # celery, psycopg and rich load when a query runs, not for `rlm --help` (cli_types)
    from rich.console import Console

    from rlm_workers.engine import (
        cancel_query,
        ensure_workers,
        get_app,
        require_buffers,
        submit_query,
        validate_options,
        validate_query,
        wait_for_job,
    )

    celery_app = get_app()

    tenant = resolve_tenant(tenant)
    validate_query(text)
    if not timeout > 0:  # a wait that ends before it starts would cancel the job it just submitted
        raise InvalidInput(f"invalid value for timeout: {timeout:g} (must be a number above 0)")
    options = validate_options(
        {
            "skip_plan": skip_plan or None,
            "search_mode": search_mode.value if search_mode else None,
            "threshold": threshold,
            "top_k": top_k,
            "max_chunks": max_chunks,
            "batch_size": batch_size,
            "num_agents": num_agents,
            "mode": mode.value if mode else None,
            "depth": depth,
            "scope": scope.value if scope else None,
            "max_llm_calls": max_llm_calls,
            "max_tokens": max_tokens,
            "max_cost": max_cost,
            "deadline": deadline,
        }
    )
    console = Console(stderr=True)
    with open_db() as (_settings, _url, conn):
        require_buffers(conn, tenant=tenant, names=buffer)
        prepare_local_model()  # the first use fetches the model, with a bar: not inside a worker's first call
        # Ctrl-C only sets a flag while a job may exist: the wait below stops at a safe point and cancels
        # the job, instead of a KeyboardInterrupt tearing through psycopg, kombu and the in-process worker.
        with sigint_as_flag() as interrupted, ensure_workers(celery_app) as ephemeral:
            if interrupted.is_set():
                err("interrupted; nothing was submitted")
                raise typer.Exit(130)
            job_id, _ = submit_query(conn, tenant=tenant, query=text, buffers=buffer, options=options)
            conn.commit()
            if verbose:
                console.print(f"job {job_id} ({'in-process worker' if ephemeral else 'running workers'})")
            show = not (fmt == Fmt.json and not console.is_terminal)
            with console.status("queued", spinner="dots") as status:
                log = None if console.is_terminal else Ticker(after=10.0, every=10.0)
                seen: list[str] = []

                def progress(job, done, total):
                    if interrupted.is_set():
                        raise Interrupted
                    extra = f" {done}/{total} batches" if total else ""
                    if log is not None:
                        # a stage change is a line of its own once the quiet start is over; counts every 10 s
                        changed = seen[-1:] != [job.stage]
                        if log.maybe(lambda s: f"stage: {job.stage}{extra} ({s:.0f} s)", force=changed):
                            seen.append(job.stage)
                    elif show:
                        status.update(f"{job.stage}{extra}")

                try:
                    job = wait_for_job(conn, job_id, timeout=timeout, on_progress=progress)
                except Interrupted:
                    status.stop()
                    cancel_query(conn, job_id=job_id, tenant=tenant)
                    err(f"interrupted: job {job_id} cancelled")
                    raise typer.Exit(130) from None
                except TimeoutError:
                    status.stop()
                    timed_out(conn, job_id, timeout, ephemeral, tenant)
                    raise typer.Exit(1) from None
        if verbose:
            _print_verbose(console, conn, job)
    result = QueryResult.model_validate(job.result) if job.result else None
    if job.status == "done" and result is not None:
        print_result(result, fmt)
        return
    kind, message = (job.error.type, job.error.message) if job.error else ("error", f"job ended {job.status}")
    if result is not None and fmt == Fmt.json:
        print_result(result, fmt)  # findings are kept even when synthesis failed
    if kind == "no_chunks":
        raise NoChunks(message.split(". Try:")[0])
    # Even a bad-input failure (a buffer removed mid-job, a worker's setting) happened after the job was
    # stored: exit 1 with its id, not 2, which promises nothing was written (docs/contract.md#exit-codes).
    raise RLMError(f"job {job_id} {job.status} ({kind}): {message}")


def _print_verbose(console: Console, conn: psycopg.Connection, job: JobRow) -> None:
    from rlm_workers.engine import llm_calls_of, tree_of

    # soft_wrap: a line each, never cut at the console's width (80 when stderr is a file), so a log greps
    plan, params = (m.stored() if m else None for m in (job.plan, job.params))
    console.print(f"[bold]plan[/]: {json.dumps(plan)}", markup=True, highlight=False, soft_wrap=True)
    console.print(f"[bold]route[/]: {job.route} — {job.route_reason}", highlight=False, soft_wrap=True)
    console.print(f"[bold]params[/]: {json.dumps(params)}", highlight=False, soft_wrap=True)
    console.print(f"[bold]timings[/]: {json.dumps(job.timings)}", highlight=False, soft_wrap=True)
    for k, verdict in enumerate(job.checks):
        console.print(f"[bold]check {k}[/]: {json.dumps(verdict.stored())}", highlight=False, soft_wrap=True)
    for c in llm_calls_of(conn, job_id=job.id):
        console.print("  " + call_line(c), markup=False, highlight=False, soft_wrap=True)
    for kid in tree_of(conn, root_id=job.id):
        console.print(
            f"  child {kid.id} depth {kid.depth} {kid.status}: {kid.query[:100]}", markup=False, soft_wrap=True
        )
        for c in llm_calls_of(conn, job_id=kid.id):
            console.print("    " + call_line(c), markup=False, highlight=False, soft_wrap=True)


def call_line(call: LLMCall) -> str:
    """One logged LLM call as ``--verbose`` prints it: every value labelled, the unset ones left out.

    Bare values (``answer qwen2.5 1680 38 107304 ok``) left a reader guessing which number was which, and
    whether the first word named the stage or the model.
    """
    fields = {
        "stage": call.stage,
        "batch": call.batch,
        "model": call.model,
        "tokens_in": call.tokens_in,
        "tokens_out": call.tokens_out,
        "latency_ms": call.latency_ms,
        "status": call.status,
        # docs/contract.md#structured-outputs: None when the reply was not parsed at all
        "reply": None if call.parse_ok is None else ("parsed" if call.parse_ok else "unparsed"),
        "error": call.error,
    }
    return "llm " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
