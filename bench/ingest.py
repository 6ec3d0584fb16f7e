"""Ingest throughput: `rlm load` against raw SentenceTransformer.encode of the very same windows.

    .venv/bin/python bench/ingest.py [--mb 3] [--no-write] [--keep-servers]

The corpus is real text copied into a temp dir: the Markdown/RST docs found
in site-packages (package READMEs from the wheels' METADATA, plus the
.md/.rst files shipped inside packages), then Python sources of celery,
kombu, pydantic, fastapi, starlette... until --mb megabytes.

1. ``rlm load DIR --buffer bench-ingest --format json`` runs as a subprocess
   (the real CLI: discovery, chunking, tokenizing, windowing, encoding, COPY,
   one HNSW build, commit, BM25 warm-up) into a fresh embedded PostgreSQL under
   bench/_data/ingest.  Its JSON report gives the time spent in load_paths;
   the wall clock adds interpreter start-up and model load.
2. In this process, the project's embedder (``ingest.embed.get_embedder``)
   re-derives the same windows the loader encoded (same discovery order,
   chunker, ``window_texts``) and encodes them in the loader's batches of 64,
   timing only ``encode``: the ceiling a load could reach.

On this encoder-bound path the target is: load speed ≥ 80 % of raw encode speed.
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
import _util  # noqa: E402 - after the path tweak, before any project import

BUFFER = "bench-ingest"
CODE_PACKAGES = ("celery", "kombu", "pydantic", "fastapi", "starlette", "redis", "click", "rich", "httpx")
TARGET_RATIO = 0.80


def build_corpus(root: Path, budget: int) -> dict[str, int]:
    """Copy real docs, then code, into ``root`` until ``budget`` bytes; returns bytes per kind."""
    sp = _util.SITE_PACKAGES
    copied = {"markdown/rst": 0, "python": 0}
    total = 0

    def put(rel: str, data: bytes, kind: str) -> bool:
        nonlocal total
        if total >= budget:
            return False
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        copied[kind] += len(data)
        total += len(data)
        return True

    # Package READMEs: the long description after METADATA's header block, when it is Markdown.
    for meta in sorted(sp.glob("*.dist-info/METADATA")):
        raw = meta.read_bytes()
        head, _, body = raw.partition(b"\n\n")
        if b"text/markdown" in head and body.strip():
            put(f"docs/pypi/{meta.parent.name.removesuffix('.dist-info')}.md", body, "markdown/rst")
    for doc in sorted(p for ext in ("*.md", "*.rst") for p in sp.rglob(ext)):
        if ".dist-info" not in str(doc) and doc.is_file():
            put(f"docs/packages/{doc.relative_to(sp)}", doc.read_bytes(), "markdown/rst")
    for pkg in CODE_PACKAGES:
        for src in sorted((sp / pkg).rglob("*.py")):
            if "__pycache__" not in src.parts and not put(f"code/{src.relative_to(sp)}", src.read_bytes(), "python"):
                return copied
    return copied


def fresh_database(data_dir: Path) -> None:
    """Each run loads into a new embedded server: a first load, with nothing left by the previous run."""
    from rlm_workers.local_servers import stop_embedded_postgres
    from rlm_workers.store.db import connect

    stop_embedded_postgres(data_dir)
    shutil.rmtree(data_dir / "pg", ignore_errors=True)
    shutil.rmtree(data_dir / "cache", ignore_errors=True)
    # start it and create the schema now, so the timed load does not pay for them (the load creates its
    # buffer's vector table and builds its graph: that is part of loading)
    conn = connect()
    conn.commit()
    conn.close()


def run_load(corpus: Path, data_dir: Path) -> tuple[dict, float, dict[str, float]]:
    """`rlm load` as a user runs it; returns (its JSON report, wall seconds, CPU seconds by process)."""
    import resource

    rlm = Path(sys.executable).with_name("rlm")
    cmd = [str(rlm), "load", str(corpus), "--buffer", BUFFER, "--format", "json"]
    ru0, pg0 = resource.getrusage(resource.RUSAGE_CHILDREN), _util.postgres_cpu(data_dir)
    others = _util.OtherCpu()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    ru1, pg1 = resource.getrusage(resource.RUSAGE_CHILDREN), _util.postgres_cpu(data_dir)
    if proc.returncode != 0:
        raise SystemExit(f"rlm load failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    cpu = {"rlm": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), "postgres": pg1 - pg0}
    cpu["others_load"] = others.share(cpu["rlm"] + cpu["postgres"])
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall, cpu


def loader_windows(corpus: Path, embedder) -> tuple[list[str], int, int]:
    """The windows `rlm load` encodes, in its order: (windows, files, chunks)."""
    from rlm_workers.ingest.chunkers import chunk_text
    from rlm_workers.ingest.files import discover, read_text

    cands, _ = discover([corpus], max_file_bytes=50 * 1024 * 1024)
    windows: list[str] = []
    files = chunks = 0
    for c in cands:
        text, reason, _digest = read_text(c)
        if reason is not None:
            continue
        files += 1
        for ch in chunk_text(text, path=c.rel_path):  # the CLI defaults: semantic, 3000, 500
            chunks += 1
            windows.extend(embedder.window_texts(ch.text))
    return windows, files, chunks


def raw_encode(embedder, windows: list[str], batch: int) -> tuple[float, float, float]:
    """(wall s, CPU s, other processes' CPU share) to encode ``windows`` in the loader's batches."""
    embedder.encode(windows[:batch], batch_size=batch)  # warm-up: first-call allocations, not throughput
    others = _util.OtherCpu()
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(windows), batch):  # consecutive slices of ``batch``, as the loader cuts them
        part = windows[i : i + batch]
        embedder.encode(part, batch_size=len(part))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, others.share(cpu)


def report(md_args: dict) -> str:
    a = md_args
    rep, kb = a["report"], a["report"]["bytes_loaded"] / 1000  # decimal units throughout: KB = 1000 B
    load_s, wall, raw_s = rep["seconds"], a["wall"], a["raw_s"]
    ratio, ratio_wall = raw_s / load_s, raw_s / wall
    chunks, wins = rep["chunks_written"], rep["windows_embedded"]

    def row(label: str, secs: float) -> str:
        return (
            f"| {label} | {secs:.1f} | {kb / secs:.1f} | {chunks / secs:.2f} | {wins / secs:.1f} | {raw_s / secs:.0%} |"
        )

    kinds = ", ".join(f"{v / 1e6:.2f} MB {k}" for k, v in a["kinds"].items())
    lines = [
        "## Ingest throughput (`bench/ingest.py`)",
        "",
        f"- command: `{_util.command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; "
        f"load average then: {_util.loadavg()}; share of the CPU used by other processes just before / during "
        f"the load: {a['busy']['load']:.0%} / {a['cpu']['others_load']:.0%}, the raw encode: "
        f"{a['busy']['raw']:.0%} / {a['cpu']['others_raw']:.0%} (the ratio below is only as fair as these "
        "two are alike and low)",
        f"- corpus: {kb / 1000:.2f} MB of real text in {rep['files_loaded']} files ({kinds}): package READMEs "
        "(Markdown from the wheels' METADATA) and .md/.rst files from site-packages, then the .py sources of "
        f"{', '.join(CODE_PACKAGES[:5])}…; copied to a temp dir. Size from `--mb` (default 3, the low end of "
        f"3–5 MB): the encoder manages {len(a['windows']) / raw_s:.0f} windows/s on this box and the bench "
        "encodes everything twice, so 3 MB keeps it to a few minutes.",
        f"- load: `rlm load DIR --buffer {BUFFER} --format json` as a subprocess (the real CLI) into a fresh "
        'embedded PostgreSQL; "load_paths" time is the report\'s `seconds` (discovery → commit, model already '
        'loaded); "whole process" is the subprocess wall clock (adds start-up, model load, BM25 warm-up).',
        f"- raw: `SentenceTransformer.encode` through the project's embedder (`get_embedder().encode`), in "
        f"this process, over the same {len(a['windows']):,} windows (re-derived with the loader's discovery "
        f"order, chunker and `window_texts`, checked equal in number to the load's), batch {a['batch']}, "
        "after one warm-up batch; only `encode` is timed.",
        "",
        f"{chunks:,} chunks, {wins:,} windows ({wins / chunks:.2f} per chunk).",
        "",
        "| run | seconds | KB/s | chunks/s | windows/s | speed vs raw encode |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row("raw `encode`, same windows", raw_s),
        row("`rlm load`: load_paths", load_s),
        row("`rlm load`: whole process", wall),
        "",
        f"CPU seconds (2 cores, so at most {2 * wall:.0f} in the load's {wall:.0f} s): the `rlm load` process "
        f"{a['cpu']['rlm']:.0f}, the embedded PostgreSQL during it {a['cpu']['postgres']:.0f} (COPY, HNSW "
        f"inserts, commit); raw encode {a['cpu']['raw']:.0f}.",
        "",
        "### Target",
        "",
        f"- `rlm load` (load_paths) speed / raw encode speed = {ratio:.0%} (target ≥ {TARGET_RATIO:.0%}): "
        f"**{'met' if ratio >= TARGET_RATIO else 'MISSED'}**",
        f"- whole `rlm load` process / raw encode = {ratio_wall:.0%}, counting the {wall - load_s:.1f} s "
        "spent outside load_paths (interpreter and imports, model load, BM25 warm-up; fixed, so its share "
        f"shrinks with the corpus): **{'met' if ratio_wall >= TARGET_RATIO else 'MISSED'}**",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=3.0, help="corpus size in MB of 10^6 bytes (default 3)")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL running")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=180,
        metavar="SECONDS",
        help="wait up to this long for other processes to leave the CPU idle before each timed run",
    )
    args = ap.parse_args()

    data_dir = _util.isolated_env("ingest")
    machine = _util.machine_markdown()
    t_start = time.perf_counter()
    from rlm_workers.config import get_settings

    batch = get_settings().embed_batch_size
    with tempfile.TemporaryDirectory(prefix="rlm-bench-ingest-") as tmp:
        corpus = Path(tmp) / "corpus"
        kinds = build_corpus(corpus, int(args.mb * 1_000_000))
        print(f"corpus: {sum(kinds.values()) / 1e6:.2f} MB ({kinds}) in {corpus}", flush=True)
        try:
            fresh_database(data_dir)
            busy = {"load": _util.wait_for_quiet(args.wait_quiet)}
            rep, wall, cpu = run_load(corpus, data_dir)
            print(f"rlm load: {rep['seconds']:.1f} s in load_paths, {wall:.1f} s wall; {rep}", flush=True)

            from rlm_workers.ingest.embed import get_embedder

            embedder = get_embedder()
            windows, files, chunks = loader_windows(corpus, embedder)
            if (files, chunks, len(windows)) != (
                rep["files_loaded"],
                rep["chunks_written"],
                rep["windows_embedded"],
            ):
                raise SystemExit(
                    f"window mismatch: bench derived {files} files, {chunks} chunks, "
                    f"{len(windows)} windows; the load reported {rep}"
                )
            busy["raw"] = _util.wait_for_quiet(args.wait_quiet)
            raw_s, cpu["raw"], cpu["others_raw"] = raw_encode(embedder, windows, batch)
            print(f"raw encode: {raw_s:.1f} s for {len(windows)} windows", flush=True)
        finally:
            if not args.keep_servers:
                _util.stop_servers(data_dir)

    md = report(
        {
            "report": rep,
            "wall": wall,
            "raw_s": raw_s,
            "windows": windows,
            "batch": batch,
            "kinds": kinds,
            "busy": busy,
            "cpu": cpu,
        }
    )
    md += f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s."
    _util.publish("ingest", md, machine, write=not args.no_write)


if __name__ == "__main__":
    main()
