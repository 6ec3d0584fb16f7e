"""rlm.collect: the chord callback.  Gathers stored findings, filters and sorts them."""

from __future__ import annotations

import dataclasses
from typing import Any

from celery import shared_task

from ..store import jobs as job_store
from ..store.buffers import get_chunks
from .common import StageTimer, db, log, survives_outages


def _as_dict(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return dataclasses.asdict(obj)


def collect_job(conn, job) -> int:  # noqa: ANN001 - JobRow
    """Run Collect for a job and store the kept findings; returns how many were filtered out."""
    from ..config import get_settings
    from ..stages.collect import ChunkRef, collect

    found = job_store.findings_of(conn, job_id=job.id)
    rows = get_chunks(conn, tenant=job.tenant, chunk_ids=sorted({f.chunk_id for _, f in found}))
    pairs = [(f, ChunkRef(chunk_id=c.id, buffer=c.buffer, ordinal=c.ordinal, path=c.path,
                          start_line=c.start_line, end_line=c.end_line))
             for _, f in found if (c := rows.get(f.chunk_id)) is not None]
    threshold = (job.options or {}).get("finding_threshold") or get_settings().finding_threshold
    result = collect(pairs, finding_threshold=threshold)
    job_store.save_collected(conn, job_id=job.id, collected={
        "kept": [_as_dict(k) for k in result.kept], "filtered": result.filtered_count})
    return result.filtered_count


@shared_task(name="rlm.collect", bind=True, acks_late=True)
@survives_outages
def collect(self, job_id: str) -> str:  # noqa: ANN001
    from .synthesize import run_synthesis

    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        job_store.set_stage(conn, job_id=job_id, stage="collect")
        # Every header task has returned; a batch still pending never ran (its task was skipped or lost).
        from .salvage import LOST

        job_store.fail_unfinished_batches(conn, job_id=job_id, reason=LOST)
        with StageTimer(conn, job_id, "collect"):
            filtered = collect_job(conn, job)
    log.info("job %s collected (%d filtered)", job_id, filtered)
    # In-process: one broker hop less on the critical path; a crash redelivers collect, which is idempotent.
    return run_synthesis(job_id)
