"""A scripted OpenAI-protocol HTTP server: real sockets, real wire format, no model.

In-process::

    with ScriptedLLM(fixed("hello", latency_ms=50)) as srv:
        settings = Settings(api_key="test", base_url=srv.base_url)
        ...
        assert srv.max_concurrency <= 3

Standalone (for worker-process tests and benchmarks)::

    python -m tests.support.scripted_llm --port 0 --latency-ms 500 --content '[]'

prints ``listening on http://127.0.0.1:PORT/v1`` and serves ``GET /_stats``
(max_concurrency, calls, usage) and ``POST /_reset`` for out-of-process readers.

A responder maps the request JSON to a ``Reply`` (or a plain string); the
helpers below cover fixed latency, failing the first N calls, always failing,
malformed output and rules keyed on the last user message.

The Batch API is served too: ``POST /v1/files`` (multipart, purpose ``batch``), ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``POST /v1/batches``, ``GET /v1/batches`` (newest first), ``GET
/v1/batches/{id}`` and ``POST /v1/batches/{id}/cancel``.  Each line of a batch goes through the same responder
as a chat completion (in a background thread), so scripted replies, errors and usage counts are the same; a
line answered with status >= 400 goes to the error file, as OpenAI does.  Knobs: ``hold_batches()`` keeps
batches ``in_progress`` until ``release_batches()``; ``expire_after = N`` ends the next batches ``expired``
after answering N lines each (the rest never answered).  Batch lines are recorded apart
(``batch_requests``, ``/_stats`` ``batch_calls``) from synchronous calls (``requests``, ``calls``).

A local llama.cpp ``llama-server`` can be played too: ``llama_slots = N`` serves ``GET /slots`` (N slots, as
many ``is_processing`` as chat requests are being answered, so a request whose client gave up still holds its
slot until its reply is written, as llama-server's does while it computes) and ``GET /health``
(``{"status": "ok"}``); ``llama_slots = 0`` serves ``/health`` alone (llama-server started with ``--no-slots``).
Left at None, both are 404 as on OpenAI.  Probes are counted in ``slot_probes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """What the server answers to one chat completion request."""

    content: str | None = "ok"
    #: [{"name": str, "arguments": dict | str, "id": optional str}]
    tool_calls: list[dict[str, Any]] | None = None
    #: None: estimated from the request / content (~4 chars a token)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: sent as usage.prompt_tokens_details.cached_tokens (part of prompt_tokens); None: no details at all
    cached_tokens: int | None = None
    include_usage: bool = True
    status: int = 200
    #: OpenAI's error object: {"message", "type", "code", "param"}
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    #: seconds to wait before answering
    delay: float = 0.0
    #: sent verbatim instead of a JSON completion (a broken gateway)
    raw_body: bytes | None = None
    finish_reason: str | None = None

    @classmethod
    def text(
        cls,
        content: str,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        delay: float = 0.0,
    ) -> Reply:
        return cls(
            content=content,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            delay=delay,
        )

    @classmethod
    def tools(cls, *calls: tuple[str, dict[str, Any] | str], content: str | None = None, **kw: Any) -> Reply:
        return cls(content=content, tool_calls=[{"name": n, "arguments": a} for n, a in calls], **kw)

    @classmethod
    def http_error(
        cls,
        status: int,
        message: str = "scripted error",
        *,
        type: str = "server_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        delay: float = 0.0,
    ) -> Reply:
        return cls(
            content=None,
            status=status,
            error={"message": message, "type": type, "code": code, "param": param},
            headers=dict(headers or {}),
            delay=delay,
        )

    @classmethod
    def malformed_body(cls, body: bytes = b"<html>502 Bad Gateway</html>") -> Reply:
        return cls(content=None, raw_body=body)


Responder = Callable[[dict[str, Any]], "Reply | str"]


# --- ready-made responders -------------------------------------------------


def fixed(
    content: str = "ok",
    *,
    latency_ms: float = 0,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    cached_tokens: int | None = None,
) -> Responder:
    return lambda _req: Reply.text(
        content,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        delay=latency_ms / 1000,
    )


def with_latency(responder: Responder, latency_ms: float) -> Responder:
    def respond(req: dict[str, Any]) -> Reply:
        reply = _as_reply(responder(req))
        reply.delay += latency_ms / 1000
        return reply

    return respond


def fail_first(
    n: int,
    then: Responder | None = None,
    *,
    status: int = 429,
    retry_after: float | None = 1,
    message: str = "Rate limit reached",
    code: str | None = "rate_limit_exceeded",
) -> Responder:
    """The first ``n`` calls fail (429 with Retry-After by default), later ones go to ``then``."""
    then = then or fixed()
    counter = itertools.count()
    lock = threading.Lock()
    headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else {}
    kind = "requests" if status == 429 else "server_error"

    def respond(req: dict[str, Any]) -> Reply | str:
        with lock:
            i = next(counter)
        if i < n:
            return Reply.http_error(status, message, type=kind, code=code, headers=headers)
        return then(req)

    return respond


def cut_json_array(entries: Sequence[Any], *, keep: int) -> str:
    """A JSON array cut off mid-way: ``keep`` entries complete, then half of the next one (if any), no closing
    bracket — what a reply stopped at ``max_tokens`` (or a proxy dropping the tail) looks like."""
    head = "[" + ", ".join(json.dumps(e) for e in entries[:keep])
    if len(entries) <= keep:
        return head
    nxt = json.dumps(entries[keep])
    return head + ", " + nxt[: len(nxt) // 2]


def cut_replies(responder: Responder, *, fraction: float = 0.5, finish_reason: str | None = "length") -> Responder:
    """Every reply's text cut to ``fraction`` of its length, with ``finish_reason`` (``length``: the model hit
    ``max_tokens``; ``None`` keeps ``stop``, as a proxy that drops the tail would)."""

    def respond(req: dict[str, Any]) -> Reply:
        reply = _as_reply(responder(req))
        if reply.content:
            reply.content = reply.content[: int(len(reply.content) * fraction)]
            reply.finish_reason = finish_reason
        return reply

    return respond


def always_error(status: int = 500, message: str = "The server had an error", **kw: Any) -> Responder:
    return lambda _req: Reply.http_error(status, message, **kw)


def quota_exhausted() -> Responder:
    return always_error(
        429,
        "You exceeded your current quota, please check your plan and billing details.",
        type="insufficient_quota",
        code="insufficient_quota",
    )


def malformed_json(content: str = '{"chunk_id": 1, "relevance": "hi') -> Responder:
    """A 200 whose message content is not valid JSON (the model's fault, not the HTTP layer's)."""
    return fixed(content)


def rules(table: Sequence[tuple[str, Reply | str | Responder]], default: Reply | str | Responder = "ok") -> Responder:
    """First rule whose substring occurs in the last user message wins."""

    def pick(value: Reply | str | Responder, req: dict[str, Any]) -> Reply | str:
        if callable(value):
            return value(req)
        return _copy(value) if isinstance(value, Reply) else value

    def respond(req: dict[str, Any]) -> Reply | str:
        text = last_user_message(req)
        for needle, value in table:
            if needle in text:
                return pick(value, req)
        return pick(default, req)

    return respond


def last_user_message(req: dict[str, Any]) -> str:
    for msg in reversed(req.get("messages") or []):
        if msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):  # content parts
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""


def _copy(reply: Reply) -> Reply:
    from dataclasses import replace

    return replace(reply, headers=dict(reply.headers))


def _as_reply(value: Reply | str) -> Reply:
    return Reply.text(value) if isinstance(value, str) else value


# --- the server ------------------------------------------------------------


@dataclass
class RecordedRequest:
    path: str
    body: dict[str, Any]
    arrived: float
    #: lower-cased names
    headers: dict[str, str]


#: OpenAI's automatic prompt caching: a prefix shared with an earlier prompt counts once it is this long ...
CACHE_MIN_TOKENS = 1024
#: ... in steps of this many tokens
CACHE_STEP_TOKENS = 128


class _PromptCache:
    """Prompt prefixes seen per model, to report ``cached_tokens`` as OpenAI's automatic caching would: the prefix a
    prompt shares with an earlier one of the same model, cut to whole steps of 128 tokens, once it reaches 1,024.

    A prompt is its ``messages`` as JSON, counted at ~4 characters a token like the rest of the usage, so a step
    is 512 characters: each prompt leaves the digest of every whole-step prefix, and a later prompt's cached part
    is its longest prefix found there.  A prompt counts as seen as soon as it is answered (the provider's cache
    also needs the first request processed before a second one hits; near-simultaneous ones are not told apart)."""

    STEP_CHARS = CACHE_STEP_TOKENS * 4

    def __init__(self) -> None:
        self.seen: dict[str, set[bytes]] = {}

    def cached_tokens(self, model: str, prompt: str) -> int:
        import hashlib

        known = self.seen.setdefault(model, set())
        h = hashlib.sha256()
        steps, hit = len(prompt) // self.STEP_CHARS, 0
        for k in range(steps):
            h.update(prompt[k * self.STEP_CHARS : (k + 1) * self.STEP_CHARS].encode())
            digest = h.copy().digest()
            if hit == k and digest in known:  # prefixes only: the first miss ends the cached part
                hit = k + 1
            known.add(digest)
        tokens = hit * CACHE_STEP_TOKENS
        return tokens if tokens >= CACHE_MIN_TOKENS else 0


class _Stats:
    """Everything a test asserts on, behind one lock (handlers run on many threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: report prompt caching (``ScriptedLLM(prompt_cache=True)``); off, no usage carries cache details
        self.prompt_cache = False
        self.reset()

    def reset(self) -> None:
        self.requests: list[RecordedRequest] = []
        #: lines of Batch API files, as answered (path "/v1/batches/<id>", the line's body)
        self.batch_requests: list[RecordedRequest] = []
        #: GET /slots and /health answered (``llama_slots`` set)
        self.slot_probes = 0
        self.in_flight = 0
        self.max_concurrency = 0
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        self.ids = itertools.count(1)
        self.cache = _PromptCache()

    def cached_tokens(self, reply: Reply, req: dict[str, Any]) -> Reply:
        """The reply with ``cached_tokens`` from the prompt cache, when it is on and the script set none."""
        if not self.prompt_cache or reply.cached_tokens is not None or reply.prompt_tokens is not None:
            return reply
        prompt = json.dumps(req.get("messages"))
        with self.lock:
            cached = self.cache.cached_tokens(str(req.get("model")), prompt)
        return dataclasses.replace(reply, cached_tokens=min(cached, _estimate(prompt)))

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "calls": len(self.requests),
                "batch_calls": len(self.batch_requests),
                "max_concurrency": self.max_concurrency,
                "in_flight": self.in_flight,
                "usage": dict(self.usage),
            }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.server.model_name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "scripted",
                        }
                    ],
                },
            )
        elif path.startswith("/v1/files/") or path.startswith("/v1/batches"):
            self._batch_api_get(path)
        elif path in ("/slots", "/health") and self.server.llama_slots is not None:
            self._llama(path)
        elif path == "/_stats":
            self._json(200, self.server.stats.snapshot())
        elif path == "/_requests":
            with self.server.stats.lock:
                rows = [{"path": r.path, "body": r.body, "arrived": r.arrived} for r in self.server.stats.requests]
            self._json(200, {"requests": rows})
        else:
            self._json(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}})

    def _llama(self, path: str) -> None:
        """llama-server's ``/health`` and ``/slots`` (``--no-slots``: a 501 error, as llama-server answers)."""
        stats, slots = self.server.stats, self.server.llama_slots or 0
        with stats.lock:
            stats.slot_probes += 1
            busy = stats.in_flight
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif not slots:
            self._json(501, {"error": {"code": 501, "message": "This server does not support slots endpoint."}})
        else:
            self._json(200, [{"id": i, "is_processing": i < busy} for i in range(slots)])

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path == "/_reset":
            with self.server.stats.lock:
                self.server.stats.reset()
            self._json(200, {"ok": True})
            return
        if path == "/v1/files":
            self._upload(raw)
            return
        if path.startswith("/v1/batches"):
            self._batch_api_post(path, raw)
            return
        if path != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}})
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self._json(400, {"error": {"message": "request body is not JSON", "type": "invalid_request_error"}})
            return
        self._chat(body)

    def _chat(self, body: dict[str, Any]) -> None:
        stats = self.server.stats
        with stats.lock:
            stats.requests.append(
                RecordedRequest(self.path, body, time.time(), {k.lower(): v for k, v in self.headers.items()})
            )
            stats.in_flight += 1
            stats.max_concurrency = max(stats.max_concurrency, stats.in_flight)
            call_id = next(stats.ids)
        usage: dict[str, int] | None = None
        try:
            reply = stats.cached_tokens(_as_reply(self.server.responder(body)), body)
            if reply.delay > 0:
                time.sleep(reply.delay)
            status, payload, usage = _render(reply, body, call_id)
        except Exception as exc:  # a broken responder is a 500, not a dead server thread
            reply = Reply()
            status, payload = (
                500,
                {"error": {"message": f"responder failed: {exc!r}", "type": "server_error"}},
            )
        finally:
            # Leave the in-flight count BEFORE answering: a client that got its answer and
            # released its limiter slot must never still be counted here.
            with stats.lock:
                stats.in_flight -= 1
                for k in stats.usage if usage else ():
                    stats.usage[k] += usage[k]
        if reply.raw_body is not None:
            self._send(status, reply.raw_body, "application/json", reply.headers)
        else:
            self._json(status, payload, reply.headers)

    # --- Batch API -----------------------------------------------------------

    def _not_found(self, what: str) -> None:
        self._json(404, {"error": {"message": f"no such {what}", "type": "invalid_request_error", "code": None}})

    def _upload(self, raw: bytes) -> None:
        ctype = self.headers.get("Content-Type") or ""
        msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
        fields: dict[str, tuple[str | None, bytes]] = {}
        for part in msg.iter_parts() if msg.is_multipart() else ():
            name = part.get_param("name", header="content-disposition")
            if name:
                fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
        if "file" not in fields:
            self._json(
                400, {"error": {"message": "a multipart field 'file' is required", "type": "invalid_request_error"}}
            )
            return
        purpose = fields.get("purpose", (None, b"batch"))[1].decode()
        filename, data = fields["file"]
        self._json(200, self.server.batch_api.add_file(data, purpose=purpose, filename=filename or "upload.jsonl"))

    def _batch_api_get(self, path: str) -> None:
        api = self.server.batch_api
        parts = path.strip("/").split("/")  # v1, files|batches, id, [content]
        with api.lock:
            if parts[1] == "files" and len(parts) == 4 and parts[3] == "content":
                f = api.files.get(parts[2])
                if f is None:
                    return self._not_found("file")
                data = f["data"]
            elif parts[1] == "files" and len(parts) == 3:
                f = api.files.get(parts[2])
                if f is None:
                    return self._not_found("file")
                return self._json(200, f["object"])
            elif parts[1] == "batches" and len(parts) == 2:
                rows = [dict(b) for b in reversed(api.batches.values())]
                return self._json(200, {"object": "list", "data": rows, "has_more": False})
            elif parts[1] == "batches" and len(parts) == 3:
                b = api.batches.get(parts[2])
                if b is None:
                    return self._not_found("batch")
                return self._json(200, dict(b))
            else:
                return self._not_found("route")
        self._send(200, data, "application/octet-stream", {})

    def _batch_api_post(self, path: str, raw: bytes) -> None:
        api = self.server.batch_api
        parts = path.strip("/").split("/")
        if len(parts) == 4 and parts[3] == "cancel":
            with api.lock:
                b = api.batches.get(parts[2])
                if b is None:
                    return self._not_found("batch")
                if b["status"] in ("validating", "in_progress"):
                    b["status"], b["cancelling_at"] = "cancelling", int(time.time())
                out = dict(b)
            api.gate.set()  # a held batch notices its cancellation at once
            return self._json(200, out)
        if len(parts) != 2:
            return self._not_found("route")
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            return self._json(400, {"error": {"message": "request body is not JSON", "type": "invalid_request_error"}})
        with api.lock:
            f = api.files.get(body.get("input_file_id") or "")
        if f is None:
            return self._json(
                400, {"error": {"message": "input_file_id: no such file", "type": "invalid_request_error"}}
            )
        self._json(200, api.create_batch(self.server, body))

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json", headers or {})

    def _send(self, status: int, data: bytes, ctype: str, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout): exactly what timeout tests provoke


