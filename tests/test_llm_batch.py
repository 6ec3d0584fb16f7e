"""The OpenAI Batch API mode of overnight batches (docs/contract.md#llm-batch-api).

First the scripted server's /v1/files and /v1/batches through the real ``openai`` client and our
``BatchClient``; then a 3 × 2 overnight batch run with ``--llm-batch`` on real workers.
"""

from __future__ import annotations

import json
import time

import pytest

from rlm_workers.llm.batch_api import BatchClient, parse_line
from rlm_workers.llm.protocol import CompletionRequest
from tests.support.scripted_llm import Reply, ScriptedLLM, last_user_message


def _settings(srv: ScriptedLLM):
    from rlm_workers.config import Settings

    return Settings(api_key="sk-test", base_url=srv.base_url)


def _request(text: str) -> CompletionRequest:
    return CompletionRequest(
        role="analyst", model="analyst-model", messages=[{"role": "user", "content": text}], max_tokens=50
    )


def _responder(req: dict) -> Reply | str:
    text = last_user_message(req)
    if "fail" in text:
        return Reply.http_error(500, "scripted line failure")
    return Reply.text(f"echo {text}", prompt_tokens=100, completion_tokens=7, cached_tokens=40)


def _wait(client: BatchClient, batch_id: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.retrieve(batch_id)
        if state.terminal:
            return state
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} not done after {timeout}s: {state}")


def test_files_and_batches_through_the_openai_client():
    import openai

    with ScriptedLLM(_responder) as srv:
        client = openai.OpenAI(api_key="sk-test", base_url=srv.base_url, max_retries=0)
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            for i, body in enumerate(
                [
                    {"model": "m", "messages": [{"role": "user", "content": "one"}]},
                    {"model": "m", "messages": [{"role": "user", "content": "please fail"}]},
                ]
            )
        ]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len(data)
        assert client.files.content(f.id).content == data
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
        )
        deadline = time.monotonic() + 20
        while b.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.05)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed"
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (2, 1, 1)
        assert b.metadata == {"k": "v"}
        assert [x.id for x in client.batches.list(limit=10).data] == [b.id]
        out = [json.loads(s) for s in client.files.content(b.output_file_id).text.splitlines()]
        err = [json.loads(s) for s in client.files.content(b.error_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == ["r0"] and [e["custom_id"] for e in err] == ["r1"]
        assert out[0]["response"]["status_code"] == 200
        assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "echo one"
        assert err[0]["response"]["status_code"] == 500 and err[0]["response"]["body"]["error"]["message"]
        # batch lines are counted apart from synchronous calls, their usage with everything else
        assert srv.calls == 0 and srv.stats()["batch_calls"] == 2 and srv.usage["prompt_tokens"] == 100


def test_batch_client_round_trip_with_usage_and_failed_line():
    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        reqs = {"read-1": _request("alpha"), "read-2": _request("fail here"), "read-3": _request("gamma")}
        state = client.submit([client.line(k, r) for k, r in reqs.items()], metadata={"rlm_overnight": "b1"})
        assert client.custom_ids(state.input_file_id) == list(reqs)
        # the body is what an ordinary call sends (OpenAIProvider._params)
        body = json.loads(client._client.files.content(state.input_file_id).text.splitlines()[0])["body"]
        assert body["max_completion_tokens"] == 50 and body["model"] == "analyst-model"
        state = _wait(client, state.id)
        assert state.status == "completed" and state.counts == {"total": 3, "completed": 2, "failed": 1}
        lines = client.results(state, "analyst-model")
        assert set(lines) == set(reqs)
        ok = lines["read-1"].completion
        assert ok is not None and ok.text == "echo alpha"
        assert (ok.tokens_in, ok.tokens_out, ok.cached_tokens) == (100, 7, 40)
        assert lines["read-2"].completion is None and "500" in lines["read-2"].error
        assert [s.id for s in client.recent()] == [state.id] and client.recent()[0].metadata == {"rlm_overnight": "b1"}


def test_held_batch_stays_in_progress_and_expired_batch_leaves_lines_unanswered():
    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        srv.hold_batches()
        state = client.submit([client.line("a", _request("x"))], metadata={})
        time.sleep(0.3)
        assert client.retrieve(state.id).status == "in_progress" and srv.stats()["batch_calls"] == 0
        srv.release_batches()
        assert _wait(client, state.id).status == "completed"
        srv.expire_after = 1
        state = client.submit([client.line(c, _request(c)) for c in ("a", "b", "c")], metadata={})
        state = _wait(client, state.id)
        assert state.status == "expired" and set(client.results(state, "m")) == {"a"}


def test_errors_are_one_line_llm_errors():
    from rlm_workers.errors import LLMError

    with ScriptedLLM(_responder) as srv:
        client = BatchClient(_settings(srv))
        with pytest.raises(LLMError) as exc:
            client.retrieve("batch_nope")
        assert not exc.value.retryable and "\n" not in exc.value.message
    from rlm_workers.config import Settings

    gone = BatchClient(Settings(api_key="sk-test", base_url="http://127.0.0.1:9/v1"))
    with pytest.raises(LLMError) as exc:
        gone.retrieve("batch_x")
    assert exc.value.retryable


def test_parse_line_edge_cases():
    assert parse_line("not json", "m").completion is None
    line = parse_line(json.dumps({"custom_id": "x", "response": None, "error": {"code": "e", "message": "boom"}}), "m")
    assert line.custom_id == "x" and line.completion is None and "boom" in line.error
    bad = {"custom_id": "y", "response": {"status_code": 200, "body": {"choices": []}}, "error": None}
    assert parse_line(json.dumps(bad), "m").completion is None
