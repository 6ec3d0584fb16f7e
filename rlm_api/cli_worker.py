"""`rlm worker`: a Celery worker on some queues, its pool picked from them (docs/contract.md#cli-services).

Registered in cli.py as the ``worker`` command.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from rlm_workers.engine import ALL_QUEUES, QUEUE_INGEST, InvalidInput


def resolve_pool(queues: list[str], pool: str | None) -> str:
    """The worker pool: ``-P`` when given, else prefork for the CPU-bound ingest queue and threads for the rest.

    One Celery worker has one pool, so ingest (embedding, prefork per docs/contract.md#cli-services) and the
    I/O-bound control/analyst queues (threads) cannot share a worker unless the user forces a pool.
    """
    if pool is not None:
        if pool not in ("threads", "prefork", "solo"):
            raise InvalidInput(f"unknown pool {pool!r}: use threads, prefork or solo")
        return pool
    if QUEUE_INGEST not in queues:
        return "threads"
    if len(queues) == 1:
        return "prefork"
    others = ",".join(q for q in queues if q != QUEUE_INGEST)
    raise InvalidInput(
        f"{QUEUE_INGEST} runs CPU-bound embedding on the prefork pool and {others} on threads: start two workers "
        f"(`rlm worker -Q {others}` and `rlm worker -Q {QUEUE_INGEST}`) or `rlm up`, or force one pool with -P"
    )


def worker_argv(
    queues: str, pool: str | None, *, concurrency: int | None, loglevel: str, hostname: str | None
) -> list[str]:
    """The ``celery worker`` argv `rlm worker` runs (validated; no side effect)."""
    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in names if q not in ALL_QUEUES]
    if unknown or not names:
        raise InvalidInput(f"unknown queue {unknown[0] if unknown else '(none)'}: use {', '.join(ALL_QUEUES)}")
    # Gossip and mingle add nothing here (state lives in PostgreSQL) and their bootsteps are where a
    # worker breaks when Redis restarts under it (celery#8030, kombu#582): leave them out.
    argv = [
        "worker",
        "-Q",
        ",".join(names),
        "-P",
        resolve_pool(names, pool),
        "-l",
        loglevel,
        "-E",
        "--without-gossip",
        "--without-mingle",
    ]
    if concurrency:
        argv += ["-c", str(concurrency)]
    if hostname:
        argv += ["-n", hostname]
    return argv


def worker(
    queues: Annotated[
        str, typer.Option("--queues", "-Q", help="Comma-separated queues (rlm.ingest needs a worker of its own).")
    ] = "rlm.control,rlm.analyst",
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-c")] = None,
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool", "-P", help="threads, prefork or solo; default: prefork for rlm.ingest alone, threads otherwise."
        ),
    ] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
    hostname: Annotated[str | None, typer.Option("--hostname", "-n")] = None,
) -> None:
    """Run a Celery worker (same as `celery -A rlm_workers worker`)."""
    argv = worker_argv(queues, pool, concurrency=concurrency, loglevel=loglevel, hostname=hostname)
    # celery loads after the queues were checked (a bad -Q is a fast exit 2) and never for `rlm --help`.
    # Celery's `worker` command itself, not `app.worker_main`: that one parses through the whole `celery` CLI,
    # whose plugins (Flower's web app, the amqp shell's prompt_toolkit) took 0.3 CPU-s of every worker's start.
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker as celery_worker

    from rlm_workers.engine import celery_app

    # as worker_main does: the worker's own exit code is not passed on
    celery_worker.main(
        args=argv[1:],
        prog_name="celery worker",
        obj=CLIContext(app=celery_app, no_color=bool(os.environ.get("NO_COLOR")), workdir=None),
        standalone_mode=False,
    )
