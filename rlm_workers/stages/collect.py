"""Collect: stamp each finding with where its chunk lives, drop weak ones, sort (pure).

Order (DESIGN §6): relevance first, then document position (buffer, chunk
ordinal), so within a grade the report reads in the order the text does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..models import RELEVANCE_RANK, Finding


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


def collect(pairs: Iterable[tuple[Finding, ChunkRef]], *, finding_threshold: str = "low") -> CollectResult:
    if finding_threshold not in RELEVANCE_RANK:
        raise ValueError(f"finding_threshold must be one of {', '.join(RELEVANCE_RANK)}")
    floor = RELEVANCE_RANK[finding_threshold]
    kept: list[CollectedFinding] = []
    filtered = 0
    for f, ref in pairs:
        if RELEVANCE_RANK[f.relevance] < floor:
            filtered += 1
            continue
        kept.append(CollectedFinding(**vars(ref), relevance=f.relevance, findings=list(f.findings),
                                     summary=f.summary, follow_up=list(f.follow_up)))
    kept.sort(key=lambda k: (-RELEVANCE_RANK[k.relevance], k.buffer, k.ordinal, k.chunk_id))
    return CollectResult(kept=kept, filtered_count=filtered)
