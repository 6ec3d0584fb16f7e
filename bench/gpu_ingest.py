"""The encoder on a GPU (issue #29): encode speed on CUDA in half precision against the CPU, the vectors'
agreement, and a whole `rlm load` on one GPU.

    .venv/bin/python bench/gpu_ingest.py [--mb MB] [--cpu-windows N] [--no-load] [--cpu-load]

One run, one report (printed, and as JSON on the last line); nothing is written to RESULTS.md.

1. Corpus: the .py sources of the installed celery package (1.69 MB; ``--mb`` takes the first MB of them),
   chunked with the CLI's defaults and cut into the loader's sentence windows.
2. CPU: the float32 reference (``torch`` runtime) on an even sample of ``--cpu-windows`` windows: MB/s of
   window text.
3. GPU (skipped, and said so, where torch sees no CUDA device): ``torch-cuda-fp16`` on every window, as one
   call and in the loader's groups (8 batches of RLM_EMBED_BATCH_SIZE per call); sentence-transformers' own
   ``encode`` in half precision for comparison; the cosine of each GPU vector to the CPU reference's on the
   sample (mean, 1st percentile, min) against ``embed.COMPARABLE_COSINE``, the bound under which a GPU buffer is
   ranked with a CPU one.
4. Whole load (where the project's services start here): ``rlm load`` as a fresh process with
   RLM_EMBEDDING_DEVICE=cuda into a fresh embedded PostgreSQL (the issue's target: >= 1 MB/s), then the same
   load in this process with the encoder's seconds timed apart, so the rest (reading, chunking, window cutting,
   database writes, the HNSW graph build) reads as its own MB/s ceiling.  ``--cpu-load`` runs step 4 on the CPU
   where there is no GPU (a check of the bench; bench/ingest.py owns the CPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

PACKAGE = "celery"
NO_CUDA = "no CUDA device: skipped the GPU figures"


def build_corpus(root: Path, budget: int | None) -> int:
    """Copy the package's .py files into ``root`` (all, or the first ``budget`` bytes); the bytes copied."""
    return harness.copy_package_sources(root, PACKAGE, budget)[1]


def corpus_windows(root: Path, embedder) -> list[str]:
    """The windows `rlm load` encodes for the files under ``root`` (the CLI's chunking defaults)."""
    from rlm_workers.ingest.chunkers import chunk_text

    windows: list[str] = []
    for p in sorted(root.rglob("*.py")):
        for ch in chunk_text(p.read_text(encoding="utf-8"), path=str(p.relative_to(root))):
            windows.extend(embedder.window_texts(ch.text))
    return windows


def mb(texts: list[str]) -> float:
    return sum(len(t.encode()) for t in texts) / 1e6


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def as_loader(encoder, windows: list[str], batch: int) -> None:
    """``windows`` encoded as the loader hands them over: groups of 8 batches per call."""
    group = batch * 8
    for i in range(0, len(windows), group):
        encoder.encode(windows[i : i + group], batch_size=batch)


def cosines(vecs, ref) -> dict:
    import numpy as np

    cos = np.sum(vecs * ref, axis=1)
    return {"mean": float(cos.mean()), "p01": float(np.quantile(cos, 0.01)), "min": float(cos.min())}


def gpu_figures(windows: list[str], sample_idx: list[int], ref, batch: int) -> dict:
    import numpy as np
    import torch

    from rlm_workers.ingest.embed import COMPARABLE_COSINE, GPU_BATCH, torch_encoder

    gpu = torch_encoder(device="cuda", half=True)
    size = mb(windows)
    gpu.encode(windows[:GPU_BATCH])  # warm-up: CUDA context, kernels, tokenizer threads
    sync()
    vecs, one_call = timed(gpu.encode, windows)
    _, grouped = timed(as_loader, gpu, windows, batch)
    sync()

    def st_encode():
        gpu.model.encode(windows, batch_size=GPU_BATCH, normalize_embeddings=True, convert_to_numpy=True)

    _, plain = timed(st_encode)
    agree = cosines(vecs[np.array(sample_idx)], ref)
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "windows": len(windows),
        "MB": round(size, 3),
        "fed_one_call_MBps": round(size / one_call, 3),
        "fed_loader_groups_MBps": round(size / grouped, 3),
        "st_encode_fp16_MBps": round(size / plain, 3),
        "cosine_to_cpu_fp32": agree,
        "comparable": agree["min"] >= COMPARABLE_COSINE,
        "comparable_bound": COMPARABLE_COSINE,
    }


