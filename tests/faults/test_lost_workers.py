"""A worker killed mid-task (SIGKILL, its whole process tree): the work moves again long before Redis would redeliver.

The clocks here keep Redis's redelivery (``RLM_VISIBILITY_TIMEOUT``) and the idle-job sweep (``RLM_JOB_TIMEOUT``) at
their production scale, so only the detection of a dead worker can get the job or the upload going within the
test's patience (issue #41).  No timing asserts: a bounded wait fails the test if the work never moves.
"""

from __future__ import annotations

import json
import random
import threading
import uuid

import psutil
import pytest

from tests.support.jobs import submit, wait, wait_for
from tests.support.pipeline_model import NEEDLE
from tests.support.workers import WorkerProcess, running_workers, scripted_env

pytestmark = pytest.mark.slow

#: production-sized redelivery and idle timeouts; a dead worker's lock is looked for every 2 s
CLOCKS = {
    "RLM_VISIBILITY_TIMEOUT": "3600",
    "RLM_JOB_TIMEOUT": "1800",
    "RLM_RECONCILE_SECONDS": "2",
    "RLM_WORKER_LOST_SECONDS": "2",
}
#: how long a test waits for the work to move again: far below the timeouts above
PATIENCE = 120


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(rlm_env, llm, RLM_LLM_RETRIES="0", RLM_LLM_TIMEOUT="60", **CLOCKS) as e:
        yield e


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 2), "an": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("lost-logs"), pools) as ws:
        yield ws


def kill_tree(worker: WorkerProcess) -> None:
    """SIGKILL the worker and every process it started, as an OOM kill or a lost host ends it."""
    parent = psutil.Process(worker.proc.pid)
    for child in parent.children(recursive=True):
        child.kill()
    worker.kill()


def test_only_a_started_stage_nobody_runs_counts_as_lost(env):
    """No worker here: the store alone.  A stage run by a live session, a queued job, a fan-out past its chord or
    parked for its group's shared reads is never taken for a dead worker's; a stage nobody runs is, once."""
    from rlm_workers.models import JobStatus
    from rlm_workers.pipeline.reconcile import RUN_IN_TASK
    from rlm_workers.store import jobs as job_store
    from rlm_workers.store.db import connection

    def job(stage: str | None, **spec: object) -> str:
        job_id = "lostq" + uuid.uuid4().hex[:12]
        with connection() as conn:
            job_store.create_job(conn, job_id=job_id, tenant="local", query="q", buffers=["b"], options={}, spec=spec)
            if stage is not None:
                job_store.set_stage(conn, job_id=job_id, stage=stage)
            conn.execute("UPDATE jobs SET stage_at = now() - interval '1 hour' WHERE id = %s", (job_id,))
        return job_id

    dead, running, queued, parked, launched = (
        job("search"),
        job("plan"),
        job(None),
        job("fan_out", read_group="g"),
        job("fan_out"),
    )
    mine = {dead, running, queued, parked, launched}
    try:
        with connection() as conn:
            job_store.add_task_ids(conn, job_id=launched, task_ids=["t"])
        with connection() as holder, job_store.stage_held(holder, job_id=running), connection() as conn:
            found = [j for j in job_store.orphaned_jobs(conn, stages=RUN_IN_TASK, grace_seconds=2) if j[0] in mine]
            assert found == [(dead, "search")]
            # claimed: the next sweep leaves it to the task just sent
            again = job_store.orphaned_jobs(conn, stages=RUN_IN_TASK, grace_seconds=2)
            assert not [j for j in again if j[0] in mine]
    finally:
        # ended, so the workers of the tests below never pick them up
        with connection() as conn:
            for job_id in mine:
                job_store.finish_job(conn, job_id=job_id, status=JobStatus.cancelled, error={"type": "cancelled"})


