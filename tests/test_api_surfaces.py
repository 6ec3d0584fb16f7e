"""The HTTP surfaces of issue 13 as clients use them: POST /v1/search, the job list and job view after real
queries through workers, chunks by id, a buffer's files, tenant isolation of each — and the CLI agreeing with
the API (same search hits, same JobView, a buffer loaded with --tenant seen by that tenant's key only).
uvicorn in a subprocess, real workers answering through the scripted model, real PostgreSQL and Valkey."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.api import Api
from tests.support.pipeline_model import NEEDLE, QUESTION, write_essays
from tests.support.workers import running_workers, scripted_env
from tests.test_cli import CHUNK_VIEW_KEYS, run_rlm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(rlm_env, llm):
    with scripted_env(rlm_env, llm, RLM_LLM_RETRIES="1", RLM_LLM_TIMEOUT="90") as e:
        yield e


@pytest.fixture(scope="module")
def keys(env, conn):
    from rlm_api.auth import create_key

    a, _ = create_key(conn, tenant="acme")
    b, _ = create_key(conn, tenant="globex")
    conn.commit()
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def essays(env, tmp_path_factory):
    """tenant acme's buffer ``essays``, loaded by the CLI with --tenant; globex gets a different one."""
    root = tmp_path_factory.mktemp("api-surfaces") / "essays"
    write_essays(root)
    run_rlm(env, "load", str(root), "--buffer", "essays", "--tenant", "acme", check=0)
    other = tmp_path_factory.mktemp("globex") / "memo"
    other.mkdir()
    (other / "memo.md").write_text("# Memo\n\nGlobex ships the widgets on Friday.\n")
    run_rlm(env, "load", str(other), "--buffer", "memo", "--tenant", "globex", check=0)
    return root


@pytest.fixture(scope="module")
def api(env, keys, essays, tmp_path_factory):
    server = Api(env, tmp_path_factory.mktemp("api") / "api.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workers(env, api, tmp_path_factory):
    pools = {"apictl": ("rlm.control", 4), "apian": ("rlm.analyst", 4)}
    with running_workers(env, tmp_path_factory.mktemp("api-surface-w"), pools) as ws:
        yield ws


@pytest.fixture(scope="module")
def a(api, keys):
    with api.client(keys["a"]) as c:
        yield c


@pytest.fixture(scope="module")
def b(api, keys):
    with api.client(keys["b"]) as c:
        yield c


def _wait(client: httpx.Client, job_id: str) -> dict:
    import time

    deadline = time.monotonic() + 240
    while True:
        view = client.get(f"/v1/queries/{job_id}").json()
        if view["status"] in ("done", "failed", "cancelled"):
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.3)


@pytest.fixture(scope="module")
def jobs(a, workers):
    """Three answered queries of acme, oldest first: two over essays, one instant."""
    bodies = [
        {"query": QUESTION, "buffers": ["essays"], "options": {"skip_plan": True}},
        {"query": "Which notes mention glacier retreat?", "buffers": ["essays"], "options": {"skip_plan": True}},
        {"query": QUESTION, "buffers": ["essays"], "options": {"mode": "instant"}},
    ]
    ids = []
    for body in bodies:
        r = a.post("/v1/queries", json=body)
        assert r.status_code == 202, r.text
        ids.append(r.json()["job_id"])
        assert _wait(a, ids[-1])["status"] == "done"
    return ids


# --------------------------------------------------------------------------- tenant of CLI-loaded buffers


def test_a_buffer_loaded_with_tenant_is_seen_by_that_tenants_key_only(env, a, b):
    assert [x["name"] for x in a.get("/v1/buffers").json()] == ["essays"]
    assert [x["name"] for x in b.get("/v1/buffers").json()] == ["memo"]
    local = json.loads(run_rlm(env, "buffers", "--format", "json", check=0).stdout)
    assert local == {"buffers": []}


# --------------------------------------------------------------------------- POST /v1/search


