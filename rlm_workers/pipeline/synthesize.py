"""Synthesize: findings → markdown report, with read-only tool calls back into storage.

Its user message, the tool loop and the writing of the result live here.  No
findings means no LLM call: a canned answer says so (PaperQA2 style).  A
synthesis that fails still ends the job, with its findings and the error.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BudgetExhausted, ContextExceeded, LLMError
from ..limits import MAX_TOOL_CALLS_PER_TURN
from ..llm.extractive import write_report
from ..llm.protocol import CompletionRequest
from ..llm.replies import clip
from ..llm.stage_input import FindingsInput, ShownFinding
from ..llm.structured import FinalAnswer, answer_schema, parse_action, render_answer, stray_action
from ..models import RELEVANCE_RANK
from ..runtime.local_servers import database_url
from ..search.provenance import cite_of
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from ..store.db import durable_write
from ..store.job_state import Collected
from .calls import call_llm
from .flow import OK, Stage, StageContext, StageLease, StageTimer
from .prompts import (
    escape_content,
    findings_blocks,
    load_prompt,
    quote_field,
    shown_findings,
    system_message,
    tool_json,
    unescape_content,
)
from .report import not_run_for_budget, store_report
from .sessions import conversation_section
from .tools import (
    QUERY_SUBSET_SPEC,
    TOOL_SPECS,
    ToolContext,
    ToolError,
    parse_subset_call,
    run_tool_logged,
    tool_record,
)
from .tree import budget_spent, child_id, max_depth, start_children

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.synthesize")

SYNTH_MAX_TOKENS = 4096
MAX_TURNS = 10
#: turns of a synthesis whose tools are JSON actions (RLM_TOOL_CALLS, a local model): at most two rounds of tool
#: calls, then the answer with no tool offered
JSON_MAX_TURNS = 3
#: times one synthesis asks again for the report after a reply that was a tool call it could not make, written as
#: JSON (docs/contract.md#structured-outputs); counted apart from MAX_TURNS, so that the last turn can be re-asked
MAX_REASKS = 2
#: the synthesizer sees at most this much findings text; the rest is summarised by a count
MAX_SYNTH_FINDINGS_CHARS = 300_000


# --------------------------------------------------------------------------- messages


def synthesis_input(query: str, kept: Sequence[Mapping[str, Any]]) -> FindingsInput:
    """What the synthesizer is shown: the query and the findings that fit, in collect order."""
    shown, omitted = shown_findings(kept, MAX_SYNTH_FINDINGS_CHARS)
    return FindingsInput(query=query, findings=shown, omitted=omitted)


#: what a synthesis whose replies are JSON (RLM_TOOL_CALLS) is asked to reply with, after the findings
JSON_REPLY = (
    "## Reply\n\nReply with one JSON object. To look further first (the findings leave the query open, or your "
    'instructions ask for a check), a tool action: {"action": "<tool name>", "arguments": {...}}. To answer from '
    'the findings and what your tools returned: {"answer": "<the answer, in words>", "cited_chunks": [<ids of the '
    "chunks the answer comes from>]}."
)


def render_messages(
    system_prompt: str,
    shown: FindingsInput,
    stats: Mapping[str, Any],
    *,
    conversation: str = "",
    json_reply: bool = False,
) -> list[dict[str, str]]:
    """Findings in collect order; the analysts' words came from untrusted text, so they are data too.
    ``conversation``: a chat turn's earlier turns, quoted, before the query (docs/contract.md#sessions);
    ``json_reply``: the answer is asked for as a JSON object with the chunks it cites, as the direct answer is."""
    blocks = findings_blocks(shown.findings)
    # buffer names are untrusted like paths: quoted, as in the source lines
    stat_lines = "\n".join(
        f"- {k}: {', '.join(map(quote_field, v)) if isinstance(v, list | tuple) else v}" for k, v in stats.items()
    )
    user = (
        f"{conversation}## Query\n\n{escape_content(shown.query)}\n\n## Dataset\n\n{stat_lines}\n\n## Findings\n\n"
        + "\n\n".join(blocks)
    )
    if shown.omitted:
        user += f"\n\n({shown.omitted} lower-ranked findings omitted for length; use the tools to look further.)"
    if json_reply:
        user += f"\n\n{JSON_REPLY}"
    return [system_message(system_prompt), {"role": "user", "content": user}]


def build_messages(
    system_prompt: str,
    query: str,
    kept: Sequence[Mapping[str, Any]],
    stats: Mapping[str, Any],
    *,
    conversation: str = "",
) -> list[dict[str, str]]:
    """The synthesizer's messages, rendered from ``synthesis_input`` of these values."""
    return render_messages(system_prompt, synthesis_input(query, kept), stats, conversation=conversation)


