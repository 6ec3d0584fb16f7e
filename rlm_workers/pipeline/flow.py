"""The order of the pipeline's stages, written once, and the prologue every stage shares.

A query job moves through ``Stage`` in the order of ``ORDER``.  Plan and search
run back to back in one task, and so do collect and synthesize (``CHAINED``): a
broker round trip less on every query's critical path.  Between search and
collect the job waits on the chord that ``fanout.launch`` sends.  Every stage is
still a Celery task of its own (``tasks/pipeline.py``), so the reconciler can
send any of them again (``RESEND``), and a redelivered stage never moves a job
backwards: a stage that finds the job already past it passes straight on.

``run_stage`` owns what each stage would otherwise repeat: skip a job that is
gone or ended, mark the stage, time it, and end the job on an error — a known
error with its own message, anything else as a crash.  A database outage is
never the job's fault: it propagates, and the task retries (``tasks/base.py``).
See docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import kombu.exceptions
import redis.exceptions

from ..config import Settings
from ..errors import error_record
from ..models import ORDER, JobStatus, QueryResult, Stage
from ..runtime import metrics
from ..store import jobs as job_store
from ..store.db import connection

if TYPE_CHECKING:
    import psycopg

    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline")


#: a stage that ends well runs the next one in the same task (fan_out's successor runs as the chord's callback;
#: search's depends on the route: ``next_stage``)
CHAINED: dict[Stage, Stage] = {
    Stage.plan: Stage.search,
    Stage.search: Stage.fan_out,
    Stage.collect: Stage.check,
    Stage.check: Stage.synthesize,
    Stage.merge: Stage.synthesize,
}
#: a redelivery that finds the job past these passes on to the chained stage (each is idempotent); past the
#: others it stops, since a thinking job loops back through check and merge
PASS_ON: frozenset[Stage] = frozenset({Stage.plan, Stage.search, Stage.collect})
#: the Celery task of each stage (queues: ``celery_app.py``)
TASK: dict[Stage, str] = {
    Stage.plan: "rlm.plan",
    Stage.search: "rlm.search",
    Stage.code: "rlm.code",
    Stage.answer: "rlm.answer",
    Stage.fan_out: "rlm.fan_out",
    Stage.collect: "rlm.collect",
    Stage.check: "rlm.check",
    Stage.merge: "rlm.merge",
    Stage.synthesize: "rlm.synthesize",
}
#: a job stuck before its chord exists is pushed on by sending this stage's task again; later stages are
#: salvaged from what is stored instead (``salvage.py``).  A job waiting on children is sent ``merge`` once they
#: have all ended (``reconcile.py``).
RESEND: dict[Stage, Stage] = {
    Stage.queued: Stage.plan,
    Stage.plan: Stage.plan,
    Stage.search: Stage.search,
    Stage.code: Stage.code,
    Stage.answer: Stage.answer,
    Stage.check: Stage.check,
    Stage.merge: Stage.merge,
}
#: stages after the fan-out: the job's evidence is all in; what is left is writing the report
FINISHING: frozenset[Stage] = frozenset({Stage.collect, Stage.synthesize})
#: stages of a fan-out that has ended, where the watchdog has nothing to salvage (the reconciler watches them)
PAST_FANOUT: frozenset[Stage] = frozenset({Stage.check, Stage.children, Stage.merge})
#: stages that time themselves: synthesize ends the job, so its time must be stored before the report is; the
#: fan-out's time is its analysts' too, from the chord's start to Collect's (``store.jobs.set_stage``)
SELF_TIMED: frozenset[Stage] = frozenset({Stage.synthesize, Stage.answer, Stage.code, Stage.fan_out})
#: the broker (or Celery's Redis result backend) away while a stage sends a task: not the job's fault either.
#: The task fails and the job stays where it was, for the reconciler or an overnight batch's broker-epoch check
#: to pick up (a retry would need the very broker that is gone).
BROKER_OUTAGE: tuple[type[BaseException], ...] = (
    kombu.exceptions.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
#: said on the job's error when a stage fails with a known error
FAIL_PREFIX: dict[Stage, str] = {Stage.plan: "planning failed"}
#: a stage's outcome meaning: go on to the next stage (any other outcome ends the chain)
OK = "ok"


def next_stage(stage: Stage, job: JobRow) -> Stage | None:
    """The stage that follows ``stage`` in the same task (``job``: as the stage found it).  The search's
    successor depends on the route the search itself stored, so that one is read again."""
    if stage == Stage.search:
        with connection() as conn:
            fresh = job_store.get_job(conn, job_id=job.id)
        route = fresh.route if fresh is not None else None
        return {"direct": Stage.answer, "code": Stage.code}.get(route or "", Stage.fan_out)
    if stage == Stage.collect:
        # only a thinking tree's root checks its rounds; every other job goes on to its report
        thinking = job.options.mode == "thinking" and job.parent_id is None
        return Stage.check if thinking else Stage.synthesize
    return CHAINED.get(stage)


def position(stage: str) -> int:
    """Where a stored stage name stands in ``ORDER``; an ended job's (done, failed…) stands after all."""
    try:
        return ORDER.index(Stage(stage))
    except ValueError:
        return len(ORDER)


