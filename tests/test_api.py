"""The HTTP API as clients use it: uvicorn in a subprocess, real workers, real servers, real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.api import Api, free_port
from tests.support.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.slow

DOCS = [
    {
        "path": "guide/retries.md",
        "text": "# Retries\n\nFailed uploads are retried three times with exponential "
        "backoff, starting at two seconds.\n",
    },
    {
        "path": "guide/limits.md",
        "text": "# Limits\n\nEach account may store at most fifty gigabytes of documents.\n",
    },
]


@pytest.fixture(scope="module")
def env(rlm_env):
    return {**rlm_env, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def keys(env, conn):
    from rlm_api.auth import create_key

    a, _ = create_key(conn, tenant="acme")
    b, _ = create_key(conn, tenant="globex")
    revoked, _ = create_key(conn, tenant="acme", name="old")
    conn.execute("UPDATE api_keys SET revoked_at = now() WHERE name = 'old'")
    conn.commit()
    return {"a": a, "b": b, "revoked": revoked}


@pytest.fixture(scope="module")
def api(env, keys, tmp_path_factory):
    import redis

    redis.Redis.from_url(env["RLM_BROKER_URL"]).flushdb()
    server = Api(env, tmp_path_factory.mktemp("api") / "api.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def control(env, api, tmp_path_factory):
    w = WorkerProcess("actl", queues="rlm.control", env=env, log_dir=tmp_path_factory.mktemp("api-w")).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def analysts(env, control, tmp_path_factory):
    w = WorkerProcess("aan", queues="rlm.analyst", env=env, log_dir=tmp_path_factory.mktemp("api-w2")).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def docs_a(api, keys):
    with api.client(keys["a"]) as c:
        r = c.post("/v1/buffers", json={"name": "handbook", "documents": DOCS})
    assert r.status_code == 201, r.text
    return r.json()


def test_health_ready_metrics_and_openapi(api):
    assert httpx.get(f"{api.base}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{api.base}/readyz")
    assert ready.status_code == 200 and ready.json()["database"] == "ok" and ready.json()["broker"] == "ok"
    metrics = httpx.get(f"{api.base}/metrics").text
    assert "# TYPE rlm_jobs gauge" in metrics and 'rlm_queue_depth{queue="rlm.analyst"}' in metrics
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f.type for f in text_string_to_metric_families(metrics)}  # a scraper can parse it
    assert families["rlm_stage_seconds"] == "histogram" and families["rlm_queue_depth"] == "gauge"
    assert {"rlm_llm_calls", "rlm_llm_tokens", "rlm_llm_errors"} <= set(families)  # counters lose _total
    spec = httpx.get(f"{api.base}/openapi.json").json()
    assert {"/v1/queries", "/v1/queries/{job_id}", "/v1/buffers", "/v1/batches"} <= set(spec["paths"])
    assert httpx.get(f"{api.base}/docs").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer rlm_wrong"}, {"Authorization": "Basic abc"}])
def test_v1_needs_a_valid_key(api, headers):
    r = httpx.get(f"{api.base}/v1/buffers", headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "unauthorized"


def test_revoked_key_is_refused(api, keys):
    with api.client(keys["revoked"]) as c:
        assert c.get("/v1/buffers").status_code == 401


def test_upload_json_and_multipart(api, keys, docs_a):
    assert docs_a["buffer"]["name"] == "handbook" and docs_a["files_loaded"] == 2
    assert docs_a["buffer"]["files"] == 2 and docs_a["chunks_written"] >= 2 and docs_a["version"] == 1
    with api.client(keys["a"]) as c:
        r = c.post(
            "/v1/buffers",
            data={"name": "notes"},
            files=[("files", ("a.md", b"# A\n\nAlpha notes.\n")), ("files", ("sub/b.txt", b"Beta notes.\n"))],
        )
        assert r.status_code == 201, r.text
        shown = c.get("/v1/buffers/notes").json()
        assert shown["files"] == 2
        assert {b["name"] for b in c.get("/v1/buffers").json()} == {"handbook", "notes"}
        assert c.delete("/v1/buffers/notes").status_code == 204
        assert c.get("/v1/buffers/notes").status_code == 404
        # A re-upload of the same content re-embeds nothing.
        again = c.post("/v1/buffers", json={"name": "handbook", "documents": DOCS}).json()
        assert again["files_unchanged"] == 2 and again["files_loaded"] == 0


@pytest.mark.parametrize(
    ("form", "files", "needle"),
    [
        ({"name": "m", "chunk_size": "abc"}, [("files", ("a.md", b"x"))], "chunk_size"),
        ({"name": "m", "colour": "red"}, [("files", ("a.md", b"x"))], "colour"),
        ({"name": "m", "chunker": "words"}, [("files", ("a.md", b"x"))], "chunker"),
        ({"name": "bad name!"}, [("files", ("a.md", b"x"))], "buffer name"),
        ({}, [("name", ("n.txt", b"m")), ("files", ("a.md", b"x"))], "not a file"),
        ({"name": "m"}, [("other", ("a.md", b"x"))], "other"),
        ({"name": "m", "files": "just text"}, [("x", ("a.md", b"x"))], "x"),
        ({"name": "m"}, [("files", ("a.md", b"x")), ("files", ("a.md", b"y"))], "twice"),
        ({"name": "m"}, [("files", ("a", b"x")), ("files", ("a/b.md", b"y"))], "a/b.md"),
    ],
)
def test_bad_multipart_uploads_are_422(api, keys, form, files, needle):
    with api.client(keys["a"]) as c:
        r = c.post("/v1/buffers", data=form, files=files)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["type"] == "invalid_input" and needle in r.json()["error"]["message"]
        assert c.get("/v1/buffers/m").status_code == 404


def test_names_that_cannot_exist_are_404_not_500(api, keys):
    with api.client(keys["a"]) as c:
        for path in ("/v1/buffers/a%00b", "/v1/buffers/...", "/v1/queries/a%00b", "/v1/queries/" + "f" * 100):
            for method in ("GET", "DELETE"):
                r = c.request(method, path)
                assert r.status_code == 404, (method, path, r.text)
                assert r.json()["error"]["type"] in ("not_found", "buffer_not_found")
        for path in (
            "/v1/batches/a%00b",
            "/v1/batches/" + "f" * 100,
            "/v1/batches/a%00b/results",
            "/v1/uploads/a%00b",
            "/v1/uploads/" + "f" * 100,
        ):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", (path, r.text)
        assert c.delete("/v1/batches/a%00b").status_code == 404


@pytest.mark.parametrize("name", ["../etc/passwd", "/etc/passwd", "a/../../b.md", "a\\b.md", "./x.md", "a//b.md"])
def test_upload_refuses_path_tricks(api, keys, name):
    with api.client(keys["a"]) as c:
        r = c.post("/v1/buffers", json={"name": "evil", "documents": [{"path": name, "text": "x"}]})
        assert r.status_code == 422 and "file name" in r.json()["error"]["message"]
        r = c.post("/v1/buffers", data={"name": "evil"}, files=[("files", (name, b"x"))])
        assert r.status_code == 422
        assert c.get("/v1/buffers/evil").status_code == 404


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"buffers": ["handbook"]}, "query"),
        ({"query": "q", "buffers": ["handbook"], "options": {"colour": "red"}}, "colour"),
        ({"query": "x" * (10 * 1024 + 1), "buffers": ["handbook"]}, "10240 bytes"),
        ({"query": "q", "buffers": []}, "buffers"),
        ({"query": "q", "buffers": ["handbook"], "options": {"batch_size": 5, "num_agents": 2}}, "exclude"),
        ({"query": "q", "buffers": ["handbook"], "options": {"top_k": 0}}, "options.top_k"),
        ({"query": "a\x00b", "buffers": ["handbook"]}, "NUL"),
        ({"query": "q", "buffers": ["hand\x00book"]}, "buffer name"),
        ({"query": "q", "buffers": ["handbook"], "extra": 1}, "extra: unknown field"),
        # modes and budgets (docs/contract.md#modes)
        ({"query": "q", "buffers": ["handbook"], "options": {"mode": "deep"}}, "options.mode"),
        ({"query": "q", "buffers": ["handbook"], "options": {"depth": -1}}, "options.depth"),
        ({"query": "q", "buffers": ["handbook"], "options": {"depth": 6}}, "options.depth"),
        ({"query": "q", "buffers": ["handbook"], "options": {"max_llm_calls": -5}}, "options.max_llm_calls"),
        ({"query": "q", "buffers": ["handbook"], "options": {"max_tokens": 0}}, "options.max_tokens"),
        ({"query": "q", "buffers": ["handbook"], "options": {"max_cost": -1.0}}, "options.max_cost"),
        ({"query": "q", "buffers": ["handbook"], "options": {"deadline": 0}}, "options.deadline"),
        ({"query": "q", "buffers": ["handbook"], "options": {"scope": "all", "mode": "instant"}}, "instant"),
    ],
)
def test_bad_query_bodies_are_422_with_a_clear_message(api, keys, docs_a, body, needle):
    with api.client(keys["a"]) as c:
        r = c.post("/v1/queries", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_a_nan_budget_is_422(api, keys, docs_a):
    with api.client(keys["a"]) as c:
        body = '{"query": "q", "buffers": ["handbook"], "options": {"max_cost": NaN}}'
        r = c.post("/v1/queries", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert "max_cost" in r.json()["error"]["message"] or "JSON" in r.json()["error"]["message"]


def test_cancel_before_analysis(api, keys, docs_a, control):
    # No analyst worker yet: the job waits in fan-out, so the cancel always lands first.
    with api.client(keys["a"]) as c:
        job_id = c.post(
            "/v1/queries",
            json={
                "query": "How are retries done?",
                "buffers": ["handbook"],
                "options": {"skip_plan": True, "threshold": -1.0},
            },
        ).json()["job_id"]
        deadline = time.monotonic() + 60
        while c.get(f"/v1/queries/{job_id}").json()["stage"] != "fan_out" and time.monotonic() < deadline:
            time.sleep(0.2)
        r = c.delete(f"/v1/queries/{job_id}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert c.get(f"/v1/queries/{job_id}").json()["status"] == "cancelled"


def test_submit_poll_result_and_idempotency(api, keys, docs_a, analysts):
    body = {
        "query": "How many times are failed uploads retried?",
        "buffers": ["handbook"],
        "options": {"skip_plan": True, "threshold": -1.0},
    }
    with api.client(keys["a"]) as c:
        r = c.post("/v1/queries", json=body, headers={"Idempotency-Key": "retry-1"})
        assert r.status_code == 202
        job_id = r.json()["job_id"]
        assert r.headers["location"] == r.json()["status_url"] and r.json()["status_url"].endswith(job_id)
        again = c.post("/v1/queries", json=body, headers={"Idempotency-Key": "retry-1"})
        assert again.status_code == 202 and again.json()["job_id"] == job_id
        deadline = time.monotonic() + 120
        while True:
            view = c.get(f"/v1/queries/{job_id}").json()
            if view["status"] in ("done", "failed", "cancelled") or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert view["status"] == "done", view
    assert view["progress"]["batches_done"] == view["progress"]["batches_total"] >= 1
    result = view["result"]
    assert result["provider"] == "extractive" and "three times" in result["response"]
    assert any(s["path"].endswith("guide/retries.md") for s in result["sources"])
    assert set(result) >= {
        "job_id",
        "scaling_tier",
        "plan",
        "sources",
        "total_tokens",
        "elapsed",
        "batch_errors",
    }


def test_other_tenants_ids_are_404(api, keys, docs_a, control):
    with api.client(keys["a"]) as a:
        job_id = a.post("/v1/queries", json={"query": "limits?", "buffers": ["handbook"]}).json()["job_id"]
    with api.client(keys["b"]) as b:
        assert b.get("/v1/buffers/handbook").status_code == 404
        assert b.delete("/v1/buffers/handbook").status_code == 404
        assert b.get("/v1/buffers").json() == []
        assert b.get(f"/v1/queries/{job_id}").status_code == 404
        assert b.delete(f"/v1/queries/{job_id}").status_code == 404
        r = b.post("/v1/queries", json={"query": "limits?", "buffers": ["handbook"]})
        assert r.status_code == 404 and "handbook" in r.json()["error"]["message"]
    with api.client(keys["a"]) as a:
        assert a.get("/v1/buffers/handbook").status_code == 200  # B's DELETE did nothing


def test_request_size_limit(env, keys, tmp_path):
    small = Api({**env, "RLM_MAX_REQUEST_BYTES": "65536"}, tmp_path / "small.log")
    try:
        with small.client(keys["a"]) as c:
            big = {"name": "big", "documents": [{"path": "a.md", "text": "x" * 70_000}]}
            r = c.post("/v1/buffers", json=big)
            assert r.status_code == 413 and "65536" in r.json()["error"]["message"]

            def chunks():
                for _ in range(20):
                    yield b"y" * 8192

            r = c.post("/v1/buffers", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            # a route whose body FastAPI parses itself (it once answered such a stream 400)
            r = c.post("/v1/queries", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"
            assert c.get("/v1/buffers/big").status_code == 404
    finally:
        small.stop()


def test_keys_cli_create_list_revoke(api, env):
    def rlm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rlm_api.cli", "keys", *args],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = rlm("create", "--tenant", "initech", "--name", "ci")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("rlm_") and "\n" not in key  # stdout is the key alone, for $(rlm keys create …)
    with api.client(key) as c:
        assert c.get("/v1/buffers").status_code == 200
    listed = rlm("list", "--tenant", "initech")
    assert key[:10] in listed.stdout and key not in listed.stdout and "active" in listed.stdout
    assert rlm("revoke", key[:10]).returncode == 0
    with api.client(key) as c:
        assert c.get("/v1/buffers").status_code == 401
    assert "revoked" in rlm("list", "--tenant", "initech").stdout
    assert rlm("revoke", key[:10]).returncode == 2  # nothing left to revoke: invalid input
    assert rlm("create", "--tenant", "bad tenant!").returncode == 2


@pytest.fixture(scope="module")
def ingest_worker(env, api, tmp_path_factory):
    w = WorkerProcess(
        "aing",
        queues="rlm.ingest",
        env=env,
        log_dir=tmp_path_factory.mktemp("api-w3"),
        concurrency=1,
        pool="prefork",
    ).start()
    yield w
    w.stop()


def _until_ended(client: httpx.Client, url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (view := client.get(url).json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
    return view


def test_background_upload_is_loaded_by_the_ingest_worker(api, keys, conn, ingest_worker):
    tide = "# Tides\n\nThe harbour gate opens two hours before high water and closes at the ebb.\n"
    with api.client(keys["a"]) as a, api.client(keys["b"]) as b:
        r = a.post(
            "/v1/buffers?wait=false",
            json={"name": "harbour", "documents": [{"path": "notes/tide.md", "text": tide}]},
        )
        assert r.status_code == 202, r.text
        url = r.json()["status_url"]
        assert r.headers["location"] == url and r.json()["status"] == "queued"
        assert b.get(url).status_code == 404  # another tenant's upload does not exist for it
        view = _until_ended(a, url)
        assert view["status"] == "done" and view["attempts"] == 1 and view["error"] is None, view
        assert view["report"]["files_loaded"] == 1 and view["report"]["chunks_written"] >= 1
        assert a.get("/v1/buffers/harbour").json()["files"] == 1
        # the same content again, as multipart: nothing re-embedded
        r = a.post(
            "/v1/buffers",
            params={"wait": "false"},
            data={"name": "harbour"},
            files=[("files", ("notes/tide.md", tide.encode()))],
        )
        assert r.status_code == 202, r.text
        again = _until_ended(a, r.json()["status_url"])
        assert again["report"]["files_unchanged"] == 1 and again["report"]["windows_embedded"] == 0
        # names are checked before anything is stored
        r = a.post(
            "/v1/buffers?wait=false",
            json={"name": "harbour", "documents": [{"path": "../escape.md", "text": "x"}]},
        )
        assert r.status_code == 422 and "../escape.md" in r.json()["error"]["message"]
        assert a.delete("/v1/buffers/harbour").status_code == 204
    # loaded uploads leave no staged bytes behind
    assert conn.execute("SELECT count(*) FROM upload_files").fetchone()[0] == 0
    assert "rlm.ingest" in ingest_worker.tail(4000)


def test_a_bad_staged_upload_fails_with_its_reason_and_keeps_the_buffer(api, keys, conn, docs_a, env):
    """What the worker does with an upload the API would never store (names are checked again there)."""
    from rlm_workers.ingest.uploads import run_ingest
    from rlm_workers.store.uploads import create_upload, get_upload

    before = conn.execute("SELECT version FROM buffers WHERE name = 'handbook' AND tenant = 'acme'").fetchone()
    create_upload(
        conn,
        upload_id="badupload0001",
        tenant="acme",
        buffer="handbook",
        options={},
        files=[("ok.md", b"# fine\n"), ("../../etc/cron.d/x", b"* * * * * root evil\n")],
    )
    conn.commit()
    assert run_ingest("badupload0001") == "failed"
    up = get_upload(conn, upload_id="badupload0001", tenant="acme")
    assert up.status == "failed" and up.error["type"] == "invalid_input" and "cron.d" in up.error["message"]
    assert conn.execute("SELECT version FROM buffers WHERE name = 'handbook' AND tenant = 'acme'").fetchone() == before
    assert run_ingest("badupload0001") == "skipped"  # a redelivery finds it ended


def test_reconciler_resends_an_upload_whose_message_was_lost(conn, env):
    from rlm_workers.pipeline.reconcile import reconcile_uploads
    from rlm_workers.store.uploads import create_upload

    create_upload(conn, upload_id="lostupload001", tenant="acme", buffer="lost", options={}, files=[("a.md", b"# A\n")])
    conn.execute("UPDATE uploads SET sent_at = now() - interval '1 hour' WHERE id = 'lostupload001'")
    conn.commit()
    sent: list[tuple[str, str]] = []
    actions = reconcile_uploads(conn, send=lambda task, i: sent.append((task, i)), idle_seconds=600)
    conn.commit()
    assert sent == [("rlm.ingest", "lostupload001")] and "re-sent rlm.ingest" in actions[0]
    assert reconcile_uploads(conn, send=lambda task, i: sent.append((task, i)), idle_seconds=600) == []
    conn.execute("DELETE FROM uploads WHERE id = 'lostupload001'")
    conn.commit()


def test_readyz_names_the_broker_when_it_is_down(env, tmp_path):
    dead = Api({**env, "RLM_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}, tmp_path / "dead.log")
    try:
        assert httpx.get(f"{dead.base}/healthz").status_code == 200  # liveness does no I/O
        # the client timeout only keeps a hung check from hanging the test; how fast it answers is no assertion
        r = httpx.get(f"{dead.base}/readyz", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "not ready"
        assert r.json()["database"] == "ok" and r.json()["broker"].startswith("unreachable")
        metrics = httpx.get(f"{dead.base}/metrics", timeout=30)
        assert metrics.status_code == 200 and "rlm_jobs" in metrics.text  # renders without queue depths
    finally:
        dead.stop()
