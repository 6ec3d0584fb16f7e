"""Synthesize: findings → markdown report, with read-only tool calls back into storage.

Its user message, the tool loop and the writing of the result live here.  No
findings means no LLM call: a canned answer says so (PaperQA2 style).  A
synthesis that fails still ends the job, with its findings and the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import LLMError
from ..limits import MAX_TOOL_CALLS_PER_TURN
from ..llm.protocol import CompletionRequest
from ..models import JobStatus
from ..resources import provider
from ..store import jobs as job_store
from ..store.db import durable_write
from .calls import call_llm
from .flow import OK, Stage, StageContext, StageLease, StageTimer, fail_job
from .prompts import (
    content_block,
    escape_content,
    finding_block,
    load_prompt,
    quote_field,
    source_line,
    system_message,
)

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.synthesize")

SYNTH_MAX_TOKENS = 4096
MAX_TURNS = 10
#: the synthesizer sees at most this much findings text; the rest is summarised by a count
MAX_SYNTH_FINDINGS_CHARS = 300_000


# --------------------------------------------------------------------------- messages


def build_messages(
    system_prompt: str, query: str, kept: Sequence[Mapping[str, Any]], stats: Mapping[str, Any]
) -> list[dict[str, str]]:
    """Findings in collect order; the analysts' words came from untrusted text, so they are data too."""
    blocks, used, omitted = [], 0, 0
    for f in kept:
        block = (
            f"### Chunk {f['chunk_id']}\n\n{source_line(f['buffer'], f['path'], f['start_line'], f['end_line'])}"
            f"\n\n{content_block(finding_block(f))}"
        )
        if used + len(block) > MAX_SYNTH_FINDINGS_CHARS and blocks:
            omitted += 1
            continue
        blocks.append(block)
        used += len(block)
    # buffer names are untrusted like paths: quoted, as in the source lines
    stat_lines = "\n".join(
        f"- {k}: {', '.join(map(quote_field, v)) if isinstance(v, list | tuple) else v}" for k, v in stats.items()
    )
    user = f"## Query\n\n{escape_content(query)}\n\n## Dataset\n\n{stat_lines}\n\n## Findings\n\n" + "\n\n".join(blocks)
    if omitted:
        user += f"\n\n({omitted} lower-ranked findings omitted for length; use the tools to look further.)"
    return [system_message(system_prompt), {"role": "user", "content": user}]


def canned_no_findings_report(query: str) -> str:
    shown = query if len(query) <= 200 else query[:200] + "…"
    return (
        "## No relevant findings\n\n"
        f"The analysts read the chunks the search selected for “{shown}” and none of them held "
        "relevant evidence (or every finding fell below the finding threshold).\n\n"
        "Try: a lower `--threshold`, another `--search-mode` (`bm25` for exact names, `semantic` for "
        "concepts), a larger `--top-k`/`--max-chunks`, or check that the right buffer is loaded "
        "(`rlm buffer show NAME`)."
    )


# --------------------------------------------------------------------------- the stage