def test_a_job_whose_control_worker_died_mid_plan_moves_again(db, fresh, model, workers):
    held, reached = threading.Event(), threading.Event()

    def slow_plan(_req):
        reached.set()
        held.wait(60)
        return json.dumps({"search_mode": "hybrid", "threshold": -1.0})

    model.plan_reply = slow_plan
    try:
        job_id = submit(db, skip_plan=False)
        assert reached.wait(60), workers["ctl"].tail()
        kill_tree(workers["ctl"])
    finally:
        held.set()
    workers["ctl"].start()
    job = wait(db, job_id, timeout=PATIENCE)
    assert job.status == "done", (job.status, job.error, workers["ctl"].tail())
    assert NEEDLE in job.result.response


def test_a_job_whose_analyst_worker_died_mid_batch_moves_again(db, fresh, model, workers):
    """The batches the dead worker held are sent again once their leases lapse, and Collect once they ended: the
    chord would wait for the dead worker's messages until Redis redelivers them."""
    model.analyst_delay = 2.0
    job_id = submit(db)
    assert wait_for(lambda: fresh.stats()["in_flight"] >= 2, timeout=60), workers["an"].tail()
    kill_tree(workers["an"])
    workers["an"].start()
    job = wait(db, job_id, timeout=PATIENCE)
    assert job.status == "done", (job.status, job.error, workers["ctl"].tail())
    r = job.result.model_dump(mode="json")
    assert r["batches_processed"] == job.batches_total and not r["batch_errors"], r["batch_errors"]
    # every batch was paid once: the dead worker's calls never reached the log, the re-sent ones did
    calls = db.execute(
        "SELECT batch_no, count(*) FROM llm_calls WHERE job_id = %s AND stage = 'analyst' AND status = 'ok' "
        "GROUP BY batch_no",
        (job_id,),
    ).fetchall()
    db.commit()
    assert len(calls) == job.batches_total and {n for _, n in calls} == {1}, calls


def prose(rnd: random.Random, size: int) -> str:
    words = [
        "river", "ledger", "harbour", "copper", "lantern", "orchard", "signal", "meadow", "quarry", "beacon",
        "granite", "willow", "compass", "furnace", "tundra", "parcel", "saddle", "thicket", "voyage", "mosaic",
    ]  # fmt: skip
    out, n = [], 0
    while n < size:
        sentence = " ".join(rnd.choice(words) for _ in range(rnd.randint(8, 16))).capitalize() + "."
        out.append(sentence)
        n += len(sentence) + 1
    return " ".join(out)


def test_an_upload_whose_ingest_worker_died_mid_load_is_loaded_once(db, env, tmp_path):
    from rlm_workers.celery_app import get_app
    from rlm_workers.store.uploads import create_upload, get_upload

    rnd = random.Random(41)
    files = [(f"doc{i:02d}.md", prose(rnd, 20_000).encode()) for i in range(16)]
    upload_id = "lost" + uuid.uuid4().hex[:12]
    buffer = "lost-" + upload_id
    create_upload(db, upload_id=upload_id, tenant="local", buffer=buffer, options={}, files=files)
    db.commit()

    def status() -> tuple[str, int]:
        up = get_upload(db, upload_id=upload_id)
        db.commit()
        return up.status, up.attempts

    ingest = WorkerProcess("ing", queues="rlm.ingest", env=env, log_dir=tmp_path, concurrency=1, pool="prefork")
    ingest.start()
    try:
        get_app().send_task("rlm.ingest", (upload_id,))
        assert wait_for(lambda: status() == ("running", 1), timeout=60), (status(), ingest.tail())
        kill_tree(ingest)
        assert status()[0] == "running", "the load ended before the worker was killed: make it larger"
        ingest.start()
        assert wait_for(lambda: status()[0] != "running", timeout=PATIENCE, every=0.5), (status(), ingest.tail())
        assert status() == ("done", 2), (status(), ingest.tail())
    finally:
        ingest.stop()
    files_stored, chunks, distinct = db.execute(
        """SELECT count(DISTINCT f.id), count(c.id), count(DISTINCT (c.file_id, c.ordinal))
           FROM buffers b JOIN files f ON f.buffer_id = b.id JOIN chunks c ON c.file_id = f.id
           WHERE b.name = %s AND b.tenant = 'local'""",
        (buffer,),
    ).fetchone()
    db.commit()
    assert files_stored == len(files) and chunks == distinct > 0
