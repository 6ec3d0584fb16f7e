"""The one interface every LLM provider implements.

Stages build chat messages, call ``complete()``, and parse the text.  The
offline extractive provider answers by rules from the same request (its
``stage_input``, the values the messages were rendered from), so the pipeline
has a single code path whether or not a model is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .stage_input import StageInput

#: "check": the completeness check of thinking mode; "direct": one answer straight from chunks (instant/direct);
#: "code": code mode's program writer; "subcall": a sub-model call a program made
Role = Literal["plan", "analyst", "synthesizer", "check", "direct", "code", "subcall"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    #: raw JSON text as the model sent it: untrusted, parsed and capped by the tool runner
    arguments: str


@dataclass(frozen=True)
class CompletionRequest:
    role: Role
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float = 0.0
    json_output: bool = False
    #: the reply's JSON Schema as ``response_format.json_schema`` wants it (``{"name", "schema", "strict"}``,
    #: built by ``llm/structured.py``); sent when RLM_STRUCTURED_OUTPUTS and the server allow, with ``json_output``
    json_schema: dict[str, Any] | None = None
    #: OpenAI-format tool specs; only the synthesizer passes them
    tools: list[dict[str, Any]] | None = None
    #: whose job the call serves: the global in-flight limit is shared between active tenants
    #: (docs/contract.md#fair-share); None counts as the default tenant
    tenant: str | None = None
    #: what the stage put in the prompt, as data (``llm/stage_input.py``): the offline provider answers from it;
    #: never sent to a server nor logged as prompt text
    stage_input: StageInput | None = None


@dataclass(frozen=True)
class Attempt:
    """One HTTP attempt behind a call, as the provider saw it: how it ended and what it was billed.

    Providers report the attempts that failed (``Completion.failed_attempts``, ``LLMError.attempts``); the
    accounting (``pipeline/accounting.py``) makes each attempt one ``llm_calls`` row, so a job's tokens are the
    exact sum of what was billed, retries included (docs/contract.md#llm-accounting)."""

    status: Literal["ok", "error", "retried"] = "ok"
    tokens_in: int = 0
    tokens_out: int = 0
    #: input tokens served from the provider's prompt cache (part of ``tokens_in``, priced apart)
    cached_tokens: int = 0
    #: None when nothing was timed (an error raised before any attempt): the caller says what it waited
    latency_ms: int | None = None
    error: str | None = None
    #: the model that answered, when the server named it (None: the one asked for)
    model: str | None = None
    #: whether the stage could use the reply as it came (docs/contract.md#structured-outputs); None: not parsed
    parse_ok: bool | None = None


@dataclass
class Completion:
    text: str
    model: str
    tokens_in: int = 0
    tokens_out: int = 0
    #: input tokens the provider served from its prompt cache (part of ``tokens_in``, priced apart)
    cached_tokens: int = 0
    latency_ms: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: the assistant message to append to the conversation when tools were called
    raw_message: dict[str, Any] | None = None
    #: attempts that failed before this one succeeded
    failed_attempts: list[Attempt] = field(default_factory=list)
    #: why the model stopped, as the server said ("stop", "length", "tool_calls"…); "length" means the reply was
    #: cut at max_tokens, so whatever it holds may be incomplete
    finish_reason: str | None = None
    #: set by ``pipeline/calls.call_llm`` when the stage passed a parser: whether the reply parsed at the first
    #: try (None: nothing was parsed), the parsed value, and the ``ParseError`` when it did not parse
    parse_ok: bool | None = None
    parsed: Any = None
    parse_error: Exception | None = None


class LLMProvider(Protocol):
    #: "openai" or "extractive": printed in every QueryResult
    name: str
    #: answers in this process with no endpoint behind it: nothing to rate-limit or share between workers
    local: bool

    def complete(self, request: CompletionRequest, *, before_retry: Callable[[], None] | None = None) -> Completion:
        """One call.  Raises ``rlm_workers.errors.LLMError`` (with ``retryable``) on failure.

        ``before_retry`` runs before every HTTP attempt after the first (the caller reserves it on the tree's
        budget: a retry is a call); whatever it raises ends the call, and a ``BudgetExhausted`` it raises comes
        back with ``attempts`` set to the attempts made so far.  A provider that never retries ignores it."""
        ...