def run_synthesizer(
    conn: psycopg.Connection,
    job: JobRow,
    kept: list[dict],
    settings: Settings,
    *,
    tool_log: list[dict[str, Any]] | None = None,
    on_turn: Callable[[], None] | None = None,
) -> str:
    """The tool loop: at most MAX_TURNS calls; the last one is offered no tools, so it must answer.

    A turn runs at most ``MAX_TOOL_CALLS_PER_TURN`` tool calls; the rest are answered with an error (every
    call id needs a reply).  Each call is appended to ``tool_log``; ``on_turn`` runs between turns.
    """
    from ..local_servers import database_url
    from .tools import TOOL_SPECS, ToolContext, run_tool_logged

    stats = {"chunks_available": job.chunks_available, "findings": len(kept), "buffers": job.buffers}
    messages = build_messages(load_prompt("synthesizer", prompt_dir=settings.prompt_dir), job.query, kept, stats)
    ctx = ToolContext(
        conn=conn, tenant=job.tenant, buffers=list(job.buffers), settings=settings, url=database_url(settings)
    )
    log_ = tool_log if tool_log is not None else []
    for turn in range(MAX_TURNS):
        if on_turn is not None:
            on_turn()
        last = turn == MAX_TURNS - 1
        completion = call_llm(
            conn,
            job_id=job.id,
            stage="synthesize",
            request=CompletionRequest(
                role="synthesizer",
                model=settings.synthesizer_model,
                messages=messages,
                max_tokens=SYNTH_MAX_TOKENS,
                tools=None if last else TOOL_SPECS,
            ),
        )
        if not completion.tool_calls:
            if not completion.text.strip():
                raise LLMError("the synthesizer returned an empty report", retryable=True)
            return completion.text
        messages.append(
            completion.raw_message
            or {
                "role": "assistant",
                "content": completion.text or None,
                "tool_calls": [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": tc.name, "arguments": tc.arguments},
                    }
                    for tc in completion.tool_calls
                ],
            }
        )
        for k, tc in enumerate(completion.tool_calls):
            content, record = run_tool_logged(
                ctx, tc.name, tc.arguments, turn=turn + 1, allowed=k < MAX_TOOL_CALLS_PER_TURN
            )
            log_.append(record)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": content})
    raise LLMError(f"the synthesizer was still calling tools after {MAX_TURNS} turns", retryable=False)


def finish_with_report(
    conn: psycopg.Connection, job: JobRow, settings: Settings, *, lease_owner: str | None = None
) -> bool:
    """Write the report (or the canned no-findings answer) and end the job; findings are kept either way.

    Runs under the job's lease (``lease_owner``: a salvage that took it already): a delivery or salvage
    that finds another worker synthesizing leaves the job to it and returns False, so a long synthesis is
    never run twice.
    """
    collected = job.collected or {"kept": [], "filtered": 0}
    kept = collected.get("kept") or []
    error: BaseException | None = None
    tool_log: list[dict[str, Any]] = []
    with StageLease(conn, job.id, settings, owner=lease_owner) as lease:
        if not lease.acquired:
            log.info("job %s is being synthesized by another worker; leaving it to that one", job.id)
            return False
        if not kept:
            response = canned_no_findings_report(job.query)  # no evidence: no LLM call (PaperQA2 style)
        else:
            try:
                with StageTimer(conn, job.id, Stage.synthesize):
                    response = run_synthesizer(conn, job, kept, settings, tool_log=tool_log, on_turn=lease.beat)
            except Exception as exc:  # reported on the job, findings kept
                log.warning("synthesis failed for job %s: %s", job.id, exc)
                response, error = "", exc
        # The report is paid for: from here on, a database blink is waited out, never answered by a rerun.
        durable_write(
            conn,
            lambda c: _store_report(c, job, response, kept, collected, error, settings, tool_log),
            what=f"report of job {job.id}",
        )
    return True


def _store_report(
    conn: psycopg.Connection,
    job: JobRow,
    response: str,
    kept: list[dict],
    collected: dict,
    error: BaseException | None,
    settings: Settings,
    tool_log: list[dict[str, Any]] | None = None,
) -> None:
    from .report import build_result

    result = build_result(
        job_id=job.id,
        response=response,
        provider=provider().name,  # the one that answered
        tier=job.scaling_tier or "tiny",
        params=job.params or {},
        collected=kept,
        findings_filtered=int(collected.get("filtered") or 0),
        batches=job_store.batches(conn, job_id=job.id),
        chunks_available=job.chunks_available or 0,
        chunk_load_failures=job.chunk_load_failures,
        usage=job_store.usage_totals(conn, job_id=job.id),
        elapsed_seconds=time.time() - job.created_at.timestamp(),
        tool_calls=tool_log or [],
    ).model_dump()
    if error is not None:
        fail_job(conn, job_id=job.id, exc=error, result=result, prefix="synthesis failed")
    else:
        job_store.finish_job(conn, job_id=job.id, status=JobStatus.done, result=result)


def run(ctx: StageContext) -> str:
    # the job as collect left it: ``ctx.job`` was read before this stage, collected findings included
    if not finish_with_report(ctx.conn, ctx.job, ctx.settings):
        return "synthesizing elsewhere"
    return OK