def _estimate(text: str) -> int:
    return max(1, len(text) // 4)


def _render(reply: Reply, req: dict[str, Any], call_id: int) -> tuple[int, dict[str, Any], dict[str, int] | None]:
    if reply.raw_body is not None:
        return reply.status, {}, None
    if reply.status >= 400:
        return (
            reply.status,
            {"error": reply.error or {"message": "scripted error", "type": "server_error"}},
            None,
        )
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    out_text = reply.content or ""
    if reply.tool_calls:
        message["tool_calls"] = []
        for i, tc in enumerate(reply.tool_calls):
            args = tc["arguments"] if isinstance(tc["arguments"], str) else json.dumps(tc["arguments"])
            message["tool_calls"].append(
                {
                    "id": tc.get("id") or f"call_{call_id}_{i}",
                    "type": "function",
                    "function": {"name": tc["name"], "arguments": args},
                }
            )
            out_text += tc["name"] + args
    prompt = reply.prompt_tokens if reply.prompt_tokens is not None else _estimate(json.dumps(req.get("messages")))
    completion = reply.completion_tokens if reply.completion_tokens is not None else _estimate(out_text)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    # what /_stats sums: flat counts, cached ones included even when the reply sends no details
    counted = {**usage, "cached_tokens": reply.cached_tokens or 0}
    if reply.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
    payload: dict[str, Any] = {
        "id": f"chatcmpl-scripted-{call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.get("model") or "scripted",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop"),
            }
        ],
    }
    if reply.include_usage:
        payload["usage"] = usage
    return 200, payload, counted if reply.include_usage else None


