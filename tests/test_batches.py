"""Batches end to end: real worker processes, a Valkey of this module's own (the last test wipes it), real
PostgreSQL+pgvector, and a scripted OpenAI-protocol server.

Workers ``ctl`` (rlm.control: plan/search/collect/synthesize and the batch ticks) and ``an`` (rlm.analyst) run
as ``rlm worker`` subprocesses; the CLI runs as ``rlm`` subprocesses; the HTTP API in-process (TestClient).
Tests share state in order: the cache test re-submits what the first one computed.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.jobs import wait_for
from tests.support.pipeline_model import MODEL_ENV
from tests.support.scripted_llm import Reply, last_user_message
from tests.support.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.slow

QUERIES = [
    "What do practitioners of falconry disagree about?",
    "How old is the history of canal locks?",
    "Which instruments are used for sundials today?",
]
LINE_KEYS = {"batch_id", "query", "buffer", "status", "result"}
_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)


def _essay(topic: str, extra: str = "") -> str:
    return (
        f"# Notes on {topic}\n\nPeople who study {topic} keep careful records. The history of {topic} goes "
        f"back several centuries. Practitioners of {topic} often disagree about methods.\n\nModern work on "
        f"{topic} uses better instruments, yet the basic questions remain the same.\n{extra}\n"
    )


# --------------------------------------------------------------------------- scripted model


class Model:
    """Planner: hybrid search keeping everything.  Analyst: a finding per chunk.  Synthesizer: echoes the query."""

    def __init__(self) -> None:
        self.analyst_delay = 0.0

    def __call__(self, req: dict) -> Reply | str:
        model, text = req.get("model"), last_user_message(req)
        if model == "plan-model":
            return json.dumps({"search_mode": "hybrid", "threshold": -1.0})
        if model == "analyst-model":
            # a shared read (several questions over the same chunks) wants each entry once per question
            questions = [int(n) for n in re.findall(r"^### Question (\d+)$", text, re.M)] or [None]
            out = [
                {
                    "chunk_id": int(cid),
                    "relevance": "medium",
                    "findings": [body.strip().splitlines()[0]],
                    "summary": "notes",
                    "follow_up": [],
                    **({"question": q} if q is not None else {}),
                }
                for q in questions
                for cid, body in _CHUNK.findall(text)
            ]
            return Reply.text(json.dumps({"findings": out}), delay=self.analyst_delay)
        query = re.search(r"## Query\n\n(.*?)\n\n", text, re.S)
        return f"## Answer\n\nScripted answer to: {query.group(1) if query else '?'}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    """This module's own embedded Valkey: the Redis-restart test stops and wipes it."""
    from rlm_workers.runtime import local_servers as services

    root = tmp_path_factory.mktemp("batch-valkey")
    url = services.embedded_valkey_url(root)
    yield root, url
    services.stop_embedded_valkey(root)


@pytest.fixture(scope="module")
def model():
    return Model()


@pytest.fixture(scope="module")
def env(rlm_env, llm, valkey):
    from tests.support.envpatch import patched_env

    extra = {
        "RLM_BROKER_URL": valkey[1],
        "OPENAI_API_KEY": "sk-test-not-a-real-key",
        "OPENAI_BASE_URL": llm.base_url,
        **MODEL_ENV,
        "RLM_LLM_RETRIES": "1",
        "RLM_LLM_TIMEOUT": "30",
        "RLM_MAX_CONCURRENCY": "8",
        "RLM_BATCH_PARALLEL": "2",
        "RLM_BATCH_TICK_SECONDS": "0.5",
        "RLM_RECONCILE_SECONDS": "1",
        "RLM_VISIBILITY_TIMEOUT": "60",
        "RLM_JOB_TIMEOUT": "50",
        "HF_HUB_OFFLINE": "1",
    }
    # the test process sends tasks too (API submit): reset_settings (patched_env) points its Celery app and its
    # Redis client at this module's broker, and back at the shared one afterwards
    with patched_env(extra):
        yield {**rlm_env, **extra}


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("batch-corpus")
    for name, topics in (
        ("alpha", ["falconry", "canal locks", "sundials", "windmills"]),
        ("beta", ["salt marshes", "clockmaking", "kelp forests", "ice cores"]),
    ):
        d = root / name
        d.mkdir()
        for i, topic in enumerate(topics):
            (d / f"{i}-{topic.replace(' ', '-')}.md").write_text(_essay(topic))
        load_paths(conn, buffer=name, paths=[d], embedder=embedder)
        conn.commit()
    return root


@pytest.fixture(scope="module")
def workers(env, corpus, valkey, tmp_path_factory):
    import redis

    redis.Redis.from_url(valkey[1]).flushdb()
    logs = tmp_path_factory.mktemp("batch-worker-logs")
    ws = {
        "ctl": WorkerProcess("bctl", queues="rlm.control", env=env, log_dir=logs, concurrency=4),
        "an": WorkerProcess("ban", queues="rlm.analyst", env=env, log_dir=logs, concurrency=8),
    }
    for w in ws.values():
        w.start()
    yield ws
    for w in ws.values():
        w.stop()


