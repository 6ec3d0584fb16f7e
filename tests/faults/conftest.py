"""The fault suite owns its servers: it stops and restarts PostgreSQL and Valkey, so it never shares them.

Always embedded (even when RLM_TEST_DATABASE_URL / RLM_TEST_BROKER_URL are set), because a test here
must be able to kill and restart them.
"""

from __future__ import annotations

import pytest

from tests.support.pipeline_model import write_essays
from tests.support.workers import running_workers, scripted_env


@pytest.fixture(scope="session")
def test_services():
    from rlm_workers.runtime import local_servers as services
    from tests.support.services import TestServices, embedded_start_lock, run_data_dir

    data_dir = run_data_dir("rlm-faults-")
    with embedded_start_lock():
        admin_url, broker_url = services.embedded_postgres_url(data_dir), services.embedded_valkey_url(data_dir)
    svc = TestServices(
        data_dir=data_dir,
        admin_url=admin_url,
        broker_url=broker_url,
        embedded_pg=True,
        embedded_valkey=True,
    )
    yield svc
    svc.stop()


# --- per module: a scripted model, the essays corpus, a control and an analyst worker ---------------

#: short clocks so redelivery, the watchdog and the reconciler act within a test's patience
CLOCKS = {
    "RLM_VISIBILITY_TIMEOUT": "30",
    "RLM_JOB_TIMEOUT": "20",
    "RLM_RECONCILE_SECONDS": "2",
    "RLM_WORKER_LOST_SECONDS": "2",
}


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(rlm_env, llm, RLM_LLM_RETRIES="3", RLM_LLM_TIMEOUT="20", RLM_MAX_CONCURRENCY="4", **CLOCKS) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("faults") / "essays"
    write_essays(root, injection_at=None)
    load_paths(conn, buffer="essays", paths=[root], embedder=embedder)
    conn.commit()


@pytest.fixture(scope="module")
def workers(env, corpus, tmp_path_factory):
    pools = {"ctl": ("rlm.control", 4), "an": ("rlm.analyst", 8)}
    with running_workers(env, tmp_path_factory.mktemp("fault-logs"), pools) as ws:
        yield ws


@pytest.fixture()
def db(env):
    """A connection per test: a test that restarts PostgreSQL must not hand a dead one to the next."""
    from rlm_workers.config import get_settings
    from rlm_workers.store.db import connect

    c = connect(get_settings())
    yield c
    try:
        c.close()
    except Exception:
        pass
