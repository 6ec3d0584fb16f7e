"""Waiting on a job from a command (`rlm query`, `rlm chat`, `rlm batch submit`): Ctrl-C as a flag the wait
checks at a safe point, and what a ``--timeout`` that ran out says and does."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .cli_output import err

if TYPE_CHECKING:
    import psycopg


class Interrupted(Exception):
    """Ctrl-C seen by the wait loop (raised at a safe point, between database round trips)."""


@contextlib.contextmanager
def sigint_as_flag() -> Iterator[threading.Event]:
    """While inside, Ctrl-C sets the yielded event instead of raising KeyboardInterrupt."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals reach the main thread only; nothing to install
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def timed_out(conn: psycopg.Connection, job_id: str, timeout: float, ephemeral: bool, tenant: str) -> None:
    """Say that ``--timeout`` ran out, and cancel the job when only this command's in-process worker ran it."""
    # the job store and submit pull in psycopg: imported only once a wait has timed out
    from rlm_workers.engine import cancel_query, get_job

    if ephemeral:
        # The in-process worker leaves with this command: nothing would ever finish the job.
        cancel_query(conn, job_id=job_id, tenant=tenant, reason=f"timed out: --timeout {timeout:g}s ran out")
        err(
            f"timed out: job {job_id} did not end within --timeout {timeout:g}s and was cancelled: no worker was "
            "running, so nothing could finish it after this command; start workers (`rlm worker`, `rlm up`) or raise "
            "--timeout"
        )
        return
    job = get_job(conn, job_id=job_id)
    conn.commit()
    where = f"{job.status}, stage {job.stage}" if job else "running"
    err(
        f"timed out: job {job_id} still {where} after --timeout {timeout:g}s; the workers go on with it: fetch it with "
        f"GET /v1/queries/{job_id} on the API (`rlm api` or `rlm up`); an HTTP delete of that URL cancels it"
    )
