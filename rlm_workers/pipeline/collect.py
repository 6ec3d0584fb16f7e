"""Collect, the chord's callback: gather the stored findings, stamp each with where its chunk lives,
drop weak ones, sort.

Order (docs/contract.md#pipeline-semantics): relevance first, then document
position (buffer, chunk ordinal), so within a grade the report reads in the
order the text does.  ``collect`` is pure; ``collect_job`` reads and stores.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..models import RELEVANCE_RANK, Finding, Relevance
from ..store import jobs as job_store
from ..store.buffers import get_chunks
from .flow import OK, StageContext

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from ..store.jobs import JobRow

log = logging.getLogger("rlm.pipeline.collect")


@dataclass(frozen=True)
class ChunkRef:
    chunk_id: int
    buffer: str
    ordinal: int
    path: str
    start_line: int
    end_line: int


@dataclass(frozen=True)
class CollectedFinding(ChunkRef):
    """A kept finding, stamped with where its chunk lives."""

    relevance: str
    findings: list[str] = field(default_factory=list)
    summary: str = ""
    follow_up: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CollectResult:
    kept: list[CollectedFinding]
    filtered_count: int


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
                **vars(ref),
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
        (
            f,
            ChunkRef(
                chunk_id=c.id,
                buffer=c.buffer,
                ordinal=c.ordinal,
                path=c.path,
                start_line=c.start_line,
                end_line=c.end_line,
            ),
        )
        for _, f in found
        if (c := rows.get(f.chunk_id)) is not None
    ]
    threshold = (job.options or {}).get("finding_threshold") or default_threshold
    result = collect(pairs, finding_threshold=threshold)
    records = {str(f.chunk_id): [r.model_dump() for r in f.records] for f, _ in pairs if f.records}
    return {"kept": [dataclasses.asdict(k) for k in result.kept], "filtered": result.filtered_count, "records": records}


def collect_job(conn: psycopg.Connection, job: JobRow, default_threshold: str) -> int:
    """Run Collect over the job's stored findings and store the kept ones; returns how many were dropped."""
    from .tree import unite

    collected = collected_of(conn, job, default_threshold)
    # a salvage of a job with children keeps what they found (merge would have united them the same way)
    kids = [k.collected for k in job_store.children_of(conn, job_id=job.id) if k.terminal and k.collected]
    if kids:
        collected = unite([collected, *kids])
    job_store.save_collected(conn, job_id=job.id, collected=collected)
    return int(collected["filtered"])


def run(ctx: StageContext) -> str:
    from .salvage import LOST

    # Every header task has returned; a batch still pending never ran (its task was skipped or lost).
    job_store.fail_unfinished_batches(ctx.conn, job_id=ctx.job.id, reason=LOST)
    filtered = collect_job(ctx.conn, ctx.job, finding_threshold(ctx.settings))
    log.info("job %s collected (%d filtered)", ctx.job.id, filtered)
    return OK
