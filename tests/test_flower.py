"""Flower watches the same broker: a finished job's analyst tasks are listed, by ids, never chunk text."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from rlm_api.cli_up import FLOWER_AUTH_FILE, flower_argv
from rlm_workers.errors import InvalidInput
from tests.support.api import free_port
from tests.support.workers import ROOT, WorkerProcess

SECRET_LINE = "The vault combination is kept in the blue ledger on the third shelf."


def test_flower_credentials_never_go_on_the_command_line():
    argv, env = flower_argv("0.0.0.0", 5555, "ops:s3cret")
    assert not any("s3cret" in a for a in argv)
    assert env == {"FLOWER_BASIC_AUTH": "ops:s3cret"}  # and never FLOWER_UNAUTHENTICATED_API
    for bad in (None, "", "no-colon"):
        with pytest.raises(InvalidInput, match="RLM_FLOWER_BASIC_AUTH"):
            flower_argv("127.0.0.1", 5555, bad)  # loopback too: every local user reaches loopback


def _start_flower(env: dict[str, str], port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "flower", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_listening(base: str, auth: tuple[str, str] | None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/api/workers", auth=auth, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("Flower did not answer")


def _auth_file(env: dict[str, str]):
    from pathlib import Path

    return Path(env["RLM_DATA_DIR"]) / FLOWER_AUTH_FILE


def _auth(data_dir) -> tuple[str, str]:
    user, password = (data_dir / FLOWER_AUTH_FILE).read_text().strip().split(":", 1)
    return user, password


def test_flower_started_by_rlm_always_needs_credentials(rlm_env, tmp_path):
    """Flower's control API stopped workers for anyone on the host, and took form posts from any web page."""
    import stat

    data_dir = tmp_path / "data"
    env = {**rlm_env, "RLM_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    env.pop("RLM_FLOWER_BASIC_AUTH", None)
    port = free_port()
    flower = _start_flower(env, port)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not (data_dir / FLOWER_AUTH_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stat.S_IMODE((data_dir / FLOWER_AUTH_FILE).stat().st_mode) == 0o600
        auth = _auth(data_dir)
        _wait_listening(base, auth)
        assert httpx.get(f"{base}/api/workers", timeout=5).status_code == 401
        assert httpx.get(f"{base}/api/workers", auth=("rlm", "wrong"), timeout=5).status_code == 401
        assert httpx.get(f"{base}/api/workers", auth=auth, timeout=5).status_code == 200
        for action in ("shutdown", "queue/cancel-consumer", "pool/grow"):
            resp = httpx.post(f"{base}/api/worker/{action}/nobody@host", data={"queue": "rlm.analyst"}, timeout=5)
            assert resp.status_code == 401, (action, resp.status_code)
        resp = httpx.post(f"{base}/api/task/revoke/00000000-0000-0000-0000-000000000000", timeout=5)
        assert resp.status_code == 401
        # a form post from a page on another origin, with the browser's cached credentials: refused
        resp = httpx.post(
            f"{base}/api/worker/shutdown/nobody@host",
            auth=auth,
            headers={"Origin": "http://evil.example"},
            timeout=5,
        )
        assert resp.status_code == 403
        resp = httpx.post(
            f"{base}/api/worker/shutdown/nobody@host",
            auth=auth,
            headers={"Sec-Fetch-Site": "cross-site"},
            timeout=5,
        )
        assert resp.status_code == 403
        cmdline = open(f"/proc/{flower.pid}/cmdline", "rb").read()  # `rlm flower` became Flower (execve)
        assert b"flower" in cmdline and auth[1].encode() not in cmdline
        environ = open(f"/proc/{flower.pid}/environ", "rb").read().split(b"\0")
        assert b"FLOWER_UNAUTHENTICATED_API=true" not in environ
    finally:
        flower.terminate()
        _, err = flower.communicate(timeout=20)
    assert str(data_dir / FLOWER_AUTH_FILE) in err and auth[1] not in err  # says where, not what


@pytest.mark.slow
def test_flower_lists_the_analyst_tasks_of_a_finished_job(rlm_env, conn, embedder, tmp_path):
    import redis

    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.submit import submit_query, wait_for_job

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"note{i}.md").write_text(f"# Note {i}\n\nThe archive keeps records of shelf {i}. {SECRET_LINE}\n")
    load_paths(conn, buffer="vault", paths=[docs], embedder=embedder)
    conn.commit()
    redis.Redis.from_url(rlm_env["RLM_BROKER_URL"]).flushdb()
    env = {**rlm_env, "HF_HUB_OFFLINE": "1"}
    port = free_port()
    flower = _start_flower(env, port)
    workers = [
        WorkerProcess("fctl", queues="rlm.control", env=env, log_dir=tmp_path),
        WorkerProcess("fan", queues="rlm.analyst", env=env, log_dir=tmp_path),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while not _auth_file(env).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        auth = _auth(_auth_file(env).parent)
        _wait_listening(base, auth)
        time.sleep(2)  # let Flower's event receiver attach before the job's events flow
        job_id, _ = submit_query(
            conn,
            tenant="local",
            query="where is the vault combination kept?",
            buffers=["vault"],
            options={"skip_plan": True, "batch_size": 2, "threshold": -1.0},
        )
        conn.commit()
        job = wait_for_job(conn, job_id, timeout=120)
        assert job.status == "done", job.error
        mine: dict = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            tasks = httpx.get(f"{base}/api/tasks", params={"taskname": "rlm.analyst"}, auth=auth, timeout=5).json()
            mine = {k: t for k, t in tasks.items() if job_id in (t.get("args") or "")}
            if len(mine) == job.batches_total and all(t.get("state") == "SUCCESS" for t in mine.values()):
                break
            time.sleep(0.5)
        assert len(mine) == job.batches_total == 3
        assert {t["args"] for t in mine.values()} == {f"job={job_id} batch={k}/3" for k in (1, 2, 3)}
        everything = httpx.get(f"{base}/api/tasks", auth=auth, timeout=5).text
        assert SECRET_LINE not in everything  # task arguments are ids; chunk text never reaches Flower
    finally:
        for w in workers:
            w.stop()
        flower.terminate()
        flower.communicate(timeout=20)
    with pytest.raises(httpx.ConnectError):  # SIGTERM to `rlm flower` stopped Flower itself: no orphan
        httpx.get(f"{base}/api/workers", timeout=2)