def by_search_rank(kept: Sequence[Mapping[str, Any]], ranked: Sequence[int]) -> list[dict]:
    """The findings by grade, then by where the search ranked their chunk (the job's batches hold its chunks in
    rank order); a chunk the search did not rank (a child's, merged in) after those of its grade that it did."""
    rank = {cid: i for i, cid in reversed(list(enumerate(ranked)))}
    return sorted(
        (dict(k) for k in kept),
        key=lambda k: (-RELEVANCE_RANK.get(k.get("relevance") or "", 0), rank.get(k["chunk_id"], len(rank))),
    )


def canned_no_findings_report(query: str, *, route: str | None = None, counted: bool = False, not_run: int = 0) -> str:
    """The answer when no analyst kept a finding.  An exhaustive job read every chunk, with no search to widen:
    it says so instead of suggesting a lower threshold, and where records were counted the answer is the
    Exact totals added under it, so it does not open by saying nothing was found.  ``not_run`` batches were
    never read (the budget ran out first): then the budget, not the search, is what to change."""
    shown = query if len(query) <= 200 else query[:200] + "…"
    if not_run:
        return (
            "## No relevant findings yet\n\n"
            f"The budget ran out before {not_run} batch{'es' if not_run != 1 else ''} of the chunks selected for "
            f"“{shown}” could be read, and the batches that were read held no relevant evidence.\n\n"
            "Try: a higher `--max-llm-calls`, `--max-tokens` or `--max-cost` (`budget.exhausted` says which "
            "limit was reached), so that every selected chunk is read."
        )
    if route == "exhaustive" and counted:
        return (
            "## Answer\n\n"
            f"Every chunk was read for “{shown}”. No passage answers it in words; the answer is the count: the "
            "Exact totals below, summed from what each chunk shows."
        )
    if route == "exhaustive":
        return (
            "## No relevant findings\n\n"
            f"Every chunk was read for “{shown}” and none of them held relevant evidence or anything to count."
        )
    return (
        "## No relevant findings\n\n"
        f"The analysts read the chunks the search selected for “{shown}” and none of them held "
        "relevant evidence (or every finding fell below the finding threshold).\n\n"
        "Try: a lower `--threshold`, another `--search-mode` (`bm25` for exact names, `semantic` for "
        "concepts), a larger `--top-k`/`--max-chunks`, or check that the right buffer is loaded "
        "(`rlm buffer show NAME`)."
    )


# --------------------------------------------------------------------------- the stage


class Paused(Exception):
    """The synthesizer asked for query_subset children: its conversation is stored and the job waits on them."""


