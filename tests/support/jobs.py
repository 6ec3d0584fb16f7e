"""Submitting a query job from a test and waiting for it, or for anything else, without a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.support.pipeline_model import QUESTION

#: a small, deterministic job over the essays corpus: no planner call, every chunk a candidate
QUICK = {"skip_plan": True, "threshold": -1.0, "batch_size": 4}


def submit(
    conn: Any, query: str = QUESTION, buffers: Sequence[str] = ("essays",), *, quick: bool = True, **options: Any
) -> str:
    """Store and enqueue a job for the local tenant: ``QUICK`` options unless the test overrides them (or, with
    ``quick=False``, only the options it names)."""
    from rlm_workers.submit import submit_query

    options = {**QUICK, **options} if quick else options
    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=list(buffers), options=options)
    conn.commit()
    return job_id


def wait(conn: Any, job_id: str, timeout: float = 180) -> Any:
    """The job once it ended (woken by its NOTIFY)."""
    from rlm_workers.submit import wait_for_job

    return wait_for_job(conn, job_id, timeout=timeout)


def wait_for(predicate: Callable[[], Any], timeout: float = 90, every: float = 0.1) -> bool:
    """True as soon as ``predicate()`` is; False if it never was within ``timeout`` (the test then says what)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def stored_fan_out_job(prefix: str, batches: list[list[int]]) -> str:
    """A job stored as if its search had just cut ``batches`` (chunk ids need not exist): for tests of the
    claim, lease and salvage protocol that need no worker and no model."""
    import uuid

    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    job_id = prefix + uuid.uuid4().hex
    with connection() as conn:
        job_store.create_job(conn, job_id=job_id, tenant="local", query="q", buffers=["b"], options={})
        job_store.set_stage(conn, job_id=job_id, stage="fan_out")
        job_store.save_search(
            conn,
            job_id=job_id,
            params={},
            tier="tiny",
            chunks_available=sum(len(b) for b in batches),
            chunk_load_failures=0,
            batches=batches,
        )
    return job_id
