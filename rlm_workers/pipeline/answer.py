"""Answer: one direct LLM call over the best chunks that fit the context (``instant``, auto's ``direct`` route).

No planner and no chord: the search's top chunks, in rank order, as many as fit
a token budget, go to one model that writes the answer with citations
(docs/contract.md#modes).  This module holds that message, the fitting of
chunks to the budget, and reading back which chunks the answer cited.  The
chunks are fenced exactly as in an analyst's message.

The stage (``run``): the chunks the search stored as the job's one batch, one call under the job's lease (a
second delivery leaves it to the first), the cited chunks as the sources.  With the budget already spent, the
offline writer answers from the same chunks and says so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from ..errors import BudgetExhausted
from ..llm.extractive import ExtractiveProvider
from ..llm.protocol import CompletionRequest
from ..llm.replies import cited_chunk_ids
from ..llm.stage_input import ChunkForPrompt, DirectInput
from ..llm.structured import answer_schema, parse_answer, render_answer, render_cited
from ..llm.tokens import CHARS_PER_TOKEN, estimate_tokens
from ..records.totals import RECORDS_INSTRUCTION
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from ..store.db import durable_write
from ..store.job_state import Collected
from .calls import call_llm
from .evidence import grounded
from .flow import OK, Stage, StageContext, StageLease, StageTimer
from .prompts import chunk_source_line, content_block, escape_content, load_prompt, system_message
from .report import cited_entry, store_report
from .route import direct_answer_tokens, direct_budget
from .sessions import conversation_section

CUT_MARKER = "[…cut to fit the context]"
#: a citation the answer wrote inline: its words (chunk, path) are no part of what the answer says
_INLINE_CITATION = re.compile(r"\[chunks? [^\]]*\]", re.I)


def _block(c: ChunkForPrompt) -> str:
    return f"### Chunk {c.chunk_id}\n\n{chunk_source_line(c)}\n\n{content_block(c.text)}"


def _cut(c: ChunkForPrompt, budget_tokens: int) -> ChunkForPrompt:
    """``c`` with its text cut (at a line end where one is near) so that its block fits, marked as cut."""
    text = c.text
    for _ in range(8):  # escaping can lengthen the text a little: shrink until the block fits
        over = estimate_tokens(_block(c.model_copy(update={"text": text + "\n" + CUT_MARKER}))) - budget_tokens
        if over <= 0 or not text:
            break
        keep = max(0, len(text) - over * CHARS_PER_TOKEN)
        nl = text.rfind("\n", 0, keep)
        text = text[: nl if nl >= keep // 2 else keep]
    # the source line says which lines the model is shown
    return c.model_copy(
        update={"text": f"{text}\n{CUT_MARKER}", "end_line": min(c.end_line, c.start_line + text.count("\n"))}
    )


def fit_chunks(chunks: Sequence[ChunkForPrompt], budget_tokens: int) -> list[ChunkForPrompt]:
    """The chunks, in rank order, while their prompt blocks fit ``budget_tokens``; always at least the first
    (cut, and marked so, when it alone is too big)."""
    out: list[ChunkForPrompt] = []
    used = 0
    for c in chunks:
        cost = estimate_tokens(_block(c)) + (1 if out else 0)  # the blank line between blocks
        if used + cost > budget_tokens:
            if not out:
                out.append(_cut(c, budget_tokens))
            break
        out.append(c)
        used += cost
    return out


def render_messages(system_prompt: str, asked: DirectInput, *, conversation: str = "") -> list[dict[str, str]]:
    """The analyst's message layout, asking for a cited markdown answer instead of findings JSON
    (``conversation``: a chat turn's earlier turns, quoted, before the query)."""
    # the question after the chunks, as in an analyst's message: a small model answers what it read last
    parts = ["## Chunks\n\n" + "\n\n".join(_block(c) for c in asked.chunks)]
    if asked.records_wanted:
        parts.append(f"## Records\n\n{RECORDS_INSTRUCTION}")
    parts.append(f"{conversation}## Query\n\n{escape_content(asked.query)}")
    parts.append(
        "## Reply\n\nAnswer the query from these chunks only. Reply with a JSON object: "
        '{"answer": "<the answer, in words>", "cited_chunks": [<ids of the chunks the answer comes from>]}.'
    )
    return [system_message(system_prompt), {"role": "user", "content": "\n\n".join(parts)}]


def build_messages(
    system_prompt: str,
    query: str,
    chunks: Sequence[ChunkForPrompt],
    *,
    records_wanted: bool = False,
    conversation: str = "",
) -> list[dict[str, str]]:
    """The direct answer's messages, rendered from a ``DirectInput`` of these values."""
    asked = DirectInput(query, tuple(chunks), records_wanted)
    return render_messages(system_prompt, asked, conversation=conversation)


def grounded_report(reply: str, query: str, chunks: Sequence[ChunkForPrompt]) -> str:
    """The report of a direct reply, citing the chunks that hold what the answer says (``evidence.grounded``):
    a small model reads a value right more often than the id above it, so the ids it gives are checked against
    the chunks' words; when no chunk holds the answer's words (it paraphrased), its own ids stand."""
    parsed = parse_answer(reply)
    by_id = {c.chunk_id: c for c in chunks}
    if parsed is None:
        return render_answer(reply, by_id)
    held = grounded(_INLINE_CITATION.sub(" ", parsed.answer), query, chunks, parsed.cited_chunks)
    if held:
        own, ranked = parsed.cited_chunks, [c.chunk_id for c in chunks]  # the model's order, then the search's
        order = sorted(held, key=lambda cid: (0, own.index(cid)) if cid in own else (1, ranked.index(cid)))
        parsed = parsed.model_copy(update={"cited_chunks": order})
    return render_cited(parsed, by_id)


# --------------------------------------------------------------------------- the stage

log = logging.getLogger("rlm.pipeline.answer")


def run(ctx: StageContext) -> str:
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
        chunks = [ChunkForPrompt.of(c) for cid in batch.chunk_ids if (c := rows.get(cid))]
        chunks = fit_chunks(chunks, direct_budget(settings))

        asked = DirectInput(job.query, tuple(chunks))
        messages = render_messages(
            load_prompt("direct", prompt_dir=settings.prompt_dir), asked, conversation=conversation_section(job.spec)
        )
        request = CompletionRequest(
            role="direct",
            model=settings.synthesizer_model,
            messages=messages,
            max_tokens=direct_answer_tokens(settings),
            json_output=True,
            json_schema=answer_schema([c.chunk_id for c in chunks]),
            stage_input=asked,
        )
        by_id = {c.chunk_id: c for c in chunks}
        error: BaseException | None = None
        with StageTimer(conn, job.id, Stage.answer):
            try:
                completion = call_llm(conn, job_id=job.id, stage="answer", request=request, parse=parse_answer)
                response = grounded_report(completion.text, job.query, chunks)
            except BudgetExhausted as exc:
                offline = render_answer(ExtractiveProvider().complete(request).text, by_id)
                response = (
                    f"_The budget was exhausted ({exc.reason}) before a model could answer: what follows was "
                    f"assembled from the chunks without one._\n\n{offline}"
                )
            except Exception as exc:  # reported on the job; what was read is still said
                log.warning("direct answer failed for job %s: %s", job.id, exc)
                response, error = "", exc
        cited = cited_chunk_ids(response, by_id)
        kept = [cited_entry(rows[cid], by_id[cid].text, "cited by the answer") for cid in cited if cid in rows]
        collected = Collected(kept=kept, filtered=0, records={})
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
                store_report(c, job_store.reread_job(c, job_id=job.id), response, collected, error)

        durable_write(conn, store, what=f"direct answer of job {job.id}")
    return OK
