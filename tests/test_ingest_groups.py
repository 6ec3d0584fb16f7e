"""A large upload loaded as file groups by several ingest workers (docs/contract.md#ingest-groups): one new
version with every chunk, readers on the old version until the swap, a failing group failing the load and
keeping the old version, a redelivered group never duplicating, a lost group re-sent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlm_workers.store import buffers as bstore
from rlm_workers.store import vectors
from tests.support.envpatch import patched_env
from tests.support.workers import running_workers

GROUP_BYTES = 1024


def _text(topic: str, n: int = 20) -> bytes:
    lines = [f"# {topic}\n"] + [
        f"Line {i} about {topic}: the {topic} log records entry {i} in detail.\n" for i in range(n)
    ]
    return "".join(lines).encode()


CORPUS = [(f"docs/{t}.md", _text(t)) for t in ("harbour", "lighthouse", "ferry", "tides", "cargo")]


@pytest.fixture(scope="module")
def env(rlm_env):
    extra = {"RLM_INGEST_GROUP_BYTES": str(GROUP_BYTES), "HF_HUB_OFFLINE": "1", "RLM_ENCODE_THREADS": "1"}
    with patched_env(extra):
        yield {**rlm_env, **extra}


def _stage(conn, upload_id: str, files, buffer: str) -> None:
    from rlm_workers.store.uploads import create_upload

    create_upload(conn, upload_id=upload_id, tenant="acme", buffer=buffer, options={}, files=files)
    conn.commit()


def _plan(conn, upload_id: str) -> list[int]:
    """What ``rlm.ingest`` does with a large upload, without sending the groups (the test runs them)."""
    from rlm_workers.config import get_settings
    from rlm_workers.ingest import groups
    from rlm_workers.store.uploads import start_upload

    up = start_upload(conn, upload_id=upload_id)
    conn.commit()
    nos = groups.plan(conn, up, get_settings())
    conn.commit()
    assert nos is not None
    return nos


def _chunks(conn, name: str) -> tuple[int, int, int]:
    """(version, chunks, distinct (path, seq)) of the buffer as a reader sees it."""
    buf = bstore.get_buffer(conn, tenant="acme", name=name)
    if buf is None:
        return 0, 0, 0
    row = conn.execute(
        "SELECT count(*), count(DISTINCT (path, seq)) FROM chunks WHERE buffer_id = %s", (buf.id,)
    ).fetchone()
    conn.commit()
    return buf.version, int(row[0]), int(row[1])


def _staged(conn, upload_id: str) -> int:
    n = conn.execute("SELECT count(*) FROM ingest_staged_chunks WHERE upload_id = %s", (upload_id,)).fetchone()[0]
    conn.commit()
    return int(n)


def test_split_keeps_path_order_and_the_byte_budget():
    from rlm_workers.ingest.groups import split

    sizes = [("a", 400), ("b", 400), ("c", 400), ("d", 5000), ("e", 10)]
    assert split(sizes, 1000) == [(["a", "b"], 800), (["c"], 400), (["d"], 5000), (["e"], 10)]
    assert split([], 1000) == []


def test_two_ingest_workers_load_a_split_upload_as_one_new_version(env, conn, tmp_path_factory):
    from rlm_workers.celery_app import get_app
    from rlm_workers.store.uploads import get_upload, list_groups

    pools = {"ing1": ("rlm.ingest", 1), "ing2": ("rlm.ingest", 1)}
    with running_workers(env, tmp_path_factory.mktemp("ingest-groups-w"), pools) as ws:
        _stage(conn, "grouped000001", CORPUS, "fleet")
        get_app().send_task("rlm.ingest", ("grouped000001",))
        deadline = time.monotonic() + 240
        while (up := get_upload(conn, upload_id="grouped000001")).status not in ("done", "failed"):
            conn.commit()
            assert time.monotonic() < deadline, (up, ws["ing1"].tail(), ws["ing2"].tail())
            time.sleep(0.3)
        conn.commit()
        # `rlm load --queue --wait` stages a directory the same way and follows its groups to the end
        root = tmp_path_factory.mktemp("cli-corpus") / "manuals"
        root.mkdir()
        for path, data in CORPUS[:3]:
            (root / path.split("/")[-1]).write_bytes(data)
        cli = subprocess.run(
            [sys.executable, "-m", "rlm_api.cli", "load", str(root), "-b", "manuals", "--queue", "--wait"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert cli.returncode == 0, (cli.stdout, cli.stderr, ws["ing1"].tail(), ws["ing2"].tail())
        assert "groups 3/3" in cli.stderr and "buffer manuals v1: 3 files loaded" in cli.stdout, cli
        # an API upload takes the same path: multipart, queued, followed through GET /v1/uploads/{id}
        from rlm_api.auth import create_key
        from tests.support.api import Api

        key, _ = create_key(conn, tenant="acme")
        conn.commit()
        server = Api(env, tmp_path_factory.mktemp("ingest-groups-api") / "api.log")
        try:
            with server.client(key) as c:
                r = c.post(
                    "/v1/buffers",
                    params={"wait": "false"},
                    data={"name": "viaapi"},
                    files=[("files", (p, d)) for p, d in CORPUS[:3]],
                )
                assert r.status_code == 202, r.text
                deadline = time.monotonic() + 240
                while (view := c.get(r.json()["status_url"]).json())["status"] not in ("done", "failed"):
                    assert time.monotonic() < deadline, view
                    time.sleep(0.3)
        finally:
            server.stop()
        assert view["status"] == "done" and view["groups"] == 3 and view["groups_done"] == 3, view
        assert view["report"]["files_loaded"] == 3 and view["report"]["version"] == 1
        logs = ws["ing1"].tail(4000) + ws["ing2"].tail(4000)
    assert up.status == "done", (up, logs)
    assert up.groups == len(CORPUS) and up.groups_done == len(CORPUS)
    assert all(g.status == "done" for g in list_groups(conn, upload_id="grouped000001"))
    assert "rlm.ingest.group" in logs
    assert "deadlock" not in logs and "retry:" not in logs  # groups finishing together wait, never deadlock
    report = up.report
    assert report["files_loaded"] == len(CORPUS) and report["version"] == 1 and report["groups"] == len(CORPUS)
    version, chunks, distinct = _chunks(conn, "fleet")
    assert version == 1 and chunks == distinct == report["chunks_written"]
    buf = bstore.get_buffer(conn, tenant="acme", name="fleet")
    assert vectors.count(conn, buffer_id=buf.id) == report["windows_embedded"]
    # ordinals follow the files' order across groups, as one in-process load numbers them
    rows = conn.execute("SELECT path, seq, ordinal FROM chunks WHERE buffer_id = %s ORDER BY ordinal", (buf.id,))
    ordered = list(rows)
    assert [(p, s) for p, s, _ in ordered] == sorted((p, s) for p, s, _ in ordered)
    assert [o for _, _, o in ordered] == list(range(len(ordered)))
    assert _staged(conn, "grouped000001") == 0
    assert conn.execute("SELECT count(*) FROM upload_files WHERE upload_id = 'grouped000001'").fetchone()[0] == 0
    # searchable: a file's own text finds that file's chunk first
    from rlm_workers.ingest.embed import get_embedder

    vec = get_embedder().encode(["Line 3 about lighthouse: the lighthouse log records entry 3"], batch_size=1)[0]
    hits = vectors.nearest_windows(conn, buffer_ids=[buf.id], query_vec=vec, limit=3, ef_search=40)
    conn.commit()
    top = bstore.get_chunks(conn, tenant="acme", chunk_ids=[hits[0].chunk_id])
    conn.commit()
    assert top[hits[0].chunk_id].path == "docs/lighthouse.md"


def test_readers_see_the_old_version_until_the_last_group_commits(env, conn):
    from rlm_workers.ingest.groups import run_group
    from rlm_workers.store.uploads import get_upload

    _stage(conn, "firstload0001", CORPUS, "swap")
    for n in _plan(conn, "firstload0001"):
        run_group("firstload0001", n)
    before = _chunks(conn, "swap")
    assert before[0] == 1 and before[1] > 0
    # a reload that changes two files, adds one and keeps the rest
    changed = [
        (p, d + b"One more line, new in version two.\n") if "ferry" in p or "cargo" in p else (p, d) for p, d in CORPUS
    ]
    _stage(conn, "secondload001", [*changed, ("docs/weather.md", _text("weather"))], "swap")
    nos = _plan(conn, "secondload001")
    assert len(nos) == len(CORPUS) + 1
    for n in nos[:-1]:
        assert run_group("secondload001", n) == "done"
        assert _chunks(conn, "swap") == before  # staged rows are invisible to readers
    assert get_upload(conn, upload_id="secondload001").groups_done == len(nos) - 1
    conn.commit()
    assert run_group("secondload001", nos[-1]) == "done"
    up = get_upload(conn, upload_id="secondload001")
    conn.commit()
    assert up.status == "done", up
    assert up.report["files_loaded"] == 3 and up.report["files_unchanged"] == 3, up.report
    version, chunks, distinct = _chunks(conn, "swap")
    assert version == 2 and chunks == distinct > before[1]
    assert _staged(conn, "secondload001") == 0


def test_the_upload_end_wakes_a_listener(env, conn):
    """`rlm load --queue --wait` sleeps on the upload-ended channel: the commit of the last group wakes it, the
    groups before it do not."""
    from rlm_workers.ingest.groups import run_group
    from rlm_workers.store.db import connect
    from rlm_workers.store.uploads import listen_upload_ended

    _stage(conn, "listened00001", [(p, d + b"Heard version.\n") for p, d in CORPUS], "heard")
    nos = _plan(conn, "listened00001")
    listener = connect()
    try:
        listen_upload_ended(listener)
        listener.commit()
        for n in nos[:-1]:
            assert run_group("listened00001", n) == "done"
        # those groups committed already: a notification of theirs would be waiting on the socket now
        assert "listened00001" not in [n.payload for n in listener.notifies(timeout=0.5)]
        assert run_group("listened00001", nos[-1]) == "done"
        heard = next((n.payload for n in listener.notifies(timeout=30) if n.payload == "listened00001"), None)
    finally:
        listener.close()
    assert heard == "listened00001"


def test_a_failing_group_fails_the_load_and_keeps_the_old_version(env, conn):
    from rlm_workers.ingest.groups import run_group
    from rlm_workers.store.uploads import get_upload, list_groups

    before = _chunks(conn, "swap")
    bad = ("docs/m" + "n" * 300 + ".md", _text("broken"))  # a name no file system takes: that group can never load
    files = [(p, d + b"Changed for the failing load.\n") for p, d in CORPUS] + [bad]
    _stage(conn, "failedload001", files, "swap")
    nos = _plan(conn, "failedload001")
    results = [run_group("failedload001", n) for n in nos]
    assert "failed" in results, results
    up = get_upload(conn, upload_id="failedload001")
    conn.commit()
    assert up.status == "failed" and up.error["type"] == "invalid_input", up
    assert "file group" in up.error["message"] and "over 255 bytes" in up.error["message"], up.error
    assert _chunks(conn, "swap") == before
    assert _staged(conn, "failedload001") == 0
    assert [g.status for g in list_groups(conn, upload_id="failedload001")].count("failed") == 1
    conn.commit()
    assert run_group("failedload001", nos[0]) == "skipped"  # a late delivery finds the upload ended


def test_a_redelivered_group_does_not_duplicate_chunks(env, conn):
    from rlm_workers.ingest.groups import run_group
    from rlm_workers.store.uploads import get_upload

    files = [(p, d + b"Third version.\n") for p, d in CORPUS]
    _stage(conn, "redelivery001", files, "again")
    nos = _plan(conn, "redelivery001")
    assert run_group("redelivery001", nos[0]) == "done"
    once = _staged(conn, "redelivery001")
    assert run_group("redelivery001", nos[0]) == "skipped"  # done already: the redelivery leaves it
    # a delivery that died before its commit left the group open: the next one starts clean
    conn.execute(
        "UPDATE ingest_groups SET status = 'running' WHERE upload_id = 'redelivery001' AND group_no = %s", (nos[0],)
    )
    conn.execute("UPDATE uploads SET groups_done = groups_done - 1 WHERE id = 'redelivery001'")
    conn.commit()
    assert run_group("redelivery001", nos[0]) == "done"
    assert _staged(conn, "redelivery001") == once
    for n in nos[1:]:
        run_group("redelivery001", n)
    up = get_upload(conn, upload_id="redelivery001")
    conn.commit()
    assert up.status == "done", up
    version, chunks, distinct = _chunks(conn, "again")
    assert version == 1 and chunks == distinct == up.report["chunks_written"]


def test_reconciler_resends_a_group_whose_message_was_lost(env, conn):
    from rlm_workers.pipeline.reconcile import reconcile_uploads

    _stage(conn, "lostgroup0001", CORPUS[:3], "lost")
    nos = _plan(conn, "lostgroup0001")
    conn.execute("UPDATE ingest_groups SET sent_at = now() - interval '1 hour' WHERE upload_id = 'lostgroup0001'")
    conn.execute("UPDATE uploads SET sent_at = now() WHERE id = 'lostgroup0001'")
    conn.commit()
    sent: list[tuple[str, int]] = []
    actions = reconcile_uploads(
        conn, send=lambda *a: None, send_group=lambda u, n: sent.append((u, n)), idle_seconds=600
    )
    conn.commit()
    assert sorted(sent) == [("lostgroup0001", n) for n in sorted(nos)] and "rlm.ingest.group" in actions[0]
    assert (
        reconcile_uploads(conn, send=lambda *a: None, send_group=lambda u, n: sent.append((u, n)), idle_seconds=600)
        == []
    )
    conn.execute("DELETE FROM uploads WHERE id = 'lostgroup0001'")
    conn.commit()
