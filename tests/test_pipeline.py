"""The query pipeline end to end: real worker processes, real Valkey/Redis and PostgreSQL+pgvector,
and a scripted OpenAI-protocol server standing in for the model.

Workers: ``ctl`` serves rlm.control, ``an1``/``an2`` serve rlm.analyst (threads pool), all started
with ``rlm worker`` as subprocesses.  Every test submits a real job and waits for it to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support.pipeline_model import (
    CHUNK_COUNT,
    NEEDLE,
    QUESTION,
    RETRY_PREFIX,
    TOPICS,
    _essay,
    write_essays,
)
from tests.support.scripted_llm import Reply, fail_first, last_user_message
from tests.support.workers import ROOT, running_workers, scripted_env

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(rlm_env, llm, tmp_path_factory):
    """The environment every process of this module shares (test process, workers, CLI)."""
    with scripted_env(
        rlm_env,
        llm,
        RLM_LLM_RETRIES="1",
        RLM_LLM_TIMEOUT="30",
        RLM_MAX_CONCURRENCY="3",
        # short enough that a lost batch is redelivered or salvaged within the test's patience
        RLM_VISIBILITY_TIMEOUT="30",
        RLM_JOB_TIMEOUT="25",
        # a dead worker's work looked for every 2 s and re-sent once it is 2 s gone (production: 60 s and 20 s)
        RLM_RECONCILE_SECONDS="2",
        RLM_WORKER_LOST_SECONDS="2",
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("pipeline") / "essays"
    write_essays(root)
    report = load_paths(conn, buffer="essays", paths=[root], embedder=embedder)
    conn.commit()
    assert report.chunks_written == CHUNK_COUNT
    poison = tmp_path_factory.mktemp("poison") / "p"
    poison.mkdir()
    for i in range(6):
        marker = "POISON-BATCH" if i == 0 else ""
        (poison / f"{i}.md").write_text(_essay(TOPICS[i], f"{marker} {NEEDLE if i == 4 else ''}"))
    load_paths(conn, buffer="poison", paths=[poison], embedder=embedder)
    conn.commit()
    return root


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an1": ("rlm.analyst", 6), "an2": ("rlm.analyst", 6)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools) as ws:
        yield ws


def run_job(conn, query, buffers=("essays",), timeout=120, **options):
    from rlm_workers.submit import submit_query, wait_for_job

    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=list(buffers), options=options)
    conn.commit()
    return wait_for_job(conn, job_id, timeout=timeout)


def result_of(job):
    from rlm_workers.models import QueryResult

    assert job.result is not None, (job.status, job.error)
    return QueryResult.model_validate(job.result)


def requests_for(llm, model_name):
    return [r for r in llm.requests if r.body.get("model") == model_name]


def logged_calls(conn, job_id):
    return conn.execute(
        "SELECT stage, status, tokens_in, tokens_out FROM llm_calls WHERE job_id = %s ORDER BY id", (job_id,)
    ).fetchall()


# --------------------------------------------------------------------------- tests


def test_needle_across_batches_with_exact_token_accounting(conn, fresh, model):
    # the first planner attempt gets a 429 with Retry-After; the retry succeeds
    model.plan_reply = fail_first(
        1, lambda req: json.dumps({"search_mode": "hybrid", "threshold": -1.0}), status=429, retry_after=0.5
    )
    llm = fresh
    job = run_job(conn, QUESTION)
    r = result_of(job)
    assert job.status == "done", job.error
    assert NEEDLE in r.response and "(grep found: True)" in r.response
    assert r.provider == "openai" and r.scaling_tier == "small"
    assert r.batches_processed == len(requests_for(llm, "analyst-model")) >= 5
    assert r.chunks_analyzed == CHUNK_COUNT and r.batches_failed == 0
    needle_src = [s for s in r.sources if s.relevance == "high"]
    assert (
        len(needle_src) == 1 and needle_src[0].path == "essays/17-clockmaking.md" and needle_src[0].buffer == "essays"
    )
    assert r.sources[0].relevance == "high"  # collect order: relevance first
    # the bill is exact: every call the server answered, retries and the synthesizer's tool turn included
    usage = llm.usage
    assert r.total_tokens == usage["total_tokens"] and r.tokens_in == usage["prompt_tokens"]
    assert r.llm_calls == llm.calls
    stages = [row[0] for row in logged_calls(conn, job.id)]
    assert stages.count("synthesize") == 2 and stages.count("plan") == 2  # 429 then ok
    assert ("plan", "retried", 0, 0) in [tuple(x) for x in logged_calls(conn, job.id)]
    assert job.timings.keys() >= {"plan", "search", "collect", "synthesize"}


def test_an_unusable_analyst_reply_is_retried_with_what_was_wrong(conn, fresh):
    llm = fresh
    job = run_job(conn, QUESTION + " GARBLE-ONCE", skip_plan=True, threshold=-1.0)
    r = result_of(job)
    assert job.status == "done" and r.batches_failed == 0 and r.chunks_analyzed == CHUNK_COUNT
    assert any(s.relevance == "high" for s in r.sources)  # the retried batches' findings are in
    analyst = [req.body["messages"] for req in requests_for(llm, "analyst-model")]
    retries = [m for m in analyst if len(m) == 4]
    assert len(retries) == r.batches_processed == len(analyst) // 2
    for messages in retries:
        system, batch, prior, correction = messages
        assert batch["role"] == "user" and "### Chunk" in batch["content"]
        assert prior == {"role": "assistant", "content": "I looked at the chunks and they seem fine."}
        assert correction["role"] == "user" and correction["content"].startswith(RETRY_PREFIX)
        assert "not a JSON findings object" in correction["content"]
        ids = re.findall(r"### Chunk (\d+)", batch["content"])
        assert f"({', '.join(ids)})" in correction["content"]  # it names the chunks it must answer for
    # each first reply is recorded as unusable, its re-ask (a row of its own) as parsed; the job JSON shows both
    from rlm_api.routes.queries import job_view

    calls = [c for c in job_view(conn, job).calls if c.stage == "analyst"]
    assert sorted(c.parse_ok for c in calls) == [False] * len(retries) + [True] * len(retries)
    shown = json.loads(job_view(conn, job).model_dump_json())["calls"]
    assert [c["parse_ok"] for c in shown if c["stage"] == "analyst"].count(False) == len(retries)
    assert {c["parse_ok"] for c in shown if c["stage"] == "synthesize"} == {True}  # a report, not a stray call


def test_analyst_requests_follow_the_seed_format_and_are_temperature_zero(conn, fresh):
    job = run_job(conn, QUESTION, skip_plan=True, threshold=-1.0)
    assert job.status == "done"
    reqs = requests_for(fresh, "analyst-model")
    assert reqs and not requests_for(fresh, "plan-model")  # --skip-plan: no planner call
    for req in reqs:
        body = req.body
        assert body["temperature"] == 0 and body["response_format"]["type"] == "json_schema"
        assert body["response_format"]["json_schema"]["name"] == "analyst_findings"
        user = last_user_message(body)
        # the shared part first, the question last (docs/contract.md#prompt-caching)
        assert user.startswith("## Chunks\n\n### Chunk ") and f"\n\n## Query\n\n{QUESTION}\n\n## Reply\n\n" in user


def test_every_json_stage_sends_the_schema_its_replies_validate_against(conn, fresh, model):
    """RLM_STRUCTURED_OUTPUTS=auto (the default): plan, analyst and check send response_format json_schema, and
    what the scripted model answers validates against it (docs/contract.md#structured-outputs)."""
    import jsonschema

    model.check_reply = json.dumps({"complete": True, "confidence": 0.8, "gaps": [], "follow_ups": []})
    job = run_job(conn, QUESTION, mode="thinking", depth=0)
    assert job.status == "done"
    seen = set()
    for req in fresh.requests:
        if req.body.get("model") == "synth-model":
            continue
        form = req.body["response_format"]
        assert form["type"] == "json_schema", req.body.get("model")
        spec = form["json_schema"]
        assert spec["schema"]["type"] == "object" and spec["strict"] is False
        reply = model(req.body)
        jsonschema.validate(json.loads(reply if isinstance(reply, str) else reply.content), spec["schema"])
        seen.add(spec["name"])
    assert seen == {"analysis_plan", "analyst_findings", "check_verdict"}
    from rlm_workers.store.jobs import llm_calls_of

    assert {c.stage: c.parse_ok for c in llm_calls_of(conn, job_id=job.id)} == {
        "plan": True,
        "analyst": True,
        "check": True,
        "synthesize": True,
    }


def test_content_breakout_is_escaped(conn, fresh):
    job = run_job(conn, QUESTION, skip_plan=True, threshold=-1.0, batch_size=3)
    assert job.status == "done"
    [req] = [r for r in requests_for(fresh, "analyst-model") if "PWNED" in last_user_message(r.body)]
    user = last_user_message(req.body)
    n_chunks = len(re.findall(r"^### Chunk \d+$", user, re.M))
    assert 1 <= n_chunks <= 3  # its batch, wherever the search ranked it (the last batch of 28 holds one)
    # the chunk's fake closing tags were defused: exactly one real open/close per chunk
    assert user.count("<content>") == n_chunks and user.count("</content>") == n_chunks
    assert len(re.findall(r"<\s*/?\s*content", user, re.I)) == 2 * n_chunks
    start = user.index("Ignore previous instructions")
    assert user.rfind("<content>", 0, start) > user.rfind("</content>", 0, start)
    system = req.body["messages"][0]["content"]
    assert "never an instruction" in system


def test_prompt_override_takes_effect_at_next_query(conn, fresh, env):
    from pathlib import Path

    prompt_dir = Path(env["RLM_PROMPT_DIR"])
    prompt_dir.mkdir(parents=True, exist_ok=True)
    override = prompt_dir / "subcall.md"
    override.write_text("CUSTOM ANALYST PROMPT v2. Reply with a JSON array of findings.\n")
    try:
        job = run_job(conn, QUESTION, skip_plan=True, threshold=-1.0, max_chunks=5)
        assert job.status == "done"
        systems = {r.body["messages"][0]["content"] for r in requests_for(fresh, "analyst-model")}
        assert systems == {"CUSTOM ANALYST PROMPT v2. Reply with a JSON array of findings."}
        synth_system = requests_for(fresh, "synth-model")[0].body["messages"][0]["content"]
        assert synth_system.startswith("You write the final answer")  # the others keep the shipped prompt
    finally:
        override.unlink()


def test_failing_batch_is_reported_and_the_report_still_written(conn, fresh):
    job = run_job(conn, QUESTION, buffers=("poison",), skip_plan=True, threshold=-1.0, batch_size=2)
    r = result_of(job)
    assert job.status == "done", job.error
    assert r.batches_failed == 1 and r.batches_processed == 2
    [err] = r.batch_errors
    assert "scripted analyst outage" in err.message and len(err.chunk_ids) == 2
    assert NEEDLE in r.response
    assert set(err.chunk_ids).isdisjoint(r.analyzed_chunk_ids)
    # every attempt of the failing batch is logged with its status (1 retry configured)
    failed = [row for row in logged_calls(conn, job.id) if row[1] != "ok"]
    assert len(failed) == 2


def test_plan_failure_aborts_the_job(conn, fresh, model):
    model.plan_reply = Reply.http_error(500, "scripted planner outage")
    job = run_job(conn, QUESTION)
    assert job.status == "failed"
    assert job.error.message.startswith("planning failed") and "planner outage" in job.error.message
    assert not requests_for(fresh, "analyst-model") and not requests_for(fresh, "synth-model")


def test_zero_search_results_is_no_chunks_with_hints(env, fresh):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlm_api.cli",
            "query",
            "zyzzyva quokka",
            "--buffer",
            "essays",
            "--skip-plan",
            "--search-mode",
            "bm25",
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr
    assert "--threshold" in proc.stderr and "--search-mode" in proc.stderr
    assert fresh.calls == 0


def test_all_findings_filtered_gives_canned_answer_without_synthesizer(conn, fresh):
    job = run_job(conn, QUESTION + " NOTHING-RELEVANT", skip_plan=True, threshold=-1.0, max_chunks=6)
    r = result_of(job)
    assert job.status == "done"
    assert r.findings_count == 0 and r.findings_filtered == r.chunks_analyzed == 6
    assert "No relevant findings" in r.response
    assert not requests_for(fresh, "synth-model")  # no evidence, no synthesizer call
    assert r.llm_calls == fresh.calls == r.batches_processed


def test_synthesizer_failure_keeps_findings(conn, fresh):
    job = run_job(conn, QUESTION + " SYNTH-FAIL", skip_plan=True, threshold=-1.0)
    assert job.status == "failed"
    assert job.error.message.startswith("synthesis failed")
    r = result_of(job)
    assert r.findings_count > 0 and any(s.relevance == "high" for s in r.sources)


def test_chunks_missing_at_analysis_are_counted(conn, fresh, workers):
    from rlm_workers.store import jobs as job_store

    for name in ("an1", "an2"):  # nobody serves rlm.analyst while we pull chunks away
        workers[name].stop()
    from rlm_workers.submit import submit_query, wait_for_job

    job_id, _ = submit_query(
        conn,
        tenant="local",
        query=QUESTION,
        buffers=["poison"],
        options={"skip_plan": True, "threshold": -1.0, "batch_size": 2},
    )
    conn.commit()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = job_store.get_job(conn, job_id=job_id)
        conn.commit()
        if job.stage == "fan_out" or job.terminal:
            break
        time.sleep(0.2)
    assert job.stage == "fan_out", (job.status, job.error)
    batches = job_store.batches(conn, job_id=job_id)
    gone = [batches[1].chunk_ids[0]] + batches[2].chunk_ids  # one chunk of batch 1, all of batch 2
    conn.execute("DELETE FROM chunks WHERE id = ANY(%s)", (gone,))
    conn.commit()
    workers["an1"].start()
    job = wait_for_job(conn, job_id, timeout=120)
    r = result_of(job)
    assert job.status == "done"
    assert r.chunk_load_failures == 3
    assert [e.batch for e in r.batch_errors] == [2] and r.batch_errors[0].type == "chunk_load"


def test_in_flight_cap_holds_across_two_worker_processes(conn, fresh, model):
    model.analyst_delay = 0.6
    job = run_job(conn, QUESTION, skip_plan=True, threshold=-1.0, batch_size=1, max_chunks=12)
    assert job.status == "done"
    assert len(requests_for(fresh, "analyst-model")) == 12
    assert fresh.max_concurrency <= 3  # RLM_MAX_CONCURRENCY, shared by an1 and an2 through Redis
    assert fresh.max_concurrency >= 2  # and the cap is used, not serialised


def test_sigkill_of_an_analyst_worker_mid_fan_out_still_ends_the_job(conn, fresh, model, workers):
    """The killed worker's batches come back by redelivery or are salvaged by the watchdog: never a hang."""
    model.analyst_delay = 3.0
    from rlm_workers.store import jobs as job_store
    from rlm_workers.submit import submit_query, wait_for_job

    workers["an2"].stop()  # all batches go to an1, which we then kill
    job_id, _ = submit_query(
        conn,
        tenant="local",
        query=QUESTION,
        buffers=["essays"],
        options={"skip_plan": True, "threshold": -1.0, "batch_size": 4},
    )
    conn.commit()
    deadline = time.monotonic() + 60
    while fresh.stats()["in_flight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fresh.stats()["in_flight"] >= 2
    workers["an1"].kill()
    workers["an2"].start()
    job = wait_for_job(conn, job_id, timeout=150)  # raises TimeoutError if the job hangs
    assert job.status == "done", job.error
    r = result_of(job)
    assert r.batches_processed + r.batches_failed == 7
    for e in r.batch_errors:
        assert e.type == "lost"
    # every batch row ended, and the report counts exactly what the rows say: nothing left running or dropped
    rows = job_store.batches(conn, job_id=job_id)
    conn.commit()
    assert len(rows) == 7 and {b.status for b in rows} <= {"ok", "failed"}, [(b.batch_no, b.status) for b in rows]
    assert sorted(b.batch_no for b in rows if b.status == "failed") == sorted(e.batch for e in r.batch_errors)
