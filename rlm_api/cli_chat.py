"""``rlm chat``: follow-up questions with memory, in the terminal (docs/contract.md#sessions).

A session over some buffers (or one resumed with ``--session``); every line read is a turn, run as a query job
whose context carries the earlier turns.  On a terminal it is a readline prompt; from a pipe it reads one question
per line, so a conversation can be scripted.  ``/quit`` or end of input leaves; Ctrl-C while a turn runs cancels
that turn's job and returns to the prompt.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rlm_workers.engine import InvalidInput, Mode, QueryResult, RLMError

from .cli_local import prepare_local_model
from .cli_types import TenantOpt, resolve_tenant
from .cli_wait import Interrupted, sigint_as_flag, timed_out

if TYPE_CHECKING:
    import psycopg

QUIT = {"/quit", "/exit", "/q"}
PROMPT = "you> "


def chat_command(
    buffer: Annotated[
        list[str] | None, typer.Option("--buffer", "-b", help="Buffer(s) of a new session; repeatable.")
    ] = None,
    session: Annotated[
        str | None, typer.Option("--session", help="Resume this session (its buffers are kept).")
    ] = None,
    tenant: TenantOpt = None,
    mode: Annotated[
        Mode | None,
        typer.Option("--mode", help="instant, auto (default) or thinking, for every turn of a new session."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up waiting for one answer after this many seconds.")] = 3600.0,
) -> None:
    """Chat with your buffers: each question may follow up on the earlier ones (docs/contract.md#sessions)."""
    # celery, psycopg and the sessions load with the command, not for `rlm --help` (cli_types)
    from rlm_workers.config import get_settings
    from rlm_workers.engine import connect, create_session, ensure_workers, get_app, resolve_url, session_view

    celery_app = get_app()

    settings = get_settings()
    tenant = resolve_tenant(tenant)
    if session is None and not buffer:
        raise InvalidInput("name at least one --buffer for a new session, or resume one with --session ID")
    conn = connect(settings, url=resolve_url(settings))
    try:
        if session is not None:
            view = session_view(conn, tenant=tenant, session_id=session) if len(session) <= 64 else None
            conn.commit()
            if view is None:
                raise InvalidInput(f"no session {session[:64]!r} for tenant {tenant!r}")
            if buffer and sorted(set(buffer)) != sorted(view["buffers"]):
                raise InvalidInput(f"session {session} is over {', '.join(view['buffers'])}: --buffer cannot change it")
            session_id, buffers = view["session_id"], view["buffers"]
        else:
            row = create_session(
                conn, tenant=tenant, buffers=buffer or [], options={"mode": mode.value if mode else None}
            )
            session_id, buffers = row.id, row.buffers
        typer.echo(f"session {session_id} over {', '.join(buffers)} (resume: rlm chat --session {session_id})")
        prepare_local_model()
        interactive = sys.stdin.isatty()
        if interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:  # not on every platform; input() still works
                pass
            typer.echo("Ask a question; /quit or Ctrl-D leaves, Ctrl-C cancels a running answer.", err=True)
        failed = 0
        with ensure_workers(celery_app) as ephemeral:
            while (question := _read(interactive)) is not None:
                if question in QUIT:
                    break
                if not question:
                    continue
                failed += not _turn(
                    conn, tenant=tenant, session_id=session_id, question=question, timeout=timeout, ephemeral=ephemeral
                )
    finally:
        conn.close()
    if failed and not interactive:
        raise typer.Exit(1)  # a script learns that some answer is missing


def _read(interactive: bool) -> str | None:
    """The next question, stripped; None at end of input (Ctrl-D)."""
    if not interactive:
        line = sys.stdin.readline()
        return None if line == "" else line.strip()
    while True:
        try:
            return input(PROMPT).strip()
        except EOFError:
            typer.echo("")
            return None
        except KeyboardInterrupt:  # at the prompt Ctrl-C clears the line, as a shell does
            typer.echo("")


def _turn(
    conn: psycopg.Connection, *, tenant: str, session_id: str, question: str, timeout: float, ephemeral: bool
) -> bool:
    """Ask one question and print its answer and status line; False when the turn has no answer."""
    from rlm_workers.engine import cancel_query, cited_sources, post_message, wait_for_job

    try:
        posted = post_message(conn, tenant=tenant, session_id=session_id, content=question)
    except RLMError as exc:  # bad input or a busy session: this turn only, the chat goes on
        conn.rollback()
        typer.echo(f"error: {exc.message}", err=True)
        return False
    if posted is None:
        raise InvalidInput(f"session {session_id} is gone")
    turn, job_id = posted
    with sigint_as_flag() as interrupted:

        def progress(_job: Any, _done: int, _total: int) -> None:
            if interrupted.is_set():
                raise Interrupted

        try:
            job = wait_for_job(conn, job_id, timeout=timeout, on_progress=progress)
        except Interrupted:
            cancel_query(conn, job_id=job_id, tenant=tenant)
            conn.commit()
            typer.echo(f"[turn {turn} | job {job_id} | cancelled]", err=True)
            return False
        except TimeoutError:
            # as `rlm query`: a job only this command's in-process worker could finish is cancelled, so the
            # session is not left busy with it after the chat ends
            timed_out(conn, job_id, timeout, ephemeral, tenant)
            conn.commit()
            return False
    result = QueryResult.model_validate(job.result) if job.result else None
    if job.status != "done" or result is None:
        why = job.error.message if job.error else ""
        typer.echo(f"error: turn {turn} (job {job_id}) {job.status}: {why}", err=True)
        return False
    typer.echo(result.response.rstrip())
    cited = [str(c["chunk_id"]) for c in cited_sources(job.result)]
    typer.echo(
        f"[turn {turn} | job {job_id} | {job.status} | cites {', '.join(cited) or 'nothing'} | "
        f"{result.llm_calls} LLM calls | {result.total_tokens} tokens | {result.elapsed:.1f}s]"
    )
    return True
