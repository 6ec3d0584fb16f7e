"""`rlm query` when a job outlives the command: Ctrl-C cancels it, --timeout says how to fetch it later, and a
bad-input failure after the job was stored names the job.  Real workers (`rlm worker` subprocesses), real
PostgreSQL and Valkey, the scripted OpenAI-protocol model; the CLI runs as a real `rlm` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.pipeline_model import QUESTION, write_essays
from tests.support.workers import ROOT, running_workers, scripted_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(rlm_env, llm, RLM_LLM_RETRIES="1", RLM_LLM_TIMEOUT="90") as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("cli-query") / "essays"
    write_essays(root)
    load_paths(conn, buffer="essays", paths=[root], embedder=embedder)
    conn.commit()
    return root


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("worker-logs"), pools, flush_broker=False) as ws:
        yield ws


def _start_query(env, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "query", QUESTION, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until(what, check, timeout=120):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _newest_job(conn, query=QUESTION):
    row = conn.execute("SELECT id, status FROM jobs WHERE query = %s ORDER BY created_at DESC LIMIT 1", (query,))
    found = row.fetchone()
    conn.commit()
    return found


def _analyst_requests(llm):
    return [r for r in llm.requests if r.body.get("model") == "analyst-model"]


def _stderr_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def test_ctrl_c_cancels_the_running_job(env, conn, fresh, model):
    before = _newest_job(conn)
    model.gate.clear()  # analysts hold their replies: the job sits in its fan-out
    proc = _start_query(env, "--buffer", "essays", "--skip-plan")
    try:
        _until("an analyst call", lambda: _analyst_requests(fresh))
        job_id, status = _newest_job(conn)
        assert (job_id, status) != before and status == "running"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        model.gate.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert _stderr_lines(err) == [f"error: interrupted: job {job_id} cancelled"], err
    assert _newest_job(conn) == (job_id, "cancelled")


def test_timeout_names_the_job_and_how_to_fetch_it_and_the_job_goes_on(env, conn, fresh, model):
    from rlm_workers.submit import wait_for_job

    model.gate.clear()
    proc = _start_query(env, "--buffer", "essays", "--skip-plan", "--timeout", "2")
    try:
        _until("an analyst call", lambda: _analyst_requests(fresh))
        out, err = proc.communicate(timeout=120)
        job_id, status = _newest_job(conn)
        assert status == "running"  # running workers have it: --timeout gives up waiting, not the job
    finally:
        model.gate.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    lines = _stderr_lines(err)
    assert len(lines) == 1 and job_id in lines[0] and f"GET /v1/queries/{job_id}" in lines[0], err
    assert wait_for_job(conn, job_id, timeout=120).status == "done"


def test_bad_input_failure_after_the_job_was_stored_exits_1_with_the_job_id(env, conn, fresh, model, corpus):
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import delete_buffer

    load_paths(conn, buffer="doomed", paths=[corpus])
    conn.commit()
    planning, release = threading.Event(), threading.Event()

    def slow_plan(req):
        planning.set()
        release.wait(60)
        return json.dumps({"search_mode": "bm25"})

    model.plan_reply = slow_plan
    proc = _start_query(env, "--buffer", "doomed")
    try:
        assert planning.wait(120), "the planner was never called"
        assert delete_buffer(conn, tenant="local", name="doomed")  # gone before the search stage
        conn.commit()
        release.set()
        out, err = proc.communicate(timeout=120)
    finally:
        release.set()
        model.plan_reply = None
        if proc.poll() is None:
            proc.kill()
    job_id, status = _newest_job(conn)
    assert status == "failed"
    assert proc.returncode == 1, err  # 2 would say nothing was written, but the job was
    lines = _stderr_lines(err)
    assert len(lines) == 1 and job_id in lines[0] and "doomed" in lines[0], err