@dataclass
class StageContext:
    """What a stage's ``run`` gets: an open connection, the job as it was when the stage began, settings."""

    conn: psycopg.Connection
    job: JobRow
    settings: Settings


def fail_job(
    conn: psycopg.Connection,
    *,
    job_id: str,
    exc: BaseException,
    result: QueryResult | None = None,
    prefix: str | None = None,
) -> None:
    log.warning("job %s failed: %s", job_id, exc)
    job_store.finish_job(conn, job_id=job_id, status=JobStatus.failed, error=error_record(exc, prefix), result=result)


class StageTimer:
    """Adds a block's wall time to the job's ``timings`` under the stage's name."""

    def __init__(self, conn: psycopg.Connection, job_id: str, stage: str) -> None:
        self.conn, self.job_id, self.stage = conn, job_id, stage

    def __enter__(self) -> StageTimer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self.t0
        try:
            job_store.add_timing(self.conn, job_id=self.job_id, stage=self.stage, seconds=seconds)
        except Exception:  # timings never hide the stage's own outcome
            log.exception("could not record timing for job %s", self.job_id)
        metrics.stage_timed(self.stage, seconds)


def lease_seconds(settings: Settings) -> float:
    """How long a stage's lease outlives its last heartbeat: long enough to ride out a busy machine or a
    database blink, short enough that a dead holder's job is salvaged soon after ``RLM_JOB_TIMEOUT``."""
    return float(max(10, min(60, settings.job_timeout)))


class Heartbeat:
    """Renews a lease from a thread, every ``every`` seconds, until stopped or ``renew`` says it is no longer
    ours.  Each beat checks out its own pooled connection (the worker's may be busy in a long statement, or
    held by nobody while a model thinks); a failed beat only shortens the lease, so it is logged, not raised.
    """

    def __init__(
        self, renew: Callable[[psycopg.Connection], bool], every: float, what: str, settings: Settings | None = None
    ) -> None:
        self.renew, self.every, self.what, self.settings = renew, every, what, settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rlm-heartbeat {what}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=max(15.0, self.every))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with connection(self.settings, timeout=self.every) as conn:
                    if not self.renew(conn):
                        return  # ended, salvaged or taken over: nothing left to keep alive
            except Exception as exc:  # a database blink: the lease outlives a few missed beats
                log.warning("%s: heartbeat failed: %s", self.what, exc)


class StageLease:
    """The job's lease, held while a long stage runs (synthesize): a heartbeat renews it, and the stage clock
    with it, every quarter lease, so neither the reconciler nor the watchdog takes a live stage for a stuck
    one; only the holder's death lets the lease lapse.  ``acquired`` is False when another worker holds it.
    """

    def __init__(self, conn: psycopg.Connection, job_id: str, settings: Settings, owner: str | None = None) -> None:
        self.conn, self.job_id, self.settings = conn, job_id, settings
        self.owner = owner or uuid.uuid4().hex
        self.seconds = lease_seconds(settings)
        self.acquired = False
        self._heartbeat: Heartbeat | None = None

    def __enter__(self) -> StageLease:
        self.acquired = job_store.acquire_lease(self.conn, job_id=self.job_id, owner=self.owner, seconds=self.seconds)
        if self.acquired:
            self._heartbeat = Heartbeat(self._renew, self.seconds / 4, f"job {self.job_id} lease", self.settings)
            self._heartbeat.__enter__()
        return self

    def _renew(self, conn: psycopg.Connection) -> bool:
        return job_store.renew_lease(conn, job_id=self.job_id, owner=self.owner, seconds=self.seconds)

    def beat(self) -> None:
        """A renewal from the stage itself (between tool turns), on the stage's own connection."""
        if self.acquired and not self._renew(self.conn):
            log.warning("job %s: lease lost while still working (ended, or lapsed and taken over)", self.job_id)

    def __exit__(self, *exc: object) -> None:
        if self._heartbeat is not None:
            self._heartbeat.__exit__()
        if self.acquired:
            try:
                job_store.release_lease(self.conn, job_id=self.job_id, owner=self.owner)
            except Exception:  # the lease lapses by itself; the stage's own outcome matters more
                log.warning("job %s: could not release its lease", self.job_id, exc_info=True)
