"""Ingest cost against corpus size (issue #43, part 4): `rlm load` MB/s and peak RSS at growing sizes of real text.

    .venv/bin/python bench/ingest_curve.py [--sizes 1,10,30] [--no-write] [--wait-quiet S]

Each size (MB of text, 1 MB = 10^6 bytes; fractions accepted) is a corpus of the installed packages' .py, .md,
.rst and .txt files, copied from site-packages in one fixed sorted order until the size is reached (the last file
cut at a whole line): each corpus is the first N MB of the same sequence.  Corpora are kept under
``bench/_data/ingest-curve/corpora``, so a rerun does not copy them again.  site-packages holds only a few
hundred MB of such text (277 MB here); a larger size starts the sequence again (files under ``p2/``, ``p3/`` …):
the loader keeps no content cache across paths, so every byte is still chunked, encoded and stored, though the
vectors then repeat.

For each size, into a fresh embedded PostgreSQL (its data dir removed and created again, so sizes share nothing):
``rlm load DIR --buffer ingest-<N>mb --format json`` as a fresh process (the default encoder runtime, as
bench/ingest.py runs it), timed as a whole process; peak RSS of that process (its own high-water mark, see
``measure_load``), the embedded PostgreSQL's summed RSS during and at the end of the load, and the report's
chunks, windows and ``seconds``.  A least-squares line through seconds and peak RSS against MB predicts 100 MB,
1 GB and 100M chunks.  The table goes into RESULTS.md#ingest-curve, the pictures into
``bench/curves/ingest_mbps.png`` and ``bench/curves/ingest_rss.png``.

``--sizes 100`` and ``--sizes 1000`` (1 GB) are accepted, but on 2 cores `rlm load` does about 67 KB/s: 100 MB
takes ≈ 25 min and 1 GB ≈ 4 h, so the default stops at 30 MB and the prediction line says what the larger sizes
would cost.  Mind the disk too: a first check stored on the order of 0.1 GB of PostgreSQL data per MB of text
(vectors and their HNSW graph), so 1 GB would want ~100 GB free; the table's disk column says what a run stored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from ingest import EXPORT_SCRIPT, fresh_database, last_json, rlm_cmd, timed_child  # noqa: E402

SECTION = "ingest-curve"
CHART_MBPS = harness.BENCH_DIR / "curves" / "ingest_mbps.png"
CHART_RSS = harness.BENCH_DIR / "curves" / "ingest_rss.png"
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")  # packaging metadata, not the packages' text
FILES_PER_DIR = 1000
POLL_S = 0.2
PREDICT_MB = (100.0, 1000.0)
PREDICT_CHUNKS = 100_000_000
MB = 1_000_000  # decimal, as bench/ingest.py: 1 MB = 10^6 bytes
WATCHER_MODULE = "rlm_workers.runtime.embedded_watch"
#: how a cached corpus was made: a cache made by another rule is copied again
CORPUS_RULE = "site-packages text, sorted, last file cut at a line: 1"


def source_files() -> Iterator[Path]:
    """site-packages' text files in one fixed order: directories and names sorted, caches and metadata left out."""
    for dirpath, dirnames, filenames in os.walk(harness.SITE_PACKAGES):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.endswith(SKIP_DIR_SUFFIXES))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(TEXT_SUFFIXES) and not path.is_symlink():
                yield path


def flat_name(path: Path) -> str:
    """One file name for a site-packages path (``pkg__sub__mod.py``): no folder of the copy is one the loader
    skips (``build``, ``dist`` …), and the suffix the chunker reads is kept."""
    name = str(path.relative_to(harness.SITE_PACKAGES)).replace(os.sep, "__")
    if len(name.encode()) > 200:  # the loader refuses names over 255 bytes
        name = hashlib.sha1(name.encode()).hexdigest()[:12] + "__" + name[-120:]
    return name


def build_corpus(out: Path, budget: int) -> dict:
    """The first ``budget`` bytes of the sequence of text files copied into ``out``, the file that would pass it cut
    at its last whole line within the budget: {files, bytes, passes}.  Only files the loader reads as text
    (``decode_text``), so every byte copied is a byte loaded."""
    from rlm_workers.ingest.files import decode_text

    files = total = passes = 0
    while total < budget:
        passes += 1
        found = 0
        for src in source_files():
            data = src.read_bytes()
            if decode_text(data)[1] is not None:  # empty, binary or not UTF-8: the loader would skip it
                continue
            found += 1
            if total + len(data) > budget:
                data = data[: data.rfind(b"\n", 0, budget - total) + 1]  # whole lines only (none: nothing)
                if decode_text(data)[1] is not None:  # nothing left, or only blank lines
                    total = budget  # the sequence stops here, short of the budget by less than a line
                    break
            dest = out / f"p{passes}" / f"{files // FILES_PER_DIR:04d}" / flat_name(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            files, total = files + 1, total + len(data)
            if total >= budget:
                break
        if not found:
            raise SystemExit(f"no .py/.md/.rst/.txt text under {harness.SITE_PACKAGES}")
    copied = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"files": files, "bytes": copied, "passes": passes}


