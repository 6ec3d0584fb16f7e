"""Request and response bodies of the HTTP API (docs/contract.md#http-api); QueryResult is shared with the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlm_workers.engine import (
    MAX_CHUNK_SIZE,
    MAX_QUERY_BYTES,
    MIN_CHUNK_SIZE,
    BufferInfo,
    ChunkId,
    CodeRound,
    InvalidInput,
    LLMCall,
    Location,
    QueryOptions,
    QueryResult,
    check_storable_text,
    path_problem,
    validate_buffer_name,
)

#: most files one upload may carry (JSON documents or multipart parts)
MAX_UPLOAD_FILES = 10_000


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """The first pydantic error as one line a person can act on: ``options.top_k: Input should be …``."""
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":  # FastAPI's "0: JSON decode error" named a byte offset, not a field
        detail = str((first.get("ctx") or {}).get("error") or first.get("msg", "")).removeprefix("Invalid JSON: ")
        at = [p for p in first.get("loc", ()) if isinstance(p, int)]
        return f"request body is not valid JSON: {detail}" + (f" (at character {at[0]})" if at else "")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    return f"{where}: {msg}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    type: str = Field(
        description="Machine-readable: invalid_input, unauthorized, not_found, buffer_not_found, "
        "too_large, service_unavailable, …"
    )
    message: str = Field(description="What went wrong and how to fix it, for a person.")

    @classmethod
    def from_record(cls, error: BaseModel | dict | None) -> ErrorBody | None:
        """A stored error (a job's typed one, an upload's record) as the API shows it (its HTTP wording when it
        has one); None if none."""
        if not error:
            return None
        rec = error.model_dump() if isinstance(error, BaseModel) else error
        return cls(type=str(rec.get("type", "")), message=str(rec.get("api_message") or rec.get("message", "")))


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body of the API."""

    error: ErrorBody


def upload_name_ok(name: str) -> str:
    """A client's file name as the loader will take it: the one path rule `rlm load` and the worker apply."""
    check_storable_text(name, "file name", nul_ok=True)  # a NUL is a control character: path_problem names it
    if problem := path_problem(name):
        raise ValueError(f"invalid file name {name[:80]!r}: the path {problem}")
    return name


def query_ok(v: str) -> str:
    """A query or chat message as every surface takes it: not blank, storable, at most MAX_QUERY_BYTES."""
    if not v.strip():
        raise ValueError("query is empty")
    check_storable_text(v, "query")
    if len(v.encode("utf-8")) > MAX_QUERY_BYTES:
        raise ValueError(f"query is over {MAX_QUERY_BYTES} bytes")
    return v


class QueryRequest(Strict):
    query: str = Field(..., description="The question (at most 10 KB).")
    buffers: list[str] = Field(..., min_length=1, max_length=50, description="Buffers to search.")
    options: QueryOptions = Field(default_factory=QueryOptions)

    _check_query = field_validator("query")(classmethod(lambda cls, v: query_ok(v)))
    _check_buffers = field_validator("buffers")(classmethod(lambda cls, v: [buffer_name_ok(n) for n in v]))


def buffer_name_ok(name: str) -> str:
    """A buffer name checked as every surface checks it, for a pydantic validator."""
    try:
        return validate_buffer_name(name)
    except InvalidInput as exc:  # pydantic reports ValueErrors only
        raise ValueError(exc.message) from None


class UploadAccepted(BaseModel):
    """``POST /v1/buffers?wait=false``: the files are stored and an ingest worker will load them."""

    upload_id: str
    buffer: str
    status: Literal["queued"] = "queued"
    status_url: str


