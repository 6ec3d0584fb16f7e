"""Abuse of the HTTP API: no key or a wrong one, other tenants' ids on every route, oversized and
hostile bodies, and the monitoring surfaces (Flower, /metrics) closed off loopback by default."""

from __future__ import annotations

import httpx
import pytest

from rlm_api.cli_up import flower_argv
from rlm_workers.config import Settings
from rlm_workers.errors import InvalidInput
from tests.test_api import Api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(rlm_env, conn, tmp_path_factory):
    """Tenant A owns a buffer, a job and a batch; tenant B holds a valid key of its own."""
    from rlm_api.auth import create_key
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.store import jobs as job_store

    key_a, _ = create_key(conn, tenant="tenant-a")
    key_b, _ = create_key(conn, tenant="tenant-b")
    conn.commit()
    api = Api(
        {**rlm_env, "HF_HUB_OFFLINE": "1", "RLM_MAX_REQUEST_BYTES": "100000"},
        tmp_path_factory.mktemp("abuse") / "api.log",
    )
    with httpx.Client(base_url=api.base, headers={"Authorization": f"Bearer {key_a}"}, timeout=120) as a:
        r = a.post(
            "/v1/buffers",
            json={
                "name": "secrets",
                "documents": [{"path": "plan.md", "text": "# Plan\n\nThe merger closes on the fifth of March.\n"}],
            },
        )
        assert r.status_code == 201, r.text
        r = a.post(
            "/v1/buffers?wait=false",
            json={
                "name": "secrets",
                "documents": [{"path": "later.md", "text": "# Later\n\nThe merger terms stay sealed.\n"}],
            },
        )
        assert r.status_code == 202, r.text
        upload_id = r.json()["upload_id"]
    job_id, _ = job_store.create_job(
        conn, job_id="abusejob" + "0" * 8, tenant="tenant-a", query="q", buffers=["secrets"], options={}
    )
    batch_id, _ = submit_overnight(
        conn, tenant="tenant-a", queries=["when does the merger close?"], buffers=["secrets"]
    )
    conn.commit()
    yield {"api": api, "a": key_a, "b": key_b, "job": job_id, "batch": batch_id, "upload": upload_id}
    api.stop()


def _routes(w):
    j, b = w["job"], w["batch"]
    return [
        ("GET", "/v1/buffers/secrets"),
        ("DELETE", "/v1/buffers/secrets"),
        ("GET", f"/v1/queries/{j}"),
        ("DELETE", f"/v1/queries/{j}"),
        ("GET", f"/v1/batches/{b}"),
        ("DELETE", f"/v1/batches/{b}"),
        ("POST", f"/v1/batches/{b}/cancel"),
        ("GET", f"/v1/batches/{b}/results"),
        ("GET", f"/v1/uploads/{w['upload']}"),
    ]


def test_every_v1_route_needs_a_valid_key(world):
    spec = httpx.get(f"{world['api'].base}/openapi.json").json()
    v1 = [(m.upper(), p) for p, ops in spec["paths"].items() if p.startswith("/v1") for m in ops]
    assert len(v1) >= 10
    for method, path in v1:
        url = world["api"].base + path.replace("{name}", "secrets").replace("{job_id}", world["job"]).replace(
            "{batch_id}", world["batch"]
        ).replace("{upload_id}", world["upload"])
        for headers in ({}, {"Authorization": "Bearer rlm_forged"}, {"Authorization": world["a"]}):
            r = httpx.request(method, url, headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.status_code)


def test_other_tenant_ids_are_404_on_every_route_and_leak_nothing(world):
    with httpx.Client(base_url=world["api"].base, headers={"Authorization": f"Bearer {world['b']}"}, timeout=30) as b:
        for method, path in _routes(world):
            r = b.request(method, path)
            assert r.status_code == 404, (method, path, r.status_code)
            assert "merger" not in r.text
        assert b.get("/v1/buffers").json() == [] and b.get("/v1/batches").json() == []
        r = b.post("/v1/queries", json={"query": "when does the merger close?", "buffers": ["secrets"]})
        assert r.status_code == 404
        r = b.post("/v1/batches", json={"queries": ["merger?"], "buffers": ["secrets"]})
        assert r.status_code == 404
    with httpx.Client(base_url=world["api"].base, headers={"Authorization": f"Bearer {world['a']}"}) as a:
        assert a.get("/v1/buffers/secrets").status_code == 200  # B's DELETEs changed nothing
        assert a.get(f"/v1/queries/{world['job']}").json()["status"] == "queued"


def test_oversized_and_hostile_bodies(world):
    with httpx.Client(base_url=world["api"].base, headers={"Authorization": f"Bearer {world['a']}"}, timeout=60) as a:
        r = a.post("/v1/buffers", json={"name": "big", "documents": [{"path": "a.md", "text": "x" * 200_000}]})
        assert r.status_code == 413
        r = a.post("/v1/queries", json={"query": "q" * (10 * 1024 + 1), "buffers": ["secrets"]})
        assert r.status_code == 422
        for name in ("../../etc/passwd", "/etc/shadow", "..\\..\\boot.ini", "a/ /../b"):
            r = a.post("/v1/buffers", data={"name": "trav"}, files=[("files", (name, b"pwned"))])
            assert r.status_code == 422, name
        for name in ("a/\x00/b", "x\n/../y", " /etc/passwd"):
            r = a.post("/v1/buffers", json={"name": "trav", "documents": [{"path": name, "text": "pwned"}]})
            assert r.status_code == 422, name
        assert a.get("/v1/buffers/trav").status_code == 404
        r = a.post("/v1/queries", content=b"{" * 50_000, headers={"content-type": "application/json"})
        assert r.status_code == 422
        r = a.post("/v1/batches", json={"queries": ["q"] * 5, "buffers": ["secrets"], "options": {"x": 1}})
        assert r.status_code == 422


def test_monitoring_is_closed_off_loopback_by_default(world):
    s = Settings(_env_file=None)
    assert s.api_host == "127.0.0.1" and s.flower_host == "127.0.0.1" and s.flower_basic_auth is None
    with pytest.raises(InvalidInput):
        flower_argv("0.0.0.0", 5555, None)  # Flower's own /metrics skips auth: never open without a password
    # /metrics answers loopback callers only unless they bring a key (the API itself binds to loopback).
    from fastapi.testclient import TestClient

    from rlm_api.app import create_app

    remote = TestClient(create_app(), client=("203.0.113.9", 5000))
    assert remote.get("/metrics").status_code == 401
    assert remote.get("/metrics", headers={"Authorization": f"Bearer {world['a']}"}).status_code == 200
    assert httpx.get(f"{world['api'].base}/metrics").status_code == 200  # loopback