def run_synthesizer(
    conn: psycopg.Connection,
    job: JobRow,
    kept: list[dict],
    settings: Settings,
    *,
    tool_log: list[dict[str, Any]] | None = None,
    on_turn: Callable[[], None] | None = None,
) -> str:
    """The tool loop: at most MAX_TURNS turns (JSON_MAX_TURNS where tools are JSON actions); the last one is offered
    no tools, so it must answer.

    A turn runs at most ``MAX_TOOL_CALLS_PER_TURN`` tool calls; the rest are answered with an error (every
    call id needs a reply).  Each call is appended to ``tool_log``; ``on_turn`` runs between calls.
    A ``query_subset`` call starts a child job instead of answering at once: the conversation is stored and
    ``Paused`` raised; when the children end, the same call resumes it with their findings (``tree.py``).
    A reply that is a tool call written as JSON for a tool not offered on its turn is no report: the turn is
    asked again, at most MAX_REASKS times in all, and then the findings are written up without the model.
    """
    log_ = tool_log if tool_log is not None else []
    state = job.synth_state
    # a small model keeps to a grammar, not to a tool protocol: each reply is a constrained JSON action, the
    # answer an object citing the findings' chunks, and the rounds are few (docs/contract.md#structured-outputs)
    json_mode = settings.json_tool_calls(settings.synthesizer_model)
    if json_mode:
        # and it leans on what it reads first: findings of one grade go in the search's order, best match first
        kept = by_search_rank(kept, [cid for b in job_store.batches(conn, job_id=job.id) for cid in b.chunk_ids])
    # what the first turn was shown (a resumed conversation opened with it too)
    shown = synthesis_input(job.query, kept)
    max_turns = JSON_MAX_TURNS if json_mode else MAX_TURNS
    citable: dict[int, Any] = {f.chunk_id: f for f in shown.findings}
    if state is not None:
        messages = list(state.messages)
        log_[:] = list(state.tool_log)
        messages += _subset_answers(conn, job, state.pending)
        first = state.turn + 1
        reasks = state.reasks
    else:
        stats = {"chunks_available": job.chunks_available, "findings": len(kept), "buffers": job.buffers}

        messages = render_messages(
            load_prompt("synthesizer", prompt_dir=settings.prompt_dir),
            shown,
            stats,
            conversation=conversation_section(job.spec),
            json_reply=json_mode,
        )
        first, reasks = 0, 0
    ctx = ToolContext(
        conn=conn, tenant=job.tenant, buffers=list(job.buffers), settings=settings, url=database_url(settings)
    )
    _add_fetched(conn, job, citable, [m.get("content") for m in messages if m.get("role") == "tool"])
    may_recurse = job.depth + 1 <= max_depth(job, settings)
    tools = TOOL_SPECS + ([QUERY_SUBSET_SPEC] if may_recurse else [])
    turn = first
    while turn < max_turns:
        if on_turn is not None:
            on_turn()
        last = turn >= max_turns - 1
        offered: set[str] = set() if last else {t["function"]["name"] for t in tools}
        try:
            completion = call_llm(
                conn,
                job_id=job.id,
                stage="synthesize",
                request=CompletionRequest(
                    role="synthesizer",
                    model=settings.synthesizer_model,
                    messages=messages,
                    max_tokens=SYNTH_MAX_TOKENS,
                    tools=None if last else tools,
                    json_output=json_mode,
                    json_schema=answer_schema(sorted(citable)) if json_mode else None,
                    stage_input=shown,
                ),
                parse=functools.partial(_report_of, offered=offered, shown=citable),
            )
        except ContextExceeded:
            if turn == 0 and not reasks:
                raise  # the opening prompt itself does not fit: a setting to fix, reported on the job
            # tool results and re-asks outgrew a small model's context: the findings are still all there
            log.warning("job %s: the synthesis outgrew the model's context", job.id)
            return _extractive_report(conn, job, kept, settings, _OUTGREW)
        if not completion.tool_calls:
            if completion.parsed is None:
                if reasks >= MAX_REASKS:
                    log.warning("job %s: the synthesizer still wrote a tool call instead of the report", job.id)
                    return _extractive_report(conn, job, kept, settings, _NO_REPORT)
                reasks += 1
                messages.append({"role": "assistant", "content": clip(completion.text, MAX_ECHO_BYTES)})
                messages.append({"role": "user", "content": _reask(stray_action(completion.text), tools)})
                continue  # the same turn again: its tools, and whether it is the last, stay as they were
            if not completion.parsed.strip():
                raise LLMError("the synthesizer returned an empty report", retryable=True)
            return completion.parsed
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
        subsets: list[tuple[str, dict[str, Any]]] = []
        for k, tc in enumerate(completion.tool_calls):
            allowed = k < MAX_TOOL_CALLS_PER_TURN
            if tc.name == "query_subset" and allowed:
                content, record, task = _subset_call(job, tc.arguments, turn=turn + 1, may_recurse=may_recurse)
                log_.append(record)
                if task is not None:
                    subsets.append((tc.id, task))
                    continue
            else:
                content, record = run_tool_logged(ctx, tc.name, tc.arguments, turn=turn + 1, allowed=allowed)
                log_.append(record)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": content})
            _add_fetched(conn, job, citable, [content])
        if subsets:
            _pause(conn, job, messages, turn, log_, subsets, reasks=reasks)
            raise Paused
        turn += 1
    raise LLMError(f"the synthesizer was still calling tools after {max_turns} turns", retryable=False)


#: what the report written without the model opens with, after a synthesizer that kept writing tool calls
_NO_REPORT = (
    "The synthesizer model kept replying with a tool call it could not make, even when asked again for the "
    "report, so no report was written by a model"
)


