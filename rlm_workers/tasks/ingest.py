"""Celery adapters for the ingest queue: ``rlm.ingest`` (a staged upload), ``rlm.ingest.group`` (one file group
of a large one) and ``rlm.embed`` (re-embed a buffer)."""

from __future__ import annotations

from celery import Task, shared_task

from ..ingest.groups import run_group
from ..ingest.reembed import run_embed
from ..ingest.uploads import run_ingest
from .base import DurableTask


@shared_task(name="rlm.ingest", base=DurableTask, bind=True, reject_on_worker_lost=True)
def ingest(self: Task, upload_id: str) -> str:
    return run_ingest(upload_id)


@shared_task(name="rlm.ingest.group", base=DurableTask, bind=True, reject_on_worker_lost=True)
def ingest_group(self: Task, upload_id: str, group_no: int) -> str:
    return run_group(upload_id, group_no)


@shared_task(name="rlm.embed", base=DurableTask, bind=True, reject_on_worker_lost=True)
def embed(self: Task, buffer_id: int) -> str:
    return run_embed(buffer_id)
