"""The query pipeline's Celery tasks: thin adapters, one line of logic each.

What each stage does lives in ``pipeline/<stage>.py``, the order of the stages
in ``pipeline/flow.py``.  Task arguments are ids, never chunk text; queues are
routed by name in ``celery_app.py``.  Retries on a database outage are declared
by ``DurableTask``.
"""

from __future__ import annotations

from celery import shared_task

from ..llm import fair
from ..pipeline import analyst as analyst_stage
from ..pipeline import reads as reads_stage
from ..pipeline import salvage as salvage_stage
from ..pipeline import subcalls
from ..pipeline.flow import Stage
from ..pipeline.stages import run_stage
from .base import DurableTask


@shared_task(name="rlm.plan", base=DurableTask, bind=True)
def plan(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.plan)


@shared_task(name="rlm.search", base=DurableTask, bind=True)
def search(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.search)


@shared_task(name="rlm.answer", base=DurableTask, bind=True)
def answer(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.answer)


@shared_task(name="rlm.code", base=DurableTask, bind=True)
def code(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.code)


@shared_task(name="rlm.subcall", base=DurableTask, bind=True)
def subcall(self: DurableTask, job_id: str, chord_no: int, index: int, deferrals: int = 0) -> dict:
    return fair.in_turn(self, fair.tenant_of(job_id), deferrals, lambda: subcalls.run_subcall(job_id, chord_no, index))


@shared_task(name="rlm.subcalls_done", base=DurableTask, bind=True)
def subcalls_done(self: DurableTask, job_id: str, chord_no: int) -> str:
    return subcalls.subcalls_done(job_id, chord_no)


@shared_task(name="rlm.check", base=DurableTask, bind=True)
def check(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.check)


@shared_task(name="rlm.merge", base=DurableTask, bind=True)
def merge(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.merge)


@shared_task(name="rlm.fan_out", base=DurableTask, bind=True)
def fan_out(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.fan_out)


@shared_task(name="rlm.analyst", base=DurableTask, bind=True)
def analyst(self: DurableTask, job_id: str, batch_no: int, deferrals: int = 0) -> dict:
    return fair.in_turn(self, fair.tenant_of(job_id), deferrals, lambda: analyst_stage.run(job_id, batch_no))


@shared_task(name="rlm.read", base=DurableTask, bind=True)
def read(self: DurableTask, read_id: int, deferrals: int = 0) -> dict:
    return fair.in_turn(self, reads_stage.tenant_of(read_id), deferrals, lambda: reads_stage.run(read_id))


@shared_task(name="rlm.collect", base=DurableTask, bind=True)
def collect(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.collect)


@shared_task(name="rlm.synthesize", base=DurableTask, bind=True)
def synthesize(self: DurableTask, job_id: str) -> str:
    return run_stage(job_id, Stage.synthesize)


@shared_task(name="rlm.salvage", base=DurableTask, bind=True)
def salvage(self: DurableTask, job_id: str) -> str:
    return salvage_stage.salvage(job_id)


@shared_task(name="rlm.watchdog", base=DurableTask, bind=True)
def watchdog(self: DurableTask, job_id: str, rearms: int = 0) -> str:
    return salvage_stage.watchdog(job_id, rearms)
