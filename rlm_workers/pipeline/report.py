"""Assemble the QueryResult from what the job stored.

``build_result``, ``completeness`` and ``status_line`` are pure; ``result_for`` reads what a job's tree
stored (its children, their batches, every LLM call, the budget) and hands it to them.  Totals are exact over
the tree: every call logged by any job under the root.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..models import (
    AggregateRow,
    AnalysisPlan,
    AnalystBatchError,
    ChildSummary,
    JobStatus,
    QueryResult,
    Record,
    Route,
    Source,
    ToolCallRecord,
)
from ..records.totals import aggregate, is_aggregation_question, records_markdown
from ..runtime.resources import provider
from ..search.preview import shorten
from ..search.provenance import fields
from ..store import code as code_store
from ..store import jobs as job_store
from ..store.job_state import CheckRecord, Collected, JobError
from ..store.jobs import BatchRecord
from .budget import report as budget_report
from .flow import fail_job

if TYPE_CHECKING:
    import psycopg

    from ..store.jobs import JobRow

SNIPPET_CHARS = 300


def sources_from(collected: Sequence[dict[str, Any]]) -> list[Source]:
    out = []
    for f in collected:
        snippet = (f.get("findings") or [f.get("summary") or ""])[0]
        out.append(
            Source(
                chunk_id=f["chunk_id"],
                buffer=f["buffer"],
                path=f["path"],
                start_line=f["start_line"],
                end_line=f["end_line"],
                relevance=f["relevance"],
                # cut after a word, marked: a finding that ends in its place, "…" (kombu/x.py:12), must not be cut
                # inside the path, nor a cut word read as the file's
                snippet=shorten(snippet, SNIPPET_CHARS),
                # findings collected before documents had pages have no such keys: plain text
                **fields(f.get("page_start"), f.get("page_end"), f.get("heading_path")),
            )
        )
    return out


def cited_entry(chunk: Any, shown: str, summary: str) -> dict[str, Any]:
    """A chunk an answer cites, as a kept finding (``Collected.kept``), so its source is listed like an analyst's:
    the direct answer's and code mode's citations (``chunk``: a ``store.buffers.ChunkRow``)."""
    text = " ".join(shown.split())
    return {
        "chunk_id": chunk.id,
        "buffer": chunk.buffer,
        "ordinal": chunk.ordinal,
        "path": chunk.path,
        "start_line": chunk.start_line,
        "end_line": chunk.end_line,
        "page_start": chunk.page_start,
        "page_end": chunk.page_end,
        "heading_path": list(chunk.heading_path),
        "relevance": "high",
        "findings": [shorten(text, SNIPPET_CHARS)],
        "summary": summary,
        "follow_up": [],
    }


def not_run_for_budget(error: JobError | None) -> bool:
    """A batch error of a batch the budget refused before it sent anything (a refused retry is a failure)."""
    return error is not None and error.type == "budget" and not error.sent


def build_result(
    *,
    job_id: str,
    response: str,
    provider: str,
    tier: str,
    params: dict[str, Any],
    collected: Sequence[dict[str, Any]],
    findings_filtered: int,
    batches: Sequence[BatchRecord],
    chunks_available: int,
    chunk_load_failures: int,
    usage: tuple[int, int, int],
    elapsed_seconds: float,
    tool_calls: Sequence[dict[str, Any]] = (),
    child_batches: Sequence[tuple[str, BatchRecord]] = (),
    **tree: Any,
) -> QueryResult:
    """``tree``: the modes fields of QueryResult (mode, route, confidence, children, cost_usd…) as computed by
    ``result_for``; ``child_batches`` count towards what was analysed and what failed."""
    every = [(None, b) for b in batches] + list(child_batches)
    ok = [b for _, b in every if b.status == "ok"]
    failed = [(jid, b) for jid, b in every if b.status == "failed"]
    # the budget stopped these before their call was sent: not run, which is not a failure (docs/contract.md#budgets)
    not_run = [b for _, b in failed if not_run_for_budget(b.error)]
    unanswered = sorted({cid for b in ok for cid in b.unanswered})
    # a chunk the analyst never answered for was not analysed, whatever its batch's status says
    analyzed = sorted({cid for b in ok for cid in b.chunk_ids} - set(unanswered))
    calls, tokens_in, tokens_out = usage
    plan_fields = set(AnalysisPlan.model_fields)
    return QueryResult(
        job_id=job_id,
        response=response,
        provider=provider,  # type: ignore[arg-type]
        scaling_tier=tier,
        plan=AnalysisPlan(**{k: v for k, v in params.items() if k in plan_fields}),
        findings_count=len(collected),
        findings_filtered=findings_filtered,
        chunks_analyzed=len(analyzed),
        analyzed_chunk_ids=analyzed,
        chunks_unanswered=len(unanswered),
        unanswered_chunk_ids=unanswered,
        chunks_available=chunks_available,
        batches_processed=len(ok),
        batches_failed=len(failed) - len(not_run),
        batches_not_run=len(not_run),
        chunk_load_failures=chunk_load_failures,
        batch_errors=[
            AnalystBatchError(
                batch=b.batch_no,
                type=b.error.type if b.error else "error",
                message=b.error.message if b.error else "",
                chunk_ids=b.chunk_ids,
                job_id=jid,
            )
            for jid, b in failed
        ],
        sources=sources_from(collected),
        llm_calls=calls,
        total_tokens=tokens_in + tokens_out,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        elapsed=round(elapsed_seconds, 2),
        tool_calls=[ToolCallRecord(**t) for t in tool_calls],
        caps_applied=list(params.get("caps_applied") or []),
        **tree,
    )


def completeness(
    *,
    query: str,
    route: str,
    checks: Sequence[CheckRecord],
    coverage: float,
    chunks_read: int,
    chunks_available: int,
    batches_failed: int,
    chunks_unanswered: int,
    exhausted: str | None,
    batch_errors: Sequence[str] = (),
    unanswered_ids: Sequence[int] = (),
) -> tuple[float | None, bool | None, list[str]]:
    """(confidence, complete, gaps), honestly: the last completeness check's verdict where one ran (None where
    none did), an aggregation judged by what was read — an exact count needs every chunk — and every known hole
    (failed batches, unanswered chunks, a spent budget) named as a gap.  On the direct route the one "batch" is
    the answer's call and an unanswered chunk is one that did not fit its context: the gaps say so, naming the
    error (``batch_errors``) and the chunks left out (``unanswered_ids``)."""
    verdict = checks[-1] if checks else CheckRecord()
    confidence = verdict.confidence
    complete = verdict.complete
    gaps = list(verdict.gaps)
    holes = batches_failed or chunks_unanswered
    if route == "exhaustive" or is_aggregation_question(query):
        if coverage < 1.0 or holes:
            complete = False
            gaps.append(
                f"read {chunks_read} of {chunks_available} chunks ({coverage:.0%}): an exact count or full list "
                + ("needs every chunk; ask with --scope all" if route != "exhaustive" else "is missing the rest")
            )
        elif complete is None:
            complete = True
    if batches_failed and route == "direct":
        why = next((e for e in batch_errors if e), "")
        gaps.append(f"the direct answer's call failed{': ' + why if why else ''}; no model read the chunks")
    elif batches_failed:
        gaps.append(f"{batches_failed} analyst batches failed: their chunks' evidence is missing")
    if chunks_unanswered and route == "direct":
        ids = ", ".join(str(c) for c in unanswered_ids[:20]) + (" …" if len(unanswered_ids) > 20 else "")
        gaps.append(
            f"{chunks_unanswered} matched chunks did not fit the direct answer's context (RLM_DIRECT_MAX_TOKENS, "
            f"RLM_MODEL_CONTEXT) and were not read{': chunks ' + ids if ids else ''}"
        )
    elif chunks_unanswered:
        gaps.append(f"{chunks_unanswered} chunks were never answered for by their analyst")
    if exhausted:
        gaps.append(f"the budget ran out ({exhausted}): the tree stopped early")
        if complete is not True:
            complete = False
    return confidence, complete, gaps


def result_for(
    conn: psycopg.Connection, job: JobRow, response: str, collected: Collected, tool_log: list[dict[str, Any]]
) -> QueryResult:
    """The job's QueryResult; for a root, over its whole tree (children's batches, calls and findings)."""
    kept = collected.kept
    root = job.parent_id is None
    tree = job_store.tree_of(conn, root_id=job.id) if root else []
    child_batches = [(k.id, b) for k in tree for b in job_store.batches(conn, job_id=k.id)]
    if root:
        usage = job_store.tree_usage(conn, root_id=job.id)
    else:
        usage = job_store.job_usage(conn, job_ids=[job.id]).get(job.id) or job_store.TreeUsage(0, 0, 0, 0, 0.0)
    per_chunk = {int(cid): [Record.model_validate(r) for r in recs] for cid, recs in collected.records.items()}
    rows: list[AggregateRow] = aggregate(per_chunk) if per_chunk else []
    if rows and root and response:
        # the exact totals are ours, not the model's: they are added under the report as computed
        response = response.rstrip() + "\n\n" + records_markdown(rows, job.query)
    own_usage = job_store.job_usage(conn, job_ids=[k.id for k in tree]) if tree else {}
    children = []
    for k in tree:
        u = own_usage.get(k.id)
        children.append(
            ChildSummary(
                job_id=k.id,
                parent_id=k.parent_id or job.id,
                kind=(k.spec.kind if k.spec else None) or "follow_up",
                depth=k.depth,
                query=k.query,
                status=k.status,
                findings_count=(k.result.findings_count if k.result else 0)
                or (len(k.collected.kept) if k.collected else 0),
                chunks_analyzed=k.result.chunks_analyzed if k.result else 0,
                llm_calls=u.calls if u else 0,
                total_tokens=(u.tokens_in + u.tokens_out) if u else 0,
                cost_usd=round(u.cost_usd, 6) if u else 0.0,
                error=k.error.message if k.error else None,
            )
        )
    own_batches = job_store.batches(conn, job_id=job.id)
    spent = next(
        (
            b.error.reason
            for b in [*own_batches, *(b for _, b in child_batches)]
            if b.error and b.error.type == "budget"
        ),
        None,
    )
    used = (usage.calls, usage.tokens_in + usage.tokens_out, usage.cost_usd)
    budget = budget_report(job.tree, job.options.stored(), used, spent) if root else None
    result = build_result(
        job_id=job.id,
        response=response,
        provider=provider().name,
        tier=job.scaling_tier or "tiny",
        params=job.params.stored() if job.params else {},
        collected=kept,
        findings_filtered=collected.filtered,
        batches=own_batches,
        chunks_available=job.chunks_available or 0,
        chunk_load_failures=job.chunk_load_failures,
        usage=(usage.calls, usage.tokens_in, usage.tokens_out),
        elapsed_seconds=time.time() - job.created_at.timestamp(),
        tool_calls=tool_log,
        child_batches=child_batches,
        mode=job.options.mode or "auto",
        route=job.route or "fanout",
        route_reason=job.route_reason,
        rounds=1 + max((k.depth for k in tree if k.spec and k.spec.kind == "follow_up"), default=0),
        depth=max((k.depth for k in tree), default=0),
        children=children,
        cached_tokens=usage.cached_tokens,
        cost_usd=round(usage.cost_usd, 6),
        records=rows,
    )
    if budget is not None:
        result.budget = budget
    if root:
        result.models = job_store.tree_models(conn, root_id=job.id)
    if job.route == Route.code:
        # code mode reads what its programs chose: every chunk one was handed counts as read
        result.analyzed_chunk_ids, result.chunks_analyzed = sorted(collected.read), len(collected.read)
        result.code_rounds = code_store.rounds_of(conn, job_id=job.id)
    available = result.chunks_available
    result.coverage = round(min(1.0, result.chunks_analyzed / available), 4) if available else 0.0
    result.confidence, result.complete, result.gaps = completeness(
        query=job.query,
        route=result.route,
        checks=job.checks,
        coverage=result.coverage,
        chunks_read=result.chunks_analyzed,
        chunks_available=available,
        batches_failed=result.batches_failed,
        chunks_unanswered=result.chunks_unanswered,
        exhausted=result.budget.exhausted,
        batch_errors=[e.message for e in result.batch_errors],
        unanswered_ids=result.unanswered_chunk_ids,
    )
    return result


def status_line(r: QueryResult) -> str:
    """The summary printed under a text report (docs/contract.md#json-shapes): the scale line, then the modes line."""
    unanswered = f" ({r.chunks_unanswered} unanswered)" if r.chunks_unanswered else ""
    not_run = f", {r.batches_not_run} not run (budget)" if r.batches_not_run else ""
    scale = (
        f"Scale: {r.scaling_tier} | Chunks: {r.chunks_analyzed}/{r.chunks_available} analyzed{unanswered} | "
        f"Findings: {r.findings_count} | Batches: {r.batches_processed} ok, {r.batches_failed} failed{not_run} | "
        f"Tokens: {r.total_tokens} | Time: {r.elapsed:.1f}s"
    )
    confidence = "n/a" if r.confidence is None else f"{r.confidence:.2f}"
    complete = {True: "yes", False: "no", None: "unknown"}[r.complete]
    # code mode's rounds are the model's programs, not the stage's own round 0
    rounds = sum(x.round > 0 for x in r.code_rounds) if r.route == "code" else r.rounds
    modes = (
        f"Mode: {r.mode} ({r.route}) | Rounds: {rounds} | Children: {len(r.children)} | Confidence: {confidence} | "
        f"Complete: {complete} | Coverage: {r.coverage:.0%} | Cost: ${r.cost_usd:.4f}"
    )
    if r.budget.exhausted:
        modes += f" | Budget exhausted: {r.budget.exhausted}"
    return f"{scale}\n{modes}\nAnswered by: {answered_by(r)}"


def answered_by(r: QueryResult) -> str:
    """Who wrote the answer, in words: the provider and its models (docs/contract.md#providers)."""
    if r.provider == "extractive":
        return "the offline extractive provider (no model: the best-matching passages)"
    where = "a local model on this machine" if r.provider == "local" else "the OpenAI-compatible endpoint"
    return f"{where}: {', '.join(r.models)}" if r.models else where


def store_report(
    conn: psycopg.Connection,
    job: JobRow,
    response: str,
    collected: Collected,
    error: BaseException | None,
    tool_log: list[dict[str, Any]] | None = None,
) -> None:
    """End the job with its report: done, or failed with the report it had (the direct answer and the
    synthesizer end a job the same way)."""
    result = result_for(conn, job, response, collected, tool_log or [])
    if error is not None:
        fail_job(conn, job_id=job.id, exc=error, result=result, prefix="synthesis failed")
    else:
        job_store.finish_job(conn, job_id=job.id, status=JobStatus.done, result=result)