def cached_corpus(root: Path, label: str, budget: int) -> tuple[Path, dict]:
    """The corpus for ``label``, copied on the first run and kept (its manifest, written last, lies beside it so
    the load never reads it; a copy without one was interrupted and is made again)."""
    out, manifest = root / label, root / f"{label}.json"
    if out.is_dir() and manifest.is_file():
        got = json.loads(manifest.read_text())
        if got.get("budget") == budget and got.get("rule") == CORPUS_RULE:
            return out, got
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"copying a {budget / MB:g} MB corpus into {out}", flush=True)
    got = {**build_corpus(out, budget), "budget": budget, "rule": CORPUS_RULE}
    manifest.write_text(json.dumps(got))
    return out, got


def postgres_procs(data_dir: Path) -> list:
    """The embedded PostgreSQL's processes: its postmaster (postmaster.pid) and every process under it.  Only the
    postmaster's command line names the data dir; the backends' read ``postgres: user db …``."""
    import psutil

    from rlm_workers.runtime.local_servers import postgres_status

    status = postgres_status(data_dir)
    if not status:
        return []
    try:
        top = psutil.Process(status["pid"])
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def summed_mb(procs: list, field: str = "rss") -> float:
    """Summed ``rss`` (or ``pss``: shared pages split among the processes sharing them) of ``procs``, in MB."""
    import psutil

    total = 0
    for p in procs:
        try:
            mem = p.memory_full_info() if field == "pss" else p.memory_info()
        except psutil.Error:  # gone meanwhile
            continue
        total += getattr(mem, field)
    return total / MB


def own_tree(pid: int) -> list:
    """The `rlm load` process and the processes it started, less the embedded servers and their watchers (which a
    load starts only if the server is down; they outlive it and are not its cost)."""
    import psutil

    from rlm_workers.runtime.local_servers import is_postgres, is_valkey

    try:
        top = psutil.Process(pid)
        kids = top.children(recursive=True)
    except psutil.Error:
        return []
    out = [top]
    for k in kids:
        try:
            if is_postgres(k.pid) or is_valkey(k.pid) or WATCHER_MODULE in " ".join(k.cmdline()):
                continue
        except psutil.Error:
            continue
        out.append(k)
    return out


