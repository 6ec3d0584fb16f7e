"""Celery adapters for the ingest queue: ``rlm.ingest`` (a staged upload) and ``rlm.embed`` (re-embed a buffer)."""

from __future__ import annotations

from celery import Task, shared_task

from ..ingest.reembed import run_embed
from ..ingest.uploads import run_ingest
from .base import DurableTask


@shared_task(name="rlm.ingest", base=DurableTask, bind=True, reject_on_worker_lost=True)
def ingest(self: Task, upload_id: str) -> str:
    return run_ingest(upload_id)


@shared_task(name="rlm.embed", base=DurableTask, bind=True, reject_on_worker_lost=True)
def embed(self: Task, buffer_id: int) -> str:
    return run_embed(buffer_id)