class _BatchAPI:
    """Files and batches held in memory; each batch runs in its own thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        #: cleared: batches stay in_progress (hold_batches); set: they run
        self.gate = threading.Event()
        self.gate.set()
        #: not None: a batch answers this many lines, then ends expired
        self.expire_after: int | None = None

    def add_file(self, data: bytes, *, purpose: str, filename: str) -> dict[str, Any]:
        fid = f"file-{uuid.uuid4().hex[:24]}"
        obj = {
            "id": fid,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        with self.lock:
            self.files[fid] = {"object": obj, "data": data}
        return obj

    def create_batch(self, server: _Server, body: dict[str, Any]) -> dict[str, Any]:
        bid = f"batch_{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        batch = {
            "id": bid,
            "object": "batch",
            "endpoint": body.get("endpoint") or "/v1/chat/completions",
            "errors": None,
            "input_file_id": body["input_file_id"],
            "completion_window": body.get("completion_window") or "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + 86400,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        with self.lock:
            self.batches[bid] = batch
            expire_after = self.expire_after
        threading.Thread(target=self._run, args=(server, bid, expire_after), name=f"batch-{bid}", daemon=True).start()
        return dict(batch)

    def _run(self, server: _Server, bid: str, expire_after: int | None) -> None:
        with self.lock:
            batch = self.batches[bid]
            text = self.files[batch["input_file_id"]]["data"].decode()
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        with self.lock:
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
            batch["request_counts"]["total"] = len(lines)
        out: list[dict[str, Any]] = []
        err: list[dict[str, Any]] = []
        ended = "completed"
        for n, line in enumerate(lines):
            while not self.gate.wait(0.05):
                pass
            with self.lock:
                if batch["status"] == "cancelling":
                    ended = "cancelled"
            if ended == "cancelled":
                break
            if expire_after is not None and n >= expire_after:
                ended = "expired"
                break
            status, payload = self._answer(server, bid, line)
            row = {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": line.get("custom_id"),
                "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": payload},
                "error": None,
            }
            (out if status < 400 else err).append(row)
            with self.lock:
                batch["request_counts"]["completed" if status < 400 else "failed"] += 1
        while not self.gate.wait(0.05):  # held: stays in_progress even once every line is answered
            pass
        with self.lock:
            if batch["status"] == "cancelling":
                ended = "cancelled"
            batch["finalizing_at"] = int(time.time())
        for key, rows in (("output_file_id", out), ("error_file_id", err)):
            if rows:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                batch_file = self.add_file(data, purpose="batch_output", filename=f"{bid}_{key}.jsonl")
                with self.lock:
                    batch[key] = batch_file["id"]
        with self.lock:
            batch["status"] = ended
            batch[{"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[ended]] = int(
                time.time()
            )

    @staticmethod
    def _answer(server: _Server, bid: str, line: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        stats = server.stats
        body = line.get("body") or {}
        with stats.lock:
            stats.batch_requests.append(RecordedRequest(f"/v1/batches/{bid}", body, time.time(), {}))
            call_id = next(stats.ids)
        usage: dict[str, int] | None = None
        try:
            reply = stats.cached_tokens(_as_reply(server.responder(body)), body)
            if reply.delay > 0:
                time.sleep(reply.delay)
            if reply.raw_body is not None:  # no gateway sits inside a batch: a broken body is the provider's 500
                return 500, {"error": {"message": "malformed upstream body", "type": "server_error"}}
            status, payload, usage = _render(reply, body, call_id)
        except Exception as exc:
            return 500, {"error": {"message": f"responder failed: {exc!r}", "type": "server_error"}}
        with stats.lock:
            for k in stats.usage if usage else ():
                stats.usage[k] += usage[k]
        return status, payload


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 makes a burst of parallel clients wait on SYN retries (~1 s each).
    request_queue_size = 256

    def __init__(self, addr: tuple[str, int], responder: Responder, model_name: str) -> None:
        super().__init__(addr, _Handler)
        self.responder = responder
        self.model_name = model_name
        self.stats = _Stats()
        self.batch_api = _BatchAPI()
        #: None: no llama-server endpoints; N: ``/slots`` with N slots and ``/health`` (0: ``/health`` only)
        self.llama_slots: int | None = None


class ScriptedLLM:
    """The server in a background thread; ``base_url`` ends in ``/v1`` like OpenAI's."""

    def __init__(
        self,
        responder: Responder | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "scripted-model",
        prompt_cache: bool = False,
    ) -> None:
        """``prompt_cache``: report ``usage.prompt_tokens_details.cached_tokens`` like OpenAI's automatic prompt
        caching (``_PromptCache``) for replies that set no token counts of their own; ``reset`` forgets it."""
        self._server = _Server((host, port), responder or fixed(), model_name)
        self._server.stats.prompt_cache = prompt_cache
        self._thread: threading.Thread | None = None

    @property
    def responder(self) -> Responder:
        return self._server.responder

    @responder.setter
    def responder(self, value: Responder) -> None:
        self._server.responder = value

    @property
    def prompt_cache(self) -> bool:
        return self._server.stats.prompt_cache

    @prompt_cache.setter
    def prompt_cache(self, on: bool) -> None:
        self._server.stats.prompt_cache = on

    @property
    def llama_slots(self) -> int | None:
        return self._server.llama_slots

    @llama_slots.setter
    def llama_slots(self, n: int | None) -> None:
        self._server.llama_slots = n

    @property
    def slot_probes(self) -> int:
        with self._server.stats.lock:
            return self._server.stats.slot_probes

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}/v1"

    def start(self) -> ScriptedLLM:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="scripted-llm",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ScriptedLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what tests read ---------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._server.stats.lock:
            return list(self._server.stats.requests)

    @property
    def calls(self) -> int:
        return len(self.requests)

    @property
    def max_concurrency(self) -> int:
        return self._server.stats.snapshot()["max_concurrency"]

    @property
    def usage(self) -> dict[str, int]:
        return self._server.stats.snapshot()["usage"]

    def stats(self) -> dict[str, Any]:
        return self._server.stats.snapshot()

    def reset(self) -> None:
        with self._server.stats.lock:
            self._server.stats.reset()

    # --- Batch API knobs -----------------------------------------------------

    @property
    def batch_requests(self) -> list[RecordedRequest]:
        with self._server.stats.lock:
            return list(self._server.stats.batch_requests)

    @property
    def batches(self) -> list[dict[str, Any]]:
        """Every batch created, oldest first, as GET /v1/batches/{id} shows it."""
        api = self._server.batch_api
        with api.lock:
            return [json.loads(json.dumps(b)) for b in api.batches.values()]

    def hold_batches(self) -> None:
        """Batches stay ``in_progress`` (lines wait) until ``release_batches``."""
        self._server.batch_api.gate.clear()

    def release_batches(self) -> None:
        self._server.batch_api.gate.set()

    @property
    def expire_after(self) -> int | None:
        return self._server.batch_api.expire_after

    @expire_after.setter
    def expire_after(self, value: int | None) -> None:
        """Batches created from now answer ``value`` lines, then end ``expired`` (None: they complete)."""
        self._server.batch_api.expire_after = value