def vm_hwm_mb(pid: int) -> float:
    """VmHWM of ``pid`` in MB: the kernel's high-water mark of its resident memory since its exec (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MB  # kB (KiB) -> MB
    except OSError:
        pass
    return 0.0


def measure_load(corpus: Path, buffer: str, data_dir: Path, logs: Path) -> dict:
    """`rlm load` of ``corpus`` as a fresh process: wall s, its CPU s, peak RSS, PostgreSQL's RSS, its report.

    Peak RSS of `rlm load`: not ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` deltas, which are wrong twice over: that
    figure is the *largest* of all this bench's reaped children (the ONNX export, earlier and larger loads), not
    a sum, so a delta says nothing about a smaller child; and Linux carries ru_maxrss across exec, so every child
    starts at this bench's own RSS at the spawn.  Instead, a thread reads the process's VmHWM every 0.2 s (the
    kernel's own high-water mark of that process since exec: exact, not a sample, up to the last read) and sums
    the sampled RSS of it and any children it starts (none on a plain load); the process is reaped with
    ``os.wait4`` on its pid alone, whose ru_maxrss (the process's whole life, to its last page) is taken too when it
    is above this bench's own peak, the only case in which it cannot be the inherited floor.
    """
    env = harness.child_env()  # the default encoder runtime: RLM_EMBEDDING_RUNTIME is unset in main
    own_floor = harness.own_memory_mb("VmHWM")["VmHWM"] * 2**20 / MB  # MiB -> MB
    out_path, err_path = logs / f"{buffer}.out", logs / f"{buffer}.err"
    peaks = {"hwm": 0.0, "tree": 0.0, "pg": 0.0, "kids": 0}
    done = threading.Event()

    def sample(pid: int) -> None:
        while True:
            hwm = vm_hwm_mb(pid)
            if done.is_set():  # the pid is reaped: what was read after it may belong to someone else
                return
            tree = own_tree(pid)
            peaks["hwm"] = max(peaks["hwm"], hwm)
            peaks["tree"] = max(peaks["tree"], summed_mb(tree))
            peaks["kids"] = max(peaks["kids"], len(tree) - 1)
            peaks["pg"] = max(peaks["pg"], summed_mb(postgres_procs(data_dir)))
            if done.wait(POLL_S):
                return

    pg_cpu0, others, cpu0 = harness.postgres_cpu(data_dir), harness.OtherCpu(), time.process_time()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            rlm_cmd("load", str(corpus), "--buffer", buffer, "--format", "json"), stdout=out, stderr=err, env=env
        )
        sampler = threading.Thread(target=sample, args=(proc.pid,), daemon=True)
        sampler.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)  # this child alone: the wall clock ends when it does
        except BaseException:  # Ctrl-C: leave no load running into the server stop_servers is about to stop
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - t0
        done.set()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait for it again
    sampler.join()
    cpu = ru.ru_utime + ru.ru_stime
    pg_cpu = harness.postgres_cpu(data_dir) - pg_cpu0
    own_share = others.share(cpu + pg_cpu + time.process_time() - cpu0)
    if proc.returncode != 0:
        raise SystemExit(f"rlm load {buffer} failed ({proc.returncode}): {err_path.read_text().strip()[-2000:]}")
    ru_mb = ru.ru_maxrss * 1024 / MB  # kB (KiB) -> MB
    peak = max(peaks["hwm"], peaks["tree"], ru_mb if ru_mb > own_floor else 0.0)
    pg = postgres_procs(data_dir)
    return {
        "report": last_json(out_path.read_text()),
        "wall": wall,
        "cpu": cpu,
        "pg_cpu": pg_cpu,
        "others": own_share,
        "peak_rss": peak,
        "hwm_polled": peaks["hwm"],
        "ru_maxrss": ru_mb,
        "children": peaks["kids"],
        "pg_rss_peak": max(peaks["pg"], summed_mb(pg)),
        "pg_rss_end": summed_mb(pg),
        "pg_pss_end": summed_mb(pg, "pss"),
        "pg_procs": len(pg),
        "pg_disk": sum(f.stat().st_size for f in (data_dir / "pg").rglob("*") if f.is_file()) / MB,
    }


def parse_sizes(ap: argparse.ArgumentParser, text: str) -> list[float]:
    try:
        sizes = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--sizes {text!r}: comma-separated numbers of MB, e.g. 1,10,30 or 0.2,0.4")
    if not sizes:
        ap.error("--sizes: at least one size")
    bad = [s for s in sizes if not math.isfinite(s) or s <= 0]
    if bad:
        ap.error(f"--sizes: every size must be a positive number of MB (got {bad[0]:g})")
    return sizes


def label(mb: float) -> str:
    return f"{mb:g}mb"


def bends(rows: list[dict]) -> list[str]:
    """Where the curve bends: whole-process MB/s by size, and what each added MB cost between neighbouring sizes."""
    if len(rows) < 2:
        return ["- One size: no curve, so no bend to see."]
    speeds = [r["mb"] / r["wall"] for r in rows]
    steps = []
    for a, b in zip(rows, rows[1:], strict=False):
        ds = b["wall"] - a["wall"]
        rate = (b["mb"] - a["mb"]) / ds if ds > 0 else float("inf")
        rss = (b["peak_rss"] - a["peak_rss"]) / (b["mb"] - a["mb"])
        steps.append((a["mb"], b["mb"], rate, rss))
    out = [
        "- whole-process MB/s by size: "
        + " → ".join(f"{s:.3f} at {r['mb']:.2f} MB" for s, r in zip(speeds, rows, strict=True))
        + "; what the added MB cost between neighbouring sizes (ΔMB / Δs, free of the start-up): "
        + "; ".join(f"{a:.2f} → {b:.2f} MB: {rate:.3f} MB/s" for a, b, rate, _ in steps)
        + "; peak RSS added per MB: "
        + "; ".join(f"{a:.2f} → {b:.2f} MB: {rss:+.0f} MB/MB" for a, b, _, rss in steps)
        + "."
    ]
    if len(steps) == 1:
        out.append(
            "- Two sizes give one step: a bend cannot be seen. What whole-process MB/s gains between them is the "
            "fixed start-up (the fit's intercept) spread over more text, and noise."
        )
        return out
    first, last = steps[0][2], steps[-1][2]
    if last < 0.85 * first:
        out.append(
            f"- **The curve bends down**: each added MB costs more at the larger sizes (the last step's rate is "
            f"{last / first:.0%} of the first's), so the straight-line prediction below is a lower bound."
        )
    elif last > 1.15 * first:
        out.append(
            f"- The added MB gets cheaper with size (last step {last / first:.0%} of the first's rate): whatever the "
            "small corpora paid beyond start-up (a cold cache, the first files' mix) is spread out; no upward bend."
        )
    else:
        out.append(
            f"- No bend over this range: the added MB costs the same within ±15% at every step (last step "
            f"{last / first:.0%} of the first's rate); whole-process MB/s rises with size only because the "
            "start-up is spread over more text."
        )
    return out


def report(rows: list[dict], export: dict, pool_mb: float, t0: float) -> str:
    md = [
        "## Ingest cost against size (`bench/ingest_curve.py`, issue #43)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}; "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"- machine: {harness.machine_line()}",
        "- corpus: the installed packages' .py/.md/.rst/.txt files from site-packages, one fixed sorted order, "
        "copied until the size is reached, the last file cut at a whole line (each size is the first N MB of the "
        "same sequence; "
        f"1 MB = 10^6 bytes). site-packages holds {pool_mb:.0f} MB of such text; a larger size repeats the "
        "sequence (every byte still chunked, encoded and stored).",
        "- each size: `rlm load DIR --buffer ingest-<N>mb --format json` as a fresh process (default encoder "
        "runtime, ONNX files exported once beforehand and shared: "
        f"{export['wall']:.1f} s, not in the rows) into a fresh embedded PostgreSQL (its data dir made anew, schema "
        "created before the clock starts). *whole process* is its wall clock (start-up, model load, chunking, "
        "encoding, COPY, HNSW build, commit); *report s* is the report's `seconds` (load_paths alone).",
        f"- peak RSS of `rlm load`: the process's VmHWM (the kernel's high-water mark since exec) read every "
        f"{POLL_S:g} s, with `os.wait4`'s ru_maxrss for that pid when above the bench's own size (getrusage's "
        "RUSAGE_CHILDREN is the largest of all children and starts at the parent's size, so it is not used). "
        "PostgreSQL: summed RSS of the postmaster and every process under it, the largest sample during the load "
        "and after it; RSS counts shared buffers once per process that touched them, PSS splits them.",
        "- 100 MB and 1 GB are accepted sizes (`--sizes 100,1000`), but at the ~67 KB/s `rlm load` does on 2 cores "
        "they take ≈ 25 min and ≈ 4 h, so the default stops at 30 MB and the fit below, from this run's own "
        "numbers, stands in for them.",
        "",
        "| MB | files | chunks | windows | whole-process s | MB/s | report s | peak RSS `rlm load` MB | "
        "PostgreSQL RSS MB (peak / end) | PostgreSQL PSS MB (end) | PostgreSQL disk MB | CPU s (load + PG) | "
        "others' CPU (before / during) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        rep = r["report"]
        md.append(
            f"| {r['mb']:.2f} | {r['files']:,} | {rep['chunks_written']:,} | {rep['windows_embedded']:,} | "
            f"{r['wall']:.1f} | {r['mb'] / r['wall']:.3f} | {rep.get('seconds', float('nan')):.1f} | "
            f"{r['peak_rss']:.0f} | {r['pg_rss_peak']:.0f} / {r['pg_rss_end']:.0f} | {r['pg_pss_end']:.0f} | "
            f"{r['pg_disk']:.0f} | {r['cpu']:.1f} + {r['pg_cpu']:.1f} | {r['busy']:.0%} / {r['others']:.0%} |"
        )
    md.append("")
    if len(rows) >= 2:
        a_s, b_s = harness.fit_line([(r["mb"], r["wall"]) for r in rows])
        a_m, b_m = harness.fit_line([(r["mb"], r["peak_rss"]) for r in rows])
        a_d, b_d = harness.fit_line([(r["mb"], r["pg_disk"]) for r in rows])
        big = rows[-1]
        per_mb = big["report"]["chunks_written"] / big["mb"]
        chunk_mb = PREDICT_CHUNKS / per_mb if per_mb else float("nan")

        def cost(mb: float) -> str:
            secs = a_s + b_s * mb
            return (
                f"{secs:,.0f} s ({secs / 3600:,.1f} h), peak RSS {a_m + b_m * mb:,.0f} MB, "
                f"PostgreSQL data {(a_d + b_d * mb) / 1000:,.1f} GB"
            )

        md += [
            f"- least squares over {len(rows)} sizes: whole process = {a_s:.1f} s + {b_s:.1f} s/MB "
            f"({1 / b_s if b_s > 0 else float('inf'):.3f} MB/s once started); peak RSS of `rlm load` = {a_m:.0f} MB "
            f"+ {b_m:.1f} MB per MB of text; PostgreSQL's data dir = {a_d:.0f} MB + {b_d:.1f} MB per MB.",
            "- **prediction**, if nothing bends: "
            + "; ".join(f"{mb:,.0f} MB: {cost(mb)}" for mb in PREDICT_MB)
            + f"; {PREDICT_CHUNKS:,} chunks (at the {per_mb:,.0f} chunks/MB of the {big['mb']:.2f} MB corpus: "
            f"{chunk_mb:,.0f} MB): {cost(chunk_mb)}.",
        ]
    md += bends(rows)
    if any(r["children"] for r in rows):
        md.append("- `rlm load` started child processes; their sampled RSS is summed into its peak.")
    pics = ", ".join(f"[`bench/curves/{c.name}`](curves/{c.name})" for c in (CHART_MBPS, CHART_RSS))
    md += [f"- pictures: {pics}", "", f"Whole bench run: {time.time() - t0:.0f} s."]
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,10,30", help="MB of text, comma-separated (100 and 1000 accepted: slow)")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md and the PNGs alone")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=60,
        metavar="SECONDS",
        help="wait up to this long for other processes to leave the CPU idle before each load",
    )
    args = ap.parse_args()
    sizes = parse_sizes(ap, args.sizes)

    data_dir = harness.isolated_env(SECTION)
    for var in ("RLM_EMBEDDING_RUNTIME", "RLM_ENCODE_THREADS", "RLM_ENCODER_DIR", "RLM_EMBED_BATCH_SIZE"):
        os.environ.pop(var, None)  # the shipped defaults, as a user's `rlm load` gets them
    machine = harness.machine_markdown()
    t0 = time.time()
    corpora, logs = data_dir / "corpora", harness.log_dir(data_dir)
    pool_mb = sum(p.stat().st_size for p in source_files()) / MB
    rows: list[dict] = []
    try:
        # the ONNX files once, before any clock: the first load must not pay for torch and the export
        _, wall, _, _ = timed_child([sys.executable, "-c", EXPORT_SCRIPT], harness.child_env())
        export = {"wall": wall}
        for mb in sizes:
            corpus, info = cached_corpus(corpora, label(mb), int(mb * MB))
            fresh_database(data_dir)
            busy = harness.wait_for_quiet(args.wait_quiet)
            r = measure_load(corpus, f"ingest-{label(mb)}", data_dir, logs)
            if r["report"]["bytes_loaded"] != info["bytes"]:
                raise SystemExit(f"the {label(mb)} load read {r['report']['bytes_loaded']} bytes of {info['bytes']}")
            rows.append({**r, "mb": info["bytes"] / MB, "files": info["files"], "busy": busy})
            print(
                f"{info['bytes'] / MB:.2f} MB ({info['files']} files): {r['wall']:.1f} s, peak RSS "
                f"{r['peak_rss']:.0f} MB (VmHWM {r['hwm_polled']:.0f}, wait4 {r['ru_maxrss']:.0f}), PostgreSQL "
                f"{r['pg_rss_end']:.0f} MB; others {r['others']:.0%}",
                flush=True,
            )
    finally:
        harness.stop_servers(data_dir)
    md = report(rows, export, pool_mb, t0)
    if not args.no_write:
        harness.line_chart(
            CHART_MBPS,
            "rlm load: MB/s against corpus size (real text from site-packages, default runtime)",
            "MB of text (log scale)",
            "MB/s",
            {
                "whole process": [(r["mb"], r["mb"] / r["wall"]) for r in rows],
                "report seconds (load_paths alone)": [(r["mb"], r["mb"] / r["report"]["seconds"]) for r in rows],
            },
            log_x=True,
        )
        harness.line_chart(
            CHART_RSS,
            "rlm load: peak RSS against corpus size",
            "MB of text (log scale)",
            "MB",
            {
                "peak RSS of the rlm load process": [(r["mb"], r["peak_rss"]) for r in rows],
                "embedded PostgreSQL, summed RSS (peak during the load)": [(r["mb"], r["pg_rss_peak"]) for r in rows],
            },
            log_x=True,
        )
        print(f"wrote {CHART_MBPS} and {CHART_RSS}")
    harness.publish(SECTION, md, machine, write=not args.no_write)


if __name__ == "__main__":
    main()
