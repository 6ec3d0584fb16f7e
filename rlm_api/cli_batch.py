"""`rlm batch …`: overnight batches of queries × buffers.

``rlm batch submit`` only stores the batch and prints its id: the running
workers do the work (`rlm worker` / `rlm up`; a batch waits in PostgreSQL
until one serves ``rlm.control``).  Like the rest of the CLI it talks to the
database and the broker directly, as ``--tenant`` (default RLM_TENANT, ``local``).
"""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rlm_workers.engine import MAX_RUN_AT_AHEAD_DAYS, QUEUE_ANALYST, QUEUE_CONTROL, InvalidInput, Scope

from .cli_output import err
from .cli_types import SearchModeOpt, TenantOpt, new_typer, open_db, resolve_tenant, unique_prefix
from .cli_wait import sigint_as_flag

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.engine import OvernightRow

batch_app = new_typer(help="Batches of queries over many buffers (run by the workers).")

_RELATIVE = re.compile(r"^\+(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ResultFmt(str, Enum):
    jsonl = "jsonl"
    csv = "csv"


class StatusFmt(str, Enum):
    text = "text"
    json = "json"


def parse_at(value: str, *, now: datetime | None = None) -> datetime:
    """ISO 8601 or relative (+30m, +2h, +1d) → an aware time within the bounds of ``check_run_at``.

    No zone means this machine's local time (the API, with no local time to go by, refuses a zone-less
    ``run_at``): the result always carries its offset, so what is stored is never ambiguous.
    """
    # overnight.submit, the overnight store and celery pull in psycopg and kombu: each command loads what it
    # uses, so `rlm --help` does not (cli_types)
    from rlm_workers.engine import check_run_at

    now = now or datetime.now(UTC)
    m = _RELATIVE.match(value.strip())
    if m:
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        if seconds > MAX_RUN_AT_AHEAD_DAYS * 86400:  # before timedelta: +99999999d would overflow a datetime
            raise InvalidInput(f"--at {value.strip()} is more than {MAX_RUN_AT_AHEAD_DAYS} days ahead")
        return now + timedelta(seconds=seconds)
    try:
        ts = datetime.fromisoformat(value.strip())
        ts = ts.astimezone() if ts.tzinfo is None else ts
    except (ValueError, OverflowError):
        raise InvalidInput(
            f"invalid --at {value!r}: use ISO 8601 (2030-01-01T02:00, +00:00 for UTC) or +30m / +2h / +1d"
        ) from None
    return check_run_at(ts, now=now, name="--at")


def read_queries(path: str) -> list[str]:
    from rlm_workers.engine import MAX_QUERIES_FILE_BYTES, parse_queries

    if path == "-":
        text = sys.stdin.read()
    else:
        p = Path(path)
        if not p.is_file():
            raise InvalidInput(f"queries file not found: {path}")
        if p.stat().st_size > MAX_QUERIES_FILE_BYTES:
            raise InvalidInput(f"queries file over {MAX_QUERIES_FILE_BYTES} bytes: {path}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"queries file is not UTF-8: {path}") from None
    return parse_queries(text)


def _warn_if_no_worker() -> None:
    from rlm_workers.engine import get_app, served_queues

    celery_app = get_app()

    missing = [q for q in (QUEUE_CONTROL, QUEUE_ANALYST) if q not in served_queues(celery_app, timeout=1.0)]
    if missing:
        typer.echo(
            f"warning: no running worker serves {', '.join(missing)}: the batch waits until one does "
            "(start `rlm worker` or `rlm up`)",
            err=True,
        )


@batch_app.command("submit")
def submit(
    queries: Annotated[
        str,
        typer.Option(
            "--queries",
            "-q",
            help='File: one query a line (# comments, blank lines skipped) or JSON lines {"query": ...}; - for stdin.',
        ),
    ],
    buffer: Annotated[list[str] | None, typer.Option("--buffer", "-b", help="Buffer to query; repeatable.")] = None,
    buffers_glob: Annotated[
        str | None,
        typer.Option("--buffers-glob", help="Also every buffer matching this glob, e.g. 'logs-*'."),
    ] = None,
    at: Annotated[
        str | None,
        typer.Option(
            "--at", help="Start no earlier than this (≤ 1 year ahead): ISO 8601 (no zone = local time) or +30m / +2h."
        ),
    ] = None,
    priority: Annotated[int, typer.Option(help="1 soonest … 9 latest; interactive queries always go first.")] = 3,
    token_budget: Annotated[
        int | None,
        typer.Option("--token-budget", help="Stop scheduling new items once this many tokens are spent."),
    ] = None,
    skip_plan: Annotated[bool, typer.Option("--skip-plan", help="Do not ask the planner LLM.")] = False,
    scope: Annotated[
        Scope | None,
        typer.Option(
            "--scope",
            help="search: the search picks chunks; all: every chunk is analysed (questions over a buffer share "
            "each read).",
        ),
    ] = None,
    llm_batch: Annotated[
        bool,
        typer.Option(
            "--llm-batch",
            help="Send the analyst calls through the OpenAI Batch API: half price, results within 24 h.",
        ),
    ] = False,
    search_mode: SearchModeOpt = None,
    threshold: Annotated[float | None, typer.Option("--threshold")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k")] = None,
    max_chunks: Annotated[int | None, typer.Option("--max-chunks")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size")] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Submitting the same key again returns the first batch."),
    ] = None,
    check_workers: Annotated[
        bool,
        typer.Option("--check-workers/--no-check-workers", help="Warn on stderr when no worker is running."),
    ] = True,
    tenant: TenantOpt = None,
) -> None:
    """Queue every (query, buffer) pair; prints the batch id. Workers (`rlm worker` / `rlm up`) run it."""
    committed: str | None = None
    shown = False
    # from the first line: a Ctrl-C while the imports below load (most of the first second) is one too
    try:
        from rlm_workers.engine import start_overnight, store_overnight, validate_options

        tenant = resolve_tenant(tenant)
        texts = read_queries(queries)
        run_at = parse_at(at) if at else None
        options = validate_options(
            {
                "skip_plan": skip_plan or None,
                "scope": scope.value if scope else None,
                "search_mode": search_mode and search_mode.value,
                "threshold": threshold,
                "top_k": top_k,
                "max_chunks": max_chunks,
                "batch_size": batch_size,
            }
        )
        with open_db() as (_settings, _url, conn):
            # Ctrl-C up to the commit closes the connection with the batch's transaction open: nothing is kept.
            stored = store_overnight(
                conn,
                tenant=tenant,
                queries=texts,
                buffers=buffer or [],
                buffers_glob=buffers_glob,
                options=options,
                run_at=run_at,
                priority=priority,
                token_budget=token_budget,
                idempotency_key=idempotency_key,
                llm_batch=llm_batch,
            )
            # A Ctrl-C inside the commit would leave it unknown whether the batch was kept: it waits for the end.
            with sigint_as_flag() as interrupted:
                conn.commit()
                committed = stored.overnight_batch_id
            if interrupted.is_set():
                raise KeyboardInterrupt
        start_overnight(stored)
        typer.echo(stored.overnight_batch_id)
        shown = True
        if run_at is not None:
            # stdout stays the bare id for scripts; the resolved time (a zone-less --at is local) goes to stderr
            when = run_at.astimezone(UTC).isoformat().replace("+00:00", "Z")
            typer.echo(f"starts no earlier than {when}", err=True)
        if check_workers:
            _warn_if_no_worker()
    except KeyboardInterrupt:
        if committed is None:
            err("interrupted; nothing was submitted")
            raise typer.Exit(130) from None
        if not shown:
            typer.echo(committed)
        # Kept and due to run (the reconciler sends a tick that never left): say so, and how to stop it.
        err(f"interrupted, but batch {committed} was stored and will run; stop it with `rlm batch cancel {committed}`")
        raise typer.Exit(130) from None


def _get_overnight_batch(conn: psycopg.Connection, batch_id: str, tenant: str) -> OvernightRow:
    from rlm_workers.engine import get_overnight, overnight_batch_ids_starting

    overnight_batch = get_overnight(conn, overnight_batch_id=batch_id, tenant=tenant)
    if overnight_batch is None:
        found = unique_prefix(
            batch_id, lambda p: overnight_batch_ids_starting(conn, tenant=tenant, prefix=p), what="batch"
        )
        overnight_batch = get_overnight(conn, overnight_batch_id=found, tenant=tenant) if found else None
    if overnight_batch is None:
        raise InvalidInput(f"no batch {batch_id}; list batches with `rlm batch list`")
    return overnight_batch


def _status_line(st: dict) -> str:
    c = st["counts"]
    parts = [f"{st['batch_id']}  {st['status']}", f"{c['done']}/{st['total']} done"]
    parts += [f"{c[k]} {k}" for k in ("running", "pending", "failed", "skipped", "cancelled") if c[k]]
    if st["from_cache"]:
        parts.append(f"{st['from_cache']} from cache")
    budget = f"/{st['token_budget']}" if st["token_budget"] else ""
    parts.append(f"tokens {st['tokens_spent']}{budget}")
    if st["status"] == "scheduled":
        parts.append(f"starts {st['run_at'] or '(unreadable run_at)'}")
    elif st["eta_seconds"] is not None and st["status"] == "running":
        parts.append(f"ETA {st['eta_seconds']:.0f}s")
    return " | ".join(parts)


@batch_app.command("status")
def status(
    batch_id: str, fmt: Annotated[StatusFmt, typer.Option("--format")] = StatusFmt.text, tenant: TenantOpt = None
) -> None:
    """Counts by state, tokens spent, ETA."""
    from rlm_workers.engine import status_of

    tenant = resolve_tenant(tenant)
    with open_db() as (_settings, _url, conn):
        st = status_of(conn, _get_overnight_batch(conn, batch_id, tenant))
    typer.echo(json.dumps(st) if fmt == StatusFmt.json else _status_line(st))


@batch_app.command("results")
def results(
    batch_id: str, fmt: Annotated[ResultFmt, typer.Option("--format")] = ResultFmt.jsonl, tenant: TenantOpt = None
) -> None:
    """Every item, in order: JSON lines {batch_id, query, buffer, status, result, …} or CSV."""
    from rlm_workers.engine import iter_csv, iter_jsonl

    tenant = resolve_tenant(tenant)
    with open_db() as (_settings, _url, conn):
        batch_id = _get_overnight_batch(conn, batch_id, tenant).id
        out = sys.stdout
        for chunk in (iter_csv if fmt == ResultFmt.csv else iter_jsonl)(conn, batch_id):
            out.write(chunk)
        out.flush()


@batch_app.command("cancel")
def cancel(batch_id: str, tenant: TenantOpt = None) -> None:
    """Stop a batch: nothing new starts, running items' jobs are cancelled."""
    from rlm_workers.engine import cancel_overnight, status_of

    tenant = resolve_tenant(tenant)
    with open_db() as (_settings, _url, conn):
        batch_id = _get_overnight_batch(conn, batch_id, tenant).id
        cancelled = cancel_overnight(conn, tenant=tenant, overnight_batch_id=batch_id)
        if cancelled is None:  # found just above, and batches are never deleted
            raise InvalidInput(f"no batch {batch_id}; list batches with `rlm batch list`")
        st = status_of(conn, cancelled)
    typer.echo(_status_line(st))


@batch_app.command("list")
def list_cmd(
    limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
    fmt: Annotated[StatusFmt, typer.Option("--format")] = StatusFmt.text,
    tenant: TenantOpt = None,
) -> None:
    """The most recent batches, newest first."""
    from rlm_workers.engine import list_overnight, status_of

    tenant = resolve_tenant(tenant)
    with open_db() as (_settings, _url, conn):
        rows = [status_of(conn, b) for b in list_overnight(conn, tenant=tenant, limit=limit)]
    if fmt == StatusFmt.json:
        typer.echo(json.dumps(rows))
    else:
        for st in rows:
            typer.echo(_status_line(st))