class UploadView(BaseModel):
    upload_id: str
    buffer: str
    status: Literal["queued", "running", "done", "failed"]
    files: int
    bytes: int
    attempts: int = Field(description="Deliveries to an ingest worker that started loading (at most 3).")
    created_at: datetime
    finished_at: datetime | None
    report: dict | None = Field(description="Once done: the loader's report (as `rlm load --format json`).")
    error: ErrorBody | None
    groups: int | None = Field(
        None, description="File groups a large upload was split into (null: loaded whole by one worker)."
    )
    groups_done: int = Field(0, description="Groups embedded so far; the new version is committed when all are.")


class QueryAccepted(BaseModel):
    job_id: str
    status_url: str


class Progress(BaseModel):
    batches_done: int
    batches_total: int


JobStatusName = Literal["queued", "running", "done", "failed", "cancelled"]


class Usage(BaseModel):
    """The job's own logged LLM calls (retries included); a root's ``result`` has the whole tree's."""

    llm_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0


class StageTiming(BaseModel):
    stage: str
    seconds: float = Field(description="Wall time the stage's tasks took, summed over deliveries.")


class BatchView(BaseModel):
    """One analyst batch of the chord."""

    batch_no: int
    chunks: int
    state: Literal["queued", "running", "done", "failed"]
    attempts: int
    error: ErrorBody | None = None


class ChildView(BaseModel):
    """A follow-up job a ``thinking`` round (or the synthesizer's query_subset) started."""

    job_id: str
    status: JobStatusName
    stage: str
    query: str
    depth: int
    children: list[ChildView] = Field(default_factory=list)


class JobSummary(BaseModel):
    """One row of ``GET /v1/queries``."""

    job_id: str
    status: JobStatusName
    stage: str
    query: str
    buffers: list[str]
    mode: str
    parent_id: str | None = None
    created_at: datetime
    finished_at: datetime | None = None
    usage: Usage


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        None, description="Pass as ``cursor`` for the next (older) page; null on the last page."
    )


class JobView(BaseModel):
    job_id: str
    status: JobStatusName
    stage: str
    progress: Progress
    result: QueryResult | None = None
    error: ErrorBody | None = None
    query: str = ""
    buffers: list[str] = Field(default_factory=list)
    options: dict = Field(default_factory=dict, description="The options the job was submitted with.")
    parent_id: str | None = None
    root_id: str | None = None
    depth: int = 0
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: list[StageTiming] = Field(default_factory=list, description="Per stage, in pipeline order.")
    batches: list[BatchView] = Field(default_factory=list, description="The chord's analyst batches.")
    calls: list[LLMCall] = Field(default_factory=list, description="Every LLM call logged for this job.")
    children: list[ChildView] = Field(default_factory=list, description="Follow-up jobs, as a tree.")
    code_rounds: list[CodeRound] = Field(
        default_factory=list, description="Code mode's rounds so far: each program, its output and its calls."
    )
    usage: Usage = Field(default_factory=Usage)
    task_ids: list[str] = Field(default_factory=list, description="Celery task ids (as Flower shows them).")
    spec: dict | None = Field(
        None, description="What a child or a chat turn carries: its task, or the session context it used."
    )


class Document(Strict):
    path: str = Field(..., min_length=1, max_length=1024, description="Relative path, e.g. docs/intro.md.")
    text: str

    _check_path = field_validator("path")(classmethod(lambda cls, v: upload_name_ok(v)))
    # text no encoding can write (a lone surrogate) is refused here; a NUL below, naming the document
    _check_text = field_validator("text")(classmethod(lambda cls, v: check_storable_text(v, "text", nul_ok=True)))

    @model_validator(mode="after")
    def _text_has_no_nul(self) -> Document:
        # A file with a NUL is skipped as binary, but a JSON document says it is text: refuse it, naming it.
        if "\x00" in self.text:
            raise ValueError(
                f"{self.path[:200]!r}: text contains a NUL character (\\u0000); send binary files as multipart"
            )
        return self


