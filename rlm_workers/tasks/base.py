"""The one Celery task class every rlm task uses: retries declared, not hand-written.

A database outage is never a job's fault: the task is retried with exponential
backoff (1, 2, 4 … 30 s, 30 times) and the job goes on where it was, because
every stage is idempotent (docs/architecture.md, "Redelivery").  Late ack and
reject-on-worker-lost come from the app's configuration (``celery_app.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

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
