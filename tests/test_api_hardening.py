"""The HTTP API against hostile or careless clients (issue 10): reused idempotency keys, bodies sent
without a key, text PostgreSQL cannot store, oversized numbers and names, offline /docs, curl uploads,
per-tenant caps, and the errors an HTTP client is told.  uvicorn in a subprocess, real PostgreSQL and Valkey."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import pytest

from tests.support.api import Api
from tests.support.workers import ROOT

pytestmark = pytest.mark.slow

CAP = 3


@pytest.fixture(scope="module")
def env(rlm_env):
    return {**rlm_env, "HF_HUB_OFFLINE": "1", "RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT": str(CAP)}


@pytest.fixture(scope="module")
def keys(env, conn):
    """One tenant per concern, each with an (empty) buffer: submitting a query only needs it to exist."""
    from rlm_api.auth import create_key
    from rlm_workers.store.buffers import lock_or_create_buffer

    out = {}
    for tenant in ("idem", "busy", "hints", "loads"):
        out[tenant], _ = create_key(conn, tenant=tenant)
        lock_or_create_buffer(conn, tenant=tenant, name="docs")
    conn.commit()
    return out


@pytest.fixture(scope="module")
def api(env, keys, tmp_path_factory):
    import redis

    redis.Redis.from_url(env["RLM_BROKER_URL"]).flushdb()
    server = Api(env, tmp_path_factory.mktemp("hardening") / "api.log")
    yield server
    server.stop()


def _jobs(conn, tenant: str) -> int:
    n = conn.execute("SELECT count(*) FROM jobs WHERE tenant = %s", (tenant,)).fetchone()[0]
    conn.commit()
    return n


# ------------------------------------------------------------------------------------------- idempotency


def test_a_reused_idempotency_key_with_another_body_is_422(api, keys, conn):
    body = {"query": "How are retries done?", "buffers": ["docs"], "options": {"top_k": 5}}
    key = {"Idempotency-Key": "order-17"}
    with api.client(keys["idem"]) as c:
        first = c.post("/v1/queries", json=body, headers=key)
        assert first.status_code == 202, first.text
        replay = c.post("/v1/queries", json=body, headers=key)
        assert replay.status_code == 202 and replay.json()["job_id"] == first.json()["job_id"]
        for other in (
            {**body, "query": "What are the storage limits?"},
            {**body, "options": {"top_k": 6}},
            {**body, "buffers": ["docs", "other"]},
        ):
            r = c.post("/v1/queries", json=other, headers=key)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["type"] == "idempotency_key_reused" and "order-17" in err["message"], err
        # a new key is a new job
        assert c.post("/v1/queries", json=body, headers={"Idempotency-Key": "order-18"}).status_code == 202
    assert _jobs(conn, "idem") == 2


def test_a_reused_batch_idempotency_key_with_another_body_is_422(api, keys, conn):
    body = {"queries": ["When?", "Where?"], "buffers": ["docs"], "token_budget": 1000}
    key = {"Idempotency-Key": "nightly-1"}
    with api.client(keys["idem"]) as c:
        first = c.post("/v1/batches", json=body, headers=key)
        assert first.status_code == 202, first.text
        # the same request, its run_at-free fields spelled differently: still a replay
        replay = c.post("/v1/batches", json={**body, "queries": ["When?", " Where? ", "When?"]}, headers=key)
        assert replay.status_code == 200 and replay.json()["batch_id"] == first.json()["batch_id"], replay.text
        for other in ({**body, "queries": ["Who?"]}, {**body, "token_budget": 5}, {**body, "priority": 9}):
            r = c.post("/v1/batches", json=other, headers=key)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["type"] == "idempotency_key_reused", r.text
    n = conn.execute("SELECT count(*) FROM overnight_batches WHERE tenant = 'idem'").fetchone()[0]
    conn.commit()
    assert n == 1


def test_submit_overnight_checks_the_key_for_the_cli_too(conn):
    """The same guard without HTTP (a plain, non-autocommit connection, as `rlm batch submit` has)."""
    from rlm_workers.errors import IdempotencyKeyReused
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.store.buffers import lock_or_create_buffer

    lock_or_create_buffer(conn, tenant="cli-idem", name="docs")
    conn.commit()
    first, created = submit_overnight(conn, tenant="cli-idem", queries=["a?"], buffers=["docs"], idempotency_key="k")
    assert created
    assert submit_overnight(conn, tenant="cli-idem", queries=["a?"], buffers=["docs"], idempotency_key="k") == (
        first,
        False,
    )
    with pytest.raises(IdempotencyKeyReused):
        submit_overnight(conn, tenant="cli-idem", queries=["b?"], buffers=["docs"], idempotency_key="k")
    conn.rollback()


# ------------------------------------------------------------------------------------------- offline docs


def test_docs_load_nothing_from_another_host(api):
    import importlib.util

    assert importlib.util.find_spec("fastapi_offline"), "the fastapi-offline dependency is not installed"
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{api.base}{page}").text
        assert "://" not in html, html  # no CDN, no fonts, no favicon from elsewhere
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
        assert assets, html
        for url in assets:
            assert url.startswith("/") and not url.startswith("//"), url
            r = httpx.get(f"{api.base}{url}")
            assert r.status_code == 200 and len(r.content) > 1000, url
    assert "swagger-ui-bundle.js" in httpx.get(f"{api.base}/docs").text


# ------------------------------------------------------------------------------------------- curl uploads


def test_multipart_keeps_the_relative_paths_a_client_sends(api, keys, conn):
    # What `curl -F 'files=@_transports/default.py;filename=_transports/default.py'` sends.
    parts = [
        ("files", ("_transports/default.py", b"def send():\n    return 'default transport'\n")),
        ("files", ("a/README.md", b"# A\n\nThe first readme.\n")),
        ("files", ("b/README.md", b"# B\n\nThe second readme.\n")),
    ]
    with api.client(keys["loads"]) as c:
        r = c.post("/v1/buffers", data={"name": "curl"}, files=parts)
        assert r.status_code == 201, r.text
        paths = {
            row[0]
            for row in conn.execute(
                "SELECT f.path FROM files f JOIN buffers b ON b.id = f.buffer_id WHERE b.tenant = 'loads' "
                "AND b.name = 'curl'"
            )
        }
        conn.commit()
        assert paths == {"_transports/default.py", "a/README.md", "b/README.md"}, paths
        # What plain `curl -F files=@a/README.md -F files=@b/README.md` sends: the message says what to do.
        r = c.post(
            "/v1/buffers",
            data={"name": "curl2"},
            files=[("files", ("README.md", b"one\n")), ("files", ("README.md", b"two\n"))],
        )
        assert r.status_code == 422
        assert "twice" in r.json()["error"]["message"] and "filename=" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- HTTP wording


def test_errors_an_http_client_sees_name_http_not_the_cli(api, keys, conn):
    from rlm_workers.errors import NoChunks, error_record
    from rlm_workers.models import JobStatus
    from rlm_workers.store import jobs as job_store

    with api.client(keys["hints"]) as c:
        r = c.post("/v1/queries", json={"query": "q", "buffers": ["nope"]})
        assert r.status_code == 404
        message = r.json()["error"]["message"]
        assert "GET /v1/buffers" in message and "`rlm" not in message, message
        r = c.post("/v1/batches", json={"queries": ["q"], "buffers_glob": "zz*"})
        assert r.status_code == 422 and "GET /v1/buffers" in r.json()["error"]["message"], r.text
        # a job that failed in a worker: its stored error is shown the HTTP way too
        job_id, _ = job_store.create_job(
            conn, job_id="hintsjob" + "0" * 8, tenant="hints", query="q", buffers=["docs"], options={}
        )
        job_store.finish_job(conn, job_id=job_id, status=JobStatus.failed, error=error_record(NoChunks()))
        conn.commit()
        err = c.get(f"/v1/queries/{job_id}").json()["error"]
        assert err["type"] == "no_chunks" and "options.threshold" in err["message"], err
        assert "--threshold" not in err["message"] and "`rlm" not in err["message"], err
    # the CLI keeps its own wording
    assert "--threshold" in error_record(NoChunks())["message"]


def test_an_embedding_model_mismatch_tells_an_http_client_what_it_can_do(settings):
    from rlm_api.schemas import ErrorBody
    from rlm_workers.errors import InvalidInput, error_record
    from rlm_workers.search.service import _semantic_rows
    from rlm_workers.store.buffers import BufferRow

    row = BufferRow(1, "t", "old", 1, "semantic", 3000, 500, "some/other-model", 384)
    with pytest.raises(InvalidInput) as caught:
        _semantic_rows([row], settings)
    record = error_record(caught.value, "search")  # as a failed job stores it
    assert "`rlm buffer reembed old`" in record["message"]  # the CLI's wording is kept for the CLI
    shown = ErrorBody.from_record(record).message
    assert shown.startswith("search: ") and "`rlm" not in shown and "options.search_mode=bm25" in shown, shown


# ------------------------------------------------------------------------------------------- key before body


@pytest.mark.parametrize("path", ["/v1/queries", "/v1/batches", "/v1/buffers"])
def test_a_body_without_a_valid_key_is_never_read(api, keys, path):
    """Headers announce a body that never comes: the answer must not wait for it."""
    for auth in ("", "Authorization: Bearer rlm_not-a-key\r\n"):
        with socket.create_connection(("127.0.0.1", api.port), timeout=30) as s:
            s.sendall(
                (
                    f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{auth}"
                    "Content-Length: 1000000\r\n\r\n"
                ).encode()
            )
            # no body: with the key checked after the body, this read would hang until the socket timeout
            head = s.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 401"), head
        assert '"unauthorized"' in head or "unauthorized" in head.lower()


def test_large_json_bodies_parsed_off_the_loop_still_validate(api, keys):
    """Bodies over 64 KB take the thread-pool parse (ParseOffLoop): same answers as FastAPI's own parse."""
    queries = [f"Question number {i} about the archive?" for i in range(3000)]  # ~110 KB
    with api.client(keys["loads"]) as c:
        r = c.post("/v1/batches", json={"queries": queries, "buffers": ["docs"]})
        assert r.status_code == 202, r.text
        raw = json.dumps({"queries": queries, "buffers": ["docs"]})[:-1]  # cut: not JSON any more
        r = c.post("/v1/batches", content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422 and "request body is not valid JSON" in r.json()["error"]["message"], r.text
        r = c.post("/v1/batches", json={"queries": [*queries, "a\x00b"], "buffers": ["docs"]})
        assert r.status_code == 422 and "NUL" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------------- no 500s


BAD_JSON = [
    ("/v1/batches", '{"queries": ["a\\u0000b"], "buffers": ["docs"]}', "NUL"),
    ("/v1/batches", '{"queries": ["a\\ud800b"], "buffers": ["docs"]}', "surrogate"),
    ("/v1/batches", '{"queries": ["q"], "buffers_glob": "d\\u0000*"}', "NUL"),
    ("/v1/batches", '{"queries": ["q"], "buffers": ["docs"], "token_budget": 9223372036854775808}', "token_budget"),
    ("/v1/batches", '{"queries": ["q"], "buffers": ["docs"], "token_budget": 1e400}', "token_budget"),
    ("/v1/queries", '{"query": "a\\ud800b", "buffers": ["docs"]}', "surrogate"),
    ("/v1/queries", '{"query": "q", "buffers": ["docs"], "options": {"top_k": 9223372036854775808}}', "top_k"),
    ("/v1/queries", "{not json", "request body is not valid JSON"),
    ("/v1/batches", "[1, 2", "request body is not valid JSON"),
    ("/v1/buffers", "{not json", "request body is not valid JSON"),
    (
        "/v1/buffers",
        json.dumps({"name": "long", "documents": [{"path": "d/" + "x" * 256 + ".md", "text": "t"}]}),
        "255 bytes",
    ),
    ("/v1/buffers", '{"name": "s", "documents": [{"path": "a.md", "text": "a\\ud800"}]}', "JSON"),
    ("/v1/buffers", json.dumps({"name": "small", "chunk_size": 150, "documents": [{"path": "a", "text": "t"}]}), "200"),
]


@pytest.mark.parametrize(("path", "raw", "needle"), BAD_JSON)
def test_bodies_postgres_cannot_store_are_422_not_500(api, keys, path, raw, needle):
    with api.client(keys["loads"]) as c:
        r = c.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_input" and needle in err["message"], err
        assert "JSON decode error" not in err["message"]
        assert c.get("/v1/buffers").status_code == 200  # and the API is still there for this client


def test_an_over_long_multipart_name_is_422(api, keys):
    with api.client(keys["loads"]) as c:
        r = c.post("/v1/buffers", data={"name": "long"}, files=[("files", ("d/" + "é" * 128 + ".md", b"x"))])
        assert r.status_code == 422 and "255 bytes" in r.json()["error"]["message"], r.text
        r = c.post("/v1/buffers", data={"name": "long", "chunk_size": "199"}, files=[("files", ("a.md", b"x"))])
        assert r.status_code == 422 and "chunk_size" in r.json()["error"]["message"], r.text
        assert c.get("/v1/buffers/long").status_code == 404


def test_one_chunk_size_bound_for_the_api_and_the_chunker():
    from rlm_api.schemas import BufferOptions
    from rlm_workers.ingest.chunkers import validate_chunk_params

    bounds = BufferOptions.model_json_schema()["properties"]["chunk_size"]
    for size in (bounds["minimum"], bounds["maximum"]):
        validate_chunk_params("fixed", size, 0)  # whatever the API accepts, the chunker takes
    for size in (bounds["minimum"] - 1, bounds["maximum"] + 1):
        with pytest.raises(ValueError):
            validate_chunk_params("fixed", size, 0)


def test_an_unexpected_error_is_a_json_500_with_a_request_id(rlm_env, caplog):
    """Answered, not re-raised: a request that raises through Starlette's last resort costs the client its
    keep-alive connection (the server closes it) and tells it nothing it can quote."""
    from fastapi.testclient import TestClient

    from rlm_api.app import create_app

    app = create_app()

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("internal detail")

    @app.get("/db-down")
    def db_down() -> None:
        import psycopg

        raise psycopg.OperationalError("connection refused")

    with TestClient(app, raise_server_exceptions=True) as client:  # a re-raise would surface here
        down = client.get("/db-down")
        r = client.get("/boom")
    assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable", down.text
    assert r.status_code == 500
    err = r.json()["error"]
    request_id = r.headers["x-request-id"]
    assert err["type"] == "internal" and request_id in err["message"] and "internal detail" not in err["message"]
    assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)


