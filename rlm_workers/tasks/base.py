"""The one Celery task class every rlm task uses: retries declared, not hand-written.

A database outage is never a job's fault: the task is retried with exponential
backoff (1, 2, 4 … 30 s, 30 times) and the job goes on where it was, because
every stage is idempotent (docs/architecture.md, "Redelivery").  Late ack and
reject-on-worker-lost come from the app's configuration (``celery_app.py``).

A worker's heap is also frozen here once it is ready (``gc.freeze``): see ``_freeze_the_startup_heap``.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from celery import Task, signals

from ..store.db import DB_OUTAGE

log = logging.getLogger("rlm.tasks")


class DurableTask(Task):
    autoretry_for = DB_OUTAGE
    retry_backoff = 1
    retry_backoff_max = 30
    retry_jitter = False
    max_retries = 30
    acks_late = True

    def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        # operators see an outage in the log, not only a task that takes longer
        log.warning("%s %s: database unavailable (%s); retrying", self.name, tuple(args), exc)


#: the cyclic collector's first threshold in a worker: allocations net of frees between two young collections
#: (Python's default is 700)
GC_YOUNG_THRESHOLD = 10_000


@signals.worker_ready.connect(weak=False)
def _freeze_the_startup_heap(**_kw: object) -> None:
    """Keep the cyclic collector off what the worker loaded to start (Celery, the clients, the models' code).

    Every task module imports this one, so every worker runs it.  A full collection walked all of it: in a
    100-thread analyst worker, where the batches in flight keep promoting their objects to the old generation,
    that was about a fifth of the process's CPU, each pass holding the GIL from every thread (bench/RESULTS.md,
    ``--scope all``).  Frozen objects are never collected, which is what they are: they live as long as the
    worker.  Young collections are made rarer too: a batch's replies and rows are mostly freed by reference
    counting before a collection would have to look at them."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
