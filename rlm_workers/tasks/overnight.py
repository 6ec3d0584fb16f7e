"""Celery adapters for overnight batches (``rlm_workers.overnight``); the names stay ``rlm.batch.*``."""

from __future__ import annotations

from celery import Task, shared_task

from ..overnight import scheduler
from .base import DurableTask


@shared_task(name="rlm.batch.tick", base=DurableTask, bind=True, ignore_result=True)
def tick(self: Task, batch_id: str, token: str | None = None) -> str:
    """One step of the batch; a retried tick keeps its token, so it still owns the chain."""
    return scheduler.advance(batch_id, token)


@shared_task(name="rlm.batch.reconcile", base=DurableTask, bind=True, ignore_result=True)
def reconcile(self: Task) -> int:
    """For celery beat users: the same sweep the workers' reconciler thread runs."""
    return scheduler.sweep()