# ------------------------------------------------------------------------------------------- uploads


def test_an_upload_over_256_kb_is_queued_by_default(api, keys, conn):
    big = {"name": "big", "documents": [{"path": "big.md", "text": "word " * 60_000}]}  # 300 KB
    with api.client(keys["loads"]) as c:
        r = c.post("/v1/buffers", json=big)
        assert r.status_code == 202, r.text  # no ingest worker here: it stays queued, the API never embedded it
        assert c.get(r.json()["status_url"]).json()["status"] == "queued"
        r = c.post("/v1/buffers?wait=true", json=big)
        assert r.status_code == 422 and "wait" in r.json()["error"]["message"], r.text
        small = c.post("/v1/buffers", json={"name": "small", "documents": [{"path": "s.md", "text": "# S\n\nhi\n"}]})
        assert small.status_code == 201, small.text  # small ones still load in the request


# ------------------------------------------------------------------------------------------- per-tenant cap


def test_jobs_in_flight_are_capped_per_tenant(api, keys, conn):
    body = {"query": "anything?", "buffers": ["docs"]}
    with api.client(keys["busy"]) as c:
        ids = []
        for n in range(CAP):
            r = c.post("/v1/queries", json=body, headers={"Idempotency-Key": f"k{n}"})
            assert r.status_code == 202, r.text
            ids.append(r.json()["job_id"])
        r = c.post("/v1/queries", json=body)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "too_many_jobs" and "RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT" in err["message"], err
        # a replay is not a new job: still answered
        assert c.post("/v1/queries", json=body, headers={"Idempotency-Key": "k0"}).json()["job_id"] == ids[0]
        assert _jobs(conn, "busy") == CAP
        assert c.delete(f"/v1/queries/{ids[0]}").status_code == 200  # one ends: room for one more
        assert c.post("/v1/queries", json=body).status_code == 202
    with api.client(keys["idem"]) as other:  # another tenant is not affected
        assert other.post("/v1/queries", json={"query": "mine?", "buffers": ["docs"]}).status_code == 202


