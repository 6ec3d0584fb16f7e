"""The direct route's one call: the best chunks that fit one context, answered at once (no plan for instant,
no chord, no synthesizer tool loop).  Messages and fitting live in ``answer.py``; this is the stage.

The call runs under the job's lease, like a synthesis: a second delivery leaves it to the first.  The chunks
given are the job's one batch, so what was read is reported as for any job; the chunks the answer cites are
its sources.  With the budget already spent, the offline writer answers from the same chunks and says so.
"""

from __future__ import annotations

import logging

from ..errors import BudgetExhausted
from ..llm.protocol import CompletionRequest
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from ..store.db import durable_write
from .calls import call_llm
from .flow import OK, Stage, StageContext, StageLease, StageTimer

log = logging.getLogger("rlm.pipeline.direct")

DIRECT_MAX_TOKENS = 4096
SNIPPET_CHARS = 300


def run(ctx: StageContext) -> str:
    from .analyst import ChunkForPrompt
    from .answer import build_messages, cited_chunk_ids, fit_chunks
    from .prompts import load_prompt
    from .route import direct_budget
    from .synthesize import _store_report

    conn, settings = ctx.conn, ctx.settings
    with StageLease(conn, ctx.job.id, settings) as lease:
        if not lease.acquired:
            return "answering elsewhere"
        job = job_store.get_job(conn, job_id=ctx.job.id)
        if job is None or job.terminal:
            return "skipped"
        batch = job_store.batches(conn, job_id=job.id)[0]
        rows = get_chunks(conn, tenant=job.tenant, chunk_ids=batch.chunk_ids)
        if missing := [cid for cid in batch.chunk_ids if cid not in rows]:
            job_store.add_chunk_load_failures(conn, job_id=job.id, n=len(missing))
        chunks = [
            ChunkForPrompt(
                chunk_id=c.id, buffer=c.buffer, path=c.path, start_line=c.start_line, end_line=c.end_line, text=c.text
            )
            for cid in batch.chunk_ids
            if (c := rows.get(cid))
        ]
        chunks = fit_chunks(chunks, direct_budget(settings))
        messages = build_messages(load_prompt("direct", prompt_dir=settings.prompt_dir), job.query, chunks)
        request = CompletionRequest(
            role="direct", model=settings.synthesizer_model, messages=messages, max_tokens=DIRECT_MAX_TOKENS
        )
        error: BaseException | None = None
        with StageTimer(conn, job.id, Stage.answer):
            try:
                response = call_llm(conn, job_id=job.id, stage="answer", request=request).text
            except BudgetExhausted as exc:
                from ..llm.extractive import ExtractiveProvider

                offline = ExtractiveProvider().complete(request).text
                response = (
                    f"_The budget was exhausted ({exc.reason}) before a model could answer: what follows was "
                    f"assembled from the chunks without one._\n\n{offline}"
                )
            except Exception as exc:  # reported on the job; what was read is still said
                log.warning("direct answer failed for job %s: %s", job.id, exc)
                response, error = "", exc
        by_id = {c.chunk_id: c for c in chunks}
        cited = cited_chunk_ids(response, by_id)
        kept = [_cited(rows[cid], by_id[cid].text) for cid in cited if cid in rows]
        collected = {"kept": kept, "filtered": 0, "records": {}}
        unread = [cid for cid in batch.chunk_ids if cid in rows and cid not in by_id]

        def store(c) -> None:
            with c.transaction():
                job_store.finish_batch(
                    c,
                    job_id=job.id,
                    batch_no=batch.batch_no,
                    error={"type": "answer", "message": str(error)[:500]} if error is not None else None,
                    unanswered=unread,
                )
                job_store.save_collected(c, job_id=job.id, collected=collected)
                _store_report(c, job_store.get_job(c, job_id=job.id), response, kept, collected, error, settings)

        durable_write(conn, store, what=f"direct answer of job {job.id}")
    return OK


def _cited(chunk, shown: str) -> dict:
    text = " ".join(shown.split())
    return {
        "chunk_id": chunk.id,
        "buffer": chunk.buffer,
        "ordinal": chunk.ordinal,
        "path": chunk.path,
        "start_line": chunk.start_line,
        "end_line": chunk.end_line,
        "relevance": "high",
        "findings": [text[:SNIPPET_CHARS]],
        "summary": "cited by the answer",
        "follow_up": [],
    }
