"""Faults during an overnight batch: Redis away for 10 s, PostgreSQL restarted (with /readyz telling).

Promises checked: the batch ends with every (query, buffer) item exactly once, each item's tokens are
those its job logged, every token the model served is on exactly one logged call, and the recovery
is visible in the workers' logs.
"""

from __future__ import annotations

import os
import time

import httpx
import psycopg
import pytest

from tests.support.api import Api

pytestmark = pytest.mark.slow

QUERIES = [f"What do the notes say about {t}?" for t in ("falconry", "kelp forests", "sundials", "canal locks")]


@pytest.fixture(scope="module")
def api(env, workers, tmp_path_factory):
    server = Api(env, tmp_path_factory.mktemp("fault-api") / "api.log")
    yield server
    server.stop()


def _db():
    return psycopg.connect(os.environ["RLM_DATABASE_URL"], autocommit=True)


def submit(options=None):
    from rlm_workers.overnight.submit import submit_overnight

    with _db() as c:
        batch_id, _ = submit_overnight(
            c,
            tenant="local",
            queries=QUERIES,
            buffers=["essays"],
            options={
                "skip_plan": True,
                "threshold": -1.0,
                "max_chunks": 6,
                "batch_size": 2,
                **(options or {}),
            },
        )
    return batch_id


def progress(batch_id):
    from rlm_workers.store import overnight as store

    with _db() as c:
        return store.progress(c, overnight_batch_id=batch_id).counts


def wait_batch(batch_id, timeout=240):
    from rlm_workers.store import overnight as store

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with _db() as c:
                b = store.get_overnight(c, overnight_batch_id=batch_id)
                if b.status in ("done", "cancelled"):
                    return b, store.items(c, overnight_batch_id=batch_id)
        except psycopg.OperationalError:
            pass  # the database may be restarting
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not finished after {timeout}s: {progress(batch_id)}")


def logged_total():
    with _db() as c:
        return c.execute("SELECT coalesce(sum(tokens_in + tokens_out), 0) FROM llm_calls").fetchone()[0]


def check_nothing_lost_or_billed_twice(batch_id, items, llm, baseline):
    assert len(items) == len(QUERIES)
    assert sorted(i.query for i in items) == sorted(QUERIES) and {i.buffer for i in items} == {"essays"}
    assert all(i.status == "done" for i in items), [(i.item_no, i.status, i.error) for i in items]
    assert len({i.job_id for i in items}) == len(items)
    with _db() as c:
        for i in items:
            logged = c.execute(
                "SELECT coalesce(sum(tokens_in + tokens_out), 0) FROM llm_calls WHERE job_id = %s",
                (i.job_id,),
            ).fetchone()[0]
            assert i.tokens == logged == i.result["total_tokens"]
        deadline = time.monotonic() + 60
        while llm.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.2)
    # every token served since the test began is on exactly one logged call
    assert logged_total() - baseline == llm.usage["total_tokens"]


def test_redis_stopped_for_10s_during_a_batch(fresh, model, workers, test_services):
    from rlm_workers.runtime import local_servers as services

    model.analyst_delay = 1.0
    baseline = logged_total()
    batch_id = submit()
    deadline = time.monotonic() + 90
    while progress(batch_id).get("running", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert services.stop_embedded_valkey(test_services.data_dir)
    time.sleep(10)
    assert services.embedded_valkey_url(test_services.data_dir) == test_services.broker_url
    b, items = wait_batch(batch_id)
    assert b.status == "done"
    check_nothing_lost_or_billed_twice(batch_id, items, fresh, baseline)
    logs = workers["ctl"].tail(2000) + workers["an"].tail(2000)
    assert "Cannot connect to redis" in logs or "Connection to broker lost" in logs  # the outage was real


def test_postgres_restarted_during_a_batch_with_readyz_reporting_it(fresh, model, workers, api, test_services):
    from rlm_workers.runtime import local_servers as services

    model.analyst_delay = 1.0
    baseline = logged_total()
    batch_id = submit({"max_chunks": 5})
    deadline = time.monotonic() + 90
    while progress(batch_id).get("running", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert httpx.get(f"{api.base}/readyz", timeout=10).status_code == 200
    assert services.stop_embedded_postgres(test_services.data_dir)
    try:
        down = httpx.get(f"{api.base}/readyz", timeout=15)
        assert down.status_code == 503 and down.json()["database"].startswith("unreachable")
        assert down.json()["broker"] == "ok"
        time.sleep(4)
    finally:
        services.embedded_postgres_url(test_services.data_dir)
    deadline = time.monotonic() + 30
    while httpx.get(f"{api.base}/readyz", timeout=15).status_code != 200:
        assert time.monotonic() < deadline, "readyz did not recover"
        time.sleep(0.5)
    b, items = wait_batch(batch_id)
    assert b.status == "done"
    check_nothing_lost_or_billed_twice(batch_id, items, fresh, baseline)
    logs = workers["ctl"].tail(3000) + workers["an"].tail(3000)
    # the workers saw the outage and waited it out: a stage's retry, or (when it fell between tasks, as with a
    # shared read group waiting on its tick) the pool's reconnect attempts
    assert ("database unavailable" in logs and "retrying" in logs) or "error connecting in 'rlm'" in logs
