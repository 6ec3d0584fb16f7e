"""The finishing stages on real workers: a long synthesis runs once, a dead synthesizer is still salvaged,
the synthesizer's tool calls are bounded and recorded, and a cancel is not logged as an error.

Short clocks (``RLM_JOB_TIMEOUT`` 6 s, a sweep every second) make the reconciler and the watchdog look at a
synthesis many times while it runs; the scripted model's synthesizer is slowed past that timeout.
"""

from __future__ import annotations

import pytest

from tests.support import jobs
from tests.support.jobs import wait, wait_for
from tests.support.pipeline_model import NEEDLE, write_essays
from tests.support.scripted_llm import Reply
from tests.support.workers import running_workers, scripted_env

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 6


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(
        rlm_env,
        llm,
        RLM_LLM_RETRIES="0",
        RLM_LLM_TIMEOUT="60",
        RLM_MAX_CONCURRENCY="4",
        RLM_JOB_TIMEOUT=str(JOB_TIMEOUT),
        RLM_RECONCILE_SECONDS="1",
        # above every synthesis here: a redelivery of the stage is not what these tests are about
        RLM_VISIBILITY_TIMEOUT="90",
    ) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("lease") / "essays"
    write_essays(root, injection_at=None)
    load_paths(conn, buffer="essays", paths=[root], embedder=embedder)
    conn.commit()


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("lease-logs"), pools) as ws:
        yield ws


def submit(conn, **options):
    return jobs.submit(conn, **{"max_chunks": 8, **options})


def synth_requests(llm):
    return [r.body for r in llm.requests if r.body.get("model") == "synth-model"]


def synth_runs(llm) -> int:
    """Syntheses started: a synthesizer's first turn is the only request without tool results."""
    return sum(1 for b in synth_requests(llm) if not any(m.get("role") == "tool" for m in b["messages"]))


def slow_synthesizer(model, seconds: float):
    def respond(req):
        reply = model(req)
        if req.get("model") != "synth-model":
            return reply
        reply = reply if isinstance(reply, Reply) else Reply.text(reply)
        reply.delay += seconds
        return reply

    return respond


def logs_since(workers, marks):
    return "".join(
        w.log_path.read_text(errors="replace")[marks.get(name, 0) :]
        for name, w in workers.items()
        if w.log_path.exists()
    )


def log_marks(workers):
    return {name: len(w.log_path.read_text(errors="replace")) for name, w in workers.items() if w.log_path.exists()}


def test_a_synthesis_slower_than_the_job_timeout_runs_exactly_once(conn, fresh, model, workers):
    """Two turns of 8 s each: the job sits in synthesize for well over RLM_JOB_TIMEOUT, through many sweeps
    and every watchdog re-arm; the stage's heartbeat and lease keep them all off it."""
    fresh.responder = slow_synthesizer(model, 8.0)
    try:
        job = wait(conn, submit(conn))
    finally:
        fresh.responder = model
    assert job.status == "done", job.error
    assert NEEDLE in job.result.response
    assert synth_runs(fresh) == 1
    assert len(synth_requests(fresh)) == 2  # the tool turn and the answer, nothing repeated


def test_a_killed_synthesizer_is_salvaged_once_its_lease_lapses(conn, fresh, model, workers):
    from rlm_workers.store import jobs as job_store

    fresh.responder = slow_synthesizer(model, 45.0)
    try:
        job_id = submit(conn)
        assert wait_for(lambda: synth_runs(fresh) == 1), "the synthesis never started"
        workers["ctl"].kill()  # the synthesizing worker dies mid-call: nobody renews its lease
        fresh.responder = model
        workers["ctl"].start()
        job = wait(conn, job_id)
    finally:
        fresh.responder = model
    assert job.status == "done", job.error
    assert NEEDLE in job.result.response
    assert synth_runs(fresh) == 2  # the dead one, and the salvage's
    log = "".join(w.log_path.read_text(errors="replace") for w in workers.values())
    assert f"salvaging job {job_id}" in log
    assert job_store.get_job(conn, job_id=job_id).terminal
    conn.commit()


def test_tool_calls_are_bounded_per_turn_and_recorded_on_the_result(conn, fresh, model, workers):
    from rlm_workers.limits import MAX_TOOL_CALLS_PER_TURN

    asked = MAX_TOOL_CALLS_PER_TURN + 4

    def respond(req):
        if req.get("model") == "synth-model" and not any(m.get("role") == "tool" for m in req["messages"]):
            calls = [("grep_chunks", {"pattern": f"Dolores\\s+Park|call{i}"}) for i in range(asked - 1)]
            return Reply.tools(*calls, ("no_such_tool", {}))
        return model(req)

    fresh.responder = respond
    try:
        job = wait(conn, submit(conn))
    finally:
        fresh.responder = model
    assert job.status == "done", job.error
    calls = [c.model_dump() for c in job.result.tool_calls]
    assert len(calls) == asked
    assert [c["status"] for c in calls] == ["ok"] * MAX_TOOL_CALLS_PER_TURN + ["refused"] * 4
    assert all(c["turn"] == 1 and c["name"] in ("grep_chunks", "no_such_tool") for c in calls)
    assert "Dolores" in calls[0]["args"] and calls[0]["error"] is None
    assert "over the limit" in calls[-1]["error"]
    # the model got an answer for every call id, the refused ones included, and none of them ran
    second = synth_requests(fresh)[-1]
    tool_replies = [m["content"] for m in second["messages"] if m.get("role") == "tool"]
    assert len(tool_replies) == asked
    assert sum("over the limit" in t for t in tool_replies) == 4


def test_a_cancel_is_logged_as_one_info_line_not_a_chord_error(conn, fresh, model, workers):
    from rlm_workers.celery_app import get_app
    from rlm_workers.store import jobs as job_store

    marks = log_marks(workers)
    model.gate.clear()  # analysts hold their calls: the header is still running when the cancel lands
    try:
        job_id = submit(conn, batch_size=1, max_chunks=12)
        assert wait_for(lambda: fresh.stats()["in_flight"] >= 2), "no analyst call started"
        # the fan-out stores its task ids after sending the chord, so analysts can start before they are
        # stored; a cancel in that window has nothing to revoke (its analysts see the status and stop), and
        # this test is about the revoke's log line
        assert wait_for(lambda: job_store.get_job(conn, job_id=job_id).task_ids), "the chord's task ids never stored"
        conn.commit()
        job = job_store.cancel_job(conn, job_id=job_id, tenant="local")
        conn.commit()
        assert job.status == "cancelled"
        # what DELETE /v1/queries/{id} does; waiting for the workers' replies means the revoke has reached
        # them before the held calls return
        replies = get_app().control.revoke(job.task_ids, reply=True, timeout=10)
        assert replies, "no worker acknowledged the revoke"
    finally:
        model.gate.set()
    assert wait_for(lambda: "ChordError" in logs_since(workers, marks) or "ended early" in logs_since(workers, marks))
    lines = logs_since(workers, marks).splitlines()
    chord_lines = [ln for ln in lines if "ChordError" in ln or "ended early" in ln]
    assert len(chord_lines) == 1, chord_lines
    assert "INFO" in chord_lines[0] and "cancelled" in chord_lines[0]
    assert not any("Traceback" in ln or " ERROR " in ln or "ERROR/" in ln for ln in lines), "\n".join(lines[-40:])
