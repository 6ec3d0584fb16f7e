"""OpenAIProvider against the scripted server: real HTTP, the real openai client."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from rlm_workers.config import Settings
from rlm_workers.errors import BudgetExhausted, LLMError, QuotaExhausted, RateLimited
from rlm_workers.llm.openai_provider import OpenAIProvider, forget_refusals, parse_retry_after
from rlm_workers.llm.protocol import CompletionRequest
from tests.support.scripted_llm import (
    Reply,
    ScriptedLLM,
    always_error,
    fail_first,
    fixed,
    quota_exhausted,
    rules,
)

MODEL = "gpt-test"


def _settings(srv: ScriptedLLM, **kw: object) -> Settings:
    return Settings(api_key="sk-test", base_url=srv.base_url, **{"llm_timeout": 5.0, "llm_retries": 2, **kw})


def _request(text: str = "hello", **kw: object) -> CompletionRequest:
    return CompletionRequest(
        role="analyst", model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=64, **kw
    )


@pytest.fixture
def srv():
    with ScriptedLLM() as s:
        yield s


@pytest.fixture(autouse=True)
def no_learned_refusals():
    # refusals are remembered per (base URL, model) for the process: a new server may reuse an old one's port
    forget_refusals()
    yield
    forget_refusals()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    # Keeps unhinted retries quick; Retry-After (what the 429 test checks) is not affected.
    monkeypatch.setattr(OpenAIProvider, "BACKOFF_BASE", 0.05)


def test_success_maps_text_usage_and_parameters(srv):
    srv.responder = fixed("the answer", prompt_tokens=123, completion_tokens=45, latency_ms=20)
    c = OpenAIProvider(_settings(srv)).complete(_request(temperature=0.0))
    assert (c.text, c.tokens_in, c.tokens_out, c.model) == ("the answer", 123, 45, MODEL)
    # the server held its answer 20 ms: a latency that is not measured (0) is caught
    assert c.failed_attempts == [] and c.tool_calls == [] and c.latency_ms >= 20
    assert c.raw_message == {"role": "assistant", "content": "the answer"}
    body = srv.requests[0].body
    assert body["max_completion_tokens"] == 64 and "max_tokens" not in body
    assert body["temperature"] == 0.0 and "response_format" not in body
    assert srv.requests[0].headers.get("authorization") == "Bearer sk-test"
    assert srv.usage == {"prompt_tokens": 123, "completion_tokens": 45, "total_tokens": 168, "cached_tokens": 0}
    assert c.cached_tokens == 0  # no prompt_tokens_details in the reply


def _body(choices: list, usage: dict) -> bytes:
    """A chat completion as a gateway might send it, usage details verbatim."""
    return json.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": choices,
            "usage": usage,
        }
    ).encode()


def _choice(text: str) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}


def test_cached_tokens_are_read_from_prompt_tokens_details(srv):
    srv.responder = fixed("hit", prompt_tokens=1000, completion_tokens=10, cached_tokens=768)
    c = OpenAIProvider(_settings(srv)).complete(_request())
    assert (c.tokens_in, c.cached_tokens, c.tokens_out) == (1000, 768, 10)
    assert srv.usage["cached_tokens"] == 768 and srv.usage["prompt_tokens"] == 1000
    # more cached than input (a broken gateway): cached tokens are a part of the input, never more
    srv.responder = fixed("odd", prompt_tokens=100, completion_tokens=1, cached_tokens=500)
    assert OpenAIProvider(_settings(srv)).complete(_request()).cached_tokens == 100
    # the field present but null, as some servers send it
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": None},
    }
    srv.responder = lambda _r: Reply(raw_body=_body([_choice("null")], usage))
    c = OpenAIProvider(_settings(srv)).complete(_request())
    assert (c.text, c.tokens_in, c.cached_tokens) == ("null", 9, 0)


def test_failed_attempt_with_usage_reports_its_cached_tokens(srv):
    usage = {
        "prompt_tokens": 50,
        "completion_tokens": 0,
        "total_tokens": 50,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    replies = iter([Reply(raw_body=_body([], usage)), Reply.text("second", prompt_tokens=50, cached_tokens=48)])
    srv.responder = lambda _r: next(replies)
    c = OpenAIProvider(_settings(srv)).complete(_request())
    [failed] = c.failed_attempts  # a 200 without choices: billed, unusable, retried
    assert failed.status == "retried" and (failed.tokens_in, failed.cached_tokens) == (50, 32)
    assert (c.text, c.cached_tokens) == ("second", 48)


def test_missing_usage_counts_zero(srv):
    srv.responder = lambda _r: Reply(content="x", include_usage=False)
    c = OpenAIProvider(_settings(srv)).complete(_request())
    assert (c.tokens_in, c.tokens_out) == (0, 0)


def test_429_retry_after_is_honoured_and_attempt_recorded(srv, monkeypatch):
    srv.responder = fail_first(1, fixed("late", prompt_tokens=5, completion_tokens=2), retry_after=1)
    waits: list[tuple[float, float]] = []  # (when the client began to wait, for how long)
    real_backoff = OpenAIProvider._backoff

    def recorded_backoff(self, retry_no, retry_after):
        wait = real_backoff(self, retry_no, retry_after)
        waits.append((time.time(), wait))
        return wait

    monkeypatch.setattr(OpenAIProvider, "_backoff", recorded_backoff)
    c = OpenAIProvider(_settings(srv)).complete(_request())
    assert c.text == "late"
    assert srv.calls == 2
    [(began, wait)] = waits
    assert wait == 1.0  # the server's Retry-After, not the (patched, 0.05 s) exponential backoff
    # in order: the 429 arrived, the client waited what it was told, and only then sent the retry
    assert srv.requests[0].arrived <= began and srv.requests[1].arrived >= began + wait
    [failed] = c.failed_attempts
    assert failed.status == "retried" and "429" in failed.error
    assert (failed.tokens_in, failed.tokens_out, failed.cached_tokens) == (0, 0, 0) and failed.latency_ms is not None


def test_retry_after_ms_header_wins():
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_retry_after_capped_at_60s(srv):
    p = OpenAIProvider(_settings(srv))
    assert p._backoff(0, 3600.0) == 60.0
    assert p._backoff(30, None) <= OpenAIProvider.BACKOFF_CAP


def test_insufficient_quota_fails_at_once(srv):
    srv.responder = quota_exhausted()
    with pytest.raises(QuotaExhausted) as ei:
        OpenAIProvider(_settings(srv)).complete(_request())
    assert srv.calls == 1
    assert ei.value.retryable is False
    assert [a.status for a in ei.value.attempts] == ["error"]


def test_persistent_429_raises_rate_limited_with_every_attempt(srv):
    srv.responder = fail_first(100, retry_after=0)
    with pytest.raises(RateLimited) as ei:
        OpenAIProvider(_settings(srv, llm_retries=2)).complete(_request())
    assert srv.calls == 3 and ei.value.retryable
    assert [a.status for a in ei.value.attempts] == ["retried", "retried", "error"]


def test_each_retry_asks_before_retry_first_and_a_refusal_sends_nothing_more(srv):
    srv.responder = fail_first(100, retry_after=0)
    asked = []

    def before_retry() -> None:
        asked.append(srv.calls)  # requests the server had seen when the retry asked
        if len(asked) == 2:
            raise BudgetExhausted("max_llm_calls", "2 of 2 LLM calls made")

    with pytest.raises(BudgetExhausted) as ei:
        OpenAIProvider(_settings(srv, llm_retries=5)).complete(_request(), before_retry=before_retry)
    # the first attempt is the caller's to reserve; the second retry was refused and never sent
    assert asked == [1, 2] and srv.calls == 2
    assert [a.status for a in ei.value.attempts] == ["retried", "error"]
    assert all("429" in a.error for a in ei.value.attempts)


def test_persistent_500_is_retryable_after_all_retries(srv):
    srv.responder = always_error(500)
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv, llm_retries=2)).complete(_request())
    assert ei.value.retryable is True
    assert srv.calls == 3
    assert len(ei.value.attempts) == 3 and all("500" in a.error for a in ei.value.attempts)


def test_timeout_is_retryable(srv):
    gate = threading.Event()
    answered: list[int] = []

    def held(_req):
        # Nothing is answered until the client has given up; the 60 s release only keeps a client that
        # ignores its timeout from hanging the test (it then gets "too slow" and pytest.raises fails).
        gate.wait(60)
        answered.append(1)
        return Reply.text("too slow")

    srv.responder = held
    try:
        with pytest.raises(LLMError) as ei:
            OpenAIProvider(_settings(srv, llm_timeout=0.5, llm_retries=1)).complete(_request())
        assert answered == []  # the client gave up on both attempts before either was answered
    finally:
        gate.set()
    assert ei.value.retryable and "0.5s" in ei.value.message
    assert srv.calls == 2
    assert [a.status for a in ei.value.attempts] == ["retried", "error"]


def test_timeout_grows_with_the_request_per_1k_tokens(srv):
    """RLM_LLM_SECONDS_PER_1K_TOKENS gives a big prompt more time; the default keeps RLM_LLM_TIMEOUT exact."""
    small, big = _request("x"), _request("word " * 4000)
    plain = OpenAIProvider(_settings(srv, llm_timeout=30))
    assert plain.attempt_timeout(small) == plain.attempt_timeout(big) == 30
    slow = OpenAIProvider(_settings(srv, llm_timeout=30, llm_seconds_per_1k_tokens=50))
    assert slow.attempt_timeout(small) > 30
    # ~5,000 tokens of prompt and 64 of answer: about 250 s more than the floor
    assert 250 < slow.attempt_timeout(big) - 30 < 260

    gate = threading.Event()

    def held(_req):
        gate.wait(60)
        return Reply.text("too slow")

    srv.responder = held
    try:
        with pytest.raises(LLMError) as ei:
            # 0.2 s floor + 0.3 s for a ~1,000-token request: the error names the attempt's own timeout
            tight = _settings(srv, llm_timeout=0.2, llm_seconds_per_1k_tokens=0.3, llm_retries=0)
            OpenAIProvider(tight).complete(_request("word " * 750))
    finally:
        gate.set()
    assert "RLM_LLM_SECONDS_PER_1K_TOKENS" in ei.value.message
    assert f"{OpenAIProvider(tight).attempt_timeout(_request('word ' * 750)):g}s" in ei.value.message


def _held_first(release: threading.Event):
    """The first request is held until ``release`` (a local server still computing a request its client gave
    up on); every later one answers at once."""
    first = threading.Event()

    def respond(_req):
        if not first.is_set():
            first.set()
            release.wait(60)
            return Reply.text("abandoned")
        return Reply.text("the retry")

    return respond


def test_timeout_on_a_busy_local_server_waits_for_an_idle_slot_before_retrying(srv):
    """llama-server keeps computing a request whose client timed out: the retry waits until /slots shows an idle
    slot, so it never queues behind the abandoned one (the server never holds two requests at once)."""
    srv.llama_slots = 1
    release = threading.Event()
    srv.responder = _held_first(release)

    def free_when_probed():
        # the held request ends only once the client, having timed out, is asking about the slots
        while srv.slot_probes == 0 and not release.is_set():
            time.sleep(0.01)
        release.set()

    helper = threading.Thread(target=free_when_probed, daemon=True)
    helper.start()
    try:
        # the slot wait is bounded by the attempt's timeout: 2 s leaves a loaded machine time to end the held
        # request once it is released (with 0.5 s a busy suite once saw the slot still busy at the bound)
        provider = OpenAIProvider(_settings(srv, llm_timeout=2.0, llm_retries=1))
        provider.SLOT_POLL = 0.05
        c = provider.complete(_request())
    finally:
        release.set()
        helper.join(5)
    assert c.text == "the retry" and srv.calls == 2
    assert srv.max_concurrency == 1  # the retry was sent only once the abandoned request was done
    assert srv.slot_probes >= 1
    assert [a.status for a in c.failed_attempts] == ["retried"]


def test_timeout_on_a_local_server_still_busy_is_not_retried(srv):
    srv.llama_slots = 1
    release = threading.Event()
    srv.responder = _held_first(release)
    try:
        provider = OpenAIProvider(_settings(srv, llm_timeout=0.3, llm_retries=3))
        provider.SLOT_POLL = 0.05
        with pytest.raises(LLMError) as ei:
            provider.complete(_request())
    finally:
        release.set()
    assert srv.calls == 1  # no retry queued behind the request still running
    assert not ei.value.retryable and "still busy" in ei.value.message and "/slots" in ei.value.message
    assert [a.status for a in ei.value.attempts] == ["error"]


def test_timeout_on_a_local_server_without_slots_is_not_retried(srv):
    """/health says llama-server, /slots is off: nothing tells when the abandoned request ends."""
    srv.llama_slots = 0
    release = threading.Event()
    srv.responder = _held_first(release)
    try:
        with pytest.raises(LLMError) as ei:
            OpenAIProvider(_settings(srv, llm_timeout=0.3, llm_retries=3)).complete(_request())
    finally:
        release.set()
    assert srv.calls == 1 and not ei.value.retryable
    assert "--no-slots" in ei.value.message and "RLM_LLM_TIMEOUT" in ei.value.message


def test_connection_refused_is_retryable():
    import socket

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(api_key="k", base_url=f"http://127.0.0.1:{port}/v1", llm_retries=1)
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(settings).complete(_request())
    assert ei.value.retryable and "cannot connect" in ei.value.message
    assert [a.status for a in ei.value.attempts] == ["retried", "error"]


def test_auth_error_is_not_retried_and_says_what_to_check(srv):
    srv.responder = always_error(
        401, "Incorrect API key provided", type="invalid_request_error", code="invalid_api_key"
    )
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv)).complete(_request())
    assert srv.calls == 1 and not ei.value.retryable
    assert "OPENAI_API_KEY" in ei.value.message


def test_unknown_model_404_names_the_model(srv):
    srv.responder = always_error(
        404, "The model `gpt-test` does not exist", type="invalid_request_error", code="model_not_found"
    )
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv)).complete(_request())
    assert srv.calls == 1 and not ei.value.retryable and MODEL in ei.value.message


def test_malformed_body_is_retryable(srv):
    srv.responder = lambda _r: Reply.malformed_body()
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv, llm_retries=1)).complete(_request())
    assert ei.value.retryable and srv.calls == 2


def test_json_output_sends_response_format(srv):
    srv.responder = fixed('{"ok": true}')
    c = OpenAIProvider(_settings(srv)).complete(_request(json_output=True))
    assert json.loads(c.text) == {"ok": True}
    assert srv.requests[0].body["response_format"] == {"type": "json_object"}


def test_unsupported_response_format_falls_back_once(srv):
    def responder(req: dict) -> Reply | str:
        if "response_format" in req:
            return Reply.http_error(
                400,
                "'response_format' of type 'json_object' is not supported with this model.",
                type="invalid_request_error",
                param="response_format",
            )
        return '{"ok": true}'

    srv.responder = responder
    p = OpenAIProvider(_settings(srv))
    c = p.complete(_request(json_output=True))
    assert c.text == '{"ok": true}' and len(c.failed_attempts) == 1
    # learned for the model: the next call does not repeat the doomed request
    p.complete(_request(json_output=True))
    assert [("response_format" in r.body) for r in srv.requests] == [True, False, False]


def test_max_tokens_and_temperature_fallbacks(srv):
    def responder(req: dict) -> Reply | str:
        if "max_completion_tokens" in req:
            return Reply.http_error(
                400,
                "Unrecognized request argument supplied: max_completion_tokens",
                type="invalid_request_error",
            )
        if "temperature" in req:
            return Reply.http_error(
                400,
                "Unsupported value: 'temperature' does not support 0 with this model.",
                type="invalid_request_error",
                param="temperature",
            )
        return "fine"

    srv.responder = responder
    c = OpenAIProvider(_settings(srv, llm_retries=0)).complete(_request())
    assert c.text == "fine" and len(c.failed_attempts) == 2
    assert srv.requests[-1].body["max_tokens"] == 64


def test_other_400_is_not_retried(srv):
    srv.responder = always_error(400, "messages: too long", type="invalid_request_error")
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv)).complete(_request())
    assert srv.calls == 1 and not ei.value.retryable and MODEL in ei.value.message


def test_tool_call_round_trip(srv):
    def responder(req: dict) -> Reply | str:
        if any(m.get("role") == "tool" for m in req["messages"]):
            return "report using " + req["messages"][-1]["content"]
        return Reply.tools(("get_chunks", {"chunk_ids": [1, 2]}), prompt_tokens=20, completion_tokens=8)

    srv.responder = responder
    tools = [{"type": "function", "function": {"name": "get_chunks", "parameters": {"type": "object"}}}]
    p = OpenAIProvider(_settings(srv))
    messages: list[dict] = [{"role": "user", "content": "synthesize"}]
    first = p.complete(
        CompletionRequest(role="synthesizer", model=MODEL, messages=messages, max_tokens=32, tools=tools)
    )
    [call] = first.tool_calls
    assert call.name == "get_chunks" and json.loads(call.arguments) == {"chunk_ids": [1, 2]}
    assert (first.tokens_in, first.tokens_out) == (20, 8)
    assert first.raw_message["tool_calls"][0]["function"]["name"] == "get_chunks"
    assert srv.requests[0].body["tools"] == tools

    messages += [first.raw_message, {"role": "tool", "tool_call_id": call.id, "content": "chunk text"}]
    second = p.complete(
        CompletionRequest(role="synthesizer", model=MODEL, messages=messages, max_tokens=32, tools=tools)
    )
    assert second.text == "report using chunk text" and second.tool_calls == []
    sent = srv.requests[1].body["messages"]
    assert sent[1]["role"] == "assistant" and sent[1]["tool_calls"][0]["id"] == call.id


def test_rules_match_last_user_message(srv):
    srv.responder = rules([("alpha", "A"), ("beta", Reply.text("B"))], default="Z")
    p = OpenAIProvider(_settings(srv))
    assert [p.complete(_request(t)).text for t in ("say alpha", "beta!", "gamma")] == ["A", "B", "Z"]


def test_no_api_key_is_a_config_error():
    from rlm_workers.errors import ConfigError

    p = OpenAIProvider(Settings(api_key=None, base_url="http://127.0.0.1:9/v1"))
    with pytest.raises(ConfigError):
        p.complete(_request())


def test_standalone_server_process(tmp_path):
    import os
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.scripted_llm",
            "--port",
            "0",
            "--latency-ms",
            "50",
            "--content",
            "standalone",
            "--fail-first",
            "1",
            "--retry-after",
            "0",
            "--prompt-tokens",
            "100",
            "--cached-tokens",
            "64",
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        base = line.split()[-1]
        c = OpenAIProvider(Settings(api_key="k", base_url=base, llm_retries=1)).complete(_request())
        assert c.text == "standalone" and len(c.failed_attempts) == 1 and c.cached_tokens == 64
        root_url = base.removesuffix("/v1")
        stats = json.load(urllib.request.urlopen(root_url + "/_stats"))
        assert stats["calls"] == 2 and stats["max_concurrency"] == 1 and stats["usage"]["total_tokens"] > 0
        assert stats["usage"]["cached_tokens"] == 64  # the failed first call returned no usage
        urllib.request.urlopen(urllib.request.Request(root_url + "/_reset", data=b"", method="POST"))
        assert json.load(urllib.request.urlopen(root_url + "/_stats"))["calls"] == 0
        models = json.load(urllib.request.urlopen(base + "/models"))
        assert models["data"][0]["object"] == "model"
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_scripted_prompt_cache_reports_a_shared_prefix_like_openai():
    """The scripted server's optional prompt caching (off by default): a prompt sharing at least 1,024 tokens of
    prefix with an earlier one of the same model reports that prefix, in whole steps of 128 tokens, as cached."""
    long = "x" * 6000  # with the JSON around it, 11 steps of 512 characters (128 tokens) are shared
    with ScriptedLLM(fixed("ok"), prompt_cache=True) as cached_srv:
        p = OpenAIProvider(_settings(cached_srv))
        assert p.complete(_request(long + "A")).cached_tokens == 0  # nothing seen yet
        c = p.complete(_request(long + "B"))
        assert c.cached_tokens == 11 * 128 and c.tokens_in > c.cached_tokens
        assert p.complete(dataclasses.replace(_request(long + "C"), model="other")).cached_tokens == 0
        assert p.complete(_request("x" * 3000 + "D")).cached_tokens == 0  # 5 steps shared: under 1,024 tokens
        cached_srv.reset()  # forgets what it saw
        assert p.complete(_request(long + "E")).cached_tokens == 0
    with ScriptedLLM(fixed("ok")) as plain:  # off unless asked for
        p = OpenAIProvider(_settings(plain))
        assert [p.complete(_request(long)).cached_tokens for _ in range(2)] == [0, 0]


# --------------------------------------------------------------------------- structured outputs

SCHEMA = {
    "name": "answer",
    "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "strict": False,
}


def _refuse_json_schema(req: dict) -> Reply | str:
    if (req.get("response_format") or {}).get("type") == "json_schema":
        return Reply.http_error(400, "response_format type json_schema is not supported", type="invalid_request_error")
    return '{"ok": true}'


def test_a_schema_goes_out_as_json_schema(srv):
    srv.responder = fixed('{"ok": true}')
    OpenAIProvider(_settings(srv)).complete(_request(json_output=True, json_schema=SCHEMA))
    assert srv.requests[0].body["response_format"] == {"type": "json_schema", "json_schema": SCHEMA}


def test_a_refused_json_schema_falls_back_to_json_object_once_per_server_and_model(srv):
    srv.responder = _refuse_json_schema
    first = OpenAIProvider(_settings(srv)).complete(_request(json_output=True, json_schema=SCHEMA))
    assert first.text == '{"ok": true}' and len(first.failed_attempts) == 1
    # another job's provider in the same process goes straight to the learned form
    OpenAIProvider(_settings(srv)).complete(_request(json_output=True, json_schema=SCHEMA))
    forms = [r.body["response_format"]["type"] for r in srv.requests]
    assert forms == ["json_schema", "json_object", "json_object"]
    # learned for that model only
    OpenAIProvider(_settings(srv)).complete(
        dataclasses.replace(_request(json_output=True, json_schema=SCHEMA), model="other")
    )
    assert srv.requests[-2].body["response_format"]["type"] == "json_schema"


def test_json_object_refused_too_sends_no_response_format(srv):
    srv.responder = lambda req: (
        Reply.http_error(400, "'response_format' is not supported", type="invalid_request_error")
        if "response_format" in req
        else '{"ok": true}'
    )
    p = OpenAIProvider(_settings(srv))
    p.complete(_request(json_output=True, json_schema=SCHEMA))
    p.complete(_request(json_output=True, json_schema=SCHEMA))
    forms = [(r.body.get("response_format") or {}).get("type") for r in srv.requests]
    assert forms == ["json_schema", "json_object", None, None]


def test_forced_json_schema_refused_is_a_clear_error(srv):
    srv.responder = _refuse_json_schema
    with pytest.raises(LLMError) as ei:
        OpenAIProvider(_settings(srv, structured_outputs="json_schema")).complete(
            _request(json_output=True, json_schema=SCHEMA)
        )
    assert not ei.value.retryable and "RLM_STRUCTURED_OUTPUTS=json_schema" in ei.value.message
    assert srv.calls == 1


@pytest.mark.parametrize(("mode", "form"), [("json_object", {"type": "json_object"}), ("off", None)])
def test_structured_outputs_setting(srv, mode, form):
    srv.responder = fixed('{"ok": true}')
    OpenAIProvider(_settings(srv, structured_outputs=mode)).complete(_request(json_output=True, json_schema=SCHEMA))
    assert srv.requests[0].body.get("response_format") == form


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_chunks",
            "description": "Full text of chunks by id.",
            "parameters": {"type": "object", "properties": {"chunk_ids": {"type": "array"}}},
        },
    }
]


def test_a_server_without_tools_gets_them_in_words_and_its_json_action_becomes_a_call(srv):
    def responder(req: dict) -> Reply | str:
        if "tools" in req:
            return Reply.http_error(400, "tools param requires --jinja flag", type="invalid_request_error")
        if any(m["role"] == "user" and m["content"].startswith("Result of get_chunks") for m in req["messages"]):
            return json.dumps({"answer": "## Answer\n\nfound it"})
        return json.dumps({"action": "get_chunks", "arguments": {"chunk_ids": [3]}})

    srv.responder = responder
    p = OpenAIProvider(_settings(srv))
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "findings"}]
    c = p.complete(dataclasses.replace(_request(), role="synthesizer", messages=messages, tools=TOOLS))
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [("get_chunks", {"chunk_ids": [3]})]
    sent = srv.requests[-1].body
    assert "tools" not in sent and "get_chunks" in sent["messages"][0]["content"]
    assert sent["response_format"]["type"] == "json_schema"
    # the next turn: the call and its result as plain messages; the answer object is the stage's to read (with the
    # chunks it cites, where it names them)
    turn2 = [*messages, c.raw_message, {"role": "tool", "tool_call_id": c.tool_calls[0].id, "content": "{}"}]
    final = p.complete(dataclasses.replace(_request(), role="synthesizer", messages=turn2, tools=TOOLS))
    assert json.loads(final.text) == {"answer": "## Answer\n\nfound it"} and not final.tool_calls
    roles = [m["role"] for m in srv.requests[-1].body["messages"]]
    assert roles == ["system", "user", "assistant", "user"] and len(srv.requests) == 3  # one refusal only


def test_a_json_action_reply_from_a_model_with_tools_is_read_as_the_call(srv):
    srv.responder = fixed(json.dumps({"action": "get_chunks", "arguments": {"chunk_ids": [1]}}))
    c = OpenAIProvider(_settings(srv)).complete(dataclasses.replace(_request(), tools=TOOLS))
    assert [t.name for t in c.tool_calls] == ["get_chunks"] and "tools" in srv.requests[0].body
    # an unknown tool name is not a call: the text stays the report
    srv.responder = fixed(json.dumps({"action": "rm_rf", "arguments": {}}))
    c = OpenAIProvider(_settings(srv)).complete(dataclasses.replace(_request(), tools=TOOLS))
    assert not c.tool_calls
