"""An in-process worker for one-shot ``rlm query`` when no worker is running.

Runs Celery's real consumer (threads pool) in a background thread of the
CLI process, on the same broker, so the query still goes through the real
chord, not eager mode.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from celery.contrib.testing.worker import start_worker

from ..constants import ALL_QUEUES, QUEUE_ANALYST, QUEUE_CONTROL

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("rlm.worker")

#: how long a stopping in-process worker waits for its running tasks (a local model's call may take minutes)
SHUTDOWN_SECONDS = 10.0
_abandoned = threading.Event()


def abandoned() -> bool:
    """Whether an in-process worker was stopped with tasks still running (a call to a slow model): their job was
    cancelled or is left to other workers, so the process ends without waiting for them (``rlm_api.cli.entry``)."""
    return _abandoned.is_set()


def served_queues(app: Celery, timeout: float = 0.6) -> set[str]:
    """Queues some running worker consumes (empty when none answers)."""
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception:  # an unreachable broker surfaces on submit with a clear error
        return set()
    return {q["name"] for queues in replies.values() for q in queues}


@contextlib.contextmanager
def ensure_workers(
    app: Celery, *, needed: Sequence[str] = (QUEUE_CONTROL, QUEUE_ANALYST), concurrency: int = 16
) -> Iterator[bool]:
    """Yield True if an ephemeral worker was started for queues nobody serves."""
    missing = [q for q in needed if q not in served_queues(app)]
    if not missing:
        yield False
        return

    log.info("no worker serves %s: starting an in-process worker", ", ".join(missing))
    pending: BaseException | None = None
    try:
        with start_worker(
            app,
            pool="threads",
            concurrency=concurrency,
            perform_ping_check=False,
            queues=list(missing),
            loglevel="WARNING",
            shutdown_timeout=SHUTDOWN_SECONDS,
        ):
            try:
                yield True
            except BaseException as exc:
                pending = exc
                raise
    except RuntimeError as exc:
        # celery's testing worker raises this when its thread outlives the shutdown timeout, replacing whatever
        # ended the command (a timeout's exit code): that one is what the user must see
        if exc is pending or "failed to exit" not in str(exc):
            raise
        log.warning("the in-process worker still had tasks running; leaving them (their job ended or was cancelled)")
        _abandoned.set()
        if pending is not None:
            raise pending from None


__all__ = ["ALL_QUEUES", "ensure_workers", "served_queues"]
