"""Collect, the chord's callback: gather the stored findings, stamp each with where its chunk lives,
drop weak ones, sort.

Order (docs/contract.md#pipeline-semantics): relevance first, then document
position (buffer, chunk ordinal), so within a grade the report reads in the
order the text does.  ``collect`` is pure; ``collect_job`` reads and stores.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field

from ..models import RELEVANCE_RANK, ChunkId, Finding, Location, Relevance
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from .flow import OK, StageContext

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.collect")


class ChunkRef(Location, ChunkId):
    """Where a finding's chunk lives, and its place in its buffer's reading order (``ordinal``)."""

    model_config = ConfigDict(frozen=True)

    ordinal: int


class CollectedFinding(ChunkRef):
    """A kept finding, stamped with where its chunk lives."""

    relevance: str
    findings: list[str] = Field(default_factory=list)
    summary: str = ""
    follow_up: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class CollectResult:
    kept: list[CollectedFinding]
    filtered_count: int


#: the error a batch that never reported ends with, when collect or the watchdog finishes its job without it
LOST = {
    "type": "lost",
    "message": "the batch never reported (worker lost or task failed); finished without it",
}


def collect_order(relevance: str, buffer: str, ordinal: int, chunk_id: int) -> tuple:
    """Where a finding stands in collect order: stronger first, then where its chunk lives in the text."""
    return (-RELEVANCE_RANK[relevance], buffer, ordinal, chunk_id)


def collect(pairs: Iterable[tuple[Finding, ChunkRef]], *, finding_threshold: str = Relevance.low) -> CollectResult:
    if finding_threshold not in RELEVANCE_RANK:
        raise ValueError(f"finding_threshold must be one of {', '.join(RELEVANCE_RANK)}")
    floor = RELEVANCE_RANK[finding_threshold]
    kept: list[CollectedFinding] = []
    filtered = 0
    for f, ref in pairs:
        if RELEVANCE_RANK[f.relevance] < floor:
            filtered += 1
            continue
        kept.append(
            CollectedFinding(
                **dict(ref),
                relevance=f.relevance,
                findings=list(f.findings),
                summary=f.summary,
                follow_up=list(f.follow_up),
            )
        )
    kept.sort(key=lambda k: collect_order(k.relevance, k.buffer, k.ordinal, k.chunk_id))
    return CollectResult(kept=kept, filtered_count=filtered)


def finding_threshold(settings: Settings) -> str:
    """The default floor of a job's findings: ``RLM_FINDING_THRESHOLD`` when the operator set it; otherwise
    ``low`` for a model, ``medium`` for the offline extractive provider, whose ``low`` only means "shares a
    query term" and would list nearly every chunk analysed (docs/contract.md#pipeline-semantics)."""
    if "finding_threshold" in settings.model_fields_set or not settings.offline:
        return settings.finding_threshold
    return Relevance.medium.value


def collected_of(conn: psycopg.Connection, job: JobRow, default_threshold: str) -> dict:
    """Collect over the job's own stored findings: ``{"kept", "filtered", "records"}``, where ``records`` maps
    each chunk to the typed records its analyst counted — kept whatever the chunk's grade, since an exact
    total needs every chunk (docs/contract.md#modes)."""
    found = job_store.findings_of(conn, job_id=job.id)
    rows = get_chunks(conn, tenant=job.tenant, chunk_ids=sorted({f.chunk_id for _, f in found}), with_text=False)
    pairs = [
        (f, ChunkRef(chunk_id=c.id, ordinal=c.ordinal, **c.location()))
        for _, f in found
        if (c := rows.get(f.chunk_id)) is not None
    ]
    threshold = job.options.finding_threshold or default_threshold
    result = collect(pairs, finding_threshold=threshold)
    records = {str(f.chunk_id): [r.model_dump() for r in f.records] for f, _ in pairs if f.records}
    return {"kept": [k.model_dump() for k in result.kept], "filtered": result.filtered_count, "records": records}


def unite(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Collected findings of several jobs as one: per chunk the strongest grade and every distinct finding;
    records are per chunk too, so a chunk read twice is counted once (the first reading's)."""
    by_chunk: dict[int, dict[str, Any]] = {}
    records: dict[str, list] = {}
    filtered = 0
    for part in parts:
        filtered += int(part.get("filtered") or 0)
        for cid, recs in (part.get("records") or {}).items():
            records.setdefault(str(cid), recs)
        for f in part.get("kept") or []:
            cid = f["chunk_id"]
            prev = by_chunk.get(cid)
            if prev is None:
                by_chunk[cid] = dict(
                    f, findings=list(f.get("findings") or []), follow_up=list(f.get("follow_up") or [])
                )
                continue
            if RELEVANCE_RANK[f["relevance"]] > RELEVANCE_RANK[prev["relevance"]]:
                prev["relevance"] = f["relevance"]
            prev["findings"] += [x for x in f.get("findings") or [] if x not in prev["findings"]]
            prev["summary"] = prev.get("summary") or f.get("summary") or ""
    kept = sorted(
        by_chunk.values(), key=lambda k: collect_order(k["relevance"], k["buffer"], k["ordinal"], k["chunk_id"])
    )
    return {"kept": kept, "filtered": filtered, "records": records}


def collect_job(conn: psycopg.Connection, job: JobRow, default_threshold: str) -> int:
    """Run Collect over the job's stored findings and store the kept ones; returns how many were dropped."""
    collected = collected_of(conn, job, default_threshold)
    # a salvage of a job with children keeps what they found (merge would have united them the same way)
    kids = [k.collected.stored() for k in job_store.children_of(conn, job_id=job.id) if k.terminal and k.collected]
    if kids:
        collected = unite([collected, *kids])
    job_store.save_collected(conn, job_id=job.id, collected=collected)
    return int(collected["filtered"])


def run(ctx: StageContext) -> str:
    # Every header task has returned; a batch still pending never ran (its task was skipped or lost).
    job_store.fail_unfinished_batches(ctx.conn, job_id=ctx.job.id, reason=LOST)
    filtered = collect_job(ctx.conn, ctx.job, finding_threshold(ctx.settings))
    log.info("job %s collected (%d filtered)", ctx.job.id, filtered)
    return OK
