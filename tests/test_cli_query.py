"""A successful ``rlm query`` as a user runs it: the real CLI in a subprocess, the real chord, real PostgreSQL.

First with no worker anywhere and no API key (what ``make demo`` does): the CLI starts its in-process worker
(rlm_workers/runtime/ephemeral.py) and the offline extractive provider answers; then with ``rlm worker`` processes
and the scripted OpenAI-protocol server.  The module has its own Valkey, so no worker of another module can
serve its queues and hide the in-process path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.pipeline_model import CHUNK_COUNT, MODEL_ENV, NEEDLE, QUESTION, write_essays
from tests.support.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.slow

#: docs/contract.md#status-line, one line under the report
STATUS_LINE = re.compile(
    r"Scale: (?P<tier>\w+) \| Chunks: (?P<analyzed>\d+)/(?P<available>\d+) analyzed \| Findings: (?P<findings>\d+)"
    r" \| Batches: (?P<ok>\d+) ok, (?P<failed>\d+) failed \| Tokens: (?P<tokens>\d+) \| Time: (?P<time>\d+\.\d)s"
)
#: its second line: mode and route, rounds, children, confidence, completeness, coverage, cost (docs/contract.md#modes)
MODES_LINE = re.compile(
    r"Mode: (?P<mode>\w+) \((?P<route>\w+)\) \| Rounds: (?P<rounds>\d+) \| Children: (?P<children>\d+) \| "
    r"Confidence: (?P<confidence>n/a|\d\.\d\d) \| Complete: (?P<complete>yes|no|unknown) \| "
    r"Coverage: (?P<coverage>\d+)% \| Cost: \$(?P<cost>\d+\.\d{4})"
)
#: a --verbose line per LLM call (docs/contract.md#cli-query)
CALL_LINE = re.compile(
    r"llm stage=[a-z_]+( batch=\d+)? model=\S+ tokens_in=\d+ tokens_out=\d+ latency_ms=\d+ status=\w+"
    r"( reply=(parsed|unparsed))?( error=.+)?"
)
JOB_LINE = re.compile(r"^job (?P<id>\S+) \((?P<where>in-process worker|running workers)\)$", re.M)


def documented_result_fields() -> set[str]:
    """The QueryResult fields named in docs/contract.md#query-result's table: the contract, not the model."""
    text = (ROOT / "docs" / "contract.md").read_text()
    section = text[text.index('<a id="query-result"></a>') :]
    table = section[section.index("| field | meaning |") :].split("\n\n", 1)[0]
    fields: set[str] = set()
    for row in table.splitlines()[2:]:
        fields.update(re.findall(r"`(\w+)`", row.split("|")[1]))
    return fields


