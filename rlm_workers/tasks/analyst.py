"""rlm.analyst: one batch of chunks → findings stored under (job, batch).

It never raises into the chord: Celery runs a chord's callback only if every
header task succeeds (celery#1881), so any failure becomes an error record
on the batch and the job goes on with the batches that worked.
"""

from __future__ import annotations

import contextlib

from celery import shared_task

from ..config import get_settings
from ..errors import ParseError
from ..llm.protocol import CompletionRequest
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from .common import (
    DB_OUTAGE,
    OUTAGE_MAX_RETRIES,
    call_llm,
    db,
    durable_write,
    error_dict,
    log,
    outage_countdown,
)

ANALYST_MAX_TOKENS = 16_384
#: one more call when the reply was not the JSON we asked for
PARSE_RETRIES = 1


def _job_slot(job_id: str, limit: int | None, batches: int | None):  # noqa: ANN202
    """The scaling profile's per-job concurrency, shared by every worker through Redis."""
    if not limit or get_settings().offline or (batches and batches <= int(limit)):
        # a cap at or above the job's batch count can never bind: skip two Redis round trips
        return contextlib.nullcontext()
    from ..constants import LIMITER_KEY_PREFIX
    from ..llm.limiter import ConcurrencyLimiter
    from .common import redis_client

    return ConcurrencyLimiter(redis_client(), limit=int(limit), key=f"{LIMITER_KEY_PREFIX}job:{job_id}").slot()


@shared_task(name="rlm.analyst", bind=True, acks_late=True)
def analyst(self, job_id: str, batch_no: int) -> dict:  # noqa: ANN001
    try:
        return _run(job_id, batch_no)
    except DB_OUTAGE as exc:
        # Nothing can be stored while PostgreSQL is away; a retry is not a failure, so the chord waits.
        log.warning("analyst job %s batch %s: database unavailable (%s); retrying", job_id, batch_no, exc)
        raise self.retry(exc=exc, countdown=outage_countdown(self.request.retries),
                         max_retries=OUTAGE_MAX_RETRIES) from None
    except Exception as exc:  # noqa: BLE001 - see module docstring
        log.exception("analyst crashed on job %s batch %s", job_id, batch_no)
        try:
            with db() as conn:
                job_store.finish_batch(conn, job_id=job_id, batch_no=batch_no, error=error_dict(exc))
        except Exception:  # noqa: BLE001
            log.exception("could not record the failure of job %s batch %s", job_id, batch_no)
        return {"batch": batch_no, "status": "failed", "error": error_dict(exc)}


def _run(job_id: str, batch_no: int) -> dict:
    from ..stages.parsing import parse_findings
    from ..stages.prompting import ChunkForPrompt, build_analyst_messages, load_prompt

    settings = get_settings()
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return {"batch": batch_no, "status": "skipped"}
        ids = job_store.claim_batch(conn, job_id=job_id, batch_no=batch_no)
        if ids is None:
            return {"batch": batch_no, "status": "skipped"}  # finished by an earlier delivery, or salvaged
        rows = get_chunks(conn, tenant=job.tenant, chunk_ids=ids)
        if missing := [cid for cid in ids if cid not in rows]:
            job_store.add_chunk_load_failures(conn, job_id=job_id, n=len(missing))
        if not rows:
            err = {"type": "chunk_load", "message": f"none of the batch's {len(ids)} chunks could be loaded"}
            job_store.finish_batch(conn, job_id=job_id, batch_no=batch_no, error=err)
            return {"batch": batch_no, "status": "failed", "error": err}
        chunks = [ChunkForPrompt(chunk_id=c.id, buffer=c.buffer, path=c.path, start_line=c.start_line,
                                 end_line=c.end_line, text=c.text) for cid in ids if (c := rows.get(cid))]
        focus = (job.params or {}).get("focus_topics") or []
        messages = build_analyst_messages(load_prompt("subcall", prompt_dir=settings.prompt_dir), job.query,
                                          chunks, focus)
        request = CompletionRequest(role="analyst", model=settings.subcall_model, messages=messages,
                                    max_tokens=ANALYST_MAX_TOKENS, temperature=0.0, json_output=True)
        present = [c.chunk_id for c in chunks]
    # No pooled connection is held while the model thinks: the pool (20 per process) would otherwise
    # cap a 64-thread analyst worker at 20 calls in flight. Logging and storing check one out again.
    with _job_slot(job_id, (job.params or {}).get("concurrency"), job.batches_total):
        for attempt in range(PARSE_RETRIES + 1):
            completion = call_llm(None, job_id=job_id, stage="analyst", batch=batch_no, request=request)
            try:
                findings = parse_findings(completion.text, batch_chunk_ids=present)
                break
            except ParseError:
                if attempt == PARSE_RETRIES:
                    raise
    stored = durable_write(None, lambda c: job_store.finish_batch(c, job_id=job_id, batch_no=batch_no,
                                                                  findings=findings),
                           what=f"findings of job {job_id} batch {batch_no}")
    if not stored:
        log.warning("job %s batch %s was salvaged while its call ran; its findings are not in the report",
                    job_id, batch_no)
        return {"batch": batch_no, "status": "late"}
    return {"batch": batch_no, "status": "ok", "findings": len(findings)}
