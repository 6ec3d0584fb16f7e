"""Records passed between stages, stored on jobs and printed by the CLI/API.

These pydantic models are the JSON shapes of docs/contract.md; the CLI and the
API share them so the two can never drift apart.  The bounded option types
are written once here and used by the API body, the CLI, parameter resolution
and plan parsing alike.
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SearchMode(StrEnum):
    hybrid = "hybrid"
    semantic = "semantic"
    bm25 = "bm25"


class Mode(StrEnum):
    """How deep a query goes (docs/contract.md#modes)."""

    instant = "instant"
    auto = "auto"
    thinking = "thinking"
    #: the model writes programs against the buffers in a sandbox, its sub-model calls fanned out as chords
    code = "code"


class Scope(StrEnum):
    #: the search picks the chunks (today's cut-off)
    search = "search"
    #: every chunk of the buffers is analysed
    all = "all"


class Route(StrEnum):
    """What a job actually ran: one direct call, a fan-out over searched chunks, or one over every chunk."""

    direct = "direct"
    fanout = "fanout"
    exhaustive = "exhaustive"
    #: code mode: the model's programs choose what is read (docs/contract.md#code-mode)
    code = "code"


class Relevance(StrEnum):
    high = "high"
    medium = "medium"
    low = "low"
    none = "none"


#: ordering used by Collect and by ``finding_threshold``
RELEVANCE_RANK: dict[str, int] = {Relevance.high: 3, Relevance.medium: 2, Relevance.low: 1, Relevance.none: 0}


def check_storable_text(text: str, what: str = "the query", *, nul_ok: bool = False) -> str:
    """The one rule for text a client sends that PostgreSQL must store (queries, names, globs, documents).

    PostgreSQL text cannot hold a NUL, and a lone surrogate (a JSON ``"\\ud800"``, a non-UTF-8 byte in argv)
    cannot be encoded as UTF-8: either would fail only when stored.  Raises ValueError (a pydantic validator
    turns it into a 422; ``validate_query`` into InvalidInput).  ``nul_ok`` is for callers that refuse a NUL
    themselves with a message of their own.
    """
    if "\x00" in text and not nul_ok:
        raise ValueError(f"{what} contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains text that is not valid Unicode (a lone surrogate)") from None
    return text


# The bounds of every query knob, shared by QueryOptions, AnalysisPlan and plan parsing.
# Strict: a JSON true is not 1, and "50" is not a number (what a person typed is checked, not coerced).
Threshold = Annotated[float, Field(strict=True, ge=-1.0, le=1.0)]
TopK = Annotated[int, Field(strict=True, ge=1, le=10_000)]
MaxChunks = Annotated[int, Field(strict=True, ge=1, le=100_000)]
AnalystBatchSize = Annotated[int, Field(strict=True, ge=1, le=1000)]
NumAgents = Annotated[int, Field(strict=True, ge=1, le=10_000)]
Depth = Annotated[int, Field(strict=True, ge=0, le=5)]
MaxLLMCalls = Annotated[int, Field(strict=True, ge=1, le=10_000_000)]
MaxTokens = Annotated[int, Field(strict=True, ge=1, le=10**12)]
MaxCost = Annotated[float, Field(strict=True, gt=0, le=1_000_000, allow_inf_nan=False)]
#: seconds from submission; a week at most (a job cannot wait longer on its budget than an overnight run)
Deadline = Annotated[float, Field(strict=True, gt=0, le=7 * 86400, allow_inf_nan=False)]


#: what steers the search and the analysts' batches: code mode runs neither (its programs read); ``depth`` applies
#: there, as whether a program may start child jobs
_SEARCH_KNOBS = (
    "search_mode", "threshold", "top_k", "max_chunks", "batch_size", "num_agents", "scope", "finding_threshold",
)  # fmt: skip


class QueryOptions(BaseModel):
    """What the user asked for (CLI flags or the API body); unset knobs resolve through
    plan → scaling profile → config → default (``pipeline/params.py``)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True, frozen=True)

    search_mode: SearchMode | None = None
    threshold: Threshold | None = None
    top_k: TopK | None = None
    max_chunks: MaxChunks | None = None
    batch_size: AnalystBatchSize | None = None
    num_agents: NumAgents | None = None
    skip_plan: Annotated[bool, Field(strict=True)] | None = None
    finding_threshold: Relevance | None = None
    #: docs/contract.md#modes
    mode: Mode | None = None
    depth: Depth | None = None
    scope: Scope | None = None
    #: docs/contract.md#budgets: limits for the whole tree of jobs
    max_llm_calls: MaxLLMCalls | None = None
    max_tokens: MaxTokens | None = None
    max_cost: MaxCost | None = None
    deadline: Deadline | None = None

    @model_validator(mode="after")
    def _one_way_to_batch(self) -> QueryOptions:
        if self.batch_size is not None and self.num_agents is not None:
            raise ValueError("batch_size and num_agents exclude each other: give one")
        if self.mode == Mode.instant:
            if self.scope == Scope.all:
                raise ValueError("scope all reads every chunk with a fan-out: not with mode instant (one call)")
            if self.batch_size is not None or self.num_agents is not None:
                raise ValueError("mode instant makes one call: batch_size and num_agents do not apply")
        if self.mode == Mode.code:
            given = [k for k in _SEARCH_KNOBS if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} do not apply in mode code: its programs choose what is read and how"
                )
        return self

    def stored(self) -> dict:
        """The options as kept on a job: only what was given."""
        return self.model_dump(exclude_none=True)


def allowed_values(key: str) -> str:
    """What a query option accepts, read from its type in QueryOptions ("an integer from 0 to 5", "one of
    instant, auto, thinking"), so an error names the range the type enforces; "" for an unknown option."""
    field = QueryOptions.model_fields.get(key)
    if field is None:
        return ""
    for arg in get_args(field.annotation):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return "one of " + ", ".join(str(m.value) for m in arg)
        if get_origin(arg) is not Annotated:
            continue
        base = get_args(arg)[0]
        bounds = {
            name: getattr(m, name)
            for info in arg.__metadata__
            for m in getattr(info, "metadata", [])
            for name in ("ge", "gt", "le", "lt")
            if hasattr(m, name)
        }
        kind = {int: "an integer", float: "a number", bool: "true or false"}.get(base, "a value")
        if base is bool:
            return "must be true or false"
        low = (
            f"from {_num(bounds['ge'])}" if "ge" in bounds else f"above {_num(bounds['gt'])}" if "gt" in bounds else ""
        )
        high = f"{_num(bounds['le'])}" if "le" in bounds else ""
        if low and high:
            return f"must be {kind} {low} {'to' if low.startswith('from') else 'and at most'} {high}"
        if low or high:
            return f"must be {kind} {low or 'at most ' + high}"
    return ""


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


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


class Stage(StrEnum):
    """Where a job is: the ``stage`` column of ``jobs``."""

    queued = "queued"
    plan = "plan"
    search = "search"
    #: code mode's rounds: the model writes a program, the sandbox runs it, until it calls final()
    code = "code"
    #: the direct route's one call (instant, or auto on a small context)
    answer = "answer"
    fan_out = "fan_out"
    collect = "collect"
    #: thinking mode's completeness check after a round; it may start child jobs
    check = "check"
    #: waiting, with no task running, for child jobs (follow-ups, query_subset) to end
    children = "children"
    #: the children ended: their findings join the job's, and the job goes on (check again, or synthesize)
    merge = "merge"
    synthesize = "synthesize"


#: the stages in the order a job moves through them (``pipeline/flow.py`` moves it); a thinking job goes round
#: check → children → merge more than once, and a direct job leaves at answer (docs/architecture.md#job-trees)
ORDER: tuple[Stage, ...] = (
    Stage.queued,
    Stage.plan,
    Stage.search,
    Stage.code,
    Stage.answer,
    Stage.fan_out,
    Stage.collect,
    Stage.check,
    Stage.children,
    Stage.merge,
    Stage.synthesize,
)


class BufferInfo(BaseModel):
    name: str
    id: int
    version: int
    files: int
    chunks: int
    bytes: int
    chunker: str | None = None
    embedding_model: str | None = None
    #: how chunks were cut into embedding windows, e.g. ``sentences:64/16`` (docs/contract.md#cli-buffers)
    embedding_windows: str | None = None
    #: what ran the embedding model: torch, onnx or onnx-int8 (docs/contract.md#cli-buffers)
    embedding_runtime: str | None = None
    created_at: str | None = None
    updated_at: str | None = None


class FileInfo(BaseModel):
    """One loaded file of a buffer (``rlm buffer show``, ``GET /v1/buffers/{name}/files``)."""

    path: str
    bytes: int
    chunks: int
    loaded_at: str | None = None


class Location(BaseModel):
    """Where a chunk or passage sits: its buffer's file and lines and, for a converted document, its pages and
    headings (docs/contract.md#documents: null / [] for plain text and code).  The one declaration of these
    fields: every shape that says where something is inherits them — the printed ones, so their JSON stays
    flat, and the internal records (a stored chunk row, a prompt's chunk, Collect's reference, a section read
    back), so a new field reaches them all (tests/test_structure.py keeps it so)."""

    buffer: str
    path: str
    start_line: int
    end_line: int
    page_start: int | None = None
    page_end: int | None = None
    #: the innermost heading; left out, it is taken from ``heading_path``, so no record can carry a stale one
    section: str | None = None
    heading_path: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _section_of_heading_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("section") is None and data.get("heading_path"):
            return {**data, "section": data["heading_path"][-1]}
        return data

    def location(self) -> dict[str, Any]:
        """Just these fields, to pass where something sits on to another record (``Record(**x.location())``)."""
        return {name: getattr(self, name) for name in Location.model_fields}


class ChunkId(BaseModel):
    """A chunk's stable id, the first key of every shape that points at one (listed last among the bases, so
    that its field comes first: pydantic lays the bases' fields out from the last base to the first)."""

    chunk_id: int


class ChunkView(Location, ChunkId):
    """One chunk as a citation points at it (``rlm chunk show``, ``GET /v1/chunks/{id}``, MCP ``get_chunks``)."""

    text: str


class SearchHit(Location, ChunkId):
    """One row of ``rlm search --format json`` (docs/contract.md#search-json)."""

    score: float
    text: str
    #: the chunk's window nearest the query (the sentences the semantic arm matched); None for a bm25-only hit
    passage: str | None = None


class AnalysisPlan(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    search_mode: SearchMode = SearchMode.hybrid
    # unbounded on purpose: a record of what ran (``--num-agents 1`` may make a batch of 5,000 chunks);
    # what a planner may ask for is bounded by plan parsing with the QueryOptions types
    threshold: float = 0.3
    top_k: int = 200
    max_chunks: int = 100
    batch_size: int = 10
    focus_topics: list[str] = Field(default_factory=list)


class Record(BaseModel):
    """One typed record an analyst counted in one chunk (``--scope all``): ``count`` items of ``label`` = ``value``.
    Collect sums them exactly over every chunk (docs/contract.md#modes)."""

    label: str
    value: str
    count: int = 1


class AggregateRow(BaseModel):
    """A record summed over every chunk that reported it: the exact total behind an aggregation answer."""

    label: str
    value: str
    count: int
    #: how many chunks reported this (label, value)
    chunks: int = 1


class Finding(BaseModel):
    """One analyst verdict on one chunk."""

    model_config = ConfigDict(use_enum_values=True)

    chunk_id: int
    relevance: Relevance
    findings: list[str] = Field(default_factory=list)
    summary: str = ""
    follow_up: list[str] = Field(default_factory=list)
    #: typed records counted in the chunk, when the job asked for them (exhaustive scope)
    records: list[Record] = Field(default_factory=list)


class Source(Location, ChunkId):
    model_config = ConfigDict(use_enum_values=True)

    relevance: Relevance
    snippet: str


class AnalystBatchError(BaseModel):
    batch: int
    type: str
    message: str
    chunk_ids: list[int] = Field(default_factory=list)
    #: the child job the batch belonged to; None for the job's own batches
    job_id: str | None = None


class ToolCallRecord(BaseModel):
    """One synthesizer tool call as recorded on the result: what was asked, and how it ended."""

    turn: int
    name: str
    #: the arguments as the model sent them, clipped (limits.MAX_TOOL_ARGS_SUMMARY_CHARS)
    args: str = ""
    status: Literal["ok", "error", "refused"] = "ok"
    error: str | None = None


class CodeRound(BaseModel):
    """One round of code mode (docs/contract.md#code-mode): the program the model wrote and what running it did."""

    round: int
    code: str
    #: what the program printed, cut to limits.MAX_CODE_OUTPUT_CHARS (``output_chars`` says how much it printed)
    output: str = ""
    output_chars: int = 0
    error: str | None = None
    #: API calls the program made (search, grep, read…), and the sub-model calls among them
    calls: int = 0
    sub_calls: int = 0
    #: the program's own seconds, without the time its calls waited on the workers
    seconds: float = 0.0
    #: the sandbox process ended with this round (a limit, a cancel): the next round started without its variables
    ended: bool = False


class ChildSummary(BaseModel):
    """One child job of a query's tree: a follow-up of thinking mode or a query_subset call."""

    job_id: str
    parent_id: str
    #: follow_up (thinking), subset (query_subset) or program (a code-mode program's rlm_query)
    kind: str
    depth: int
    query: str
    status: str
    findings_count: int = 0
    chunks_analyzed: int = 0
    llm_calls: int = 0
    total_tokens: int = 0
    cost_usd: float = 0.0
    error: str | None = None


class BudgetReport(BaseModel):
    """The tree's limits as asked, what was used, and which limit stopped it (None: none did)."""

    max_llm_calls: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    deadline: float | None = None
    used_llm_calls: int = 0
    used_tokens: int = 0
    used_cost_usd: float = 0.0
    #: max_llm_calls, max_tokens, max_cost or deadline
    exhausted: str | None = None


class QueryResult(BaseModel):
    """The answer to one query (docs/contract.md#query-result)."""

    job_id: str
    response: str
    provider: Literal["openai", "local", "extractive"]
    #: the models that answered the tree's calls, in the order they first answered (none for the extractive provider)
    models: list[str] = Field(default_factory=list)
    scaling_tier: str
    plan: AnalysisPlan
    findings_count: int = 0
    findings_filtered: int = 0
    chunks_analyzed: int = 0
    analyzed_chunk_ids: list[int] = Field(default_factory=list)
    #: chunks of finished batches the analyst never gave an entry for, even when asked again (cut-off replies)
    chunks_unanswered: int = 0
    unanswered_chunk_ids: list[int] = Field(default_factory=list)
    chunks_available: int = 0
    batches_processed: int = 0
    #: batches that ended in an error after running; those the budget stopped before they ran are not_run
    batches_failed: int = 0
    #: batches never run because the tree's budget was spent (docs/contract.md#budgets); not failures
    batches_not_run: int = 0
    chunk_load_failures: int = 0
    batch_errors: list[AnalystBatchError] = Field(default_factory=list)
    sources: list[Source] = Field(default_factory=list)
    llm_calls: int = 0
    total_tokens: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    #: wall time of the job in seconds
    elapsed: float = 0.0
    #: the synthesizer's tool calls, in order
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    #: per-job caps that cut what the plan asked for (RLM_MAX_CHUNKS_PER_JOB, RLM_MAX_BATCHES_PER_JOB)
    caps_applied: list[str] = Field(default_factory=list)
    # --- modes, recursion and budgets (docs/contract.md#modes) ---
    mode: str = "auto"
    #: direct, fanout, exhaustive or code
    route: str = "fanout"
    route_reason: str | None = None
    #: the last completeness check's verdict; None where no check ran (and, for an aggregation, from coverage)
    confidence: float | None = None
    complete: bool | None = None
    gaps: list[str] = Field(default_factory=list)
    #: fan-out rounds run (1 + rounds of child jobs) and the deepest child's depth (0: no children)
    rounds: int = 1
    depth: int = 0
    children: list[ChildSummary] = Field(default_factory=list)
    #: distinct chunks analysed over the whole tree / chunks in the queried buffers
    coverage: float = 0.0
    #: exact sums over every job of the tree (also in llm_calls and the token totals above)
    cached_tokens: int = 0
    cost_usd: float = 0.0
    budget: BudgetReport = Field(default_factory=lambda: BudgetReport())
    #: typed records summed over every chunk analysed (exhaustive scope)
    records: list[AggregateRow] = Field(default_factory=list)
    #: code mode's rounds, in order (empty in the other modes)
    code_rounds: list[CodeRound] = Field(default_factory=list)

    @field_validator("elapsed", mode="before")
    @classmethod
    def _elapsed_seconds(cls, value: Any) -> Any:
        # results stored before elapsed became seconds hold {"secs", "nanos"}; every reader shows seconds
        if isinstance(value, dict) and "secs" in value:
            return float(value["secs"]) + float(value.get("nanos") or 0) / 1e9
        return value


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
    cached_tokens: int = 0
    #: priced from RLM_PRICES when the call was logged; None for a model without a price
    cost_usd: float | None = None
    latency_ms: int = 0
    status: Literal["ok", "error", "retried"] = "ok"
    error: str | None = None
    batch: int | None = None
    #: questions that shared this call (a shared read, docs/contract.md#shared-reads): this row holds the job's
    #: share of the tokens and cost; 1 for a call of the job's own
    shared: int = 1
    #: what the job alone would have sent as input (an estimate, for shared calls): tokens with and without sharing
    solo_tokens_in: int | None = None
    #: "sync" (an ordinary request) or "batch_api" (a line of an OpenAI Batch API file, priced at its discount)
    via: Literal["sync", "batch_api"] = "sync"
    #: whether the stage could use the reply as it came (docs/contract.md#structured-outputs): False when it was
    #: no JSON of the right shape (the stage then re-asks, in a call of its own, or falls back); None for a call
    #: whose reply is not parsed (synthesis, direct answers) or that failed
    parse_ok: bool | None = None
