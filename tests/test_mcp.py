"""The MCP server (docs/contract.md#mcp) through the SDK's own client, real sessions on both transports.

stdio: the client spawns ``python -m rlm_api.cli_mcp`` (the `rlm mcp` command) acting for the local tenant.
HTTP: ``rlm mcp --transport http`` in a subprocess, keys of two tenants.  Queries run on real worker
processes with the offline extractive provider (conftest removes every LLM key from the environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from tests.support.api import free_port
from tests.support.mcp_client import stdio_run
from tests.support.workers import ROOT, running_workers

pytestmark = pytest.mark.slow

NEEDLE = "The refund window for damaged parcels is forty-five days from delivery."
DOCS = {
    "policy/refunds.md": "# Refunds\n\n"
    + "Customers write in about orders that arrived late or broken. " * 8
    + f"\n\n{NEEDLE}\n\n"
    + "Store credit is offered when the original card has expired. " * 6,
    "policy/shipping.md": "# Shipping\n\n"
    + "Parcels leave the warehouse within two working days of the order. " * 10
    + "\n\nExpress delivery costs twelve euros and arrives the next day.\n",
    "team/oncall.md": "# On call\n\n" + "The on-call engineer answers pages within fifteen minutes. " * 12,
}


@pytest.fixture(scope="module")
def env(rlm_env):
    return {**rlm_env, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    """The same files as buffer ``docs`` of the local tenant and buffer ``handbook`` of tenant acme."""
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("mcp") / "docs"
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    load_paths(conn, buffer="docs", paths=[root], embedder=embedder, chunk_size=400, overlap=50)
    load_paths(conn, buffer="handbook", paths=[root], embedder=embedder, chunk_size=400, overlap=50, tenant="acme")
    conn.commit()
    return root


@pytest.fixture(scope="module")
def keys(env, conn):
    from rlm_api.auth import create_key

    acme, _ = create_key(conn, tenant="acme")
    globex, _ = create_key(conn, tenant="globex")
    conn.commit()
    return {"acme": acme, "globex": globex}


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"mctl": ("rlm.control", 4), "man": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("mcp-workers"), pools) as ws:
        yield ws


@pytest.fixture(scope="module")
def http_server(env, keys, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("mcp-http") / "mcp.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlm_api.cli_mcp", "--transport", "http", "--port", str(port)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"MCP HTTP server did not start: {log_path.read_text()[-2000:]}") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


# --------------------------------------------------------------------------- client helpers


def _http_run(url: str, key: str | None, script):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with (
            create_mcp_http_client(headers=headers) as http,
            streamable_http_client(url, http_client=http) as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            return await script(session)

    return anyio.run(main)


async def call(session, name: str, **arguments):
    """(is_error, the structured result or the error's text)."""
    result = await session.call_tool(name, arguments)
    if result.isError:
        return True, result.content[0].text
    return False, result.structuredContent or json.loads(result.content[0].text)


def ok(pair):
    is_error, value = pair
    assert not is_error, value
    return value


def error(pair) -> str:
    is_error, value = pair
    assert is_error, value
    assert isinstance(value, str) and "\n" not in value and "Traceback" not in value, value
    return value


# --------------------------------------------------------------------------- stdio


def test_stdio_tools_answer_for_the_local_tenant(env, corpus, workers):
    async def script(s):
        tools = {t.name for t in (await s.list_tools()).tools}
        buffers = ok(await call(s, "list_buffers"))
        hits = ok(await call(s, "search", query="refund window damaged parcels", buffers="docs", top_k=3))
        chunks = ok(await call(s, "get_chunks", chunk_ids=[hits["results"][0]["chunk_id"], 999_999_999]))
        answer = ok(
            await call(s, "query", query="How long is the refund window for damaged parcels?", buffers=["docs"])
        )
        job = ok(await call(s, "get_job", job_id=answer["job_id"], include_calls=True))
        bad = [
            error(await call(s, "search", query="refund", buffers="docs", top_k=500)),
            error(await call(s, "search", query="refund", buffers="nope")),
            error(await call(s, "get_job", job_id="f" * 32)),
            error(await call(s, "get_chunks", chunk_ids=[])),
            error(await call(s, "query", query="  ", buffers="docs")),
            error(await call(s, "query", question="How long is the refund window?", buffers="docs")),
        ]
        return tools, buffers, hits, chunks, answer, job, bad

    tools, buffers, hits, chunks, answer, job, bad = stdio_run(env, script)
    assert tools == {"list_buffers", "search", "query", "get_job", "get_chunks", "get_outline", "get_section"}
    # the local tenant's buffer only: acme's handbook is another tenant's
    assert [b["name"] for b in buffers["buffers"]] == ["docs"] and buffers["buffers"][0]["files"] == 3
    top = hits["results"][0]
    assert top["buffer"] == "docs" and top["path"].endswith("policy/refunds.md") and "forty-five days" in top["text"]
    assert len(hits["results"]) <= 3
    assert chunks["missing"] == [999_999_999] and chunks["chunks"][0]["chunk_id"] == top["chunk_id"]
    assert NEEDLE in chunks["chunks"][0]["text"]

    assert answer["status"] == "done" and "forty-five days" in answer["report"], answer
    assert answer["status_line"].startswith("Scale: ") and "Batches: " in answer["status_line"]
    assert job["job_id"] == answer["job_id"] and job["status"] == "done" and job["buffers"] == ["docs"]
    assert job["result"]["response"] == answer["report"] and job["calls"] is not None

    top_k, unknown, no_job, no_ids, empty, renamed = bad
    assert top_k.startswith("invalid arguments: top_k") and "500" in top_k
    assert unknown == "no buffer named 'nope'; the list_buffers tool names them"
    assert no_job == f"no query job {'f' * 32!r}"
    assert no_ids.startswith("invalid arguments: chunk_ids")
    assert "empty" in empty
    # the argument is `query`, as in the CLI and the API; the first release's `question` is named in the error
    assert renamed == "invalid arguments: query: the question goes in `query` (it was called `question`)"


@pytest.mark.parametrize("run", range(10))
def test_tool_calls_sent_together_after_initialize_all_answer(env, corpus, run):
    """A fresh server's first calls run in threads at once: whatever they need (modules, the pool, settings)
    is ready before serving, so none fails with an import deadlock or an internal error."""

    async def script(s):
        results: dict[str, tuple[bool, object]] = {}

        async def one(name, arguments):
            results[name] = await call(s, name, **arguments)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "list_buffers", {})
            tg.start_soon(one, "search", {"query": "refund window damaged parcels", "buffers": "docs", "top_k": 3})
            tg.start_soon(one, "get_chunks", {"chunk_ids": [1, 2]})
            tg.start_soon(one, "get_job", {"job_id": "f" * 32})
        return results

    results = stdio_run(env, script)
    assert [b["name"] for b in ok(results["list_buffers"])["buffers"]] == ["docs"]
    assert ok(results["search"])["results"][0]["buffer"] == "docs"
    assert "missing" in ok(results["get_chunks"])
    assert error(results["get_job"]) == f"no query job {'f' * 32!r}"