def run_query(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "query", QUESTION, "--buffer", "essays", "--verbose", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def env(rlm_env, tmp_path_factory):
    """This module's own broker; no API key (conftest removed any from the environment)."""
    from rlm_workers.runtime import local_servers as services
    from tests.support.envpatch import patched_env

    root = tmp_path_factory.mktemp("cli-query-valkey")
    extra = {"RLM_BROKER_URL": services.embedded_valkey_url(root), "HF_HUB_OFFLINE": "1"}
    try:
        with patched_env(extra):
            yield {**rlm_env, **extra}
    finally:
        services.stop_embedded_valkey(root)


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("cli-query") / "essays"
    write_essays(root)
    assert load_paths(conn, buffer="essays", paths=[root], embedder=embedder).chunks_written == CHUNK_COUNT
    conn.commit()
    return root


def job_of(conn, job_id):
    from rlm_workers.models import QueryResult
    from rlm_workers.store import jobs as job_store

    job = job_store.get_job(conn, job_id=job_id)
    rows = job_store.batches(conn, job_id=job_id)
    conn.commit()
    assert job is not None and job.result is not None, job
    return job, QueryResult.model_validate(job.result), rows


def test_offline_query_with_no_worker_runs_in_process_and_prints_the_status_line(env, conn, corpus):
    from rlm_workers.celery_app import get_app
    from rlm_workers.runtime.ephemeral import served_queues

    assert served_queues(get_app()) == set()  # nobody serves the queues: only the CLI's own worker can run the job
    proc = run_query(env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    [started] = JOB_LINE.finditer(proc.stderr)
    assert started["where"] == "in-process worker", proc.stderr
    assert "Traceback" not in proc.stderr

    job, result, rows = job_of(conn, started["id"])
    assert job.status == "done" and result.provider == "extractive"
    # the real chord ran: every planned batch has its row, each ended ok
    assert rows and [b.status for b in rows] == ["ok"] * len(rows) and result.batches_processed == len(rows)
    assert result.chunks_available == CHUNK_COUNT and result.chunks_analyzed > 0

    rest, _, answered = proc.stdout.rstrip().rpartition("\n")
    assert answered == "Answered by: the offline extractive provider (no model: the best-matching passages)"
    rest, _, modes = rest.rpartition("\n")
    report, _, last = rest.rpartition("\n")
    assert report.rstrip() == result.response.rstrip()
    m = MODES_LINE.fullmatch(modes)
    assert m, modes
    assert (m["mode"], m["route"], int(m["rounds"]), int(m["children"])) == (
        result.mode,
        result.route,
        result.rounds,
        len(result.children),
    )
    assert m["confidence"] == "n/a" and m["complete"] == "unknown" and m["cost"] == "0.0000"
    assert NEEDLE.split(" is ")[1].rstrip(".") in report  # the extractive answer quotes the needle
    m = STATUS_LINE.fullmatch(last)
    assert m, last
    assert (m["tier"], int(m["available"]), int(m["analyzed"])) == (
        result.scaling_tier,
        result.chunks_available,
        result.chunks_analyzed,
    )
    assert (int(m["findings"]), int(m["ok"]), int(m["failed"]), int(m["tokens"])) == (
        result.findings_count,
        result.batches_processed,
        result.batches_failed,
        result.total_tokens,
    )
    assert m["time"] == f"{result.elapsed:.1f}"
    assert served_queues(get_app()) == set()  # the in-process worker left with the CLI


@pytest.fixture(scope="module")
def workers(env, corpus, llm, tmp_path_factory):
    """rlm.control and rlm.analyst workers talking to the scripted server (the CLI gets the same env)."""
    wenv = {
        **env,
        "OPENAI_API_KEY": "sk-test-not-a-real-key",
        "OPENAI_BASE_URL": llm.base_url,
        **MODEL_ENV,
        "RLM_LLM_RETRIES": "1",
        "RLM_LLM_TIMEOUT": "30",
    }
    logs = tmp_path_factory.mktemp("cli-query-workers")
    ws = [
        WorkerProcess("ctl", queues="rlm.control", env=wenv, log_dir=logs, concurrency=4),
        WorkerProcess("an", queues="rlm.analyst", env=wenv, log_dir=logs, concurrency=4),
    ]
    try:
        for w in ws:
            w.start()
        yield wenv
    finally:
        for w in ws:
            w.stop()


def test_json_query_on_running_workers_through_the_scripted_server(conn, workers, llm):
    llm.reset()
    proc = run_query(workers, "--format", "json")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    [started] = JOB_LINE.finditer(proc.stderr)
    assert started["where"] == "running workers", proc.stderr

    data = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert set(data) == documented_result_fields()
    job, result, rows = job_of(conn, started["id"])
    assert data == json.loads(result.model_dump_json())  # what the CLI printed is what the job stored
    assert data["job_id"] == started["id"] and job.status == "done"
    assert data["provider"] == "openai" and NEEDLE in data["response"]
    assert data["chunks_available"] == CHUNK_COUNT and data["batches_failed"] == 0
    assert data["batches_processed"] == len(rows) > 0
    # every call the scripted server answered is accounted for, with the tokens it reported
    assert data["llm_calls"] == llm.calls
    assert data["total_tokens"] == llm.usage["total_tokens"] == data["tokens_in"] + data["tokens_out"]
    # --verbose labels each value of a call line: bare ones left the reader guessing stage from model
    calls = [line.strip() for line in proc.stderr.splitlines() if line.lstrip().startswith("llm ")]
    assert len(calls) == data["llm_calls"], proc.stderr
    for line in calls:
        assert CALL_LINE.fullmatch(line), line
