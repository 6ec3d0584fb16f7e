"""Assemble the QueryResult from what the job stored (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import AnalysisPlan, BatchError, Elapsed, QueryResult, Source, ToolCallRecord
from ..store.jobs import BatchRecord

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
                snippet=snippet[:SNIPPET_CHARS],
            )
        )
    return out


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
) -> QueryResult:
    ok = [b for b in batches if b.status == "ok"]
    failed = [b for b in batches if b.status == "failed"]
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
        batches_failed=len(failed),
        chunk_load_failures=chunk_load_failures,
        batch_errors=[
            BatchError(
                batch=b.batch_no,
                type=(b.error or {}).get("type", "error"),
                message=(b.error or {}).get("message", ""),
                chunk_ids=b.chunk_ids,
            )
            for b in failed
        ],
        sources=sources_from(collected),
        llm_calls=calls,
        total_tokens=tokens_in + tokens_out,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        elapsed=Elapsed.from_seconds(elapsed_seconds),
        tool_calls=[ToolCallRecord(**t) for t in tool_calls],
        caps_applied=list(params.get("caps_applied") or []),
    )


def status_line(r: QueryResult) -> str:
    """The one-line summary printed under a text report (docs/contract.md#json-shapes)."""
    unanswered = f" ({r.chunks_unanswered} unanswered)" if r.chunks_unanswered else ""
    return (
        f"Scale: {r.scaling_tier} | Chunks: {r.chunks_analyzed}/{r.chunks_available} analyzed{unanswered} | "
        f"Findings: {r.findings_count} | Batches: {r.batches_processed} ok, {r.batches_failed} failed | "
        f"Tokens: {r.total_tokens} | Time: {r.elapsed.seconds:.1f}s"
    )
