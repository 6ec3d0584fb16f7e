"""RLM_EMBEDDING_DEVICE: which device the torch encoder runs on, what a GPU's vectors are recorded as, and why
they may be ranked with the float32 reference's (docs/architecture.md#gpu-encoder).

This host has no CUDA device: the GPU's half precision is run on the CPU here (the same dtype, the same fed
encode path), and selection with a CUDA device is checked by telling torch it sees one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from rlm_workers.errors import ConfigError, InvalidInput
from rlm_workers.ingest.embed import (
    COMPARABLE_COSINE,
    CUDA_RUNTIME,
    Embedder,
    get_embedder,
    get_query_encoder,
    gpu_driver_present,
    ranked_as,
    resolve_runtime,
    torch_encoder,
)
from tests.support.envpatch import patched_env
from tests.test_cli import run_rlm

pytestmark = pytest.mark.usefixtures("rlm_env")

FOG = "# Fog signals\n\nThe fog horn sounds every thirty seconds while the harbour lies in fog.\n"
QUAY = "# Quay\n\nThe harbour crane lifts containers onto the night train.\n"


def _real_windows(ref: Embedder, limit: int = 160) -> list[str]:
    """Distinct windows of real code and prose, cut as the loader cuts them, spread evenly."""
    import celery

    root = os.path.dirname(celery.__file__)
    texts = [open(os.path.join(root, name), encoding="utf-8").read()[:6000] for name in ("app/base.py", "result.py")]
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "architecture.md")
    texts.append(open(docs, encoding="utf-8").read()[:12000])
    windows = list(dict.fromkeys(w for t in texts for w in ref.window_texts(t) if w.strip()))
    step = max(1, len(windows) // limit)
    return windows[::step][:limit]


@pytest.fixture(scope="module")
def half(torch_embedder) -> Embedder:
    """The model in half precision, the GPU's dtype, on the CPU."""
    return torch_encoder(device="cpu", half=True)


def test_half_precision_vectors_agree_with_the_float32_reference_within_the_ranking_tolerance(torch_embedder, half):
    import torch

    texts = _real_windows(torch_embedder)
    ref = torch_embedder.encode(texts)
    vecs = half.encode(texts, batch_size=16)
    assert half.runtime == "torch-cpu-fp16" and half.model.dtype == torch.float16
    assert vecs.shape == ref.shape and vecs.dtype == np.float32
    cos = np.sum(vecs * ref, axis=1)
    assert float(cos.min()) >= COMPARABLE_COSINE, float(cos.min())
    # the fed path sorts by length and puts each vector back: every window is nearest its own reference
    assert (np.argmax(vecs @ ref.T, axis=1) == np.arange(len(texts))).all()


def test_the_cpu_device_keeps_the_runtimes_it_always_had():
    assert resolve_runtime(None, "auto", "cpu") == "onnx-int8"
    assert resolve_runtime(None, "torch", "cpu") == "torch"
    assert resolve_runtime(None, "onnx", "cpu") == "onnx"
    assert get_embedder(runtime="torch").runtime == "torch"  # a named runtime is the CPU reference, as before