@pytest.fixture(scope="module")
def api(env, conn):
    from fastapi.testclient import TestClient

    from rlm_api.app import create_app
    from rlm_api.auth import create_key

    key, _ = create_key(conn, tenant="local", name="batch tests")
    other, _ = create_key(conn, tenant="someone-else", name="batch tests")
    conn.commit()
    client = TestClient(create_app())
    client.headers["Authorization"] = f"Bearer {key}"
    client.other_key = other
    return client


@pytest.fixture()
def fresh(llm, model, workers):
    model.analyst_delay = 0.0
    for w in workers.values():
        if not w.alive:
            w.start()
    llm.reset()
    return llm


def run_rlm(env, *args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
        input=stdin,
    )


def wait_batch(conn, batch_id, workers, timeout=120.0, on_poll=None):
    from rlm_workers.store import overnight as store

    deadline = time.monotonic() + timeout
    while True:
        b = store.get_overnight(conn, overnight_batch_id=batch_id)
        if on_poll is not None:
            on_poll(store.progress(conn, overnight_batch_id=batch_id))
        conn.commit()
        if b.status in ("done", "cancelled"):
            return b
        if time.monotonic() > deadline:
            p = store.progress(conn, overnight_batch_id=batch_id)
            conn.commit()
            tails = "\n".join(f"--- {n}\n{w.tail(40)}" for n, w in workers.items())
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout}s: {p.counts}\n{tails}")
        time.sleep(0.2)


