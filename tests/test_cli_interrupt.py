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
    """What the command said on stderr, without ``rlm query``'s progress lines (``stage: …``), which a query
    still waiting after 10 s prints when stderr is no terminal: on a slow machine the tests' ones can."""
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("stage: ")]


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


# --------------------------------------------------------------------------- rlm batch submit


@pytest.fixture()
def black_hole_broker():
    """A broker URL whose server accepts connections and never answers: sending the first tick hangs there."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    srv.close()


def _start_batch(env, tmp_path, *args, **extra_env):
    queries = tmp_path / "queries.txt"
    queries.write_text("What did the essays say about cities?\nWho wrote the letters?\n")
    return subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "batch", "submit", "-q", str(queries), "-b", "essays"]
        + ["--no-check-workers", *args],
        cwd=ROOT,
        env={**os.environ, **env, **extra_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _batch_ids(conn) -> set[str]:
    from rlm_workers.store.overnight import list_overnight

    ids = {b.id for b in list_overnight(conn, tenant="local", limit=500)}
    conn.commit()
    return ids


def _batch_waits_on_a_lock(conn) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO overnight_batches%'"
    ).fetchone()
    conn.commit()
    return row[0] > 0


def test_ctrl_c_after_the_batch_is_stored_names_it_and_how_to_cancel_it(env, conn, corpus, black_hole_broker, tmp_path):
    before = _batch_ids(conn)
    proc = _start_batch(env, tmp_path, RLM_BROKER_URL=black_hole_broker)
    try:
        _until("the batch to be committed", lambda: _batch_ids(conn) - before)
        (batch_id,) = _batch_ids(conn) - before
        time.sleep(0.3)  # into the first tick's send, which the broker never answers
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert out == f"{batch_id}\n"
    assert _stderr_lines(err) == [
        f"error: interrupted, but batch {batch_id} was stored and will run; stop it with `rlm batch cancel {batch_id}`"
    ], err


def test_ctrl_c_before_the_commit_keeps_nothing(env, conn, corpus, tmp_path):
    """The CLI's insert waits on another transaction that holds the same idempotency key; Ctrl-C there keeps
    neither the batch nor its items."""
    import uuid

    from rlm_workers.store.db import connect
    from rlm_workers.store.overnight import create_overnight, list_overnight

    before = _batch_ids(conn)
    key = f"held-{uuid.uuid4().hex}"
    holder = connect()
    try:
        list_overnight(holder, tenant="local", limit=1)  # a transaction is open: the insert below stays in it
        create_overnight(
            holder,
            overnight_batch_id=uuid.uuid4().hex,
            tenant="local",
            queries=["held"],
            buffers=["essays"],
            options={},
            run_at=None,
            priority=3,
            token_budget=None,
            tick_token="t",
            idempotency_key=key,
        )
        proc = _start_batch(env, tmp_path, "--idempotency-key", key)
        try:
            _until("the CLI's insert to wait", lambda: _batch_waits_on_a_lock(conn))
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        holder.rollback()
        holder.close()
    assert proc.returncode == 130, err
    assert out == "" and _stderr_lines(err) == ["error: interrupted; nothing was submitted"], err
    assert _batch_ids(conn) == before


#: `rlm …` with a real SIGINT sent to itself while the named module is being imported: a Ctrl-C in the CLI's
#: first second, when its imports run, at a chosen place instead of a chosen time
INTERRUPT_DURING_IMPORT = """
import os, runpy, signal, sys

at = sys.argv.pop(1)


class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, CtrlC())
runpy.run_module("rlm_api.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "module, line",
    [
        # the CLI's own imports, before any command runs
        ("typer", "error: interrupted; nothing half-written was kept"),
        # `batch submit`'s imports, before it reads its queries
        ("rlm_workers.overnight.submit", "error: interrupted; nothing was submitted"),
    ],
)
def test_ctrl_c_in_the_first_second_of_batch_submit_is_one_line_and_exit_130(env, tmp_path, module, line):
    queries = tmp_path / "queries.txt"
    queries.write_text("Who wrote the letters?\n")
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT_DURING_IMPORT, module, "batch", "submit", "-q", str(queries), "-b", "essays"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr
    assert (proc.stdout, proc.stderr) == ("", line + "\n")


def test_ctrl_c_during_a_load_says_so_and_leaves_the_buffer_as_it_was(env, conn, corpus, tmp_path):
    """`rlm load` into a loaded buffer, interrupted once it has embedded windows: one line, exit 130, and the
    buffer keeps its version, files and chunks (the load is one transaction)."""
    from rlm_workers.store.buffers import get_buffer

    before = get_buffer(conn, tenant="local", name="essays")
    chunks_before = conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = %s", (before.id,)).fetchone()[0]
    conn.commit()
    big = tmp_path / "big"
    big.mkdir()
    for i in range(80):  # ~1.3 MB of distinct sentences: tens of seconds to embed on 2 cores
        lines = (f"Note {i}.{j}: the ferry left pier {j % 17} at hour {j % 24}, {i * j} crates.\n" for j in range(200))
        (big / f"notes-{i:03d}.txt").write_text("".join(lines))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlm_api.cli", "load", str(big), "--buffer", "essays"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            seen.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        # a progress line with windows embedded: the load is inside its transaction, encoding
        embedding = lambda: any(" windows embedded" in ln and " 0 windows" not in ln for ln in seen)  # noqa: E731
        _until("the load to embed windows", embedding)
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen)
    assert proc.returncode == 130, err
    assert out == ""
    assert [ln for ln in _stderr_lines(err) if not ln.startswith("loading: ")] == [
        "error: interrupted; buffer 'essays' was not changed"
    ], err
    after = get_buffer(conn, tenant="local", name="essays")
    chunks_after = conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = %s", (after.id,)).fetchone()[0]
    conn.commit()
    assert (after.version, chunks_after) == (before.version, chunks_before)