_OUTGREW = "The conversation with the synthesizer outgrew the model's context before it wrote the report"
#: the most of a stray reply sent back with the re-ask: a small model that repeats one call to its output limit
#: must not fill the context with it (the re-ask says what was wrong; the start shows what it wrote)
MAX_ECHO_BYTES = 1_000


def _report_of(text: str, offered: set[str], shown: Mapping[int, Any]) -> str | None:
    """The report a reply carries: the text, or the answer of an ``{"answer": ...}`` object with the chunks it names
    cited (on the last turn too, where the provider offered no tools and so read no action); None for a tool call
    written as JSON that names a tool not offered on this turn, which ``call_llm`` logs as a reply that did not
    parse."""
    name = stray_action(text)
    if name is not None:
        return text if name in offered else None  # an offered one the provider has already made a call
    reply = parse_action(text, set())
    if isinstance(reply, FinalAnswer):
        return render_answer(text, shown) if "cited_chunks" in text else reply.answer
    return render_answer(text, shown)


_CHUNK_ID = re.compile(r'"chunk_id":\s*(\d{1,18})')


def _add_fetched(conn: psycopg.Connection, job: JobRow, citable: dict[int, Any], results: Sequence[Any]) -> None:
    """The chunks tool results showed the model, which its answer may cite beside the findings' (read back from the
    store for their place: a tool result is the model's to echo, not ours to trust)."""
    ids = {int(m) for r in results if isinstance(r, str) for m in _CHUNK_ID.findall(r)} - citable.keys()
    if ids:
        citable.update(get_chunks(conn, tenant=job.tenant, chunk_ids=sorted(ids), with_text=False))


def _reask(name: str | None, tools: list[dict[str, Any]]) -> str:
    """The message that asks again for the report, after a call ``run_synthesizer`` did not offer on the turn
    (``tools``: those of the synthesis).  The name is the model's own text: it is named back only when it is ours."""
    if name in {t["function"]["name"] for t in tools}:
        why = f"`{name}` cannot be called on this turn: no more tool calls are offered"
    elif name == QUERY_SUBSET_SPEC["function"]["name"]:
        why = f"`{name}` is not available in this synthesis (the depth limit is reached)"
    else:
        why = "the tool it names does not exist"
    return (
        f"Your last reply was a tool call written as JSON, not the report, and {why}. Reply now with the report "
        "itself, in markdown: answer the question from the findings above and the tool results you already have, "
        "cite every claim as `[chunk N, path:lines]` as the system message asks, and end with the Sources list. "
        "Do not reply with JSON."
    )


MAX_SUBSET_RESULT_CHARS = 30_000


def _subset_call(
    job: JobRow, raw: str | None, *, turn: int, may_recurse: bool
) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """Validate a query_subset call (untrusted arguments): (error content, record, None) or ("", record, task)."""
    try:
        call = parse_subset_call(raw)
        if not may_recurse:
            raise ToolError("the depth limit is reached: answer with what you have")
        if budget_spent(job):
            raise ToolError("the budget is spent: answer with what you have")
    except ToolError as exc:
        return json.dumps({"error": str(exc)}), tool_record("query_subset", raw, turn=turn, error=str(exc)), None
    task = {"question": call.question.strip(), "chunk_ids": call.chunk_ids, "search": call.search}
    return "", tool_record("query_subset", raw, turn=turn, error=None), task


def _pause(
    conn: psycopg.Connection,
    job: JobRow,
    messages: list[dict[str, Any]],
    turn: int,
    tool_log: list[dict[str, Any]],
    subsets: list[tuple[str, dict[str, Any]]],
    *,
    reasks: int,
) -> None:
    """Store the conversation, then start one child per query_subset call (a subset child reads exactly the
    chunk ids given, or what its own search finds)."""
    tag = f"s{turn}"
    tasks = [
        (
            t["question"],
            {"kind": "subset", **({"chunk_ids": t["chunk_ids"]} if t["chunk_ids"] else {"search": t["search"]})},
        )
        for _, t in subsets
    ]
    pending = {call_id: child_id(job.id, tag, k) for k, (call_id, _) in enumerate(subsets)}
    # the conversation first: once the children exist, their end may resume it at any moment
    state = {"messages": messages, "turn": turn, "tool_log": tool_log, "pending": pending, "reasks": reasks}
    job_store.save_synth_state(conn, job_id=job.id, state=state)
    start_children(conn, job, tasks, depth=job.depth + 1, tag=tag)


