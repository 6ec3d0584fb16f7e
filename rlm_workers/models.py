"""Records passed between stages, stored on jobs and printed by the CLI/API.

These pydantic models are the JSON shapes of DESIGN §5 and §8; the CLI and
the API share them so the two can never drift apart.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field

SearchMode = Literal["hybrid", "semantic", "bm25"]
Relevance = Literal["high", "medium", "low", "none"]

#: ordering used by Collect and by ``finding_threshold``
RELEVANCE_RANK: dict[str, int] = {"high": 3, "medium": 2, "low": 1, "none": 0}


class JobStatus(str, Enum):
    #: accepted, no task has started yet
    queued = "queued"
    #: some stage is running
    running = "running"
    #: finished with a report (possibly with failed batches)
    done = "done"
    #: ended without a report; ``error`` says why
    failed = "failed"
    #: stopped by the user
    cancelled = "cancelled"


class BufferInfo(BaseModel):
    name: str
    id: int
    version: int
    files: int
    chunks: int
    bytes: int
    chunker: str | None = None
    embedding_model: str | None = None
    created_at: str | None = None
    updated_at: str | None = None


class SearchHit(BaseModel):
    """One row of ``rlm search --format json`` (DESIGN §5)."""

    chunk_id: int
    buffer: str
    path: str
    start_line: int
    end_line: int
    score: float
    text: str


class AnalysisPlan(BaseModel):
    search_mode: SearchMode = "hybrid"
    threshold: float = 0.3
    top_k: int = 200
    max_chunks: int = 100
    batch_size: int = 10
    focus_topics: list[str] = Field(default_factory=list)


class Finding(BaseModel):
    """One analyst verdict on one chunk."""

    chunk_id: int
    relevance: Relevance
    findings: list[str] = Field(default_factory=list)
    summary: str = ""
    follow_up: list[str] = Field(default_factory=list)


class Source(BaseModel):
    chunk_id: int
    buffer: str
    path: str
    start_line: int
    end_line: int
    relevance: Relevance
    snippet: str


class Elapsed(BaseModel):
    secs: int
    nanos: int

    @classmethod
    def from_seconds(cls, seconds: float) -> Elapsed:
        secs = int(seconds)
        return cls(secs=secs, nanos=int(round((seconds - secs) * 1e9)))

    @property
    def seconds(self) -> float:
        return self.secs + self.nanos / 1e9


class BatchError(BaseModel):
    batch: int
    type: str
    message: str
    chunk_ids: list[int] = Field(default_factory=list)


class QueryResult(BaseModel):
    """The answer to one query (DESIGN §5)."""

    job_id: str
    response: str
    provider: Literal["openai", "extractive"]
    scaling_tier: str
    plan: AnalysisPlan
    findings_count: int = 0
    findings_filtered: int = 0
    chunks_analyzed: int = 0
    analyzed_chunk_ids: list[int] = Field(default_factory=list)
    chunks_available: int = 0
    batches_processed: int = 0
    batches_failed: int = 0
    chunk_load_failures: int = 0
    batch_errors: list[BatchError] = Field(default_factory=list)
    sources: list[Source] = Field(default_factory=list)
    llm_calls: int = 0
    total_tokens: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    elapsed: Elapsed = Field(default_factory=lambda: Elapsed(secs=0, nanos=0))


class Usage(BaseModel):
    """Tokens one LLM call reported; ``None`` fields mean the server sent no usage."""

    tokens_in: int = 0
    tokens_out: int = 0

    @property
    def total(self) -> int:
        return self.tokens_in + self.tokens_out


class LLMCall(BaseModel):
    """One logged LLM call (simonw/llm style): what, how big, how long, how it ended."""

    stage: str
    model: str
    provider: str
    tokens_in: int = 0
    tokens_out: int = 0
    latency_ms: int = 0
    status: Literal["ok", "error", "retried"] = "ok"
    error: str | None = None
    batch: int | None = None
