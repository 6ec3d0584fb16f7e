"""The ``rlm`` command line (docs/contract.md#cli): the root command, its groups wired in, and ``main``.

Each command group lives in a ``cli_*`` module of its own.  Heavy modules (torch, sentence-transformers,
celery, psycopg) are imported inside the commands that need them, so ``rlm --help`` and ``rlm search`` start
fast.  Every known error prints one line on stderr and exits with the code docs/contract.md#exit-codes gives it.
"""

from __future__ import annotations

import sys

#: what Ctrl-C prints when no command has more to say (docs/contract.md#exit-codes)
INTERRUPTED = "interrupted; nothing half-written was kept"

try:
    import logging
    import os
    import warnings
    from importlib.metadata import version
    from typing import Annotated

    import typer

    from rlm_workers.engine import RLMError, worker_abandoned

    from .cli_batch import batch_app
    from .cli_buffers import buffer_app, buffers_cmd
    from .cli_chat import chat_command
    from .cli_doctor import doctor_command
    from .cli_jobs import chunk_app, job_app, jobs_command
    from .cli_keys import api_command, keys_app
    from .cli_load import load
    from .cli_mcp import mcp_command
    from .cli_output import err
    from .cli_query import query
    from .cli_search import search
    from .cli_services import services_app
    from .cli_types import click_error_kind, new_typer
    from .cli_up import flower_command, up_command
    from .cli_worker import worker
except KeyboardInterrupt:
    # Ctrl-C while the CLI is still loading (most of its first second): nothing has run, so it ends as an
    # interrupted command does, not with a traceback of whichever import was under way
    sys.stderr.write(f"error: {INTERRUPTED}\n")
    raise SystemExit(130) from None

app = new_typer(
    help="rlm-pipeline: load large text into buffers and ask questions no single prompt can hold.",
    add_completion=True,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlm-pipeline {version('rlm-pipeline')}")
        raise typer.Exit()


@app.callback()
def _root(
    _version_flag: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """rlm-pipeline: load large text into buffers and ask questions no single prompt can hold."""


def _undecodable_arg(argv: list[str]) -> int | None:
    """Index of the first argument that was not valid UTF-8 (Python keeps such bytes as lone surrogates)."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


# In the order a newcomer uses them: `rlm -h` lists them so.
app.command("load")(load)
app.command("buffers")(buffers_cmd)
app.command("search")(search)
app.command("query")(query)
app.command("worker")(worker)
app.command("jobs")(jobs_command)
app.command("chat")(chat_command)
app.command("mcp")(mcp_command)
app.command("api")(api_command)
app.command("up")(up_command)
app.command("flower")(flower_command)
app.command("doctor")(doctor_command)
app.add_typer(buffer_app, name="buffer")
app.add_typer(job_app, name="job")
app.add_typer(chunk_app, name="chunk")
app.add_typer(batch_app, name="batch")
app.add_typer(keys_app, name="keys")
app.add_typer(services_app, name="services")


def main(argv: list[str] | None = None) -> int:
    try:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        args = sys.argv[1:] if argv is None else argv
        bad = _undecodable_arg(args)
        if bad is not None:
            # Never echo the bytes back: they are not text, and the terminal may take them as control codes.
            err(f"argument {bad + 1} is not valid UTF-8; rlm takes names, queries and paths as UTF-8 text")
            return 2
        # Outside standalone mode click returns the code of typer.Exit instead of raising it.
        rc = app(args=args, prog_name="rlm", standalone_mode=False)
        if isinstance(rc, int) and rc:
            return rc
    except RLMError as exc:
        err(exc.message)
        return exc.exit_code
    except KeyboardInterrupt:
        err(INTERRUPTED)
        return 130
    except Exception as exc:  # click usage errors and the like, from click or typer's vendored copy
        kind = click_error_kind(exc)
        if kind is None:
            if _broker_down(exc):
                # PostgreSQL's outage is turned into ServiceUnavailable where we connect; kombu connects for us
                err(f"cannot reach the broker ({exc}): start it (`rlm up`, or your Redis) or check RLM_BROKER_URL")
                return 1
            raise
        if kind[0] in ("usage", "click"):
            # typer >= 0.25 checks choices with pydantic, whose wording starts "Value error, ": not ours to show
            if isinstance(getattr(exc, "message", None), str):
                exc.message = exc.message.replace("Value error, ", "")  # type: ignore[attr-defined]
            exc.show()  # type: ignore[attr-defined]
        return kind[1]
    return 0


def _broker_down(exc: BaseException) -> bool:
    # pipeline.flow pulls in kombu and psycopg: loaded only once a command has failed
    from rlm_workers.engine import BROKER_OUTAGE

    return isinstance(exc, BROKER_OUTAGE)


def entry() -> None:
    rc = main()
    if worker_abandoned():
        # an in-process worker's threads still wait on a model: the interpreter would join them before exiting
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