def test_search_matches_the_cli(env, a):
    r = a.post("/v1/search", json={"query": "Dolores Park sandwich", "buffer": "essays", "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"results"} and len(body["results"]) == 3
    assert NEEDLE in body["results"][0]["text"]
    cli = json.loads(
        run_rlm(
            env,
            "search",
            "Dolores Park sandwich",
            "--buffer",
            "essays",
            "--top-k",
            "3",
            "--tenant",
            "acme",
            "--format",
            "json",
            check=0,
        ).stdout
    )
    assert [h["chunk_id"] for h in body["results"]] == [h["chunk_id"] for h in cli["results"]]
    assert set(body["results"][0]) == set(cli["results"][0])
    same = a.post("/v1/search", json={"query": "Dolores Park sandwich", "buffers": ["essays"], "top_k": 3})
    assert same.json() == body
    bm25 = a.post("/v1/search", json={"query": "glacier retreat", "buffer": "essays", "mode": "bm25", "top_k": 1})
    assert "glacier retreat" in bm25.json()["results"][0]["text"]
    nothing = a.post("/v1/search", json={"query": "zyzzyva", "buffer": "essays", "mode": "bm25"})
    assert nothing.status_code == 200 and nothing.json() == {"results": []}


def test_search_is_tenant_scoped_and_suggests_names(a, b):
    other = b.post("/v1/search", json={"query": "Dolores Park", "buffer": "essays"})
    assert other.status_code == 404 and other.json()["error"]["type"] == "buffer_not_found"
    assert "did you mean" not in other.json()["error"]["message"]  # acme's names are not globex's to see
    typo = a.post("/v1/search", json={"query": "Dolores Park", "buffer": "esays"})
    assert typo.status_code == 404 and "did you mean 'essays'?" in typo.json()["error"]["message"]
    shown = a.get("/v1/buffers/essay")
    assert shown.status_code == 404 and "did you mean 'essays'?" in shown.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"buffer": "essays"}, "query"),
        ({"query": "   ", "buffer": "essays"}, "query"),
        ({"query": "x"}, "either buffers"),
        ({"query": "x", "buffer": "essays", "buffers": ["essays"]}, "either buffers"),
        ({"query": "x", "buffers": []}, "buffers"),
        ({"query": "x", "buffers": [f"b{i}" for i in range(51)]}, "buffers"),
        ({"query": "x", "buffer": "essays", "top_k": 0}, "top_k"),
        ({"query": "x", "buffer": "essays", "top_k": "3"}, "top_k"),
        ({"query": "x", "buffer": "essays", "threshold": 2}, "threshold"),
        ({"query": "x", "buffer": "essays", "mode": "fuzzy"}, "mode"),
        ({"query": "x", "buffer": "essays", "colour": "red"}, "colour"),
        ({"query": "a\x00b", "buffer": "essays"}, "NUL"),
        ({"query": "x" * (10 * 1024 + 1), "buffer": "essays"}, "bytes"),
        ({"query": "x", "buffer": "bad name/.."}, "buffer"),
    ],
)
def test_bad_search_bodies_are_422(a, body, needle):
    r = a.post("/v1/search", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_search_needs_a_key(api):
    assert httpx.post(f"{api.base}/v1/search", json={"query": "x", "buffer": "essays"}).status_code == 401


# --------------------------------------------------------------------------- GET /v1/queries (list)


def test_job_list_filters_and_pages(a, jobs):
    page = a.get("/v1/queries").json()
    assert [j["job_id"] for j in page["jobs"]][:3] == jobs[::-1] and page["next_cursor"] is None
    first = page["jobs"][0]
    assert first["status"] == "done" and first["mode"] == "instant" and first["usage"]["llm_calls"] >= 1
    assert [j["job_id"] for j in a.get("/v1/queries", params={"q": "glacier"}).json()["jobs"]] == [jobs[1]]
    assert len(a.get("/v1/queries", params={"status": "done", "buffer": "essays"}).json()["jobs"]) == 3
    assert a.get("/v1/queries", params={"status": "failed"}).json()["jobs"] == []
    assert a.get("/v1/queries", params={"buffer": "memo"}).json()["jobs"] == []
    walked, cursor = [], None
    while True:
        params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        got = a.get("/v1/queries", params=params).json()
        walked += [j["job_id"] for j in got["jobs"]]
        cursor = got["next_cursor"]
        if cursor is None:
            break
    assert walked == jobs[::-1]


def test_job_list_refuses_bad_input_and_other_tenants(a, b, jobs):
    assert a.get("/v1/queries", params={"cursor": "not-a-job"}).status_code == 422
    assert a.get("/v1/queries", params={"status": "sleeping"}).status_code == 422
    assert a.get("/v1/queries", params={"limit": 0}).status_code == 422
    assert b.get("/v1/queries").json() == {"jobs": [], "next_cursor": None}
    # acme's job id is no cursor for globex
    assert b.get("/v1/queries", params={"cursor": jobs[0]}).status_code == 422


def test_cli_jobs_json_is_the_api_page(env, a, jobs):
    cli = json.loads(run_rlm(env, "jobs", "--tenant", "acme", "--format", "json", check=0).stdout)
    assert cli == a.get("/v1/queries", params={"limit": 20}).json()


# --------------------------------------------------------------------------- GET /v1/queries/{id}


def test_job_view_after_a_real_query(env, a, b, jobs):
    view = a.get(f"/v1/queries/{jobs[0]}").json()
    stages = [t["stage"] for t in view["timings"]]
    assert "fan_out" in stages and "synthesize" in stages and all(t["seconds"] >= 0 for t in view["timings"])
    assert view["batches"] and all(x["state"] == "done" and x["chunks"] >= 1 for x in view["batches"])
    assert view["progress"]["batches_done"] == view["progress"]["batches_total"] == len(view["batches"])
    assert {c["stage"] for c in view["calls"]} >= {"analyst"} or len(view["calls"]) >= 2
    assert view["usage"]["llm_calls"] == len(view["calls"]) and view["usage"]["tokens_in"] > 0
    assert view["query"] == QUESTION and view["buffers"] == ["essays"] and view["depth"] == 0
    assert view["root_id"] == jobs[0] and view["parent_id"] is None and view["children"] == []
    assert view["created_at"] <= view["started_at"] <= view["finished_at"]
    assert NEEDLE in view["result"]["response"]
    # the CLI prints exactly this view
    cli = json.loads(run_rlm(env, "job", "show", jobs[0], "--tenant", "acme", "--format", "json", check=0).stdout)
    assert cli == view
    assert b.get(f"/v1/queries/{jobs[0]}").status_code == 404


# --------------------------------------------------------------------------- chunks and files


def test_chunks_by_id_are_tenant_scoped(a, b):
    mine = a.post("/v1/search", json={"query": "Dolores Park", "buffer": "essays", "top_k": 2}).json()["results"]
    theirs = b.post("/v1/search", json={"query": "widgets Friday", "buffer": "memo", "top_k": 1}).json()["results"]
    one = a.get(f"/v1/chunks/{mine[0]['chunk_id']}")
    assert one.status_code == 200
    assert one.json() == {k: mine[0][k] for k in CHUNK_VIEW_KEYS}
    assert b.get(f"/v1/chunks/{mine[0]['chunk_id']}").status_code == 404
    ids = [mine[1]["chunk_id"], theirs[0]["chunk_id"], mine[0]["chunk_id"]]
    many = a.get("/v1/chunks", params={"ids": ",".join(map(str, ids))}).json()
    assert [c["chunk_id"] for c in many] == [mine[1]["chunk_id"], mine[0]["chunk_id"]]
    assert a.get("/v1/chunks", params={"ids": "1,x"}).status_code == 422
    assert a.get("/v1/chunks/0").status_code == 404


def test_buffer_files_page_in_path_order(a, b, essays):
    names = sorted(p.name for p in essays.iterdir())
    files = a.get("/v1/buffers/essays/files").json()
    assert [f["path"] for f in files] == [f"essays/{n}" for n in names]
    assert all(
        f["bytes"] == (essays / n).stat().st_size and f["chunks"] >= 1 for f, n in zip(files, names, strict=True)
    )
    page = a.get("/v1/buffers/essays/files", params={"limit": 2, "after": files[1]["path"]}).json()
    assert [f["path"] for f in page] == [files[2]["path"], files[3]["path"]]
    assert b.get("/v1/buffers/essays/files").status_code == 404
    assert a.get("/v1/buffers/essays/files", params={"limit": 0}).status_code == 422
