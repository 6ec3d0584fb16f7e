"""rlm.synthesize: findings → markdown report, with read-only tool calls into storage."""

from __future__ import annotations

import time

from celery import shared_task

from ..config import get_settings
from ..errors import LLMError
from ..llm.protocol import CompletionRequest
from ..models import JobStatus
from ..store import jobs as job_store
from .common import StageTimer, call_llm, db, durable_write, fail_job, log, provider_name, survives_outages

SYNTH_MAX_TOKENS = 4096
MAX_TURNS = 10


def run_synthesizer(conn, job, kept: list[dict]) -> str:  # noqa: ANN001 - JobRow
    """The tool loop: at most MAX_TURNS calls; the last one is offered no tools, so it must answer."""
    from ..services import database_url
    from ..stages.prompting import build_synthesizer_messages, load_prompt
    from ..stages.tools import TOOL_SPECS, ToolContext, run_tool

    settings = get_settings()
    stats = {"chunks_available": job.chunks_available, "findings": len(kept), "buffers": job.buffers}
    messages = build_synthesizer_messages(load_prompt("synthesizer", prompt_dir=settings.prompt_dir),
                                          job.query, kept, stats)
    ctx = ToolContext(conn=conn, tenant=job.tenant, buffers=list(job.buffers), settings=settings,
                      url=database_url(settings))
    for turn in range(MAX_TURNS):
        last = turn == MAX_TURNS - 1
        completion = call_llm(conn, job_id=job.id, stage="synthesize", request=CompletionRequest(
            role="synthesizer", model=settings.synthesizer_model, messages=messages, max_tokens=SYNTH_MAX_TOKENS,
            tools=None if last else TOOL_SPECS))
        if not completion.tool_calls:
            if not completion.text.strip():
                raise LLMError("the synthesizer returned an empty report", retryable=True)
            return completion.text
        messages.append(completion.raw_message or {"role": "assistant", "content": completion.text or None,
                                                   "tool_calls": [
                                                       {"id": tc.id, "type": "function",
                                                        "function": {"name": tc.name, "arguments": tc.arguments}}
                                                       for tc in completion.tool_calls]})
        for tc in completion.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": run_tool(ctx, tc.name, tc.arguments)})
    raise LLMError(f"the synthesizer was still calling tools after {MAX_TURNS} turns", retryable=False)


def finish_with_report(conn, job) -> None:  # noqa: ANN001 - JobRow
    """Write the report (or the canned no-findings answer) and end the job; findings are kept either way."""
    from ..stages.prompting import canned_no_findings_report

    collected = job.collected or {"kept": [], "filtered": 0}
    kept = collected.get("kept") or []
    error: BaseException | None = None
    if not kept:
        response = canned_no_findings_report(job.query)  # no evidence: no LLM call (PaperQA2 style)
    else:
        try:
            with StageTimer(conn, job.id, "synthesize"):
                response = run_synthesizer(conn, job, kept)
        except Exception as exc:  # noqa: BLE001 - reported on the job, findings kept
            log.warning("synthesis failed for job %s: %s", job.id, exc)
            response, error = "", exc
    # The report is paid for: from here on, a database blink is waited out, never answered by a rerun.
    durable_write(conn, lambda c: _store_report(c, job, response, kept, collected, error), what=f"report of job {job.id}")


def _store_report(conn, job, response: str, kept: list[dict], collected: dict, error: BaseException | None) -> None:  # noqa: ANN001
    from ..stages.report import build_result

    created = job.created_at
    elapsed = time.time() - created.timestamp()
    result = build_result(
        job_id=job.id, response=response, provider=provider_name(), tier=job.scaling_tier or "tiny",
        params=job.params or {}, collected=kept, findings_filtered=int(collected.get("filtered") or 0),
        batches=job_store.batches(conn, job_id=job.id), chunks_available=job.chunks_available or 0,
        chunk_load_failures=job.chunk_load_failures, usage=job_store.usage_totals(conn, job_id=job.id),
        elapsed_seconds=elapsed,
    ).model_dump()
    if error is not None:
        fail_job(conn, job_id=job.id, exc=error, result=result, prefix="synthesis failed")
    else:
        job_store.finish_job(conn, job_id=job.id, status=JobStatus.done, result=result)


@shared_task(name="rlm.synthesize", bind=True, acks_late=True)
@survives_outages
def synthesize(self, job_id: str) -> str:  # noqa: ANN001
    """The stage as its own task (the reconciler re-sends it); ``rlm.collect`` calls ``run_synthesis`` in-process."""
    return run_synthesis(job_id)


def run_synthesis(job_id: str) -> str:
    with db() as conn:
        job = job_store.get_job(conn, job_id=job_id)
        if job is None or job.terminal:
            return "skipped"
        job_store.set_stage(conn, job_id=job_id, stage="synthesize")
        finish_with_report(conn, job)
    return "ok"
