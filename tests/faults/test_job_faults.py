"""Faults during a job, with real worker processes, real servers and the scripted model.

For each fault the promise is the same: every job ends (done, or failed with a reason, never stuck),
nothing finished is lost, nothing is billed twice, and the reconciler's actions are logged.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from tests.support.jobs import submit, wait, wait_for
from tests.support.pipeline_model import NEEDLE, QUESTION
from tests.support.scripted_llm import Reply

pytestmark = pytest.mark.slow


#: jobs run one after another while the model refuses three calls in ten (a minute's worth on a fast machine)
JOBS_UNDER_ERRORS = 5


def stage_of(conn, job_id):
    row = conn.execute("SELECT stage FROM jobs WHERE id = %s", (job_id,)).fetchone()
    conn.commit()
    return row[0]


def analyst_calls_per_batch(conn, job_id):
    rows = conn.execute(
        "SELECT batch_no, count(*) FROM llm_calls WHERE job_id = %s AND stage = 'analyst' "
        "AND status = 'ok' GROUP BY batch_no",
        (job_id,),
    ).fetchall()
    conn.commit()
    return dict(rows)


def assert_bill_matches_server(job, llm):
    """Billed tokens = tokens the server reported; no call counted twice, none missing."""
    r = job.result.model_dump(mode="json")
    assert r["total_tokens"] == llm.usage["total_tokens"]


def test_sigkill_of_the_control_worker_between_search_and_fan_out(db, fresh, workers):
    workers["ctl"].stop()
    workers["ctl"].start()  # a fresh process: its first search loads the query encoder, a wide window
    job_id = submit(db)
    assert wait_for(lambda: stage_of(db, job_id) == "search", timeout=60)
    workers["ctl"].kill()
    workers["ctl"].start()
    job = wait(db, job_id)
    assert job.status == "done", job.error
    assert NEEDLE in job.result.response
    # redelivered or reconciled, every batch was analysed exactly once
    assert set(analyst_calls_per_batch(db, job_id).values()) == {1}
    assert_bill_matches_server(job, fresh)


def test_sigkill_of_the_analyst_worker_mid_batch(db, fresh, model, workers):
    model.analyst_delay = 2.0
    job_id = submit(db)
    assert wait_for(lambda: fresh.stats()["in_flight"] >= 2, timeout=60)
    workers["an"].kill()
    workers["an"].start()
    job = wait(db, job_id)
    assert job.status == "done", job.error
    r = job.result.model_dump(mode="json")
    assert r["batches_processed"] + r["batches_failed"] == job.batches_total
    assert all(e["type"] == "lost" for e in r["batch_errors"])


def test_redis_stopped_for_10s_during_a_job(db, fresh, model, test_services):
    from rlm_workers.runtime import local_servers as services

    model.analyst_delay = 1.5
    job_id = submit(db, batch_size=2)
    assert wait_for(lambda: fresh.stats()["in_flight"] >= 1, timeout=60)
    assert services.stop_embedded_valkey(test_services.data_dir)
    time.sleep(10)
    assert services.embedded_valkey_url(test_services.data_dir) == test_services.broker_url
    job = wait(db, job_id, timeout=180)
    assert job.status in ("done", "failed"), job.status
    if job.status == "failed":
        assert job.error and job.error.message
    else:
        assert job.result.batches_processed + job.result.batches_failed == job.batches_total
    # the stack still works afterwards
    after = wait(db, submit(db, max_chunks=4))
    assert after.status == "done", after.error


def test_postgres_restarted_during_a_job(db, fresh, model, test_services):
    import psycopg

    from rlm_workers.runtime import local_servers as services

    model.analyst_delay = 1.5
    job_id = submit(db, batch_size=2)
    assert wait_for(lambda: fresh.stats()["in_flight"] >= 1, timeout=60)
    db.close()
    assert services.stop_embedded_postgres(test_services.data_dir)
    time.sleep(5)
    services.embedded_postgres_url(test_services.data_dir)
    db_url = os.environ["RLM_DATABASE_URL"]
    with psycopg.connect(db_url, autocommit=True) as c2:
        job = wait(c2, job_id, timeout=180)
        assert job.status == "done", job.error
        r = job.result.model_dump(mode="json")
        assert r["batches_processed"] + r["batches_failed"] == job.batches_total
        # batches that were in flight during the outage retried (a retry is not a failure)
        assert NEEDLE in r["response"] or any(e["chunk_ids"] for e in r["batch_errors"])


def test_llm_answering_30_percent_errors_across_several_jobs(db_url, rlm_env, fresh, model):
    """Several jobs, one after another, while the model fails three calls in ten: they all end, and the bill is
    exact.  A fixed number of jobs rather than a minute's worth: the same faults, however fast the machine."""
    import psycopg

    rnd = random.Random(7)
    lock = threading.Lock()
    inner = model.__call__
    refused = []

    def flaky(req):
        with lock:
            fail = rnd.random() < 0.3
            refused.append(fail)
        return Reply.http_error(503, "scripted overload") if fail else inner(req)

    fresh.responder = flaky
    try:
        with psycopg.connect(os.environ["RLM_DATABASE_URL"], autocommit=True) as c:
            jobs = [wait(c, submit(c, max_chunks=8, batch_size=2), timeout=150) for _ in range(JOBS_UNDER_ERRORS)]
            assert any(refused), "no call was refused: the fault never happened"
            for job in jobs:
                assert job.status in ("done", "failed"), job.status
                if job.status == "failed":
                    assert job.error.message
            # Every usage the server reported is on exactly one logged call (none twice, none lost);
            # a job salvaged while a call was in flight has that call logged after its result was written.
            assert wait_for(lambda: fresh.stats()["in_flight"] == 0, timeout=60)

            def logged():
                return c.execute(
                    "SELECT coalesce(sum(tokens_in + tokens_out), 0) FROM llm_calls WHERE job_id = ANY(%s)",
                    ([j.id for j in jobs],),
                ).fetchone()[0]

            # a call the server has answered is logged by its worker a moment later
            assert wait_for(lambda: logged() == fresh.usage["total_tokens"], timeout=30), (
                logged(),
                fresh.usage["total_tokens"],
            )
            for j in jobs:
                if j.result:
                    mine = c.execute(
                        "SELECT coalesce(sum(tokens_in + tokens_out), 0) FROM llm_calls WHERE job_id = %s",
                        (j.id,),
                    ).fetchone()[0]
                    assert j.result.total_tokens <= mine
            assert sum(1 for j in jobs if j.status == "done") >= len(jobs) // 2
    finally:
        fresh.responder = model


