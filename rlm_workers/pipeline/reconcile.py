"""The reconciler: jobs whose stage stopped moving are pushed on, so no job is stuck forever.

Celery with Redis can lose a message (a broker restarted without persistence,
a task that failed while PostgreSQL was away).  Job state lives in
PostgreSQL, so one periodic sweep can see every job that has not moved for
``RLM_JOB_TIMEOUT`` and act: re-send the stage task (stages are idempotent)
or, once the fan-out had its chance, finish the job from what is stored.

It runs as a thread in every worker; a Redis lock lets one of them sweep per
interval.  Every action is logged with the job id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery import signals

from ..celery_app import get_app
from ..config import Settings, get_settings
from ..constants import RECONCILE_LOCK_KEY
from ..ingest.groups import send_groups
from ..models import ORDER, Stage
from ..overnight.scheduler import reconcile_overnight
from ..runtime.resources import redis_client
from ..store import jobs as job_store
from ..store.db import connection
from ..store.uploads import orphaned_groups, orphaned_uploads, stale_groups, stale_uploads
from .analyst import batch_lease_seconds
from .flow import RESEND, TASK
from .salvage import salvage_job

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.reconcile")


def reconcile_jobs(conn: psycopg.Connection, *, send: Callable[[str, str], None], idle_seconds: float) -> list[str]:
    """One sweep; returns a line per action taken (also logged)."""
    actions = []
    for job_id, stage, idle in job_store.stale_jobs(conn, idle_seconds=idle_seconds):
        if stage == Stage.children:
            # waiting is not being stuck: children that are slow are watched on their own; once every child has
            # ended and no merge came (its message lost), one is sent
            if any(not k.terminal for k in job_store.children_of(conn, job_id=job_id)):
                job_store.touch_job(conn, job_id=job_id)
                continue
            job_store.touch_job(conn, job_id=job_id)
            send(TASK[Stage.merge], job_id)
            action = f"re-sent {TASK[Stage.merge]} (every child has ended)"
        elif stage in RESEND:
            task = TASK[RESEND[Stage(stage)]]
            # Reset the clock first: a second sweep must wait a full period before acting again.
            job_store.touch_job(conn, job_id=job_id)
            send(task, job_id)
            action = f"re-sent {task}"
        elif salvage_job(conn, job_id, f"reconciler: stuck in {stage} for {idle:.0f}s", min_idle_seconds=idle_seconds):
            action = "salvaged from stored findings"
        else:
            continue  # a batch started or the job ended since the sweep looked: not stuck after all
        line = f"job {job_id} idle {idle:.0f}s in {stage}: {action}"
        log.warning("reconciler: %s", line)
        actions.append(line)
    return actions


def reconcile_uploads(
    conn: psycopg.Connection,
    *,
    send: Callable[[str, str], None],
    idle_seconds: float,
    send_group: Callable[[str, int], None] | None = None,
) -> list[str]:
    """Re-send ``rlm.ingest`` for uploads still open after ``idle_seconds``: a lost message, a dead worker, or
    a broker that was down when the API stored it.  A delivery that finds the upload being loaded leaves it.
    Likewise ``rlm.ingest.group`` for a file group still open (``send_group``: the group sender)."""
    if send_group is None:

        def send_group(upload_id: str, group_no: int) -> None:
            send_groups(upload_id, [group_no])

    actions = []
    for upload_id in stale_uploads(conn, idle_seconds=idle_seconds):
        send("rlm.ingest", upload_id)
        line = f"upload {upload_id} still open after {idle_seconds:.0f}s: re-sent rlm.ingest"
        log.warning("reconciler: %s", line)
        actions.append(line)
    # A file group's message lost (or its worker dead) would hold the whole upload open: re-send the group.
    for upload_id, group_no in stale_groups(conn, idle_seconds=idle_seconds):
        send_group(upload_id, group_no)
        line = f"upload {upload_id} group {group_no} still open after {idle_seconds:.0f}s: re-sent rlm.ingest.group"
        log.warning("reconciler: %s", line)
        actions.append(line)
    return actions


#: stages a worker runs from start to end in one task (``stages.run_stage``; all but queued and children): found
#: open with nobody running them, their worker died; fan_out counts only before its chord was sent
#: (``store.jobs.orphaned_jobs``)
RUN_IN_TASK: tuple[Stage, ...] = tuple(s for s in ORDER if s not in (Stage.queued, Stage.children))


def reconcile_lost(
    conn: psycopg.Connection,
    *,
    send: Callable[[str, str], None],
    send_upload: Callable[[str, str], None],
    send_batch: Callable[[str, int], None],
    grace_seconds: float,
    lease_seconds: float,
    send_group: Callable[[str, int], None] | None = None,
) -> list[str]:
    """Re-send the work of a worker that died mid-task: a job's stage, an upload, a file group that a task had
    started and whose worker's database session (and the lock it held there) is gone, and an analyst batch whose
    lease nobody renewed for ``lease_seconds``.  Redis would redeliver the dead worker's message only after the
    visibility timeout (an hour by default); stages, loads, groups and batches are idempotent, so that late
    redelivery finds the work done and does nothing."""
    if send_group is None:

        def send_group(upload_id: str, group_no: int) -> None:
            send_groups(upload_id, [group_no])

    actions = []
    for job_id, stage in job_store.orphaned_jobs(conn, stages=RUN_IN_TASK, grace_seconds=grace_seconds):
        task = TASK[Stage(stage)]
        send(task, job_id)
        actions.append(f"job {job_id} in {stage}: its worker is gone; re-sent {task}")
    # Collect before the batches: a job whose re-sent batches ended in an earlier sweep gets its report now.
    for job_id in job_store.unreported_fan_outs(conn, grace_seconds=grace_seconds):
        send(TASK[Stage.collect], job_id)
        actions.append(f"job {job_id}: every batch ended but Collect never came; sent {TASK[Stage.collect]}")
    lost = job_store.orphaned_batches(conn, lease_seconds=lease_seconds, grace_seconds=grace_seconds)
    for job_id, batch_no in lost:
        # outside the chord: Collect is sent by the sweep above once every batch has ended
        send_batch(job_id, batch_no)
    for job_id in dict.fromkeys(job_id for job_id, _ in lost):
        numbers = ", ".join(str(b + 1) for j, b in lost if j == job_id)
        actions.append(f"job {job_id}: the analyst holding batch {numbers} is gone; re-sent rlm.analyst")
    for upload_id in orphaned_uploads(conn, grace_seconds=grace_seconds):
        send_upload("rlm.ingest", upload_id)
        actions.append(f"upload {upload_id}: its worker is gone; re-sent rlm.ingest")
    for upload_id, group_no in orphaned_groups(conn, grace_seconds=grace_seconds):
        send_group(upload_id, group_no)
        actions.append(f"upload {upload_id} group {group_no}: its worker is gone; re-sent rlm.ingest.group")
    for line in actions:
        log.warning("reconciler: %s", line)
    return actions


def sweep_once(settings: Settings | None = None) -> list[str]:
    """Sweep if no other worker did within the interval; [] when another holds the turn."""
    app = get_app()

    settings = settings or get_settings()
    if not redis_client().set(RECONCILE_LOCK_KEY, "1", nx=True, ex=max(1, int(settings.reconcile_seconds))):
        return []

    def sender(label: str) -> Callable[[str, str], None]:
        """Sends a task whose one argument is an id; Flower shows it as ``label=id``."""
        return lambda task, some_id: app.send_task(task, (some_id,), argsrepr=f"{label}={some_id}")

    def send_batch(job_id: str, batch_no: int) -> None:
        app.send_task("rlm.analyst", (job_id, batch_no), argsrepr=f"job={job_id} batch={batch_no + 1}")

    actions: list[str] = []
    with connection() as conn:
        actions += reconcile_lost(
            conn,
            send=sender("job"),
            send_upload=sender("upload"),
            send_batch=send_batch,
            grace_seconds=settings.worker_lost_seconds,
            lease_seconds=batch_lease_seconds(settings),
        )
        actions += reconcile_jobs(conn, send=sender("job"), idle_seconds=settings.job_timeout)
        actions += reconcile_uploads(conn, send=sender("upload"), idle_seconds=settings.job_timeout)
        actions += reconcile_overnight(conn, settings=settings)
    return actions


#: set when the worker shuts down: the sweep thread ends with it
_STOP = threading.Event()


@signals.worker_ready.connect(weak=False)
def _start_with_the_worker(**_kw: object) -> None:
    """Every worker runs the reconciler while it serves (one of them sweeps per interval); a worker imports
    this module when it starts (``celery_app.WORKER_MODULES``)."""
    start_reconciler(_STOP)


@signals.worker_shutting_down.connect(weak=False)
def _stop_with_the_worker(**_kw: object) -> None:
    _STOP.set()


def start_reconciler(stop: threading.Event) -> threading.Thread:
    """The periodic sweep in a daemon thread; broker or database outages are logged and outlived."""
    settings = get_settings()

    def run() -> None:
        while not stop.wait(settings.reconcile_seconds):
            try:
                sweep_once(settings)
            except Exception as exc:  # the next round tries again
                log.warning("reconciler sweep failed: %s", exc)

    thread = threading.Thread(target=run, name="rlm-reconciler", daemon=True)
    thread.start()
    return thread
