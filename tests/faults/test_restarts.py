"""A database or broker restart under running processes: the next request after the server is back succeeds.

Real embedded PostgreSQL and Valkey (the fault suite's own), stopped as ``rlm services stop`` stops them and
started again while the API keeps running (issue #41).  No timing asserts: each request has a client timeout
well past the pool's 30 s checkout, so a pool that waits that out answers 503 and fails the test.
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import httpx
import pytest

from tests.support.api import Api

pytestmark = pytest.mark.slow

#: idle pooled connections left when the server goes away: from six on, finding them dead one by one cost
#: the checkout 1 + 2 + 4 + 8 + 16 s of pauses, past its 30 s
HELD = 8


@pytest.fixture(scope="module")
def env(rlm_env):
    return {**rlm_env, "HF_HUB_OFFLINE": "1"}


def restart_postgres(data_dir) -> None:
    from rlm_workers.runtime import local_servers as services

    assert services.stop_embedded_postgres(data_dir)
    services.embedded_postgres_url(data_dir)


def restart_valkey(data_dir, url: str) -> None:
    from rlm_workers.runtime import local_servers as services

    assert services.stop_embedded_valkey(data_dir)
    assert services.embedded_valkey_url(data_dir) == url


def test_the_pool_replaces_every_dead_connection_at_the_first_checkout(env, test_services):
    from rlm_workers.store.db import close_pools, connection
    from rlm_workers.store.metrics import ping

    close_pools()
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(HELD):
                ping(stack.enter_context(connection()))
        restart_postgres(test_services.data_dir)
        with connection() as conn:
            ping(conn)
    finally:
        close_pools()


@pytest.fixture(scope="module")
def api(env, conn, tmp_path_factory):
    from rlm_api.auth import create_key

    key, _ = create_key(conn, tenant="acme")
    conn.commit()
    server = Api(env, tmp_path_factory.mktemp("api") / "api.log")
    server.key = key
    yield server
    server.stop()


def busy(client: httpx.Client, n: int = 40) -> None:
    """Requests at once, so the API's pool holds several connections when the server goes away."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: client.get("/v1/buffers").status_code, range(n)))
    assert set(codes) == {200}, codes


def test_the_api_answers_the_first_request_after_postgres_restarted(api, test_services):
    with api.client(api.key) as c:
        busy(c)
        restart_postgres(test_services.data_dir)
        r = c.get("/v1/buffers")
        assert r.status_code == 200, r.text
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text


def test_the_api_answers_after_postgres_was_down_while_it_was_asked(api, test_services):
    """Requests during the outage set the pool retrying; the first one after the restart must not wait for its
    retries to come round (they doubled up to minutes apart)."""
    from rlm_workers.runtime import local_servers as services

    with api.client(api.key) as c:
        busy(c)
        assert services.stop_embedded_postgres(test_services.data_dir)
        try:
            down = c.get("/readyz")
            assert down.status_code == 503 and down.json()["database"].startswith("unreachable"), down.text
            # a request that waits for the database while it is away, and gives up (the server keeps it)
            with contextlib.suppress(httpx.TimeoutException):
                c.get("/v1/buffers", timeout=3)
        finally:
            services.embedded_postgres_url(test_services.data_dir)
        r = c.get("/v1/buffers")
        assert r.status_code == 200, r.text


def test_the_api_queues_an_upload_after_valkey_restarted(api, test_services):
    with api.client(api.key) as c:
        busy(c)
        before = c.post("/v1/buffers?wait=false", json={"name": "before", "documents": [{"path": "a.md", "text": "a"}]})
        assert before.status_code == 202, before.text
        assert c.get("/metrics").status_code == 200  # its Redis client now holds a connection
        restart_valkey(test_services.data_dir, test_services.broker_url)
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        after = c.post("/v1/buffers?wait=false", json={"name": "after", "documents": [{"path": "b.md", "text": "b"}]})
        assert after.status_code == 202, after.text
        # the counters /metrics reads live in Valkey, through the process's long-lived client
        metrics = c.get("/metrics")
        assert metrics.status_code == 200, metrics.text
