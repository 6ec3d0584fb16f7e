"""Fan-out: one flat chord, an analyst task per batch, collect as its callback.

Kept flat on purpose (docs/contract.md#celery-conventions): single tasks in the
header, no chains or nested chords.  The callback's error path (``rlm.salvage``)
and a watchdog sent here make sure the job ends even if a header task is lost.
Tasks are named, not imported: the pipeline does not depend on its adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery import chord

from ..celery_app import get_app
from ..llm import fair
from ..store import jobs as job_store
from .flow import TASK, Stage, StageContext
from .salvage import watchdog_countdown

if TYPE_CHECKING:
    from celery import Celery, Signature

    from ..store.jobs import JobRow


def run(ctx: StageContext) -> str:
    """Send the chord for a job whose batches are cut; a redelivery (task ids stored, or a launch in progress
    under the job's launch lock) sends nothing."""
    if ctx.job.spec and ctx.job.spec.read_group:
        # an overnight batch's question reading together with the others over the same buffer: the batch's tick
        # launches the group's shared reads once every job of it has searched (reads.py)
        return "waiting for the shared reads of its group"
    with job_store.launch_lock(ctx.conn, job_id=ctx.job.id) as mine:
        if not mine:
            return "being launched by another delivery"
        # read again under the lock: a delivery that held it may have launched since this stage began
        job = job_store.reread_job(ctx.conn, job_id=ctx.job.id)
        if job.task_ids:
            return "already launched"
        return _launch(ctx, job)


def send_chord(app: Celery, header: list[Signature], body: Signature, *, tenant: str) -> list[str]:
    """Send a flat chord of ``tenant``'s tasks; the ids of its callback and header tasks, for the job's record.
    The fan-out's analysts and a code-mode program's sub-calls are both sent here."""
    fair.note_queued(tenant, len(header))  # its tasks may queue behind another tenant's: docs/contract.md#fair-share
    result = chord(header, app=app)(body)
    return [result.id] + [r.id for r in (result.parent.results if result.parent is not None else [])]


def _launch(ctx: StageContext, job: JobRow) -> str:
    app = get_app()

    n = job.batches_total
    own = fair.current_priority()
    # a big job's tail goes a priority step down, so a later small query is not queued behind all of it
    priorities = fair.header_priorities(n, own=own, head=ctx.settings.max_concurrency)
    header = [
        app.signature("rlm.analyst", (job.id, k), immutable=True).set(
            argsrepr=f"job={job.id} batch={k + 1}/{n}", priority=priorities[k]
        )
        for k in range(n)
    ]
    # the callback is sent by whichever analyst ends last: named here, its priority is the job's, not the tail's
    body = app.signature(TASK[Stage.collect], (job.id,), immutable=True).set(argsrepr=f"job={job.id}", priority=own)
    body.link_error(app.signature("rlm.salvage", (job.id,), immutable=True).set(argsrepr=f"job={job.id}", priority=own))
    ids = send_chord(app, header, body, tenant=job.tenant)
    job_store.add_task_ids(ctx.conn, job_id=job.id, task_ids=ids)
    app.send_task("rlm.watchdog", (job.id,), countdown=watchdog_countdown(ctx.settings), argsrepr=f"job={job.id}")
    return f"{n} batches"