# --- standalone process ----------------------------------------------------


def _load_responder(spec: str) -> Responder:
    """``module:attr``: a responder, or a zero-argument factory returning one."""
    module, _, attr = spec.partition(":")
    obj = getattr(importlib.import_module(module), attr or "responder")
    try:
        made = obj()
    except TypeError:
        return obj
    return made if callable(made) else obj


def build_responder(args: argparse.Namespace) -> Responder:
    if args.responder:
        base = _load_responder(args.responder)
    elif args.always_status:
        base = always_error(args.always_status)
    elif args.malformed:
        base = malformed_json()
    else:
        base = fixed(
            args.content,
            prompt_tokens=args.prompt_tokens,
            completion_tokens=args.completion_tokens,
            cached_tokens=args.cached_tokens,
        )
    if args.fail_first:
        base = fail_first(args.fail_first, base, status=args.fail_status, retry_after=args.retry_after)
    return with_latency(base, args.latency_ms) if args.latency_ms else base


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.support.scripted_llm", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    p.add_argument("--latency-ms", type=float, default=0, help="delay before every answer")
    p.add_argument("--content", default="ok", help="the assistant's reply text")
    p.add_argument("--prompt-tokens", type=int, default=None)
    p.add_argument("--completion-tokens", type=int, default=None)
    p.add_argument("--cached-tokens", type=int, default=None, help="usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--fail-first", type=int, default=0, help="fail the first N calls")
    p.add_argument("--fail-status", type=int, default=429)
    p.add_argument("--retry-after", type=float, default=1, help="Retry-After seconds on --fail-first errors")
    p.add_argument("--always-status", type=int, default=0, help="answer every call with this HTTP error")
    p.add_argument("--malformed", action="store_true", help="reply with content that is not valid JSON")
    p.add_argument("--responder", default=None, help="module:callable responder (or zero-arg factory)")
    args = p.parse_args(argv)
    srv = ScriptedLLM(build_responder(args), host=args.host, port=args.port)
    print(f"listening on {srv.base_url}", flush=True)
    try:
        srv._server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv._server.server_close()


if __name__ == "__main__":
    main()