def _subset_answers(conn: psycopg.Connection, job: JobRow, pending: dict[str, str]) -> list[dict[str, Any]]:
    """Each paused query_subset call answered with its child's findings (data, fenced like all findings)."""
    out = []
    for call_id, kid in pending.items():
        child = job_store.get_job(conn, job_id=kid)
        if child is None or child.status != "done":
            err = child.error.message if child and child.error else "the child job did not finish"
            content = tool_json({"job_id": kid, "status": child.status if child else "missing", "error": err})
        else:
            kept = child.collected.kept if child.collected else []
            rows, used = [], 0
            for f in kept:
                row = {
                    "chunk_id": f["chunk_id"],
                    "source": cite_of(ShownFinding.of(f), f"{f['buffer']}:{f['path']}"),
                    "relevance": f["relevance"],
                    # an analyst that quoted from inside a fence may have copied its escaping: the file's words
                    "findings": [unescape_content(x) for x in f.get("findings") or []],
                    "summary": unescape_content(f.get("summary") or ""),
                }
                size = len(json.dumps(row))
                if used + size > MAX_SUBSET_RESULT_CHARS:
                    break
                rows.append(row)
                used += size
            content = tool_json({"job_id": kid, "status": "done", "findings": rows, "omitted": len(kept) - len(rows)})
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return out


def budget_fallback_report(
    conn: psycopg.Connection, job: JobRow, kept: list[dict], settings: Settings, reason: str
) -> str:
    """No model call may start: the findings are written up by the offline extractive writer, and it says so."""
    why = f"The budget was exhausted ({reason}) before the report could be written by a model"
    return _extractive_report(conn, job, kept, settings, why)


def _extractive_report(conn: psycopg.Connection, job: JobRow, kept: list[dict], settings: Settings, why: str) -> str:
    """The findings written up by the offline extractive writer, opening with ``why`` no model wrote them up."""
    body = write_report(synthesis_input(job.query, kept)) if kept else _canned(conn, job)
    return f"_{why}: what follows was assembled from the findings without one._\n\n{body}"


def _canned(conn: psycopg.Connection, job: JobRow) -> str:
    counted = any(job.collected.records.values()) if job.collected else False
    not_run = sum(not_run_for_budget(b.error) for b in job_store.batches(conn, job_id=job.id))
    return canned_no_findings_report(job.query, route=job.route, counted=counted, not_run=not_run)


def finish_with_report(
    conn: psycopg.Connection, job: JobRow, settings: Settings, *, lease_owner: str | None = None
) -> bool:
    """Write the report (or the canned no-findings answer) and end the job; findings are kept either way.

    Runs under the job's lease (``lease_owner``: a salvage that took it already): a delivery or salvage
    that finds another worker synthesizing leaves the job to it and returns False, so a long synthesis is
    never run twice.
    """
    collected = job.collected or Collected()
    kept = collected.kept
    error: BaseException | None = None
    tool_log: list[dict[str, Any]] = []
    with StageLease(conn, job.id, settings, owner=lease_owner) as lease:
        if not lease.acquired:
            log.info("job %s is being synthesized by another worker; leaving it to that one", job.id)
            return False
        if job.merges_into_parent:
            response = ""  # a child's findings go to its parent, which writes the one report
        elif not kept and not job.synth_state:
            response = _canned(conn, job)  # no evidence: no LLM call (PaperQA2 style)
        else:
            try:
                with StageTimer(conn, job.id, Stage.synthesize):
                    response = run_synthesizer(conn, job, kept, settings, tool_log=tool_log, on_turn=lease.beat)
            except Paused:
                log.info("job %s: synthesis waits on query_subset children", job.id)
                return True
            except BudgetExhausted as exc:
                response = budget_fallback_report(conn, job, kept, settings, exc.reason)
            except Exception as exc:  # reported on the job, findings kept
                log.warning("synthesis failed for job %s: %s", job.id, exc)
                response, error = "", exc
        # The report is paid for: from here on, a database blink is waited out, never answered by a rerun.
        durable_write(
            conn,
            lambda c: store_report(c, job, response, collected, error, tool_log),
            what=f"report of job {job.id}",
        )
    return True


def run(ctx: StageContext) -> str:
    # the job as collect left it: ``ctx.job`` was read before this stage, collected findings included
    if not finish_with_report(ctx.conn, ctx.job, ctx.settings):
        return "synthesizing elsewhere"
    return OK