def test_a_query_no_worker_can_run_is_refused_before_it_is_stored(env, conn, corpus, workers):
    from rlm_workers.store.jobs import list_jobs

    def jobs() -> list[str]:
        ids = [j.id for j in list_jobs(conn, tenant="local", limit=200)]
        conn.commit()
        return ids

    async def script(s):
        return error(await call(s, "query", query="How long is the refund window?", buffers="docs"))

    before = jobs()
    workers["man"].stop()
    try:
        message = stdio_run(env, script)
    finally:
        workers["man"].start()
    assert message == "no worker serves rlm.analyst, so a query cannot run; start them with `rlm up` or `rlm worker`"
    assert jobs() == before


def test_a_wait_that_runs_out_returns_the_job_to_poll(env, conn, corpus, workers):
    """The job cannot end while no analyst runs: the wait gives up after its timeout with the job id; once an
    analyst is back the same job ends done."""
    import threading

    from rlm_api.mcp_server import _wait
    from rlm_workers.submit import submit_query, wait_for_job

    workers["man"].stop()
    try:
        job_id, _ = submit_query(
            conn, tenant="local", query="What does express delivery cost?", buffers=["docs"], options={}
        )
        conn.commit()
        answer = _wait(job_id, 2.0, threading.Event())
    finally:
        workers["man"].start()
    assert (answer.job_id, answer.report) == (job_id, None) and answer.status in ("queued", "running"), answer
    assert f"job {job_id} is still {answer.status}" in answer.message and "get_job" in answer.message
    assert wait_for_job(conn, job_id, timeout=120).status == "done"


