"""Every error a user can see, with whether retrying can help.

Errors carry ``retryable`` so Celery tasks and the CLI decide the same way, and
a message written for the person who has to fix the problem.  ``exit_code``
follows docs/contract.md#exit-codes: 2 for bad input, 3 when no chunk survived the search, 1 for
everything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm.protocol import Attempt


class RLMError(Exception):
    """Base class: a message a user can act on."""

    retryable: bool = False
    exit_code: int = 1
    #: short machine-readable name used in job records and API error bodies
    type: str = "error"

    def __init__(self, message: str, *, retryable: bool | None = None, api_message: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: the same message for an HTTP client: a hint that names a CLI command says the HTTP way instead
        self.api_message = api_message or message
        if retryable is not None:
            self.retryable = retryable

    def to_dict(self) -> dict[str, str]:
        err = {"type": self.type, "message": self.message}
        if self.api_message != self.message:  # kept on the record so the API can show it later (a job's error)
            err["api_message"] = self.api_message
        return err


class InvalidInput(RLMError):
    """The user gave something we cannot accept; nothing was written."""

    exit_code = 2
    type = "invalid_input"


class IdempotencyKeyReused(InvalidInput):
    """An Idempotency-Key already used for a different request (HTTP 422, as the IETF draft says)."""

    type = "idempotency_key_reused"


class ConfigError(InvalidInput):
    """A setting is missing or malformed."""

    type = "config_error"


class BufferNotFound(InvalidInput):
    type = "buffer_not_found"

    def __init__(self, name: str, *, suggestion: str | None = None) -> None:
        # a near name of the tenant's own (store.buffers.buffer_not_found finds it) beats a listing
        hint = f"did you mean {suggestion!r}? " if suggestion else ""
        super().__init__(
            f"no buffer named {name!r}; {hint}list buffers with `rlm buffers`",
            api_message=f"no buffer named {name!r}; {hint}list buffers with GET /v1/buffers",
        )
        self.name = name
        self.suggestion = suggestion


class NoChunks(RLMError):
    """Search returned nothing to analyse."""

    exit_code = 3
    type = "no_chunks"

    #: ``{mode}`` is the flag of the command that failed: `rlm query` and `rlm batch submit` say --search-mode,
    #: `rlm search` --mode (a hint must name a flag the command takes)
    HINTS = (
        "lower --threshold (e.g. 0.1)",
        "switch {mode} (bm25 for exact identifiers, semantic for paraphrases)",
        "check the buffer holds what you expect: `rlm buffer show NAME`",
    )

    API_HINTS = (
        "lower options.threshold (e.g. 0.1)",
        "switch options.search_mode (bm25 for exact identifiers, semantic for paraphrases)",
        "check the buffer holds what you expect: GET /v1/buffers/NAME",
    )

    def __init__(self, detail: str = "no chunks matched the query", *, mode_flag: str = "--search-mode") -> None:
        hint, api_hint = "; ".join(self.HINTS).format(mode=mode_flag), "; ".join(self.API_HINTS)
        super().__init__(f"{detail}. Try: {hint}", api_message=f"{detail}. Try: {api_hint}")


class ServiceUnavailable(RLMError):
    """A database, broker or model endpoint could not be reached."""

    retryable = True
    type = "service_unavailable"


class MissingExtension(ServiceUnavailable):
    """The configured PostgreSQL lacks pgvector."""

    retryable = False
    type = "missing_extension"


class LLMError(RLMError):
    """An LLM call failed; ``retryable`` tells whether another try may succeed."""

    type = "llm_error"

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message, retryable=retryable)
        #: every HTTP attempt behind this error, final one included; [] if none was made
        self.attempts: list[Attempt] = []


class ModelServerError(LLMError):
    """The local model server could not be set up or started (docs/contract.md#local-llm).  Never retried: a server
    that died at start dies again, and a retry loop would only hide its log."""

    type = "model_server"

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class RateLimited(LLMError):
    """429 from the provider; ``retry_after`` is the server's hint in seconds."""

    retryable = True
    type = "rate_limited"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, retryable=True)
        self.retry_after = retry_after


class ContextExceeded(LLMError):
    """The server refused a request longer than the model's context: the same request will never fit."""

    retryable = False
    type = "context_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class QuotaExhausted(LLMError):
    """``insufficient_quota``: waiting will not help."""

    retryable = False
    type = "insufficient_quota"


class LimiterBusy(LLMError):
    """No slot of the shared LLM limiter came free within the bounded wait (docs/contract.md#limiter):
    the call was never sent, and another try later may get one."""

    retryable = True
    type = "rate_limiter_busy"


class ParseError(LLMError):
    """The model's reply was not the JSON we asked for."""

    type = "parse_error"


class BudgetExhausted(RLMError):
    """A job tree's budget (--max-llm-calls, --max-tokens, --max-cost, --deadline) is spent: no new LLM call
    starts; the stage finishes with what it has (docs/contract.md#budgets).  ``reason`` names the limit."""

    type = "budget"

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"budget exhausted ({reason}){': ' + detail if detail else ''}; no new LLM call was started")
        self.detail = detail
        #: HTTP attempts the call had already sent when its retry was refused (as LLMError.attempts);
        #: [] when the refusal came before the first one, so nothing was sent
        self.attempts: list[Attempt] = []

    def after_attempts(self, attempts: list[Attempt]) -> None:
        """The refusal came at a retry: ``attempts`` were sent (and failed) first, so the call did run."""
        self.attempts = attempts
        tail = f": {self.detail}" if self.detail else ""
        self.message = self.api_message = (
            f"budget exhausted ({self.reason}){tail}; the call failed after {len(attempts)} HTTP attempt(s) "
            f"and its retry was not sent"
        )
        self.args = (self.message,)

    def to_dict(self) -> dict[str, str]:
        # "sent": the batch's call ran and failed (a failure); without it the batch never ran (not run)
        sent = {"sent": str(len(self.attempts))} if self.attempts else {}
        return {**super().to_dict(), "reason": self.reason, **sent}


class JobCancelled(RLMError):
    type = "cancelled"


class TooManyJobs(RLMError):
    """A tenant already has its cap of jobs in flight: retry once some have ended (HTTP 429)."""

    retryable = True
    type = "too_many_jobs"


class SessionBusy(InvalidInput):
    """A chat turn was posted while the session's previous turn is still running (HTTP 409)."""

    type = "session_busy"


def error_record(exc: BaseException, prefix: str | None = None) -> dict[str, str]:
    """How an error is stored on a job, batch or upload: ``{"type", "message"}``, never a traceback."""
    if isinstance(exc, RLMError):
        err = exc.to_dict()
    else:
        err = {"type": type(exc).__name__, "message": str(exc)[:2000] or type(exc).__name__}
    if prefix:
        err["message"] = f"{prefix}: {err['message']}"
        if "api_message" in err:
            err["api_message"] = f"{prefix}: {err['api_message']}"
    return err
