"""Re-embedding a buffer after a model change: `rlm buffer reembed` in-process and as rlm.embed on a real
ingest worker; a failure half-way keeps the old vectors."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.workers import WorkerProcess
from tests.test_cli import run_rlm

OLD_MODEL = "old-org/retired-encoder-v1"
TEXT = (
    "# Lighthouse log\n\nThe keeper trims the lamp wick every evening before dusk.\n\n"
    "Fog signals sound twice a minute whenever visibility drops below two miles.\n"
)


@pytest.fixture(scope="module")
def drift(rlm_env, conn, embedder, tmp_path_factory):
    from rlm_workers.ingest.loader import load_paths

    root = tmp_path_factory.mktemp("reembed") / "log"
    root.mkdir()
    (root / "lighthouse.md").write_text(TEXT)
    (root / "harbour.md").write_text("# Harbour\n\nThe ferry leaves at nine and returns at noon.\n")
    load_paths(conn, buffer="drift", paths=[root], embedder=embedder, chunk_size=200, overlap=0)
    conn.commit()
    return root


def _pretend_an_old_model(conn) -> int:
    """As if another model had embedded the buffer: its recorded model differs from RLM_EMBEDDING_MODEL."""
    row = conn.execute(
        "UPDATE buffers SET embedding_model = %s WHERE name = 'drift' RETURNING version", (OLD_MODEL,)
    ).fetchone()
    conn.commit()
    return row[0]


def _vectors(conn) -> int:
    from rlm_workers.store import vectors

    (buffer_id,) = conn.execute("SELECT id FROM buffers WHERE name = 'drift'").fetchone()
    return vectors.count(conn, buffer_id=buffer_id)


def test_cli_reembeds_after_a_model_change(rlm_env, conn, drift):
    windows = _vectors(conn)
    version = _pretend_an_old_model(conn)
    refused = run_rlm(rlm_env, "search", "how often do fog signals sound", "--buffer", "drift", "--mode", "semantic")
    assert refused.returncode == 2 and "rlm buffer reembed drift" in refused.stderr
    done = run_rlm(rlm_env, "buffer", "reembed", "drift", "--format", "json", check=0)
    report = json.loads(done.stdout)
    assert report["previous_model"] == OLD_MODEL and report["version"] == version + 1 and not report["unchanged"]
    assert report["chunks"] >= 2 and report["windows_embedded"] == windows == _vectors(conn)
    hits = json.loads(
        run_rlm(
            rlm_env,
            "search",
            "how often do fog signals sound",
            "--buffer",
            "drift",
            "--mode",
            "semantic",
            "--format",
            "json",
            "--top-k",
            "1",
            check=0,
        ).stdout
    )
    assert "Fog signals" in json.dumps(hits)
    again = run_rlm(rlm_env, "buffer", "reembed", "drift", check=0)
    assert "already embedded" in again.stdout
    missing = run_rlm(rlm_env, "buffer", "reembed", "no-such-buffer")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_failure_half_way_keeps_the_old_vectors(rlm_env, conn, drift, embedder, monkeypatch):
    from rlm_workers.ingest import reembed

    class Failing:
        model_id, dim, spec, runtime = embedder.model_id, embedder.dim, embedder.spec, embedder.runtime
        calls = 0

        def window_spans(self, text: str, spec) -> list[tuple[int, int]]:
            return embedder.window_spans(text, spec)

        def encode(self, texts, batch_size):
            Failing.calls += 1
            if Failing.calls == 2:
                raise RuntimeError("encoder crashed")
            return embedder.encode(texts, batch_size=batch_size)

    windows = _vectors(conn)
    version = _pretend_an_old_model(conn)
    monkeypatch.setattr(reembed, "PAGE", 1)  # one chunk per round, so the crash comes after a page was written
    with pytest.raises(RuntimeError, match="encoder crashed"):
        reembed.reembed_buffer(conn, tenant="local", name="drift", embedder=Failing())
    conn.rollback()
    row = conn.execute("SELECT embedding_model, version FROM buffers WHERE name = 'drift'").fetchone()
    assert row == (OLD_MODEL, version) and _vectors(conn) == windows


def test_rlm_embed_task_on_an_ingest_worker(rlm_env, conn, drift, tmp_path):
    from rlm_workers.ingest.embed import model_id_for

    windows = _vectors(conn)
    _pretend_an_old_model(conn)
    worker = WorkerProcess(
        "emb",
        queues="rlm.ingest",
        env={**rlm_env, "HF_HUB_OFFLINE": "1"},
        log_dir=tmp_path,
        concurrency=1,
        pool="prefork",
    ).start()
    try:
        queued = run_rlm(rlm_env, "buffer", "reembed", "drift", "--queue", check=0)
        assert "queued rlm.embed" in queued.stdout
        deadline = time.monotonic() + 120
        while conn.execute("SELECT embedding_model FROM buffers WHERE name = 'drift'").fetchone()[0] == OLD_MODEL:
            conn.commit()
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.3)
        conn.commit()
        assert conn.execute("SELECT embedding_model FROM buffers WHERE name = 'drift'").fetchone()[0] == model_id_for(
            None
        )
        assert _vectors(conn) == windows and "re-embedded with" in worker.tail(200)
    finally:
        worker.stop()


def test_buffers_cut_into_different_windows_are_not_ranked_together(rlm_env, conn, drift, embedder, tmp_path):
    """A buffer from before the window change is searched alone, refused beside a newer one, and re-embedded."""
    from rlm_workers.ingest.loader import load_paths

    other = tmp_path / "other"
    other.mkdir()
    (other / "pier.md").write_text("# Pier\n\nFishing boats unload at the north pier before sunrise.\n")
    load_paths(conn, buffer="newer", paths=[other], embedder=embedder)
    conn.execute("UPDATE buffers SET embedding_windows = 'tokens:254/32' WHERE name = 'drift'")
    conn.commit()
    alone = run_rlm(rlm_env, "search", "fog signals", "--buffer", "drift", "--mode", "semantic", check=0)
    assert "Fog signals" in alone.stdout
    both = ["search", "fog signals", "--buffer", "drift", "--buffer", "newer", "--mode", "semantic"]
    refused = run_rlm(rlm_env, *both)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "different window settings" in refused.stderr and "rlm buffer reembed drift" in refused.stderr
    assert run_rlm(rlm_env, *both[:-1], "bm25", check=0).returncode == 0  # no vectors, nothing to mix
    done = json.loads(run_rlm(rlm_env, "buffer", "reembed", "drift", "--format", "json", check=0).stdout)
    assert not done["unchanged"]
    label = conn.execute("SELECT embedding_windows FROM buffers WHERE name = 'drift'").fetchone()[0]
    conn.commit()
    assert label == embedder.spec.label
    assert "Fog signals" in run_rlm(rlm_env, *both, check=0).stdout


def test_buffers_embedded_by_different_runtimes_are_not_ranked_together(rlm_env, conn, drift, embedder, tmp_path):
    """A buffer embedded by PyTorch is searched with a PyTorch query vector, refused beside an ONNX one, and
    brought to the configured runtime by reembed (docs/architecture.md#encoder-runtimes)."""
    from rlm_workers.ingest.loader import load_paths

    assert embedder.runtime != "torch"  # the default runtime where onnxruntime runs the model
    other = tmp_path / "other"
    other.mkdir()
    (other / "quay.md").write_text("# Quay\n\nThe harbour crane lifts containers onto the night train.\n")
    load_paths(conn, buffer="newer-rt", paths=[other], embedder=embedder)
    # drift's vectors were written by the default runtime; say PyTorch wrote them, and write PyTorch's vectors
    conn.commit()
    done = run_rlm({**rlm_env, "RLM_EMBEDDING_RUNTIME": "torch"}, "buffer", "reembed", "drift", "--format", "json")
    assert done.returncode == 0, done.stderr
    conn.commit()
    runtime = conn.execute("SELECT embedding_runtime FROM buffers WHERE name = 'drift'").fetchone()[0]
    conn.commit()
    assert runtime == "torch"
    shown = json.loads(run_rlm(rlm_env, "buffer", "show", "drift", "--format", "json", check=0).stdout)
    assert shown["embedding_runtime"] == "torch"
    # alone, the query is embedded by the buffer's runtime whatever RLM_EMBEDDING_RUNTIME says
    alone = run_rlm(rlm_env, "search", "how often do fog signals sound", "--buffer", "drift", "--mode", "semantic")
    assert alone.returncode == 0 and "Fog signals" in alone.stdout
    both = ["search", "fog signals", "--buffer", "drift", "--buffer", "newer-rt", "--mode", "semantic"]
    refused = run_rlm(rlm_env, *both)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "different encoder runtimes" in refused.stderr and "rlm buffer reembed drift" in refused.stderr
    assert run_rlm(rlm_env, *both[:-1], "bm25", check=0).returncode == 0  # no vectors, nothing to mix
    again = json.loads(run_rlm(rlm_env, "buffer", "reembed", "drift", "--format", "json", check=0).stdout)
    assert not again["unchanged"]  # same model and windows, another runtime: re-embedded
    assert "Fog signals" in run_rlm(rlm_env, *both, check=0).stdout
    assert json.loads(run_rlm(rlm_env, "buffer", "reembed", "drift", "--format", "json", check=0).stdout)["unchanged"]
