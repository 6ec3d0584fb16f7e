"""The OpenAI Batch API (docs/contract.md#llm-batch-api): a JSONL file of chat requests in, one of answers out.

A thin layer over the official ``openai`` client.  Each line's body is built by the same
``OpenAIProvider.params`` an ordinary call uses, and each answered line becomes a ``Completion`` through the
same usage parsing (``usage.py``), so a read answered through a batch is indistinguishable from one answered
directly except for its price (``prices.BATCH_API_DISCOUNT``, applied when ``pipeline/accounting.py`` logs it).
No call here goes through the limiter: uploading a file or polling a batch takes no chat-completion slot.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import openai
from openai.types.chat import ChatCompletion

from ..errors import ConfigError, LLMError
from .openai_provider import OpenAIProvider
from .protocol import Completion, CompletionRequest
from .usage import cached_tokens, to_completion, token_usage

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("rlm.llm")

ENDPOINT = "/v1/chat/completions"
#: the only window the Batch API offers
COMPLETION_WINDOW = "24h"
#: provider statuses after which nothing more happens to a batch
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(frozen=True)
class BatchState:
    id: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    #: {"total", "completed", "failed"} as the provider counts them
    counts: dict[str, int]
    metadata: dict[str, str]
    input_file_id: str
    #: the provider's own errors (a batch that failed validation), one line
    error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass
class Line:
    """One line of an output or error file: a completion, or why there is none."""

    custom_id: str
    completion: Completion | None
    #: None when ``completion`` is set
    error: str | None = None


class BatchClient:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._provider = OpenAIProvider(settings)

    @property
    def where(self) -> str:
        return self.settings.base_url or "api.openai.com"

    def line(self, custom_id: str, request: CompletionRequest) -> dict[str, Any]:
        """The JSONL line of one request, its body exactly what an ordinary call would send."""
        return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": self._provider.params(request)}

    def submit(self, lines: Sequence[dict[str, Any]], *, metadata: dict[str, str]) -> BatchState:
        """Upload the lines as one file and start a batch over it."""
        data = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
        with self._errors("upload a Batch API input file"):
            f = self._client.files.create(file=("rlm-batch.jsonl", io.BytesIO(data)), purpose="batch")
        with self._errors("create a batch"):
            b = self._client.batches.create(
                input_file_id=f.id, endpoint=ENDPOINT, completion_window=COMPLETION_WINDOW, metadata=metadata
            )
        log.info("batch api: %s created with %d requests (input file %s)", b.id, len(lines), f.id)
        return _state(b)

    def retrieve(self, batch_id: str) -> BatchState:
        with self._errors(f"read batch {batch_id}"):
            return _state(self._client.batches.retrieve(batch_id))

    def cancel(self, batch_id: str) -> BatchState:
        """Ask the provider to stop a batch: lines not yet run are not run (nor billed)."""
        with self._errors(f"cancel batch {batch_id}"):
            return _state(self._client.batches.cancel(batch_id))

    def recent(self, limit: int = 100) -> list[BatchState]:
        """The newest batches of the account (to adopt one whose creation was never recorded)."""
        with self._errors("list batches"):
            return [_state(b) for b in self._client.batches.list(limit=limit).data]

    def custom_ids(self, file_id: str) -> list[str]:
        """The custom_ids of an input file."""
        return [json.loads(s).get("custom_id") or "" for s in self._text(file_id).splitlines() if s.strip()]

    def results(self, state: BatchState, model: str) -> dict[str, Line]:
        """Every line of the batch's output and error files, by custom_id (a line missing: never answered)."""
        out: dict[str, Line] = {}
        for file_id in (state.output_file_id, state.error_file_id):
            if not file_id:
                continue
            for raw in self._text(file_id).splitlines():
                if raw.strip():
                    line = parse_line(raw, model, where=self.where)
                    out[line.custom_id] = line
        return out

    def _text(self, file_id: str) -> str:
        with self._errors(f"download file {file_id}"):
            return self._client.files.content(file_id).text

    @property
    def _client(self) -> Any:
        try:
            return self._provider.client
        except ConfigError as exc:  # no key on this worker: nothing can be batched, the reads go the ordinary way
            raise LLMError(f"the Batch API needs an API key: {exc.message}", retryable=False) from exc

    def _errors(self, what: str) -> _Errors:
        return _Errors(what, self.where)


class _Errors:
    """Turns what the client raises into one-line ``LLMError``s, retryable when waiting may help."""

    def __init__(self, what: str, where: str) -> None:
        self.what, self.where = what, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None or isinstance(exc, LLMError):
            return False
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            retryable = status in (408, 409, 429) or status >= 500
            hint = "" if retryable else "; check OPENAI_BASE_URL serves the Batch API (/v1/files, /v1/batches)"
            raise LLMError(
                f"could not {self.what} at {self.where} ({status}): {(exc.message or '').strip()[:300]}{hint}",
                retryable=retryable,
            ) from exc
        if isinstance(exc, openai.APIError):  # connection, timeout, a body we could not read
            raise LLMError(f"could not {self.what} at {self.where}: {exc}", retryable=True) from exc
        return False


def parse_line(raw: str, model: str, *, where: str = "the provider") -> Line:
    """One output- or error-file line → a ``Line``; anything but a usable 200 is an error line."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return Line("", None, f"unreadable line from {where}: {exc.msg}")
    custom_id = str(obj.get("custom_id") or "")
    response = obj.get("response") or {}
    status = response.get("status_code")
    body = response.get("body")
    if obj.get("error") or status != 200 or not isinstance(body, dict):
        err = obj.get("error") or (body.get("error") if isinstance(body, dict) else None) or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
        return Line(custom_id, None, f"{where} answered the batch line {status or 'without a status'}: {message}")
    try:
        parsed = ChatCompletion.model_validate(body)
        usage = token_usage(parsed)
        completion = to_completion(parsed, model, usage)
    except Exception as exc:  # a body we cannot use is a failed line: the read falls back to an ordinary call
        return Line(custom_id, None, f"malformed batch line from {where}: {type(exc).__name__}: {str(exc)[:200]}")
    completion.cached_tokens = cached_tokens(parsed, usage[0])
    return Line(custom_id, completion)


def _state(b: Any) -> BatchState:
    errors = getattr(getattr(b, "errors", None), "data", None) or []
    error = "; ".join(f"{e.code}: {e.message}" for e in errors[:3]) or None
    counts = getattr(b, "request_counts", None)
    return BatchState(
        id=b.id,
        status=b.status,
        output_file_id=b.output_file_id,
        error_file_id=b.error_file_id,
        counts={k: int(getattr(counts, k, 0) or 0) for k in ("total", "completed", "failed")},
        metadata=dict(b.metadata or {}),
        input_file_id=b.input_file_id,
        error=error,
    )