def test_reconciler_pushes_a_job_whose_task_was_lost(fresh, workers, env):
    """A job whose plan message vanished (e.g. a broker without persistence restarted) is re-sent and logged."""
    import psycopg

    from rlm_workers.store import jobs as job_store

    conn = psycopg.connect(env["RLM_DATABASE_URL"])

    job_id, _ = job_store.create_job(
        conn,
        job_id="lost" + os.urandom(6).hex(),
        tenant="local",
        query=QUESTION,
        buffers=["essays"],
        options={"skip_plan": True, "threshold": -1.0, "max_chunks": 4},
    )
    conn.commit()  # stored, but no task was ever sent: exactly what a lost message looks like
    job = wait(conn, job_id, timeout=90)
    assert job.status == "done", job.error
    log = workers["ctl"].log_path.read_text(errors="replace") + workers["an"].log_path.read_text(errors="replace")
    assert f"reconciler: job {job_id}" in log and "re-sent rlm.plan" in log


def test_graceful_worker_shutdown_requeues_unstarted_work(db, fresh, model, workers, env, tmp_path):
    """SIGTERM: running batches finish (soft shutdown), reserved-but-unstarted ones go back to the queue."""
    from tests.support.workers import WorkerProcess

    model.analyst_delay = 2.0
    workers["an"].stop()
    small = WorkerProcess("fan-small", queues="rlm.analyst", env=env, log_dir=tmp_path, concurrency=2).start()
    try:
        job_id = submit(db, batch_size=2, max_chunks=12)  # 6 batches for 2 threads: some wait in the worker
        assert wait_for(lambda: fresh.stats()["in_flight"] >= 2, timeout=60)
    finally:
        small.stop()  # SIGTERM, waits for the process to leave
        workers["an"].start()
    job = wait(db, job_id)
    assert job.status == "done", job.error
    r = job.result.model_dump(mode="json")
    assert r["batches_processed"] == job.batches_total == 6 and r["batches_failed"] == 0
    assert set(analyst_calls_per_batch(db, job_id).values()) == {1}  # none run twice
