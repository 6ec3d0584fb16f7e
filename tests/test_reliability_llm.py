"""LLM-call reliability (issue #10) on real PostgreSQL, real Valkey and the scripted OpenAI-protocol server:
usage is recorded whenever a response arrived, limiter waits are bounded, a batch is claimed once while its
lease lives (and a waiting batch counts as progress), the offline answer quotes verbatim, and logs name the
provider and model that actually answered."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from tests.support.jobs import stored_fan_out_job
from tests.support.scripted_llm import Reply, ScriptedLLM


def _completion_body(model: str, message: dict, usage: dict | None = None) -> bytes:
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


@pytest.fixture()
def job(settings):
    return stored_fan_out_job("rl", [[1], [2]])


@pytest.fixture()
def online(rlm_env):
    """A scripted server and settings that send every call to it (one attempt, no retries)."""
    from tests.support.envpatch import patched_env

    with (
        ScriptedLLM() as srv,
        patched_env({"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": srv.base_url, "RLM_LLM_RETRIES": "0"}),
    ):
        yield srv


def _request(model: str = "gpt-test"):
    from rlm_workers.llm.protocol import CompletionRequest
    from rlm_workers.llm.stage_input import Question, ReadInput

    # what the offline provider reads (an analyst's read of no chunks); a server is sent only the message
    return CompletionRequest(
        role="analyst",
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=64,
        stage_input=ReadInput((), (Question("hi"),)),
    )


# --------------------------------------------------------------------------- usage after a response


def test_usage_is_recorded_when_a_response_arrived_but_could_not_be_used(online, job):
    from rlm_workers.errors import LLMError
    from rlm_workers.pipeline.calls import call_llm
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    # a 200 with usage whose tool call is garbage: reading it fails after the tokens were billed
    online.responder = lambda _req: Reply(
        content=None,
        raw_body=_completion_body(
            "gpt-test",
            {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": "garbage"}]},
            {"prompt_tokens": 123, "completion_tokens": 45, "total_tokens": 168},
        ),
    )
    with pytest.raises(LLMError) as err:
        call_llm(None, job_id=job, stage="analyst", batch=0, request=_request())
    assert err.value.retryable and "unusable response" in err.value.message
    with connection() as conn:
        calls = job_store.llm_calls_of(conn, job_id=job)
        usage = job_store.job_usage(conn, job_ids=[job])[job]
        assert (usage.calls, usage.tokens_in, usage.tokens_out) == (1, 123, 45)
    assert [(c.status, c.tokens_in, c.tokens_out) for c in calls] == [("error", 123, 45)]


# --------------------------------------------------------------------------- bounded limiter waits


def test_a_call_that_gets_no_limiter_slot_in_time_ends_rate_limiter_busy_without_being_sent(rlm_env):
    import redis

    from rlm_workers.config import Settings
    from rlm_workers.llm.limiter import ConcurrencyLimiter
    from rlm_workers.llm.registry import build_provider

    client = redis.Redis.from_url(rlm_env["RLM_BROKER_URL"])
    with ScriptedLLM() as srv:
        # every limiter wait is bounded by a third of the visibility timeout: 2 s here
        settings = Settings(
            api_key="sk-test", base_url=srv.base_url, max_concurrency=1, visibility_timeout=6, job_timeout=5
        )
        provider = build_provider(settings, lambda: client)
        holder = ConcurrencyLimiter(client, limit=1)
        with holder.slot():  # the only global slot stays taken (renewed) for the whole test
            outcome: list[BaseException | object] = []

            def call() -> None:
                try:
                    outcome.append(provider.complete(_request()))
                except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
                    outcome.append(exc)

            t = threading.Thread(target=call, daemon=True)
            t.start()
            t.join(120)  # liveness, not speed: an unbounded wait never returns while the slot is held
            assert not t.is_alive(), "the call waited on the limiter without bound"
        from rlm_workers.errors import LimiterBusy

        [exc] = outcome
        assert isinstance(exc, LimiterBusy) and exc.retryable and exc.type == "rate_limiter_busy"
        assert "rate limiter busy" in exc.message
        assert srv.calls == 0  # never sent, never paid


# --------------------------------------------------------------------------- one claim per batch


def test_a_batch_is_claimed_once_while_its_lease_lives_and_again_once_it_lapsed(job):
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]
        # a redelivered message of the same batch: the holder is alive, so no second model call
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) is None
        assert job_store.batch_held(conn, job_id=job, batch_no=0, lease_seconds=60)
        # the holder died: no heartbeat for longer than the lease, and a later delivery may take the batch
        conn.execute(
            "UPDATE job_batches SET heartbeat_at = now() - interval '5 minutes' WHERE job_id = %s AND batch_no = 0",
            (job,),
        )
        assert not job_store.batch_held(conn, job_id=job, batch_no=0, lease_seconds=60)
        assert job_store.claim_batch(conn, job_id=job, batch_no=0, lease_seconds=60) == [1]
        assert job_store.finish_batch(conn, job_id=job, batch_no=0)
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) is None  # done: never again


def test_a_batch_waiting_on_the_limiter_counts_as_progress(job):
    from rlm_workers.pipeline.salvage import salvage_job
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    with connection() as conn:
        assert job_store.claim_batch(conn, job_id=job, batch_no=0) == [1]
        ago = "now() - interval '10 minutes'"
        conn.execute(f"UPDATE jobs SET stage_at = {ago} WHERE id = %s", (job,))
        conn.execute(f"UPDATE job_batches SET started_at = {ago}, heartbeat_at = {ago} WHERE job_id = %s", (job,))
        assert job in [j for j, _, _ in job_store.stale_jobs(conn, idle_seconds=300)]
        # the analyst is still waiting for a slot: its heartbeat is the job's sign of life
        assert job_store.heartbeat_batch(conn, job_id=job, batch_no=0)
        assert job not in [j for j, _, _ in job_store.stale_jobs(conn, idle_seconds=300)]
        assert not salvage_job(conn, job, "test", min_idle_seconds=300)
        assert job_store.get_job(conn, job_id=job).status == "running"


# --------------------------------------------------------------------------- the offline answer


def test_the_offline_answer_quotes_the_document_not_the_fence():
    from rlm_workers.llm.extractive import ExtractiveProvider
    from rlm_workers.llm.protocol import CompletionRequest
    from rlm_workers.pipeline.analyst import ChunkForPrompt, read_input
    from rlm_workers.pipeline.analyst import render_messages as analyst_messages
    from rlm_workers.pipeline.synthesize import render_messages as synthesizer_messages
    from rlm_workers.pipeline.synthesize import synthesis_input

    query = "Where does the template close the content tag?"
    text = "Template notes.\n\nThe template closes the </content> tag right after the <b>footer</b>.\n"
    chunk = ChunkForPrompt(chunk_id=7, buffer="docs", path="tpl/page.md", start_line=3, end_line=5, text=text)
    offline = ExtractiveProvider()
    read = read_input(query, [chunk])
    reply = offline.complete(
        CompletionRequest(
            role="analyst", model="m", messages=analyst_messages("SYS", read), max_tokens=64, stage_input=read
        )
    )
    [entry] = json.loads(reply.text)["entries"]  # the wire shape (llm/structured.py)
    assert entry["relevance"] != "none"
    assert any("closes the </content> tag right after the <b>footer</b>" in f for f in entry["findings"])
    assert not any("&lt;" in f or "&#x" in f for f in entry["findings"])
    kept = [{"chunk_id": 7, "buffer": "docs", "path": "tpl/page.md", "start_line": 3, "end_line": 5, **entry}]
    shown = synthesis_input(query, kept)
    report = offline.complete(
        CompletionRequest(
            role="synthesizer",
            model="m",
            messages=synthesizer_messages("SYS", shown, {"buffers": ["docs"]}),
            max_tokens=64,
            stage_input=shown,
        )
    ).text
    assert "&lt;" not in report and "&#x" not in report
    # verbatim, with each tag escaped for markdown so a renderer shows it instead of treating it as HTML
    assert r"closes the \</content> tag right after the \<b>footer\</b>" in report
    assert "docs:tpl/page.md:3-5" in report


# --------------------------------------------------------------------------- logs name who answered


def test_logs_name_the_provider_and_model_that_answered(rlm_env, job, caplog):
    from rlm_workers.pipeline.calls import call_llm
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection
    from tests.support.envpatch import patched_env

    caplog.set_level(logging.INFO, logger="rlm.llm")
    with patched_env({"RLM_SUBCALL_MODEL": "gpt-5.2-2025-12-11"}):  # offline: no key, the extractive provider
        call_llm(None, job_id=job, stage="plan", request=_request("gpt-5.2-2025-12-11"))
    offline = [r.getMessage() for r in caplog.records if r.getMessage().startswith("llm plan")]
    assert offline and "provider=extractive model=extractive" in offline[0] and "gpt-5.2" not in offline[0]

    caplog.clear()
    with ScriptedLLM() as srv, patched_env({"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": srv.base_url}):
        # the server answers with the dated model behind the alias we asked for
        srv.responder = lambda _req: Reply(
            content=None,
            raw_body=_completion_body(
                "served-model-2026-01-01",
                {"content": "ok"},
                {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            ),
        )
        call_llm(None, job_id=job, stage="analyst", batch=0, request=_request("served-model"))
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("llm call model=served-model-2026-01-01 ") for m in lines), lines
    assert any(m.startswith("llm analyst") and "provider=openai model=served-model-2026-01-01" in m for m in lines)
    with connection() as conn:
        models = [(c.provider, c.model) for c in job_store.llm_calls_of(conn, job_id=job)]
    assert models == [("extractive", "extractive"), ("openai", "served-model-2026-01-01")]


def test_a_call_is_logged_with_the_stage_that_made_it_not_the_task_that_started(rlm_env, job):
    """``rlm.plan`` runs search and the direct answer in the same task: the answer's call (and each of its
    attempts) is tagged ``answer``, not the task's ``plan`` (seen on a failed instant query)."""
    from rlm_workers.errors import LLMError
    from rlm_workers.llm.protocol import CompletionRequest
    from rlm_workers.pipeline.calls import call_llm
    from rlm_workers.runtime.logs import ContextFilter, reset_context, set_context
    from tests.support.envpatch import patched_env
    from tests.support.scripted_llm import always_error

    tagged: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tagged.append((record.getMessage(), record.stage))

    handler = Keep()
    handler.addFilter(ContextFilter())
    logger = logging.getLogger("rlm.llm")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    token = set_context(job_id=job, stage="plan", task_id="t-1")  # as the worker's task_prerun sets it
    request = CompletionRequest(
        role="direct", model="gpt-test", messages=[{"role": "user", "content": "q"}], max_tokens=16
    )
    try:
        with (
            ScriptedLLM(always_error(500)) as srv,
            patched_env({"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": srv.base_url, "RLM_LLM_RETRIES": "0"}),
        ):
            with pytest.raises(LLMError):
                call_llm(None, job_id=job, stage="answer", request=request)
    finally:
        reset_context(token)
        logger.removeHandler(handler)
        logger.setLevel(level)
    calls = [(m, s) for m, s in tagged if m.startswith("llm call")]
    assert calls and all(s == "answer" for _, s in calls), tagged