def jsonl(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plans(llm):
    """Jobs that reached the model: one planner call each."""
    return sum(1 for r in llm.requests if r.body.get("model") == "plan-model")


def llm_call_rows(conn):
    n = conn.execute("SELECT count(*) FROM llm_calls").fetchone()[0]
    conn.commit()
    return n


# --------------------------------------------------------------------------- pure parts


def test_queries_file_formats():
    from rlm_workers.errors import InvalidInput
    from rlm_workers.overnight.submit import parse_queries

    text = '# nightly questions\n\nWhat is A?\n  {"query": "What is B?", "tag": 1}\nWhat is A?\n\n'
    assert parse_queries(text) == ["What is A?", "What is B?"]
    for bad, msg in (
        ("# only a comment\n\n", "no query"),
        ('{"q": 1}\n', "line 1"),
        ("ok\n{not json\n", "line 2"),
        ("x" * 20_000, "line 1"),
    ):
        with pytest.raises(InvalidInput, match=msg):
            parse_queries(bad)


def test_cache_key_covers_buffer_content_options_and_models():
    from rlm_workers.config import Settings
    from rlm_workers.overnight.cache import cache_key, fingerprint

    s1 = Settings(api_key="k", subcall_model="m1")
    s2 = Settings(api_key="k", subcall_model="m2")
    fp1, fp2 = fingerprint(s1), fingerprint(s2)
    base = dict(tenant="t", query="q", buffer_id=1, content="c1", options={}, fp=fp1)
    k = cache_key(**base)
    assert k == cache_key(**base)
    assert fp1 != fp2 and fp1 != fingerprint(Settings())  # other model; offline provider
    for change in (
        {"content": "c2"},
        {"options": {"top_k": 5}},
        {"fp": fp2},
        {"tenant": "u"},
        {"buffer_id": 2},
        {"query": "q2"},
    ):
        assert cache_key(**{**base, **change}) != k


def test_at_accepts_iso_and_relative_times():
    from rlm_api.cli_batch import parse_at
    from rlm_workers.errors import InvalidInput

    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_at("+90m", now=now) == now + timedelta(minutes=90)
    assert parse_at("2030-01-02T03:00:00+00:00", now=now) == datetime(2030, 1, 2, 3, tzinfo=UTC)
    local = parse_at("2030-01-02T03:00", now=now)  # no zone: this machine's local time, made explicit
    assert local.utcoffset() is not None and local == datetime(2030, 1, 2, 3).astimezone()
    with pytest.raises(InvalidInput):
        parse_at("tomorrow")


def test_at_is_bounded_to_a_year_either_way():
    """--at +99999999d overflowed a datetime (traceback); a year-10000 time was stored and then unreadable."""
    from rlm_api.cli_batch import parse_at
    from rlm_workers.errors import InvalidInput

    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_at("+365d", now=now) == now + timedelta(days=365)
    for bad, msg in (
        ("+99999999d", "more than 365 days ahead"),
        ("+999999999999999999999999999999h", "more than 365 days ahead"),
        ("+366d", "more than 365 days ahead"),
        ("9999-12-31T23:59:59-23:59", "more than 365 days ahead"),
        ("9999-12-31T23:59:59", "ahead|invalid --at"),
        ("0001-01-01T00:00:00+14:00", "in the past|invalid --at"),
        ("2028-12-31T00:00:00Z", "in the past"),
    ):
        with pytest.raises(InvalidInput, match=msg):
            parse_at(bad, now=now)


def test_broker_priority_keeps_batches_behind_interactive_queries():
    from rlm_workers.overnight.scheduler import broker_priority

    assert [broker_priority(p) for p in range(1, 10)] == [3, 3, 3, 6, 6, 6, 9, 9, 9]


# --------------------------------------------------------------------------- end to end


def test_cli_batch_runs_every_item_with_bounded_parallelism(env, conn, fresh, workers, api, tmp_path):
    qfile = tmp_path / "queries.txt"
    qfile.write_text(f"# three questions\n\n{QUERIES[0]}\n{json.dumps({'query': QUERIES[1]})}\n\n{QUERIES[2]}\n")
    proc = run_rlm(env, "batch", "submit", "--queries", str(qfile), "--buffer", "alpha", "--buffer", "beta")
    assert proc.returncode == 0, proc.stderr
    batch_id = proc.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", batch_id), proc.stdout
    assert "no running worker" not in proc.stderr

    most_running = []
    b = wait_batch(conn, batch_id, workers, on_poll=lambda p: most_running.append(p.counts["running"]))
    assert b.status == "done"
    assert max(most_running) <= 2  # RLM_BATCH_PARALLEL

    # results: CLI JSONL, CLI CSV, API JSONL agree
    proc = run_rlm(env, "batch", "results", batch_id)
    assert proc.returncode == 0, proc.stderr
    lines = jsonl(proc.stdout)
    assert len(lines) == 6
    assert all(LINE_KEYS <= set(line) for line in lines)
    assert {(x["query"], x["buffer"]) for x in lines} == {(q, b) for q in QUERIES for b in ("alpha", "beta")}
    for line in lines:
        assert line["batch_id"] == batch_id and line["status"] == "done" and not line["from_cache"]
        assert line["result"]["response"] == f"## Answer\n\nScripted answer to: {line['query']}"
        assert {s["buffer"] for s in line["result"]["sources"]} == {line["buffer"]}
    proc = run_rlm(env, "batch", "results", batch_id, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert len(rows) == 6 and {r["status"] for r in rows} == {"done"}
    assert rows[0]["response"].startswith("## Answer")
    r = api.get(f"/v1/batches/{batch_id}/results")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert jsonl(r.text) == lines

    # progress: counts, exact tokens (the sum of every logged LLM call of the items' jobs), ETA 0
    st = api.get(f"/v1/batches/{batch_id}").json()
    assert st["status"] == "done" and st["total"] == 6 and st["counts"]["done"] == 6 and st["eta_seconds"] == 0
    job_ids = [line["result"]["job_id"] for line in lines]
    assert len(set(job_ids)) == 6
    # a shared read is logged once per question it answered, each row holding its share (docs/contract.md#shared-reads)
    billed = conn.execute(
        "SELECT sum(tokens_in + tokens_out), round(sum(1.0 / shared)) FROM llm_calls WHERE job_id = ANY(%s)",
        (job_ids,),
    ).fetchone()
    conn.commit()
    assert st["tokens_spent"] == billed[0] == fresh.usage["total_tokens"] > 0
    assert billed[1] == fresh.calls
    per_item = conn.execute(
        "SELECT job_id, count(*) FILTER (WHERE stage = 'plan'), count(*) FILTER (WHERE stage = "
        "'synthesize') FROM llm_calls WHERE job_id = ANY(%s) GROUP BY job_id",
        (job_ids,),
    ).fetchall()
    conn.commit()
    assert len(per_item) == 6 and all(row[1] == 1 and row[2] == 1 for row in per_item)  # each item ran once
    proc = run_rlm(env, "batch", "status", batch_id)
    assert proc.returncode == 0 and "done" in proc.stdout and "6/6 done" in proc.stdout

    # another tenant sees nothing
    other = {"Authorization": f"Bearer {api.other_key}"}
    for path in (f"/v1/batches/{batch_id}", f"/v1/batches/{batch_id}/results"):
        assert api.get(path, headers=other).status_code == 404
    assert api.get("/v1/batches", headers=other).json() == []


def test_resubmitted_batch_is_served_from_the_cache_without_llm_calls(env, conn, fresh, workers, api, embedder, corpus):
    calls_before = llm_call_rows(conn)
    jobs_before = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    conn.commit()
    r = api.post("/v1/batches", json={"queries": QUERIES, "buffers": ["alpha", "beta"]})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status_url"] == f"/v1/batches/{body['batch_id']}"
    b = wait_batch(conn, body["batch_id"], workers, timeout=30)
    assert b.status == "done"
    lines = jsonl(api.get(body["results_url"]).text)
    assert len(lines) == 6 and all(x["status"] == "done" and x["from_cache"] for x in lines)
    assert fresh.calls == 0 and llm_call_rows(conn) == calls_before
    assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == jobs_before  # not even a job
    conn.commit()
    assert api.get(body["status_url"]).json()["from_cache"] == 6

    # reloading a buffer bumps its version: only that buffer's items run again
    from rlm_workers.ingest.loader import load_paths

    (corpus / "beta" / "9-extra.md").write_text(_essay("tea ceremonies"))
    load_paths(conn, buffer="beta", paths=[corpus / "beta"], embedder=embedder)
    conn.commit()
    r = api.post("/v1/batches", json={"queries": QUERIES, "buffers": ["alpha", "beta"]})
    wait_batch(conn, r.json()["batch_id"], workers)
    lines = jsonl(api.get(r.json()["results_url"]).text)
    assert {x["buffer"] for x in lines if x["from_cache"]} == {"alpha"}
    assert {x["buffer"] for x in lines if not x["from_cache"]} == {"beta"}
    assert all(x["status"] == "done" for x in lines) and plans(fresh) == 3


def test_run_at_in_the_future_does_not_start_early(env, conn, fresh, workers, api):
    run_at = datetime.now(UTC) + timedelta(seconds=5)
    r = api.post(
        "/v1/batches",
        json={
            "queries": ["Why do people study windmills?"],
            "buffers": ["alpha"],
            "run_at": run_at.isoformat(),
            "priority": 7,
        },
    )
    assert r.status_code == 202, r.text
    batch_id = r.json()["batch_id"]
    while datetime.now(UTC) < run_at - timedelta(seconds=0.5):
        st = api.get(f"/v1/batches/{batch_id}").json()
        assert st["status"] == "scheduled" and st["counts"]["pending"] == 1, st
        assert fresh.calls == 0
        time.sleep(0.3)
    b = wait_batch(conn, batch_id, workers)
    assert b.status == "done" and b.started_at >= run_at - timedelta(milliseconds=50)
    assert plans(fresh) == 1


def test_token_budget_stops_scheduling(env, conn, fresh, workers, api):
    queries = [f"Budget question {i} about ice cores?" for i in range(3)]
    r = api.post("/v1/batches", json={"queries": queries, "buffers": ["beta"], "token_budget": 1})
    batch_id = r.json()["batch_id"]
    wait_batch(conn, batch_id, workers)
    st = api.get(f"/v1/batches/{batch_id}").json()
    # two items were in flight (RLM_BATCH_PARALLEL) before anything was spent; the third never starts
    assert st["counts"]["done"] == 2 and st["counts"]["skipped"] == 1, st
    assert st["tokens_spent"] == fresh.usage["total_tokens"] and plans(fresh) == 2
    skipped = [x for x in jsonl(api.get(f"/v1/batches/{batch_id}/results").text) if x["status"] == "skipped"]
    assert skipped[0]["error"]["type"] == "token_budget" and skipped[0]["result"] is None


def test_ticks_never_fork_the_chain(env, conn, fresh, workers, settings):
    """Only the tick holding the current token re-arms (and hands on a new one); a locked batch is skipped."""
    import psycopg

    from rlm_workers.overnight.scheduler import tick_overnight
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.store import overnight as store

    batch_id, _ = submit_overnight(
        conn,
        tenant="local",
        queries=["Chain question?"],
        buffers=["alpha"],
        run_at=datetime.now(UTC) + timedelta(hours=1),
    )
    # the worker runs the first tick and re-arms for a minute later; wait for it so nothing races the test
    deadline = time.monotonic() + 30
    while store.get_overnight(conn, overnight_batch_id=batch_id).last_tick_at is None:
        conn.commit()
        assert time.monotonic() < deadline, "the worker never ran the batch's first tick"
        time.sleep(0.05)
    conn.commit()
    res = tick_overnight(conn, batch_id, "not-the-owner", epoch=None)
    assert res.status == "waiting" and res.next_token is None and not res.to_send
    token = store.get_overnight(conn, overnight_batch_id=batch_id).tick_token
    conn.commit()
    res = tick_overnight(conn, batch_id, token, epoch=None)
    assert res.status == "waiting" and res.next_token not in (None, token) and 0 < res.next_in <= 60
    assert store.get_overnight(conn, overnight_batch_id=batch_id).tick_token == res.next_token
    conn.commit()
    with psycopg.connect(env["RLM_DATABASE_URL"]) as other:
        other.execute("SELECT 1 FROM overnight_batches WHERE id = %s FOR UPDATE", (batch_id,))
        assert tick_overnight(conn, batch_id, res.next_token, epoch=None).status == "busy"
    assert tick_overnight(conn, "0" * 32, None, epoch=None).status == "missing"
    from rlm_workers.overnight.submit import cancel_overnight

    assert cancel_overnight(conn, tenant="local", overnight_batch_id=batch_id).status == "cancelled"
    assert tick_overnight(conn, batch_id, res.next_token, epoch=None).status == "cancelled"
    assert fresh.calls == 0


def test_idempotency_cancel_and_validation(env, conn, fresh, workers, api):
    later = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    body = {"queries": ["Idempotent question?"], "buffers": ["alpha"], "run_at": later}
    first = api.post("/v1/batches", json=body, headers={"Idempotency-Key": "nightly-1"})
    again = api.post("/v1/batches", json=body, headers={"Idempotency-Key": "nightly-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert first.json()["batch_id"] == again.json()["batch_id"]
    batch_id = first.json()["batch_id"]
    r = api.delete(f"/v1/batches/{batch_id}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["counts"]["cancelled"] == 1
    assert fresh.calls == 0

    for bad, code, kind in (
        ({"queries": [], "buffers": ["alpha"]}, 422, "invalid_input"),
        ({"queries": ["q"], "buffers": ["nope"]}, 404, "buffer_not_found"),
        ({"queries": ["q"], "buffers": []}, 422, "invalid_input"),
        ({"queries": ["q"], "buffers": ["alpha"], "priority": 0}, 422, "invalid_input"),
        ({"queries": ["q"], "buffers": ["alpha"], "options": {"top_k": -1}}, 422, "invalid_input"),
        ({"queries": ["q"], "buffers_glob": "zz-*"}, 422, "invalid_input"),
    ):
        r = api.post("/v1/batches", json=bad)
        assert r.status_code == code and r.json()["error"]["type"] == kind, (bad, r.text)
    assert api.get("/v1/batches/0123456789abcdef").status_code == 404
    assert api.get("/v1/batches", headers={"Authorization": "Bearer nope"}).status_code == 401

    proc = run_rlm(env, "batch", "submit", "--queries", "/nonexistent/q.txt", "--buffer", "alpha")
    assert proc.returncode == 2 and "queries file not found" in proc.stderr and proc.stdout == ""
    proc = run_rlm(env, "batch", "submit", "--queries", "-", "--buffer", "alpha", "--at", "soon", stdin="q\n")
    assert proc.returncode == 2 and "--at" in proc.stderr
    proc = run_rlm(
        env,
        "batch",
        "submit",
        "--queries",
        "-",
        "--buffers-glob",
        "al*",
        "--at",
        "+1h",
        "--no-check-workers",
        stdin="Glob question?\n",
    )
    assert proc.returncode == 0, proc.stderr
    st = json.loads(run_rlm(env, "batch", "status", proc.stdout.strip(), "--format", "json").stdout)
    assert st["status"] == "scheduled" and st["total"] == 1
    assert run_rlm(env, "batch", "cancel", proc.stdout.strip()).returncode == 0
    assert run_rlm(env, "batch", "status", "f" * 32).returncode == 2

    # the CLI checks a reused key as the API does: another request under it is refused, the same one replays
    # (a fixed --at: a relative one is another instant, so another request, at every call)
    at = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0).isoformat()
    keyed = ("batch", "submit", "--queries", "-", "--buffer", "alpha", "--at", at, "--no-check-workers")
    keyed += ("--idempotency-key", "cli-nightly")
    first = run_rlm(env, *keyed, stdin="Keyed question?\n")
    assert first.returncode == 0, first.stderr
    assert run_rlm(env, *keyed, stdin="Keyed question?\n").stdout == first.stdout
    other = run_rlm(env, *keyed, stdin="Another question?\n")
    assert other.returncode == 2 and other.stdout == "", other.stderr
    assert "used for a different request" in other.stderr and "Traceback" not in other.stderr
    assert run_rlm(env, "batch", "cancel", first.stdout.strip()).returncode == 0


def test_run_at_needs_a_zone_and_is_bounded(env, conn, api, workers, tmp_path):
    """A far-future run_at was accepted (202) and poisoned the tenant's batches; a zone-less one was taken as
    UTC by the API but as local time by the CLI.  Now: the API refuses both (422, nothing stored); the CLI
    resolves a zone-less --at as local time and says the UTC instant."""
    before = conn.execute("SELECT count(*) FROM overnight_batches").fetchone()[0]
    conn.commit()
    for run_at, msg in (
        ("9999-12-31T23:59:59-23:59", "more than 365 days ahead"),
        ((datetime.now(UTC) + timedelta(days=400)).isoformat(), "more than 365 days ahead"),
        ("2001-01-01T00:00:00Z", "in the past"),
        ("2030-01-01T02:00:00", "run_at needs a time zone offset, e.g. 2026-11-24T02:00:00Z"),
    ):
        r = api.post("/v1/batches", json={"queries": ["Bounded?"], "buffers": ["alpha"], "run_at": run_at})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_input", (run_at, r.text)
        assert msg in r.json()["error"]["message"], (run_at, r.text)
    assert conn.execute("SELECT count(*) FROM overnight_batches").fetchone()[0] == before
    conn.commit()

    for at in ("+99999999d", "9999-12-31T23:59:59-23:59"):
        proc = run_rlm(env, "batch", "submit", "-q", "-", "-b", "alpha", "--at", at, "--no-check-workers", stdin="q\n")
        assert proc.returncode == 2 and proc.stdout == "", (at, proc.stderr)
        assert "--at" in proc.stderr and "365 days" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    local = (datetime.now() + timedelta(hours=3)).replace(microsecond=0)
    proc = run_rlm(
        env, "batch", "submit", "-q", "-", "-b", "alpha", "--at", local.isoformat(), "--no-check-workers", stdin="q\n"
    )
    assert proc.returncode == 0, proc.stderr
    batch_id = proc.stdout.strip()
    utc = local.astimezone(UTC)
    assert f"starts no earlier than {utc.isoformat().replace('+00:00', 'Z')}" in proc.stderr
    st = api.get(f"/v1/batches/{batch_id}").json()
    assert datetime.fromisoformat(st["run_at"]) == utc
    assert api.delete(f"/v1/batches/{batch_id}").status_code == 200


def _insert_raw_batch(conn, batch_id, *, run_at_sql, next_tick_sql, query="Unreadable question?"):
    """A batch row written straight to SQL, as a version without the run_at bound could store it."""
    conn.execute(
        f"""INSERT INTO overnight_batches (id, tenant, run_at, tick_token, next_tick_at)
            VALUES (%s, 'local', {run_at_sql}, 'old-token', {next_tick_sql})""",
        (batch_id,),
    )
    conn.execute(
        "INSERT INTO overnight_batch_items (overnight_batch_id, item_no, query, buffer) VALUES (%s, 0, %s, 'alpha')",
        (batch_id, query),
    )
    conn.commit()


def test_an_unreadable_batch_row_breaks_no_list_cancel_or_tick(env, conn, fresh, workers, api):
    """Year 10000 (UTC) is stored by PostgreSQL but cannot be loaded by psycopg: one such row made
    GET /v1/batches 500 for its tenant, `rlm batch list/status/cancel` traceback, and its tick fail forever."""
    from rlm_workers.store import overnight as store

    far = "'10000-01-01 23:58:59+00'::timestamptz"  # 9999-12-31T23:59:59-23:59 in UTC
    kept, ticked = "a" * 31 + "1", "a" * 31 + "2"
    # one the reconciler leaves alone for now (next tick an hour away), one whose tick is long overdue
    _insert_raw_batch(conn, kept, run_at_sql=far, next_tick_sql="now() + interval '1 hour'")
    _insert_raw_batch(conn, ticked, run_at_sql=far, next_tick_sql="now() - interval '1 hour'")

    r = api.get("/v1/batches")
    assert r.status_code == 200, r.text
    shown = {b["batch_id"]: b for b in r.json()}
    assert kept in shown and shown[kept]["run_at"] is None and shown[kept]["total"] == 1
    assert api.get(f"/v1/batches/{kept}").status_code == 200
    proc = run_rlm(env, "batch", "list")
    assert proc.returncode == 0 and kept in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    proc = run_rlm(env, "batch", "status", kept, "--format", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["run_at"] is None, proc.stderr
    proc = run_rlm(env, "batch", "cancel", kept)
    assert proc.returncode == 0 and "cancelled" in proc.stdout, proc.stderr
    assert api.delete(f"/v1/batches/{kept}").json()["status"] == "cancelled"

    # the reconciler re-arms the overdue one once; its tick closes it for good instead of failing
    b = wait_batch(conn, ticked, workers, timeout=60)
    assert b.status == "done" and b.run_at is None
    (item,) = store.items(conn, overnight_batch_id=ticked)
    conn.commit()
    assert item.status == "failed" and item.error["type"] == "batch_failed" and "run_at" in item.error["message"]
    assert fresh.calls == 0
    assert api.get("/v1/batches").status_code == 200


def test_a_tick_that_keeps_failing_closes_the_batch(env, conn, fresh, workers, api):
    """A tick that fails for a reason other than an outage used to be re-armed by the reconciler forever;
    now the failures are counted and the batch is closed with its items failed and its error said."""
    from rlm_workers.overnight.scheduler import MAX_TICK_FAILURES
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.store import overnight as store

    # a real failure inside the tick's transaction: creating this batch's job raises in PostgreSQL
    conn.execute(
        """CREATE FUNCTION poison_job() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN IF NEW.query LIKE 'Poisoned tick%' THEN RAISE EXCEPTION 'injected failure'; END IF;
           RETURN NEW; END $$;
           CREATE TRIGGER poison_job BEFORE INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION poison_job();"""
    )
    conn.commit()
    try:
        batch_id, _ = submit_overnight(conn, tenant="local", queries=["Poisoned tick question?"], buffers=["alpha"])
        b = wait_batch(conn, batch_id, workers, timeout=90)
    finally:
        conn.execute("DROP TRIGGER poison_job ON jobs; DROP FUNCTION poison_job()")
        conn.commit()
    assert b.status == "done"
    (item,) = store.items(conn, overnight_batch_id=batch_id)
    failures = conn.execute("SELECT tick_failures FROM overnight_batches WHERE id = %s", (batch_id,)).fetchone()[0]
    conn.commit()
    assert failures == MAX_TICK_FAILURES
    assert item.status == "failed" and item.error["type"] == "batch_failed"
    assert f"failed {MAX_TICK_FAILURES} times in a row" in item.error["message"]
    assert fresh.calls == 0


def test_a_buffer_deleted_and_reloaded_is_not_answered_from_the_cache(
    env, conn, fresh, workers, api, embedder, tmp_path
):
    """The cache was keyed on buffer name + version; both restart when a buffer is deleted and recreated, so
    the old content's answer (with its dead chunk ids) was served for the new content."""
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import delete_buffer, get_buffer

    def load(topic):
        d = tmp_path / topic.replace(" ", "-")
        d.mkdir()
        (d / "notes.md").write_text(_essay(topic))
        load_paths(conn, buffer="gamma", paths=[d], embedder=embedder)
        conn.commit()
        return get_buffer(conn, tenant="local", name="gamma")

    def run():
        r = api.post("/v1/batches", json={"queries": ["What do people disagree about?"], "buffers": ["gamma"]})
        assert r.status_code == 202, r.text
        wait_batch(conn, r.json()["batch_id"], workers)
        (line,) = jsonl(api.get(r.json()["results_url"]).text)
        assert line["status"] == "done", line
        return line

    first_buffer = load("lighthouses")
    first = run()
    assert not first["from_cache"] and run()["from_cache"]  # cached, and served again while unchanged
    cached = conn.execute("SELECT count(*) FROM result_cache WHERE buffer_id = %s", (first_buffer.id,)).fetchone()[0]
    assert cached == 1

    assert delete_buffer(conn, tenant="local", name="gamma")
    conn.commit()
    # the deleted content's answers go with it
    assert conn.execute("SELECT count(*) FROM result_cache WHERE buffer_id = %s", (first_buffer.id,)).fetchone()[0] == 0
    second_buffer = load("beekeeping")
    conn.commit()
    assert second_buffer.version == first_buffer.version  # versions restart: the name and version are not enough
    plans_before = plans(fresh)
    second = run()
    assert not second["from_cache"] and plans(fresh) == plans_before + 1
    chunk_ids = {s["chunk_id"] for s in second["result"]["sources"]}
    live = {r[0] for r in conn.execute("SELECT id FROM chunks WHERE buffer_id = %s", (second_buffer.id,))}
    conn.commit()
    assert chunk_ids and chunk_ids <= live
    assert delete_buffer(conn, tenant="local", name="gamma")
    conn.commit()


def test_nul_and_lone_surrogates_are_refused_on_every_query_path(env, conn, api, workers, tmp_path):
    """PostgreSQL text cannot hold NUL and UTF-8 cannot encode a lone surrogate: batch queries (API and queries
    file) and `rlm query` let them through to a 500 or a traceback.  One validator refuses them everywhere."""
    before = conn.execute("SELECT count(*) FROM overnight_batches").fetchone()[0]
    conn.commit()
    for raw in (b'["Fine?", "a\\u0000b"]', b'["Fine?", "lone \\ud800 half"]'):
        body = b'{"queries": ' + raw + b', "buffers": ["alpha"]}'
        r = api.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_input", (raw, r.text)
    assert conn.execute("SELECT count(*) FROM overnight_batches").fetchone()[0] == before
    conn.commit()

    for text, what in (
        ("Fine?\nnul \x00 here\n", "line 2: the query contains a NUL character"),
        ('{"query": "lone \\ud800 half"}\n', "line 1: the query contains text that is not valid Unicode"),
        ('Fine?\n{"query": "a\\u0000b"}\n', "line 2: the query contains a NUL character"),
    ):
        qfile = tmp_path / "queries.txt"
        qfile.write_text(text, encoding="utf-8")
        proc = run_rlm(env, "batch", "submit", "-q", str(qfile), "-b", "alpha", "--no-check-workers")
        assert proc.returncode == 2 and proc.stdout == "", (text, proc.stderr)
        assert what in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (text, proc.stderr)

    # a non-UTF-8 byte in argv arrives as a lone surrogate (surrogateescape)
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "query", b"broken \xff byte", "--buffer", "alpha"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        timeout=180,
    )
    err = proc.stderr.decode("utf-8", "replace")
    # the CLI refuses it before any command runs: one line, exit 2
    assert proc.returncode == 2 and "not valid UTF-8" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert conn.execute("SELECT count(*) FROM overnight_batches").fetchone()[0] == before
    conn.commit()


def test_interactive_query_gets_through_a_running_batch(env, conn, fresh, model, workers, api):
    """Batch items are bounded per batch and start behind interactive work: a query submitted mid-batch ends first."""
    from rlm_workers.store import overnight as store
    from rlm_workers.submit import submit_query, wait_for_job

    model.analyst_delay = 1.0
    queries = [f"Long batch question {i} about clockmaking?" for i in range(6)]
    r = api.post("/v1/batches", json={"queries": queries, "buffers": ["beta"], "priority": 9})
    batch_id = r.json()["batch_id"]

    def batch_running():
        p = store.progress(conn, overnight_batch_id=batch_id)
        conn.commit()
        return p.counts["running"] >= 1

    assert wait_for(batch_running, timeout=60)  # the query is submitted mid-batch, not before it began
    job_id, _ = submit_query(
        conn, tenant="local", query="Interactive: what about salt marshes?", buffers=["beta"], options={}
    )
    conn.commit()
    job = wait_for_job(conn, job_id, timeout=60)
    assert job.status == "done"
    p = store.progress(conn, overnight_batch_id=batch_id)
    conn.commit()
    # the order of events, not a duration: the query ended while batch items still waited or ran
    assert p.counts["pending"] + p.counts["running"] > 0, "the batch should still be running"
    b = wait_batch(conn, batch_id, workers)
    assert b.status == "done" and job.finished_at < b.finished_at


def test_redis_wiped_mid_batch_loses_and_duplicates_nothing(env, conn, fresh, model, workers, api, valkey):
    """Valkey stopped, its data deleted (a Redis without persistence), started again on the same port."""
    from rlm_workers.runtime import local_servers as services
    from rlm_workers.store import overnight as store

    model.analyst_delay = 1.5
    queries = [f"After the restart, what about {t}?" for t in ("falconry", "kelp", "sundials")]
    r = api.post("/v1/batches", json={"queries": queries, "buffers": ["alpha", "beta"]})
    batch_id = r.json()["batch_id"]
    deadline = time.monotonic() + 60
    while True:
        p = store.progress(conn, overnight_batch_id=batch_id)
        conn.commit()
        if p.counts["done"] >= 1 and p.counts["running"] >= 1:
            break
        assert time.monotonic() < deadline, p.counts
        time.sleep(0.1)

    root, url = valkey
    vdir = root / services.VALKEY_DIRNAME
    state = (vdir / "server.json").read_text()
    assert services.stop_embedded_valkey(root)
    for p in vdir.iterdir():
        if p.name.startswith("appendonly") or p.suffix == ".rdb":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    time.sleep(2.0)  # workers notice the broker is gone
    (vdir / "server.json").write_text(state)  # the old port is reused: every client reconnects to the same URL
    assert services.embedded_valkey_url(root) == url

    b = wait_batch(conn, batch_id, workers, timeout=180)
    assert b.status == "done"
    items = store.items(conn, overnight_batch_id=batch_id)
    conn.commit()
    assert len(items) == 6 and all(i.status == "done" for i in items), [(i.item_no, i.status, i.error) for i in items]
    lines = jsonl(api.get(f"/v1/batches/{batch_id}/results").text)
    assert len(lines) == 6
    assert sorted((x["query"], x["buffer"]) for x in lines) == sorted(
        (q, b) for q in queries for b in ("alpha", "beta")
    )
    assert len({x["result"]["job_id"] for x in lines}) == 6
    # the loss was noticed and acted on, and the actions were logged
    assert any(i.attempts >= 1 for i in items) or "reconcile: batch" in workers["ctl"].tail(400)
    assert "reconcile: batch" in workers["ctl"].tail(400) + workers["an"].tail(400)
    # every job ended as lost is accounted for: abandoned by the reconciler (an attempt counted), or never enqueued
    # while the broker was down (released to pending, no attempt counted: a loaded machine can submit in that gap)
    lost = [r[0] for r in conn.execute("SELECT error->>'message' FROM jobs WHERE error->>'type' = 'lost'")]
    conn.commit()
    abandoned = [m for m in lost if m.startswith(f"abandoned by batch {batch_id}:")]
    unsent = [m for m in lost if m == "could not be enqueued (broker unavailable)"]
    assert len(abandoned) + len(unsent) == len(lost), lost
    assert len(abandoned) == sum(i.attempts for i in items), (lost, [(i.item_no, i.attempts) for i in items])
