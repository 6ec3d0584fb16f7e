"""rlm.salvage and rlm.watchdog: a job always ends, with whatever was stored.

``rlm.salvage`` is the error path of the chord callback: it marks batches
that never reported as lost and finishes the job from the stored findings.
``rlm.watchdog`` fires after ``RLM_JOB_TIMEOUT`` and salvages a job still
waiting on its fan-out (a header task lost with its worker and not yet
redelivered), so no job hangs forever.
"""

from __future__ import annotations

from celery import shared_task

from ..config import get_settings
from ..store import jobs as job_store
from .common import db, fail_job, log, survives_outages

LOST = {"type": "lost", "message": "the batch never reported (worker lost or task failed); finished without it"}
#: how often the watchdog re-arms while collect/synthesize are still legitimately running
MAX_REARMS = 3


def salvage_job(conn, job_id: str, reason: str, *, min_idle_seconds: float | None = None) -> bool:  # noqa: ANN001
    """Finish the job from what is stored; with ``min_idle_seconds``, only if it made no progress that long.

    The idle check and the marking of unfinished batches happen under the job's row lock, the same
    lock an analyst takes to claim a batch: a batch starting right now makes the salvage back off.
    """
    from .collect import collect_job
    from .synthesize import finish_with_report

    with conn.transaction():
        if not job_store.lock_for_salvage(conn, job_id=job_id, min_idle_seconds=min_idle_seconds):
            return False
        lost = job_store.fail_unfinished_batches(conn, job_id=job_id, reason=LOST)
    log.warning("salvaging job %s (%s): %d batches marked lost", job_id, reason, lost)
    try:
        collect_job(conn, job_store.get_job(conn, job_id=job_id))
        finish_with_report(conn, job_store.get_job(conn, job_id=job_id))
    except Exception as exc:  # noqa: BLE001 - last resort: end the job, never leave it running
        log.exception("salvage of job %s failed", job_id)
        fail_job(conn, job_id=job_id, exc=exc, prefix="salvage failed")
    return True


@shared_task(name="rlm.salvage", bind=True, acks_late=True)
@survives_outages
def salvage(self, job_id: str) -> str:  # noqa: ANN001
    with db() as conn:
        return "salvaged" if salvage_job(conn, job_id, "chord callback failed") else "skipped"


@shared_task(name="rlm.watchdog", bind=True, acks_late=True)
@survives_outages
def watchdog(self, job_id: str, rearms: int = 0) -> str:  # noqa: ANN001
    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "ended"
        done, total = job_store.batch_progress(conn, job_id=job_id)
        if job.stage in ("collect", "synthesize") and rearms < MAX_REARMS:
            watchdog.apply_async((job_id, rearms + 1), countdown=max(5, settings.job_timeout // 2),
                                 argsrepr=f"job={job_id}")
            return "rearmed"
        # A fan-out still moving (batches claimed or finished lately) is slow, not stuck: wait again.
        idle_limit = None if job.stage in ("collect", "synthesize") else settings.job_timeout
        if salvage_job(conn, job_id, f"watchdog: {done}/{total} batches, idle {settings.job_timeout}s",
                       min_idle_seconds=idle_limit):
            return "salvaged"
        if job_store.get_job(conn, job_id=job_id).terminal:
            return "ended"
        watchdog.apply_async((job_id, rearms), countdown=max(5, min(settings.job_timeout,
                                                                  settings.visibility_timeout - 5)),
                             argsrepr=f"job={job_id}")
        return "rearmed"
