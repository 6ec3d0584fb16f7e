"""rlm.fan_out: one flat chord, an analyst per batch, collect as the callback.

Kept flat on purpose (DESIGN §9): single tasks in the header, no chains or
nested chords.  The callback's error path (``rlm.salvage``) and a watchdog
scheduled here make sure the job ends even if a header task is lost.
"""

from __future__ import annotations

from celery import chord, shared_task

from ..config import get_settings
from ..store import jobs as job_store
from .common import db, survives_outages


@shared_task(name="rlm.fan_out", bind=True, acks_late=True)
@survives_outages
def fan_out(self, job_id: str) -> str:  # noqa: ANN001
    return launch(job_id)


def launch(job_id: str) -> str:
    """Send the chord for a job whose batches are cut; idempotent (a second call sends nothing).

    ``rlm.search`` calls this in-process right after cutting the batches, saving a broker round
    trip on every query's critical path; the ``rlm.fan_out`` task runs the same code when a stage
    is re-sent by the reconciler.
    """
    from .analyst import analyst
    from .collect import collect
    from .salvage import salvage, watchdog

    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        if job.stage != "search" and job.task_ids:
            return "already launched"  # redelivered after the chord was sent
        n = job.batches_total
        header = [
            analyst.si(job_id, k).set(argsrepr=f"job={job_id} batch={k + 1}/{n}")
            for k in range(n)
        ]
        body = collect.si(job_id).set(argsrepr=f"job={job_id}")
        body.link_error(salvage.si(job_id).set(argsrepr=f"job={job_id}"))
        job_store.set_stage(conn, job_id=job_id, stage="fan_out")
        result = chord(header)(body)
        ids = [result.id] + [r.id for r in (result.parent.results if result.parent is not None else [])]
        job_store.add_task_ids(conn, job_id=job_id, task_ids=ids)
    # The watchdog must fire before Redis would redeliver it (ETA tasks count against visibility_timeout).
    countdown = min(settings.job_timeout, max(5, settings.visibility_timeout - 5))
    watchdog.apply_async((job_id,), countdown=countdown, argsrepr=f"job={job_id}")
    return f"{n} batches"
