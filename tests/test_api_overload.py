"""The HTTP API under a flood of concurrent requests (issue 25, item 2): while the database is up, every
request gets its answer or a 429 ``overloaded`` with Retry-After, never a 503, and /healthz is answered.
uvicorn in a subprocess, real PostgreSQL and Valkey; the speed figures are in bench/flood.py."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn

from rlm_api.app import Admission
from tests.support.api import Api, free_port

pytestmark = pytest.mark.slow

TENANTS = ("flood-a", "flood-b", "flood-c")
#: more than the 40 worker threads and the 20 pooled connections together: enough to deadlock them
CONCURRENT = 150


@pytest.fixture(scope="module")
def env(rlm_env):
    # A short queue, so that the flood also meets the limiter's 429 and not only its waiting line.
    return {**rlm_env, "HF_HUB_OFFLINE": "1", "RLM_API_QUEUE": "60"}


@pytest.fixture(scope="module")
def keys(env, conn):
    from rlm_api.auth import create_key
    from rlm_workers.store.buffers import lock_or_create_buffer

    out = {}
    for tenant in TENANTS:
        out[tenant], _ = create_key(conn, tenant=tenant)
        lock_or_create_buffer(conn, tenant=tenant, name="docs")
    conn.commit()
    return out


@pytest.fixture(scope="module")
def api(env, keys, tmp_path_factory):
    import redis

    broker = redis.Redis.from_url(env["RLM_BROKER_URL"])
    broker.flushdb()
    server = Api(env, tmp_path_factory.mktemp("overload") / "api.log")
    yield server
    server.stop()
    broker.flushdb()  # the queued query tasks no worker of this module runs


def test_a_flood_of_requests_gets_answers_or_429_never_503(api, keys):
    start = threading.Barrier(CONCURRENT + 1)

    def one(i: int) -> httpx.Response:
        tenant = TENANTS[i % len(TENANTS)]
        # a client timeout far past the pool's 30 s checkout wait: a deadlock shows as its 503, not as a hang
        with httpx.Client(base_url=api.base, headers={"Authorization": f"Bearer {keys[tenant]}"}, timeout=180) as c:
            start.wait()
            if i % 5 == 0:
                return c.post("/v1/queries", json={"query": f"question {i}?", "buffers": ["docs"]})
            return c.get("/v1/buffers")

    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(one, i) for i in range(CONCURRENT)]
        start.wait()
        health = httpx.get(f"{api.base}/healthz", timeout=180)
        answers = [f.result() for f in futures]

    assert health.status_code == 200 and health.json() == {"status": "ok"}
    statuses = sorted(r.status_code for r in answers)
    assert not [r for r in answers if r.status_code >= 500], [r.text for r in answers if r.status_code >= 500][:3]
    assert set(statuses) <= {200, 202, 429}, statuses
    assert any(s in (200, 202) for s in statuses)
    for r in answers:
        if r.status_code == 429:
            assert r.headers["Retry-After"].isdigit(), r.headers
            assert r.json()["error"]["type"] == "overloaded", r.text
    # and the API is its normal self afterwards
    with api.client(keys[TENANTS[0]]) as c:
        assert [b["name"] for b in c.get("/v1/buffers").json()] == ["docs"]


def test_rlm_api_lifts_its_open_files_limit_and_listens_with_the_backlog_asked(env, tmp_path):
    # Every client is a socket: a soft limit of 256 would turn the 257th concurrent client away (EMFILE),
    # and the listen backlog bounds how many can be connecting at once.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard > 256, "the hard limit leaves nothing to lift"
    low_soft_limit = ("sh", "-c", 'ulimit -Sn 256 && exec "$@"', "sh")
    server = Api(env, tmp_path / "api.log", args=("--backlog", "300"), launcher=low_soft_limit)
    try:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
        soft, hard_seen = line.split()[3:5]
        assert soft == hard_seen != "256", line
        listening = subprocess.run(
            ["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert listening[2] == "300", listening  # Send-Q of a listening socket is its backlog
    finally:
        server.stop()


def test_rlm_api_refuses_a_backlog_of_zero(env):
    done = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "api", "--backlog", "0"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--backlog" in done.stderr


def test_a_429_sent_before_the_body_is_read_leaves_the_connection_serving():
    # One of the suspects for a connection the flood saw closed: Admission answers 429 without reading the
    # body; the server must drop that body and answer the next request on the same keep-alive connection.
    holding = threading.Event()
    release = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/hold":
            holding.set()
            await anyio.to_thread.run_sync(release.wait, 30)
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(Admission(app, slots=1, queue=0), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        hold = ThreadPoolExecutor(1)
        holder = hold.submit(httpx.get, f"http://127.0.0.1:{port}/v1/hold", timeout=30)
        assert holding.wait(10)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            body = b'{"query": "x"}'
            head = f"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            sock.sendall(head)  # the body is not sent yet: the 429 goes out before it could be read
            refused = _read_response(sock)
            assert refused.startswith(b"HTTP/1.1 429"), refused
            assert b"retry-after: 1" in refused.lower(), refused
            release.set()
            assert holder.result().status_code == 200
            sock.sendall(body + b"GET /v1/next HTTP/1.1\r\nHost: x\r\n\r\n")
            answered = _read_response(sock)
            assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b"ok"), answered
        hold.shutdown()
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=10)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection instead of answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    (length,) = [
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    ]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection in the middle of a response: {data!r}"
        body += chunk
    assert len(body) == length, f"more than one response came: {head + body!r}"
    return head + b"\r\n\r\n" + body
