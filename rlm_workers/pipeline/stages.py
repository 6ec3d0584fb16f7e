"""The stage runner: which function runs each stage of a job, and the loop that runs a stage and the stages
chained after it (docs/architecture.md#flow).  The stages are named directly here; the stage machine
itself (``Stage``, ``next_stage``, leases, failure) lives in ``flow``, which every stage imports.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import get_settings
from ..errors import RLMError
from ..runtime.logs import stage_context
from ..store import jobs as job_store
from ..store.db import DB_OUTAGE, connection
from . import answer, collect, fanout, plan, program, search, synthesize
from .flow import (
    BROKER_OUTAGE,
    FAIL_PREFIX,
    OK,
    PASS_ON,
    SELF_TIMED,
    Stage,
    StageContext,
    StageTimer,
    fail_job,
    next_stage,
    position,
)
from .tree import notify_parent_if_ended, run_check, run_merge

if TYPE_CHECKING:
    import psycopg

    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline")

#: the function that runs each stage (its ``run``, unless named)
RUNNERS: dict[Stage, Callable[[StageContext], str]] = {
    Stage.plan: plan.run,
    Stage.search: search.run,
    Stage.code: program.run,
    Stage.answer: answer.run,
    Stage.fan_out: fanout.run,
    Stage.collect: collect.run,
    Stage.check: run_check,
    Stage.merge: run_merge,
    Stage.synthesize: synthesize.run,
}


def run_stage(job_id: str, stage: Stage) -> str:
    """Run ``stage`` of the job, then every stage chained after it; returns the last one's outcome.  A child job
    that ended here tells its parent (``tree.py``), whose next step waits for that."""
    current: Stage | None = stage
    outcome = OK
    parent: str | None = None
    try:
        # One connection for the whole task, marking the job as run by a live worker: when this process dies, the
        # mark goes with its session, and the reconciler sends the stage again without waiting for Redis to
        # redeliver the message (docs/architecture.md#redelivery).
        with connection() as conn, job_store.stage_held(conn, job_id=job_id):
            while current is not None:
                outcome, job = _run_one(conn, job_id, current)
                if job is None:
                    return outcome
                parent = job.parent_id
                if outcome != OK:
                    return outcome
                current = next_stage(current, job)
            return outcome
    finally:
        if parent is not None:
            notify_parent_if_ended(job_id)


def _run_one(conn: psycopg.Connection, job_id: str, stage: Stage) -> tuple[str, JobRow | None]:
    """The stage's outcome, and the job as the stage found it (None when it is gone)."""
    settings = get_settings()
    job = job_store.get_job(conn, job_id=job_id)
    if job is None or job.terminal:
        return "skipped", job
    if position(job.stage) > position(stage):
        # a redelivery of an earlier stage: the job is past it; pass on without moving it back
        return (OK if stage in PASS_ON else "skipped"), job
    job_store.set_stage(conn, job_id=job_id, stage=stage)
    ctx = StageContext(conn=conn, job=job, settings=settings)
    try:
        # a task runs the stages chained after its own: each one's lines carry its name
        with stage_context(stage.value):
            if stage in SELF_TIMED:
                return RUNNERS[stage](ctx), job
            with StageTimer(conn, job_id, stage):
                return RUNNERS[stage](ctx), job
    except DB_OUTAGE:
        raise  # not the job's fault: the task retries
    except BROKER_OUTAGE:
        log.warning("%s of job %s: broker unavailable; the job stays in %s for recovery", stage, job_id, stage)
        raise
    except RLMError as exc:
        fail_job(conn, job_id=job_id, exc=exc, prefix=FAIL_PREFIX.get(stage))
    except Exception as exc:  # the job must end, whatever broke
        log.exception("%s stage crashed for job %s", stage, job_id)
        fail_job(conn, job_id=job_id, exc=exc, prefix=f"{stage} failed")
    return "failed", job