def test_the_cli_says_the_same_over_the_cap(rlm_env, conn):
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.buffers import lock_or_create_buffer

    lock_or_create_buffer(conn, tenant="local", name="capped")
    job_store.create_job(conn, job_id="clicap" + "0" * 10, tenant="local", query="q", buffers=["capped"], options={})
    conn.commit()
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "query", "what?", "--buffer", "capped"],
        cwd=ROOT,
        env={**os.environ, **rlm_env, "RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


#: a body FastAPI's parse did not turn into a 422: not UTF-8, or nested past the parser's recursion limit;
#: each small (FastAPI's own parse: 400 "There was an error parsing the body") and over 64 KB (the off-loop
#: parse: a RecursionError escaped as a 500)
UNPARSABLE = {
    "deep": b"[" * 5000 + b"]" * 5000,
    "deep-large": b'{"queries": ["q"], "x": ' + b"[" * 40_000 + b"]" * 40_000 + b"}",
    "not-utf8": b'{"query": "caf\xe9", "buffers": ["docs"]}',
    "not-utf8-large": b'{"query": "' + b"a" * 70_000 + b'\xff", "buffers": ["docs"]}',
}


@pytest.mark.parametrize("path", ["/v1/search", "/v1/queries", "/v1/batches", "/v1/sessions"])
@pytest.mark.parametrize("kind", sorted(UNPARSABLE))
def test_bodies_not_utf8_or_nested_too_deep_are_422(api, keys, path, kind):
    with api.client(keys["loads"]) as c:
        r = c.post(path, content=UNPARSABLE[kind], headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_input" and err["message"].startswith("request body is not valid JSON"), err
        assert ("UTF-8" if "utf8" in kind else "nested too deep") in err["message"], err


LAX = [
    ("/v1/batches", {"queries": ["q"], "buffers": ["docs"], "llm_batch": "yes"}, "llm_batch"),
    ("/v1/batches", {"queries": ["q"], "buffers": ["docs"], "llm_batch": 1}, "llm_batch"),
    ("/v1/batches", {"queries": ["q"], "buffers": ["docs"], "priority": "3"}, "priority"),
    ("/v1/batches", {"queries": ["q"], "buffers": ["docs"], "priority": 3.0}, "priority"),
    ("/v1/batches", {"queries": ["q"], "buffers": ["docs"], "token_budget": "500"}, "token_budget"),
    ("/v1/queries", {"query": "q", "buffers": ["docs"], "options": {"max_cost": "5"}}, "options.max_cost"),
    ("/v1/queries", {"query": "q", "buffers": ["docs"], "options": {"max_cost": True}}, "options.max_cost"),
    ("/v1/queries", {"query": "q", "buffers": ["docs"], "options": {"deadline": "60"}}, "options.deadline"),
    ("/v1/buffers", {"name": "lax", "chunk_size": "3000", "documents": [{"path": "a", "text": "t"}]}, "chunk_size"),
    ("/v1/buffers", {"name": "lax", "overlap": 50.0, "documents": [{"path": "a", "text": "t"}]}, "overlap"),
]


@pytest.mark.parametrize(("path", "body", "field"), LAX)
def test_booleans_and_numbers_of_the_wrong_json_type_are_422(api, keys, conn, path, body, field):
    before = _jobs(conn, "loads")
    with api.client(keys["loads"]) as c:
        r = c.post(path, json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"].startswith(f"{field}: "), r.text
    assert _jobs(conn, "loads") == before


def test_a_batch_is_cancelled_by_post_cancel_and_by_delete(api, keys):
    with api.client(keys["idem"]) as c:
        made = [c.post("/v1/batches", json={"queries": [q], "buffers": ["docs"]}) for q in "AB"]
        ids = [m.json()["batch_id"] for m in made]
        r = c.post(f"/v1/batches/{ids[0]}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        r = c.delete(f"/v1/batches/{ids[1]}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        r = c.post("/v1/batches/no-such-batch/cancel")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", r.text
