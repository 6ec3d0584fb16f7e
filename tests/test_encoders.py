"""The fast encoder runtimes (ingest/onnxenc.py) against the PyTorch reference, on real text.

docs/architecture.md#encoder-runtimes: onnx (float32) must give the reference's vectors; onnx-int8 must stay
within a mean cosine of 0.99 of them on a real corpus, cut into windows exactly as the reference cuts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlm_workers.ingest.windows import DEFAULT_WINDOWS, WindowSpec, query_windows

pytestmark = pytest.mark.usefixtures("rlm_env")


def _real_corpus(limit: int = 800) -> list[str]:
    """Windows of real text: an installed package's source and this project's own prose, by the default cut.
    800 of them, an even spread: int8's mean cosine over them was 0.99625 against 0.99626 over all 2,131 the cut
    gives, and the float32 reference over all was two minutes of the suite on 2 cores (2026-11-30)."""
    import celery

    from rlm_workers.ingest.embed import get_embedder

    ref = get_embedder(runtime="torch")
    code = sorted(Path(celery.__file__).parent.rglob("*.py"))
    docs = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    texts = []
    for p in [*code[::7], *docs]:
        text = p.read_text(encoding="utf-8")
        texts.extend(text[i : i + 3000] for i in range(0, min(len(text), 12000), 3000))
    windows: list[str] = []
    for t in texts:
        windows.extend(ref.window_texts(t))
    # an even spread over code and prose rather than the first files only
    step = max(1, len(windows) // limit)
    return windows[::step][:limit]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _real_corpus()


@pytest.fixture(scope="module")
def reference(corpus, torch_embedder) -> np.ndarray:
    return torch_embedder.encode(corpus)


def test_int8_vectors_stay_within_a_cosine_of_099_of_the_reference(corpus, reference):
    from rlm_workers.ingest.embed import get_embedder

    fast = get_embedder(runtime="onnx-int8")
    assert fast.runtime == "onnx-int8" and fast.dim == reference.shape[1]
    vecs = fast.encode(corpus, batch_size=64)
    cos = np.sum(vecs * reference, axis=1)
    assert len(corpus) >= 800
    assert float(cos.mean()) >= 0.99, f"mean cosine {cos.mean():.4f} over {len(corpus)} windows"
    assert float(cos.min()) >= 0.95, f"worst window {corpus[int(cos.argmin())]!r} at {cos.min():.4f}"
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)


def test_float32_onnx_gives_the_reference_vectors(corpus, reference):
    from rlm_workers.ingest.embed import get_embedder

    fast = get_embedder(runtime="onnx")
    vecs = fast.encode(corpus[:600], batch_size=64)
    assert float(np.max(np.abs(vecs - reference[:600]))) < 1e-4


def test_batches_threads_and_order_do_not_change_a_vector(corpus):
    """Sorted by length, cut into batches, run on several threads: every vector lands on its own text."""
    from rlm_workers.ingest.embed import get_embedder

    fast = get_embedder(runtime="onnx")
    sample = corpus[:300]
    whole = fast.encode(sample, batch_size=64)
    one_by_one = np.stack([fast.encode([t], batch_size=1)[0] for t in sample[:40]])
    assert float(np.max(np.abs(whole[:40] - one_by_one))) < 1e-4
    shuffled = list(reversed(sample))
    assert float(np.max(np.abs(fast.encode(shuffled, batch_size=7)[::-1] - whole))) < 1e-4
    assert fast.encode([], batch_size=64).shape == (0, fast.dim)


@pytest.mark.parametrize("runtime", ["onnx", "onnx-int8"])
def test_fast_runtimes_cut_windows_and_queries_as_the_reference(runtime, torch_embedder):
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.windows import LEGACY_WINDOWS_LABEL

    fast = get_embedder(runtime=runtime)
    texts = [
        "The lighthouse keeper wrote the weather down. Did anyone read it? Nobody knows.\n" * 30,
        "def f(x):\n    return x * 2  # doubles\n\n" * 40,
        "Ünïcödé — naïve café, 東京. Emoji 🚀 here! " * 25,
    ]
    assert fast.spec == torch_embedder.spec == DEFAULT_WINDOWS.capped(torch_embedder.window_tokens)
    for spec in (DEFAULT_WINDOWS, WindowSpec.from_label(LEGACY_WINDOWS_LABEL), WindowSpec(64, 16)):
        for text in texts:
            assert fast.window_spans(text, spec) == torch_embedder.window_spans(text, spec)
    long_query = " ".join(["a long question about fog signals and lighthouse keepers"] * 60)  # over 256 pieces
    assert fast.window_texts(long_query, query_windows(fast.window_tokens)) == torch_embedder.window_texts(
        long_query, query_windows(torch_embedder.window_tokens)
    )
    for q in ("where is the spare key hidden?", "x", long_query):
        a, b = fast.encode_query(q), torch_embedder.encode_query(q)
        assert a.shape == b.shape and a.dtype == np.float32
        assert float(a @ b) >= (0.9999 if runtime == "onnx" else 0.97), q[:30]


def test_exports_once_under_concurrent_first_use(tmp_path):
    """Two processes asking for an encoder nobody exported yet: one exports, both get a working file."""
    script = (
        "import sys, time; from pathlib import Path\n"
        "from rlm_workers.ingest import onnxenc\n"
        "from rlm_workers.ingest.embed import _resolve_model\n"
        "model_id, path = _resolve_model(None)\n"
        "t = time.perf_counter(); p = onnxenc.exported_path(model_id, Path(path), 'onnx-int8', Path(sys.argv[1]))\n"
        "print(p)\n"
    )
    env = {**os.environ, "RLM_LOG_LEVEL": "INFO"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    paths = {o[0].decode().strip() for o in outs}
    assert len(paths) == 1
    made = Path(paths.pop())
    assert made.name == "model-int8.onnx" and made.parent.parent == tmp_path
    assert sorted(p.name for p in made.parent.iterdir() if not p.name.startswith(".")) == [
        "meta.json",
        "model-int8.onnx",
        "model.onnx",
    ]  # no temporary file left behind by either process
    assert json.loads((made.parent / "meta.json").read_text())["export_version"] >= 1
    import onnxruntime as ort

    sess = ort.InferenceSession(str(made), providers=["CPUExecutionProvider"])
    ids = np.array([[101, 7592, 102]], dtype=np.int64)
    (vec,) = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert vec.shape == (1, 384) and abs(float(np.linalg.norm(vec)) - 1) < 1e-4


def test_a_model_onnx_cannot_run_falls_back_to_torch_under_auto_and_is_refused_when_named(tmp_path):
    """A head the exporter does not write (a Dense layer after pooling) must not be silently dropped."""
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.errors import ConfigError
    from rlm_workers.ingest import onnxenc
    from rlm_workers.ingest.embed import _resolve_model, resolve_runtime

    _, src = _resolve_model(None)
    model = tmp_path / "with-dense"
    model.mkdir()
    for p in Path(src).iterdir():
        (model / p.name).symlink_to(p)
    (model / "modules.json").unlink()
    modules = json.loads((Path(src) / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (model / "modules.json").write_text(json.dumps(modules))
    assert onnxenc.pooling_of(Path(src)) == "mean" and onnxenc.pooling_of(model) is None
    assert resolve_runtime(str(model), "auto") == "torch"
    assert resolve_runtime(None, "auto") == "onnx-int8"
    with pytest.raises(ConfigError, match="RLM_EMBEDDING_RUNTIME=torch"):
        onnxenc.exported_path("custom", model, "onnx", tmp_path / "cache")
    reset_settings()
    assert get_settings().embedding_runtime == "auto"


def test_an_unknown_runtime_is_a_one_line_usage_error(rlm_env):
    from tests.test_cli import run_rlm

    bad = run_rlm({**rlm_env, "RLM_EMBEDDING_RUNTIME": "tensorrt"}, "buffers")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "RLM_EMBEDDING_RUNTIME" in bad.stderr


def test_an_int8_vector_depends_on_its_batch_only_within_the_documented_bound(corpus, reference):
    """Activations are scaled per batch (docs/architecture.md#encoder-runtimes): the same window among other
    windows gets a slightly different int8 vector, never one that leaves the reference's neighbourhood."""
    from rlm_workers.ingest.embed import get_embedder

    fast = get_embedder(runtime="onnx-int8")
    sample = corpus[:640]
    sorted_batches = fast.encode(sample, batch_size=64)
    alone = np.stack([fast.encode([t], batch_size=1)[0] for t in sample[:64]])
    mixed = fast.encode(list(reversed(sample)), batch_size=5)[::-1]
    for other in (alone, mixed[:64]):
        self_cos = np.sum(other * sorted_batches[: len(other)], axis=1)
        assert float(self_cos.mean()) >= 0.99 and float(self_cos.min()) >= 0.95
    to_ref = np.sum(alone * reference[:64], axis=1)
    assert float(to_ref.mean()) >= 0.99
