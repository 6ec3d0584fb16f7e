"""One settings object for every process: CLI, workers and API.

Values come from the environment (docs/contract.md#configuration).  ``get_settings()`` caches one
instance per process; tests call ``reset_settings()`` after changing the
environment.  Validation errors are turned into one-line ``ConfigError``s so a
typo in an env var reads as a sentence, not a pydantic traceback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import AliasChoices, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError
from .llm.prices import parse_prices
from .runtime.local_models import DEFAULT_STAGE_MODELS, MODELS, host_problem, resolve_model

#: RLM_LOCAL_LLM's value that keeps `auto` from picking a local model
LOCAL_OFF = "off"
#: the stage settings that name a model, each of which a local server may have to serve
_STAGE_MODELS = ("primary_model", "subcall_model", "synthesizer_model", "check_model")


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("rlm-pipeline", appauthor=False))


#: processes of this host encoding side by side (a prefork worker's children), set once before they fork
_core_sharers = 1


def share_cores(processes: int) -> None:
    """This process's children split the cores between their encoders (see ``resolved_encode_threads``).

    Kept outside ``Settings`` on purpose: a worker must not re-read its settings after it started, and the
    share is a fact of the worker process, not configuration."""
    global _core_sharers
    _core_sharers = max(1, processes)


def usable_cores() -> int:
    """The cores this process may run on (its affinity on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLM_", extra="ignore", populate_by_name=True)

    # --- LLM -------------------------------------------------------------
    provider: Literal["auto", "openai", "local", "extractive"] = Field(
        "auto",
        description="Who answers the LLM stages (docs/contract.md#providers): auto picks openai when an API key or "
        "base URL is set, else a local model when this machine can serve one, else the offline extractive provider; "
        "openai, local and extractive pick one outright.",
    )
    api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("RLM_API_KEY", "OPENAI_API_KEY"),
        description="LLM API key; absent means the offline extractive provider is used.",
        repr=False,
    )
    base_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("RLM_BASE_URL", "OPENAI_BASE_URL"),
        description="OpenAI-compatible endpoint; unset means OpenAI itself.",
    )
    primary_model: str = Field("gpt-5.2-2025-12-11", description="Planner model.")
    subcall_model: str = Field("gpt-5-mini-2025-08-07", description="Analyst model.")
    synthesizer_model: str = Field("gpt-5.2-2025-12-11", description="Synthesizer model.")
    check_model: str | None = Field(
        None,
        description="Completeness checker of `thinking` mode; unset means RLM_PRIMARY_MODEL (docs/contract.md#modes).",
    )
    max_depth: int = Field(2, ge=0, le=5, description="Default recursion depth of `thinking` mode (--depth).")
    code_max_rounds: int = Field(
        10, ge=1, le=100, description="Programs the model may write for one `--mode code` query before it must answer."
    )
    code_child_waits: int = Field(
        2,
        ge=1,
        le=1000,
        description="Code-mode programs that may wait on child jobs at once, over all workers; below the control "
        "pool's slots, so the children always find one.",
    )
    direct_max_tokens: int = Field(
        16_000,
        ge=0,
        le=1_000_000,
        description="The crossover of `auto`: a selected context estimated at most this many tokens is answered by "
        "one direct call; `instant` fits its chunks into it. 0: `auto` never routes direct.",
    )
    prices: str | None = Field(
        None,
        description="USD per 1M input / cached input / output tokens per model, as JSON or a path to a JSON file; "
        "merged over the built-in table (docs/contract.md#costs).",
    )
    max_concurrency: int = Field(50, ge=1, le=10_000, description="Ceiling on in-flight LLM calls across all workers.")
    rpm: int | None = Field(None, ge=1, description="Optional requests-per-minute budget shared by all workers.")
    tpm: int | None = Field(None, ge=1, description="Optional tokens-per-minute budget shared by all workers.")
    llm_timeout: float = Field(120.0, gt=0, description="Seconds before one LLM HTTP call is abandoned.")
    llm_retries: int = Field(3, ge=0, le=20, description="Retries of a failed LLM call (429/5xx/timeouts).")
    local_llm: str | None = Field(
        None,
        description="The local model every stage uses (docs/contract.md#local-llm): `gemma-3-270m`, "
        "`qwen2.5-coder-0.5b` or `qwen2.5-coder-1.5b`; implies RLM_PROVIDER=local unless a key or base URL is set. "
        "`off`: RLM_PROVIDER=auto never picks a local model. Unset: each stage's default local model.",
    )
    local_llm_dir: Path | None = Field(
        None,
        description="Where local models are assembled (and a fallback llama-server built); unset: the user cache dir.",
    )
    local_llm_ctx: int | None = Field(
        None, ge=1024, le=131_072, description="Context tokens per request slot of the local model server."
    )
    local_llm_parallel: int = Field(
        2, ge=1, le=8, description="Requests the local model server runs at once (its slots); small CPUs: 1-2."
    )
    local_llm_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads of the local model server; unset: every core this process may use. On cores "
        "busy with other work, fewer threads waste less time waiting for each other.",
    )
    local_llm_batch_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads the local model server reads prompts with; unset: RLM_LOCAL_LLM_THREADS. Reading "
        "a prompt is a few large matrix products that use more threads well; writing a reply token by token is not.",
    )
    local_llm_gpu_layers: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Layers of each local model the server puts on a GPU (llama.cpp's --n-gpu-layers): 0 runs it on "
        "the CPU, more than the model has puts all of it there. Unset: all where the installed xllamacpp build sees "
        "a GPU (the PyPI wheel is built for the CPU only), else 0.",
    )
    structured_outputs: Literal["auto", "json_schema", "json_object", "off"] = Field(
        "auto",
        description=(
            "How JSON stages ask for JSON (docs/contract.md#structured-outputs): auto tries a JSON Schema, then "
            "json_object, then none, learning per (base URL, model) what the server accepts; json_schema only; "
            "json_object only; off sends no response_format."
        ),
    )
    tool_calls: Literal["auto", "native", "json"] = Field(
        "auto",
        description="How the synthesizer calls its tools (docs/contract.md#structured-outputs): native tool calling, "
        "or json: each reply a schema-constrained JSON action (a tool call or the answer), which a small model "
        "keeps to; auto is json for a local model and native otherwise (and json after a server refused tools).",
    )
    planner: Literal["auto", "model", "defaults"] = Field(
        "auto",
        description="Whether a model plans each query's search (docs/contract.md#modes): model, or defaults (the "
        "operator's settings and the scaling tier, no call); auto is defaults for a local model, whose plans cut "
        "recall (top_k 1, max_chunks 1 seen from a 0.5B model), and model otherwise.",
    )
    analyst_findings: Literal["auto", "entries", "answers"] = Field(
        "auto",
        description="What an analyst reports (docs/contract.md#analyst-message): entries, a grade, findings and a "
        "summary for every chunk; or answers: what its batch says about the question, in a few sentences citing "
        "the chunks it comes from (a small model answers from a few chunks well and grades or summarises each "
        "badly); auto is answers for a local model. Counting jobs (records) always use entries.",
    )
    llm_seconds_per_1k_tokens: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="Seconds added to RLM_LLM_TIMEOUT per 1,000 tokens of a call (prompt and answer allowance, "
        "estimated): a slow local server's timeout grows with the work (docs/contract.md#llm-calls).",
    )
    model_context: int | None = Field(
        None,
        ge=512,
        le=10_000_000,
        description="Context window of the endpoint's models in tokens (a local server's -c); a direct answer's "
        "prompt and answer are held to it. Unset: no limit past RLM_DIRECT_MAX_TOKENS (docs/contract.md#modes).",
    )

    # --- query defaults ----------------------------------------------------
    batch_size: int = Field(10, ge=1, le=1000, description="Default chunks per analyst batch.")
    search_top_k: int = Field(200, ge=1, le=10_000, description="Default search depth.")
    threshold: float = Field(0.3, ge=-1.0, le=1.0, description="Default similarity threshold for the semantic arm.")
    finding_threshold: Literal["high", "medium", "low", "none"] = Field(
        "low", description="Findings below this relevance are dropped by Collect."
    )
    max_chunks_per_job: int = Field(
        10_000,
        ge=1,
        le=100_000,
        description="Most chunks one job may analyse (an exhaustive job over 10,000 chunks is a normal case): "
        "a request over it is refused, a plan over it is cut.",
    )
    max_batches_per_job: int = Field(
        200,
        ge=1,
        le=10_000,
        description="Most analyst batches one job may send: a request over it is refused; otherwise batches grow.",
    )
    prompt_dir: Path = Field(
        Path("~/.config/rlm/prompts"),
        description="Directory whose primary.md/subcall.md/synthesizer.md override the shipped prompts.",
    )

    # --- services ----------------------------------------------------------
    database_url: str | None = Field(None, description="PostgreSQL with pgvector; unset starts the embedded server.")
    broker_url: str | None = Field(None, description="Redis broker; unset starts embedded Valkey.")
    result_backend: str | None = Field(None, description="Celery result backend; defaults to the broker URL.")
    data_dir: Path = Field(default_factory=_default_data_dir, description="Embedded services' data and caches.")
    embedded_idle_seconds: float = Field(
        1800.0,
        ge=0,
        description="An embedded server with no client connected for this long is stopped (the next rlm command "
        "starts it again); 0: never (docs/contract.md#components).",
    )
    visibility_timeout: int = Field(
        3600,
        ge=5,
        description="Seconds before Redis redelivers an unacknowledged task; keep above the longest task.",
    )
    job_timeout: int = Field(
        1800,
        ge=5,
        description="Seconds a job's fan-out may go without progress (no batch started or finished) before it is "
        "finished with what it has; keep below RLM_VISIBILITY_TIMEOUT.",
    )

    # --- ingest ------------------------------------------------------------
    embedding_model: str | None = Field(
        None, description="sentence-transformers model name or path; unset uses the bundled all-MiniLM-L6-v2."
    )
    embedding_runtime: Literal["auto", "torch", "onnx", "onnx-int8"] = Field(
        "auto",
        description="What runs the embedding model at ingest: torch (float32 reference), onnx (ONNX Runtime, "
        "float32) or onnx-int8; auto picks onnx-int8 where onnxruntime can run the model, else torch. Recorded "
        "on every buffer; queries use the buffer's runtime.",
    )
    embedding_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the torch runtime encodes at ingest: cuda (a GPU, half precision, recorded as "
        "torch-cuda-fp16), cpu, or auto: cuda where this process's torch sees a CUDA device, then `auto` and "
        "`torch` runtimes run there (docs/architecture.md#gpu-encoder).",
    )
    encode_threads: int | None = Field(
        None, ge=1, le=256, description="Batches encoded at once by the ONNX runtimes; unset uses the usable cores."
    )
    encoder_dir: Path | None = Field(
        None, description="Cache of exported ONNX encoders; unset uses RLM_DATA_DIR/encoders."
    )
    embed_batch_size: int = Field(64, ge=1, le=4096, description="Windows per encoder batch.")
    max_file_bytes: int = Field(50 * 1024 * 1024, ge=1, description="Files larger than this are skipped by `rlm load`.")
    ingest_group_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="A queued load (`rlm load --queue`, a queued API upload) larger than this is split into file "
        "groups of about this many bytes, embedded by any ingest workers at once and committed as one new version.",
    )

    # --- operations --------------------------------------------------------
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: str = Field("INFO", description="Python logging level.")
    flower_basic_auth: str | None = Field(
        None,
        description="user:password for Flower (always required); unset: generated into RLM_DATA_DIR/flower-auth.",
        repr=False,
    )

    # --- HTTP API and batches ----------------------------------------------
    tenant: str = Field(
        "local",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Tenant the CLI works in when a command gets no --tenant (the API takes it from the key).",
    )
    flower_url: str | None = Field(
        None,
        description="Flower's address as a browser reaches it, e.g. https://ops.example.com/flower; the web view "
        "links each task id there when set.",
    )
    session_history_tokens: int = Field(
        4000,
        ge=200,
        le=200_000,
        description="A chat session's earlier turns carried into a new question, in tokens; older turns are "
        "compacted to their question and citations past it.",
    )
    api_host: str = Field("127.0.0.1", description="Address `rlm api` / `rlm up` bind the HTTP API to.")
    api_port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP API.")
    flower_host: str = Field("127.0.0.1", description="Address Flower binds to (behind basic auth).")
    flower_port: int = Field(5555, ge=0, le=65535, description="Port of Flower.")
    max_request_bytes: int = Field(50 * 1024 * 1024, ge=1024, description="Largest HTTP request body (413 above).")
    api_queue: int = Field(
        500,
        ge=0,
        le=100_000,
        description="Requests to /v1 and /metrics that may wait for one of the API's database slots; past it "
        "(or after 10 s waiting) the answer is 429 `overloaded` with Retry-After.",
    )
    max_jobs_in_flight_per_tenant: int = Field(
        50,
        ge=1,
        le=1_000_000,
        description="Queued or running query jobs one tenant may have; a submission over it is refused (HTTP 429).",
    )
    batch_parallel: int = Field(
        4,
        ge=1,
        le=1000,
        description="Batch items in flight at once per batch; the rest of the LLM budget stays free for interactive "
        "queries.",
    )
    batch_tick_seconds: float = Field(2.0, gt=0, le=600, description="How often a running batch is advanced.")
    shared_read_questions: int = Field(
        8,
        ge=1,
        le=50,
        description="Questions of an overnight batch one analyst call may answer over the same chunk batch "
        "(shared reads, docs/contract.md#shared-reads); 1 turns sharing off.",
    )
    llm_batch_poll_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How often an overnight batch run through the OpenAI Batch API (--llm-batch) polls the "
        "provider's batches (docs/contract.md#llm-batch-api).",
    )
    llm_batch_max_requests: int = Field(
        50_000,
        ge=1,
        le=50_000,
        description="Requests per provider batch file (the Batch API takes at most 50,000).",
    )
    tenant_weights: str | None = Field(
        None,
        description='Shares of RLM_MAX_CONCURRENCY between active tenants, as JSON {"tenant": weight}; a tenant '
        "not named weighs 1 (docs/contract.md#fair-share).",
    )
    reconcile_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How often one worker looks for jobs whose stage stopped moving for RLM_JOB_TIMEOUT and "
        "pushes them on (lost tasks after a broker or worker crash).",
    )
    worker_lost_seconds: float = Field(
        20.0,
        ge=1,
        le=3600,
        description="A job stage, upload or file group whose worker died (its database session gone) is sent again "
        "by the reconciler once it has not started for this long; also the least time between two such re-sends.",
    )

    @field_validator("prompt_dir", "data_dir", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("prices")
    @classmethod
    def _prices(cls, v: str | None) -> str | None:
        """Checked at start-up, so a typo fails every command at once rather than the first priced call."""
        try:
            parse_prices(v)
        except ConfigError as exc:
            raise ValueError(exc.message.removeprefix("invalid setting RLM_PRICES: ")) from None
        return v

    @field_validator("local_llm")
    @classmethod
    def _local_model(cls, v: str | None) -> str | None:
        if v and v != LOCAL_OFF and v not in MODELS:
            raise ValueError(f"unknown local model {v!r}: one of {', '.join(MODELS)} (or {LOCAL_OFF})")
        return v or None

    @field_validator("database_url")
    @classmethod
    def _pg_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql://")
        return v or None

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis:// URL")
        return v or None

    @model_validator(mode="after")
    def _resolve_provider(self) -> Settings:
        """Who answers; a local model answers under its own name, on a CPU and with a small context: unless set, the
        models, the timeout, the concurrency and the prompt sizes are ones it can meet (docs/contract.md#local-llm)."""
        given = self._user_set = frozenset(self.model_fields_set)
        provider = self.provider
        chosen = self.local_llm if self.local_llm != LOCAL_OFF else None
        if provider == "auto":
            if self.api_key or self.base_url:
                provider = "openai"
            elif chosen:
                provider = "local"
            elif self.local_llm == LOCAL_OFF:
                self._local_problem = f"RLM_LOCAL_LLM={LOCAL_OFF}"
                provider = "extractive"
            else:
                models = {resolve_model(m) for m in DEFAULT_STAGE_MODELS.values()}
                self._local_problem = host_problem(self.resolved_local_llm_dir, models)
                provider = "extractive" if self._local_problem else "local"
        self._resolved_provider = provider
        if provider != "local":
            return self
        for name, default in DEFAULT_STAGE_MODELS.items():
            if name not in given:
                setattr(self, name, chosen or default)
        context = self.local_llm_ctx or max(resolve_model(m).context for m in self.local_models)
        defaults = {
            # a prompt of a few thousand tokens takes minutes on two cores: the timeout grows with the prompt
            "llm_timeout": 300.0,
            "llm_seconds_per_1k_tokens": 60.0,
            "max_concurrency": self.local_llm_parallel,
            # prompts and replies are held to the slot's context (pipeline/route.py, the provider's reply cap)
            "model_context": context,
            "batch_size": 4,
            # a cold answer stays in minutes: two batches of four chunks, one round of follow-ups
            "search_top_k": 8,
            "max_depth": 1,
        }
        for name, value in defaults.items():
            if name not in given:
                setattr(self, name, value)
        return self

    @model_validator(mode="after")
    def _backend_follows_broker(self) -> Settings:
        if self.result_backend is None and self.broker_url:
            self.result_backend = self.broker_url
        return self

    @model_validator(mode="after")
    def _job_timeout_below_redelivery(self) -> Settings:
        """A stuck job's watchdog is an ETA task, which Redis redelivers after the visibility timeout like any
        other: a job timeout at or above it cannot be honoured, so it is refused rather than cut short."""
        if self.job_timeout >= self.visibility_timeout:
            raise ValueError(
                f"RLM_JOB_TIMEOUT ({self.job_timeout}) must be below RLM_VISIBILITY_TIMEOUT "
                f"({self.visibility_timeout}): Redis would redeliver a stuck job's tasks before it is pushed on"
            )
        return self

    _resolved_provider: str = PrivateAttr("extractive")
    _local_problem: str | None = PrivateAttr(None)
    _user_set: frozenset[str] = PrivateAttr(frozenset())

    def user_set(self, name: str) -> bool:
        """Whether the setting ``name`` was given (environment or argument), not a default, a local model's included."""
        return name in self._user_set

    @property
    def resolved_provider(self) -> Literal["openai", "local", "extractive"]:
        """Who answers the LLM stages: RLM_PROVIDER, or what `auto` found (docs/contract.md#providers)."""
        return self._resolved_provider  # type: ignore[return-value]

    @property
    def local_problem(self) -> str | None:
        """Why `auto` could not pick a local model on this machine (None when it did, or was not asked to look)."""
        return self._local_problem

    @property
    def offline(self) -> bool:
        """The LLM stages use the extractive provider: no model answers."""
        return self._resolved_provider == "extractive"

    def json_tool_calls(self, model: str) -> bool:
        """Whether ``model`` is offered tools as JSON actions rather than native tool calls (RLM_TOOL_CALLS)."""
        if self.tool_calls != "auto":
            return self.tool_calls == "json"
        return model in self.local_models

    def plans_with_model(self, model: str) -> bool:
        """Whether the plan stage asks ``model`` (RLM_PLANNER)."""
        if self.planner != "auto":
            return self.planner == "model"
        return model not in self.local_models

    def answering_analysts(self, model: str) -> bool:
        """Whether ``model``'s analysts answer from their batch rather than write entries (RLM_ANALYST_FINDINGS)."""
        if self.analyst_findings != "auto":
            return self.analyst_findings == "answers"
        return model in self.local_models

    @property
    def local_models(self) -> list[str]:
        """The local models the stages name, which the local model server serves (empty unless it answers)."""
        if self._resolved_provider != "local":
            return []
        named = (getattr(self, n) for n in _STAGE_MODELS)
        return sorted({m for m in named if m in MODELS})

    @property
    def resolved_local_llm_dir(self) -> Path:
        if self.local_llm_dir:
            return self.local_llm_dir.expanduser()

        return Path(platformdirs.user_cache_dir("rlm-pipeline", appauthor=False)) / "local-llm"

    @property
    def resolved_check_model(self) -> str:
        return self.check_model or self.primary_model

    @property
    def encoder_cache_dir(self) -> Path:
        return (self.encoder_dir or self.data_dir / "encoders").expanduser()

    @property
    def resolved_encode_threads(self) -> int:
        """RLM_ENCODE_THREADS, else this process's share of the cores it may run on (``share_cores``)."""
        if self.encode_threads:
            return self.encode_threads
        return max(1, usable_cores() // _core_sharers)


def _env_name(loc: tuple) -> str:
    field = str(loc[0]) if loc else "?"
    info = Settings.model_fields.get(field)
    alias = getattr(info, "validation_alias", None) if info else None
    if isinstance(alias, AliasChoices):
        return " or ".join(str(c) for c in alias.choices)
    return f"RLM_{field.upper()}"


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a rule between settings: its message names them
            raise ConfigError(f"invalid settings: {msg}") from None
        raise ConfigError(f"invalid setting {_env_name(err['loc'])}: {msg}") from None


@functools.cache
def get_settings() -> Settings:
    return load_settings()


def reset_settings() -> None:
    """Re-read the environment (tests and benchmarks switch databases and brokers within one process).

    The next use builds a provider and Redis client from the new settings, and ``celery_app.get_app()`` an app
    for a new broker; Celery's own app is never reconfigured (a worker's -Q choice lives in it)."""
    get_settings.cache_clear()
    for drop in _ON_RESET:
        drop()


#: what a process built from its settings and must build again after ``reset_settings`` (``resources`` adds its
#: reset when imported: a process that never imported it built nothing to drop)
_ON_RESET: list[Callable[[], None]] = []


def on_settings_reset(drop: Callable[[], None]) -> None:
    """Call ``drop`` whenever the settings are re-read."""
    if drop not in _ON_RESET:
        _ON_RESET.append(drop)