def test_stdout_carries_only_the_protocol(env, corpus):
    """Every line the stdio server writes on stdout is a JSON-RPC message (logs go to stderr)."""
    requests = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_buffers", "arguments": {}}},
        {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "tools/call",
            "params": {"name": "get_chunks", "arguments": {"chunk_ids": "x"}},
        },
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli_mcp"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    replies = {}
    try:
        for r in requests:
            proc.stdin.write((json.dumps(r) + "\n").encode())
            proc.stdin.flush()
            if "id" in r:
                while r["id"] not in replies:
                    message = json.loads(proc.stdout.readline())  # anything else on stdout fails here
                    assert message["jsonrpc"] == "2.0"
                    replies[message.get("id")] = message
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        assert proc.stdout.read() == b""
    finally:
        proc.kill()
    from rlm_workers import __version__

    # the server reports rlm's version, not the MCP SDK's
    assert replies[1]["result"]["serverInfo"] == {"name": "rlm-pipeline", "version": __version__}
    assert replies[2]["result"]["structuredContent"]["buffers"][0]["name"] == "docs"
    assert replies[3]["result"]["isError"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "9"], "--host and --port are for --transport http; stdio talks on stdin/stdout"),
        (["--transport", "http", "--tenant", "acme"], "over --transport http each request's API key names the tenant"),
        (["--tenant", "no spaces"], "invalid tenant name 'no spaces'"),
    ],
)
def test_bad_options_exit_2_with_one_line(env, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli_mcp", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {message}") and proc.stderr.count("\n") == 1, proc.stderr


# --------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("authorization", [None, "Bearer rlm_not-a-key", "Basic abc"])
def test_http_needs_a_valid_key(http_server, authorization):
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    r = httpx.post(http_server, headers=headers, json=body, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "unauthorized"


@pytest.mark.parametrize(
    "raw",
    [b"[" * 5000 + b"]" * 5000, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "\xff"}}'],
    ids=["nested-too-deep", "not-utf8"],
)
def test_http_a_body_that_cannot_be_parsed_is_a_400_parse_error(http_server, keys, raw):
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {keys['acme']}",
    }
    r = httpx.post(http_server, headers=headers, content=raw, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == -32700 and r.json()["error"]["message"].startswith("Parse error"), r.text
    # the server is still there and parses good bodies
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    assert httpx.post(http_server, headers=headers, json=body, timeout=30).status_code == 200


def test_http_client_without_a_key_cannot_open_a_session(http_server):
    async def never(_session):
        raise AssertionError("a session opened without a key")

    with pytest.raises(BaseException) as info:  # the SDK's task group wraps the HTTP error
        _http_run(http_server, None, never)
    assert "401 Unauthorized" in str(info.getrepr())


def test_http_tools_are_scoped_to_the_keys_tenant(http_server, keys, corpus, workers):
    async def acme(s):
        buffers = ok(await call(s, "list_buffers"))
        hits = ok(await call(s, "search", query="express delivery price", buffers=["handbook"], mode="bm25"))
        submitted = ok(await call(s, "query", query="What does express delivery cost?", buffers="handbook", wait=False))
        for _ in range(600):
            job = ok(await call(s, "get_job", job_id=submitted["job_id"]))
            if job["status"] in ("done", "failed", "cancelled"):
                break
            await anyio.sleep(0.25)
        return buffers, hits, submitted, job

    buffers, hits, submitted, job = _http_run(http_server, keys["acme"], acme)
    assert [b["name"] for b in buffers["buffers"]] == ["handbook"]
    assert hits["results"][0]["path"].endswith("policy/shipping.md") and hits["results"][0]["buffer"] == "handbook"
    # not waited for (the offline provider may have finished already): the id to poll, no report
    assert submitted["report"] is None and "get_job" in submitted["message"] and submitted["job_id"] == job["job_id"]
    assert job["status"] == "done", job
    assert "twelve euros" in job["result"]["response"] and job["calls"] == []
    chunk_id = hits["results"][0]["chunk_id"]

    async def globex(s):
        return (
            ok(await call(s, "list_buffers")),
            error(await call(s, "search", query="express delivery", buffers="handbook")),
            error(await call(s, "get_job", job_id=submitted["job_id"])),
            ok(await call(s, "get_chunks", chunk_ids=[chunk_id])),
            error(await call(s, "query", query="What does express delivery cost?", buffers="handbook")),
        )

    none, search_err, job_err, chunks, query_err = _http_run(http_server, keys["globex"], globex)
    assert none == {"buffers": []}
    assert search_err == query_err == "no buffer named 'handbook'; the list_buffers tool names them"
    assert job_err == f"no query job {submitted['job_id']!r}"
    assert chunks == {"chunks": [], "missing": [chunk_id]}