def test_auto_on_a_host_without_cuda_resolves_as_before_without_importing_torch(rlm_env):
    import torch

    if gpu_driver_present():  # torch is asked, and its answer decides
        expected = CUDA_RUNTIME if torch.cuda.is_available() else "onnx-int8"
        assert resolve_runtime(None, "auto", "auto") == expected
        return
    script = (
        "import sys\nfrom rlm_workers.ingest.embed import resolve_runtime\n"
        "print(resolve_runtime(None), 'torch' in sys.modules)\n"
    )
    env = {**os.environ, **rlm_env, "RLM_EMBEDDING_DEVICE": "auto", "RLM_EMBEDDING_RUNTIME": "auto"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["onnx-int8", "False"]


def test_where_torch_sees_cuda_the_torch_runtimes_run_on_it_in_half_precision(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_runtime(None, "auto", "cuda") == CUDA_RUNTIME
    assert resolve_runtime(None, "torch", "cuda") == CUDA_RUNTIME
    assert resolve_runtime(None, "torch", "cpu") == "torch"
    assert resolve_runtime(None, "onnx-int8", "auto") == "onnx-int8"  # a named ONNX runtime stays on the CPU
    # auto asks torch only where a GPU driver is present
    assert resolve_runtime(None, "auto", "auto") == (CUDA_RUNTIME if gpu_driver_present() else "onnx-int8")


def test_cuda_asked_for_where_torch_sees_none_is_a_one_line_config_error(rlm_env, tmp_path):
    import torch

    with pytest.raises(ConfigError, match="RLM_EMBEDDING_RUNTIME=onnx-int8 runs on the CPU only"):
        resolve_runtime(None, "onnx-int8", "cuda")
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    with patched_env({"RLM_EMBEDDING_DEVICE": "cuda"}), pytest.raises(ConfigError) as refused:
        get_embedder()
    assert "RLM_EMBEDDING_DEVICE=cuda" in refused.value.message and "\n" not in refused.value.message
    (tmp_path / "fog.md").write_text(FOG)
    for extra, args in (
        ({"RLM_EMBEDDING_DEVICE": "cuda"}, ("load", str(tmp_path), "--buffer", "never")),
        ({"RLM_EMBEDDING_DEVICE": "gpu"}, ("buffers",)),
    ):
        bad = run_rlm({**rlm_env, **extra}, *args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert "RLM_EMBEDDING_DEVICE" in bad.stderr


def test_gpu_embedded_buffers_are_ranked_with_torch_ones_and_queried_on_the_cpu(
    conn, settings, db_url, torch_embedder, half, tmp_path
):
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.search.service import search
    from rlm_workers.store.buffers import DEFAULT_TENANT

    # what a GPU worker writes: the model's half-precision vectors, recorded as CUDA_RUNTIME
    gpu = Embedder(torch_embedder.model_id, half.model, CUDA_RUNTIME)
    fog, quay = tmp_path / "fog", tmp_path / "quay"
    fog.mkdir(), quay.mkdir()
    (fog / "fog.md").write_text(FOG)
    (quay / "quay.md").write_text(QUAY)
    load_paths(conn, buffer="on-gpu", paths=[fog], embedder=gpu)
    load_paths(conn, buffer="on-cpu", paths=[quay], embedder=torch_embedder)
    load_paths(conn, buffer="fog-on-cpu", paths=[fog], embedder=torch_embedder)
    load_paths(conn, buffer="on-int8", paths=[quay], embedder=get_embedder(runtime="onnx-int8"))
    recorded = dict(conn.execute("SELECT name, embedding_runtime FROM buffers").fetchall())
    conn.commit()
    assert recorded["on-gpu"] == CUDA_RUNTIME and recorded["on-cpu"] == "torch"
    assert ranked_as(CUDA_RUNTIME) == "torch" and ranked_as("onnx-int8") == "onnx-int8"
    # a search process embeds a GPU buffer's query on the CPU, with the reference's family encoder
    assert get_query_encoder(None, CUDA_RUNTIME) is get_query_encoder(None, "torch")

    def hits(*buffers):
        return search(
            conn,
            settings=settings,
            url=db_url,
            tenant=DEFAULT_TENANT,
            buffers=list(buffers),
            query="how often does the fog horn sound",
            mode="semantic",
            top_k=5,
            threshold=-1.0,
        )

    both = hits("on-gpu", "on-cpu")
    assert {h.buffer for h in both} == {"on-gpu", "on-cpu"}  # ranked together, not refused
    assert both[0].buffer == "on-gpu" and "fog horn" in both[0].text
    # the same text embedded on either device scores alike (halfvec storage rounds at ~1e-3 anyway)
    assert abs(hits("on-gpu")[0].score - hits("fog-on-cpu")[0].score) < 2e-3
    with pytest.raises(InvalidInput, match="different encoder runtimes"):
        hits("on-gpu", "on-int8")


def test_the_doctor_says_what_an_ingest_worker_here_encodes_with(rlm_env):
    import torch

    from rlm_workers.config import get_settings
    from rlm_workers.runtime.doctor import check_encoder

    (here,) = check_encoder(get_settings())
    assert here.ok and here.name == "encoder"
    if not torch.cuda.is_available():
        assert here.detail.startswith("onnx-int8 on the CPU")
        with patched_env({"RLM_EMBEDDING_DEVICE": "cuda"}):
            (refused,) = check_encoder(get_settings())
        assert not refused.ok and "RLM_EMBEDDING_DEVICE=cuda" in refused.detail
    with patched_env({"RLM_EMBEDDING_DEVICE": "cpu", "RLM_EMBEDDING_RUNTIME": "torch"}):
        (cpu,) = check_encoder(get_settings())
    assert cpu.ok and cpu.detail == "torch on the CPU (RLM_EMBEDDING_DEVICE=cpu)"
