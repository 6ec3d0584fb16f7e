"""Salvage and watchdog: a job always ends, with whatever was stored.

``salvage`` is the error path of the chord callback: it marks batches that
never reported as lost and finishes the job from the stored findings.
``watchdog`` fires after ``RLM_JOB_TIMEOUT`` and salvages a job still waiting
on its fan-out (a header task lost with its worker and not yet redelivered),
so no job hangs forever.  The claim/salvage lock protocol is described in
docs/architecture.md ("Locks").
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from ..celery_app import get_app
from ..config import Settings, get_settings
from ..store import jobs as job_store
from ..store.db import connection
from .collect import LOST, collect_job, finding_threshold
from .flow import FINISHING, PAST_FANOUT, fail_job, lease_seconds
from .synthesize import finish_with_report
from .tree import notify_parent_if_ended

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.pipeline.salvage")

#: how often the watchdog re-arms while collect/synthesize are still legitimately running
MAX_REARMS = 3


def watchdog_countdown(settings: Settings) -> float:
    """When a fan-out's watchdog looks: after ``job_timeout``, but before Redis would redeliver it (an ETA
    task counts against ``visibility_timeout``).  Settings refuse a ``job_timeout`` not below the visibility
    timeout, so only the last 5 s of margin can shorten it here."""
    return min(settings.job_timeout, max(5, settings.visibility_timeout - 5))


def salvage_job(conn: psycopg.Connection, job_id: str, reason: str, *, min_idle_seconds: float | None = None) -> bool:
    """Finish the job from what is stored; with ``min_idle_seconds``, only if it made no progress that long.

    The idle check and the marking of unfinished batches happen under the job's row lock, the same
    lock an analyst takes to claim a batch: a batch starting right now makes the salvage back off.
    """
    settings = get_settings()
    # The salvage takes the job's lease with the row lock: a job whose synthesizer is alive (lease renewed)
    # is left to it, and the salvage's own synthesis is protected the same way.
    owner = uuid.uuid4().hex
    with conn.transaction():
        if not job_store.lock_for_salvage(
            conn,
            job_id=job_id,
            min_idle_seconds=min_idle_seconds,
            lease_owner=owner,
            lease_seconds=lease_seconds(settings),
        ):
            return False
        lost = job_store.fail_unfinished_batches(conn, job_id=job_id, reason=LOST)
    log.warning("salvaging job %s (%s): %d batches marked lost", job_id, reason, lost)
    try:
        collect_job(conn, job_store.reread_job(conn, job_id=job_id), finding_threshold(settings))
        finish_with_report(conn, job_store.reread_job(conn, job_id=job_id), settings, lease_owner=owner)
    except Exception as exc:  # last resort: end the job, never leave it running
        log.exception("salvage of job %s failed", job_id)
        fail_job(conn, job_id=job_id, exc=exc, prefix="salvage failed")

    notify_parent_if_ended(job_id)  # a salvaged child still lets its parent go on
    return True


def salvage(job_id: str) -> str:
    """The chord callback failed: finish the job from what is stored."""
    with connection() as conn:
        return "salvaged" if salvage_job(conn, job_id, "chord callback failed") else "skipped"


def watchdog(job_id: str, rearms: int = 0) -> str:
    app = get_app()

    settings = get_settings()
    with connection() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "ended"
        if job.stage in PAST_FANOUT:
            return "fan-out over"  # checking or waiting on children: the reconciler watches those stages
        done, total = job_store.batch_progress(conn, job_id=job_id)
        finishing = job.stage in FINISHING
        if finishing and rearms < MAX_REARMS:
            app.send_task(
                "rlm.watchdog",
                (job_id, rearms + 1),
                countdown=max(5, settings.job_timeout // 2),
                argsrepr=f"job={job_id}",
            )
            return "rearmed"
        # A fan-out still moving (batches claimed or finished lately) is slow, not stuck: wait again.
        if salvage_job(
            conn,
            job_id,
            f"watchdog: {done}/{total} batches, idle {settings.job_timeout}s",
            min_idle_seconds=None if finishing else settings.job_timeout,
        ):
            return "salvaged"
        if job_store.reread_job(conn, job_id=job_id).terminal:
            return "ended"
        app.send_task(
            "rlm.watchdog", (job_id, rearms), countdown=watchdog_countdown(settings), argsrepr=f"job={job_id}"
        )
        return "rearmed"
