"""Flower watches the same broker: a finished job's analyst tasks are listed, by ids, never chunk text."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from rlm_api.cli_up import flower_argv, is_loopback
from rlm_workers.errors import InvalidInput
from tests.support.workers import ROOT, WorkerProcess

SECRET_LINE = "The vault combination is kept in the blue ledger on the third shelf."


def test_flower_refuses_an_open_bind_off_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(InvalidInput, match="RLM_FLOWER_BASIC_AUTH"):
        flower_argv("0.0.0.0", 5555, None)
    argv, env = flower_argv("0.0.0.0", 5555, "ops:s3cret")
    assert "--basic-auth=ops:s3cret" in argv and "FLOWER_UNAUTHENTICATED_API" not in env
    argv, env = flower_argv("127.0.0.1", 5555, None)
    assert env == {"FLOWER_UNAUTHENTICATED_API": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
    flower = subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "flower", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    workers = [
        WorkerProcess("fctl", queues="rlm.control", env=env, log_dir=tmp_path),
        WorkerProcess("fan", queues="rlm.analyst", env=env, log_dir=tmp_path),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/api/workers", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
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
            tasks = httpx.get(f"{base}/api/tasks", params={"taskname": "rlm.analyst"}, timeout=5).json()
            mine = {k: t for k, t in tasks.items() if job_id in (t.get("args") or "")}
            if len(mine) == job.batches_total and all(t.get("state") == "SUCCESS" for t in mine.values()):
                break
            time.sleep(0.5)
        assert len(mine) == job.batches_total == 3
        assert {t["args"] for t in mine.values()} == {f"job={job_id} batch={k}/3" for k in (1, 2, 3)}
        everything = httpx.get(f"{base}/api/tasks", timeout=5).text
        assert SECRET_LINE not in everything  # task arguments are ids; chunk text never reaches Flower
    finally:
        for w in workers:
            w.stop()
        flower.terminate()
        flower.wait(timeout=20)
    with pytest.raises(httpx.ConnectError):  # SIGTERM to `rlm flower` stopped Flower itself: no orphan
        httpx.get(f"{base}/api/workers", timeout=2)