class BufferOptions(Strict):
    """What a multipart upload sends as form fields next to its ``files`` parts."""

    name: str = Field(..., min_length=1, max_length=128, description="Buffer to create or update.")
    chunker: Literal["semantic", "fixed", "code"] = "semantic"
    # Lax here: a multipart form field is always a string ("3000"); the JSON body below is strict.
    chunk_size: int = Field(
        3000, ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE, description="Maximum characters per chunk (as `rlm load`)."
    )
    overlap: int = Field(500, ge=0, le=50_000, description="Characters shared by consecutive chunks.")

    _check_name = field_validator("name")(classmethod(lambda cls, v: buffer_name_ok(v)))


class BufferCreate(BufferOptions):
    """A JSON upload: the documents travel in the body, each under a relative path."""

    # JSON has numbers: "3000", 3000.0 or true is a 422 here, as for every other option of a JSON body.
    chunk_size: int = Field(
        3000,
        strict=True,
        ge=MIN_CHUNK_SIZE,
        le=MAX_CHUNK_SIZE,
        description="Maximum characters per chunk (as `rlm load`).",
    )
    overlap: int = Field(500, strict=True, ge=0, le=50_000, description="Characters shared by consecutive chunks.")
    documents: list[Document] = Field(..., min_length=1, max_length=MAX_UPLOAD_FILES)


class LoadResponse(BaseModel):
    """The loader's report (as `rlm load --format json` prints it) and the buffer as it now is."""

    buffer: BufferInfo
    version: int
    files_loaded: int
    files_unchanged: int
    files_removed: int = Field(
        description="Files under an uploaded top-level directory that the upload no "
        "longer has (same rule as `rlm load DIR`)."
    )
    chunks_written: int
    windows_embedded: int
    skipped: dict[str, int] = Field(
        description="Files not loaded, by reason (binary, not-utf8, too-large, encrypted, corrupt, no-text-layer, "
        "unpack-limit, …)."
    )
    too_large: list[str]
    cut: dict[str, int] = Field(
        default_factory=dict, description="Documents loaded in part, by reason (cut-pages, cut-text, cut-time)."
    )
    named: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The documents behind each document skip or cut reason (at most 100 names per reason).",
    )
    seconds: float


# --------------------------------------------------------------------------- chat sessions (docs/contract.md#sessions)


class SessionCreate(Strict):
    buffers: list[str] = Field(..., min_length=1, max_length=50, description="Buffers every turn searches.")
    options: QueryOptions = Field(default_factory=QueryOptions, description="Query options every turn runs with.")

    _check_buffers = field_validator("buffers")(classmethod(lambda cls, v: [buffer_name_ok(n) for n in v]))


class SessionCreated(BaseModel):
    session_id: str
    buffers: list[str]
    options: dict = Field(default_factory=dict)
    session_url: str


class MessageRequest(Strict):
    content: str = Field(..., description="The next question (at most 10 KB); a follow-up may lean on earlier turns.")

    _check_content = field_validator("content")(classmethod(lambda cls, v: query_ok(v)))


class MessageAccepted(BaseModel):
    session_id: str
    turn: int
    job_id: str
    status_url: str = Field(description="The turn's query job (GET it, or the session, until it ends).")


class Citation(Location, ChunkId):
    """A chunk an answer cited: a stable chunk id (``GET /v1/chunks/{id}``) with where it comes from."""


class TurnView(BaseModel):
    turn: int
    question: str = Field(description="As asked.")
    standalone_question: str | None = Field(
        None, description="What the turn's job searched for (the question rewritten to stand alone), once known."
    )
    job_id: str | None
    status: str = Field(description="The job's status (queued, running, done, failed, cancelled).")
    answer: str | None = Field(None, description="The answer's markdown, once done.")
    citations: list[Citation] = Field(default_factory=list, description="The chunks the answer cites, in order.")
    error: ErrorBody | None = None
    created_at: datetime | None = None


class SessionView(BaseModel):
    session_id: str
    buffers: list[str]
    options: dict = Field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    turns: list[TurnView] = Field(default_factory=list)