def whole_load(corpus: Path, data_dir: Path, size: int, device: str) -> dict:
    """`rlm load` as a fresh process, then in this process with the encoder timed apart."""
    from rlm_workers.config import reset_settings
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.runtime.local_servers import stop_embedded_postgres
    from rlm_workers.store import db

    os.environ["RLM_EMBEDDING_DEVICE"] = device
    reset_settings()
    db.close_pools()
    stop_embedded_postgres(data_dir)
    shutil.rmtree(data_dir / "pg", ignore_errors=True)
    conn = db.connect()  # started and migrated before the clock: a first load's start-up is not the load
    conn.commit()
    env = harness.child_env()
    cmd = [sys.executable, "-m", "rlm_api.cli", "load", str(corpus), "--buffer", "gpu-cli", "--format", "json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    cli_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"rlm load failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    embedder = get_embedder()
    embedder.encode(["warm-up"])
    spent = [0.0]

    class Timed:
        """The embedder, with the seconds of its ``encode`` counted."""

        def __getattr__(self, name):
            return getattr(embedder, name)

        def encode(self, texts, **kw):
            t = time.perf_counter()
            out = embedder.encode(texts, **kw)
            sync()
            spent[0] += time.perf_counter() - t
            return out

    from rlm_workers.store import vectors

    build = vectors.ensure_index
    built = [0.0]

    def timed_build(*a, **kw):  # the HNSW graph build, at the end of the load
        t = time.perf_counter()
        try:
            return build(*a, **kw)
        finally:
            built[0] += time.perf_counter() - t

    vectors.ensure_index = timed_build
    t0 = time.perf_counter()
    try:
        load_paths(conn, buffer="gpu-inproc", paths=[corpus], embedder=Timed())
        conn.commit()
    finally:
        vectors.ensure_index = build
    inproc_s = time.perf_counter() - t0
    conn.close()
    rest = max(1e-9, inproc_s - spent[0])
    return {
        "runtime": embedder.runtime,
        "cli_process_s": round(cli_s, 2),
        "cli_process_MBps": round(size / 1e6 / cli_s, 3),
        "cli_report_s": report.get("seconds"),
        "windows": report.get("windows_embedded"),
        "in_process_s": round(inproc_s, 2),
        "encode_s": round(spent[0], 2),
        "rest_s": round(rest, 2),
        "graph_build_s": round(built[0], 2),
        "rest_MBps": round(size / 1e6 / rest, 3),
        "target_MBps": 1.0,
        "met": size / 1e6 / cli_s >= 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=None, help="use the first MB of the corpus (default: all 1.69 MB)")
    ap.add_argument("--cpu-windows", type=int, default=1500, help="windows of the CPU reference sample")
    ap.add_argument("--no-load", action="store_true", help="skip the whole load")
    ap.add_argument("--cpu-load", action="store_true", help="run the whole load on the CPU where there is no GPU")
    args = ap.parse_args()

    data_dir = harness.isolated_env("gpu-ingest")
    os.environ["RLM_EMBEDDING_DEVICE"] = "cpu"  # the reference below is the CPU's whatever this host has
    import torch

    from rlm_workers.config import get_settings
    from rlm_workers.ingest.embed import get_embedder

    out: dict = {"machine": harness.machine_line(), "load": harness.loadavg(), "revision": harness.revision()}
    tmp = Path(tempfile.mkdtemp(prefix="gpu-ingest-"))
    try:
        corpus = tmp / "corpus"
        size = build_corpus(corpus, int(args.mb * 1e6) if args.mb else None)
        cpu = get_embedder(runtime="torch")
        windows, cut_s = timed(corpus_windows, corpus, cpu)
        out["chunk_and_cut_s"] = round(cut_s, 2)  # the loader's own CPU work before any vector, one thread
        step = max(1, len(windows) // args.cpu_windows)
        sample_idx = list(range(0, len(windows), step))[: args.cpu_windows]
        sample = [windows[i] for i in sample_idx]
        print(f"corpus: {size / 1e6:.2f} MB of {PACKAGE} source, {len(windows)} windows ({mb(windows):.2f} MB)")
        cpu.encode(sample[:64])
        ref, cpu_s = timed(cpu.encode, sample, batch_size=get_settings().embed_batch_size)
        out["cpu_fp32"] = {
            "threads": torch.get_num_threads(),
            "windows": len(sample),
            "MBps": round(mb(sample) / cpu_s, 3),
        }
        threads = torch.get_num_threads()
        print(f"cpu float32 ({threads} threads): {out['cpu_fp32']['MBps']} MB/s on {len(sample)} windows")
        cuda = torch.cuda.is_available()
        if cuda:
            out["gpu_fp16"] = g = gpu_figures(windows, sample_idx, ref, get_settings().embed_batch_size)
            print(
                f"gpu fp16 on {g['device']}: {g['fed_one_call_MBps']} MB/s (one call), "
                f"{g['fed_loader_groups_MBps']} MB/s (loader groups), sentence-transformers' encode "
                f"{g['st_encode_fp16_MBps']} MB/s; cosine to cpu fp32 mean {g['cosine_to_cpu_fp32']['mean']:.6f} "
                f"min {g['cosine_to_cpu_fp32']['min']:.6f} ({'within' if g['comparable'] else 'OUTSIDE'} "
                f"{g['comparable_bound']})"
            )
        else:
            out["gpu_fp16"] = NO_CUDA
            print(NO_CUDA)
        if args.no_load or not (cuda or args.cpu_load):
            out["whole_load"] = "skipped" + ("" if args.no_load else f" ({NO_CUDA}; --cpu-load runs it on the CPU)")
            print(f"whole load: {out['whole_load']}")
        else:
            try:
                out["whole_load"] = w = whole_load(corpus, data_dir, size, "cuda" if cuda else "cpu")
            except ImportError as exc:
                out["whole_load"] = f"skipped: the project's dependencies are not importable ({exc})"
                print(f"whole load: {out['whole_load']}")
            else:
                print(
                    f"whole load on {w['runtime']}: `rlm load` process {w['cli_process_MBps']} MB/s "
                    f"({w['cli_process_s']} s); in process {w['in_process_s']} s of which encode {w['encode_s']} s, "
                    f"the rest {w['rest_MBps']} MB/s (graph build {w['graph_build_s']} s; chunking and "
                    f"cutting alone {out['chunk_and_cut_s']} s)"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            from rlm_workers.runtime.local_servers import stop_embedded_postgres

            stop_embedded_postgres(data_dir)
        except Exception as exc:  # reported, not raised: the figures are already out
            print(f"could not stop the embedded PostgreSQL: {exc}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
