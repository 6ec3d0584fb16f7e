"""Document conversion throughput: how many MB/s ``read_document`` turns into text, per format.

    .venv/bin/python bench/documents.py [--seconds 1.0] [--rounds 3]
    .venv/bin/python bench/documents.py --load 8     # also: `rlm load` of a folder of 8 copies of the real PDFs

The corpus is the real files of tests/data/documents (tests/data/documents/README.md says where each comes
from); the ones the loader skips (encrypted, scanned) are left out, as they cost next to nothing.  Each file is
converted over and over, in this process and on one thread, until ``--seconds`` have passed; the figure is the
best of ``--rounds`` such runs (the least disturbed by other work on the machine).  MB = 10^6 bytes of the
*input* file, so a format whose files are mostly images or zip overhead reads fast; chars/s says how much text
came out.  The import of each format's library is paid once, before timing.

``--load N`` then times the whole ``rlm load DIR --format json`` (the real CLI, as a subprocess, into a fresh
embedded PostgreSQL under bench/_data/documents) of a folder holding N copies of each real text PDF under
distinct names, beside the conversion alone of the same files in this process: the rest is chunking,
embedding and the database.

Prints markdown tables; nothing is written to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(_util.REPO))

from rlm_workers.ingest.documents import read_document  # noqa: E402

DATA = _util.REPO / "tests" / "data" / "documents"


def corpus() -> list[Path]:
    """The real files that convert (a skipped file costs a header check, not a conversion)."""
    out = []
    for path in sorted(DATA.iterdir()):
        if path.name == "README.md" or not path.is_file():
            continue
        doc, _reason, _ = read_document(path, path.name)
        if doc is not None:
            out.append(path)
    return out


def timed(path: Path, seconds: float) -> tuple[float, int, str, int]:
    """(seconds per conversion, repeats, format, characters out) over about ``seconds`` of converting."""
    n, t0 = 0, time.perf_counter()
    while True:
        doc, _, _ = read_document(path, path.name)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    assert doc is not None
    return elapsed / n, n, doc.format, len(doc.text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="converting time per file and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per file; the best counts")
    parser.add_argument("--load", type=int, default=0, metavar="N", help="also time `rlm load` of N copies of the PDFs")
    args = parser.parse_args()

    files = corpus()  # also imports every format's library, outside the timing
    rows = []
    per_format: dict[str, list[float]] = {}
    for path in files:
        best = min((timed(path, args.seconds) for _ in range(args.rounds)), key=lambda r: r[0])
        per_conv, n, fmt, chars = best
        size = path.stat().st_size
        rows.append((fmt, path.name, size, chars, per_conv, n))
        acc = per_format.setdefault(fmt, [0.0, 0.0, 0.0])
        acc[0] += size
        acc[1] += per_conv
        acc[2] += chars

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "## Document conversion (`bench/documents.py`)",
        "",
        f"- command: `{_util.command_line()}` at {_util.revision()}",
        f"- run finished (`date -u`): {_util.sh('date -u')}",
        f"- machine: {platform.platform()}, {cores} cores usable ({_util.cpu_model()}), "
        f"python {platform.python_version()}; {_util.machine_line()}",
        f"- `read_document` on each real file of tests/data/documents, repeated for ≥ {args.seconds:g} s, best of "
        f"{args.rounds} rounds, one thread; MB = 10^6 bytes of input file",
        "",
        "| format | file | input KB | text chars | ms per file | MB/s | chars/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt, name, size, chars, per_conv, _n in sorted(rows):
        lines.append(
            f"| {fmt} | `{name}` | {size / 1e3:,.0f} | {chars:,} | {per_conv * 1e3:,.1f} | "
            f"{size / 1e6 / per_conv:,.2f} | {chars / per_conv:,.0f} |"
        )
    lines += [
        "",
        "| format | files | MB/s (all its files) | chars/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for fmt, (size, secs, chars) in sorted(per_format.items()):
        count = sum(1 for r in rows if r[0] == fmt)
        lines.append(f"| {fmt} | {count} | {size / 1e6 / secs:,.2f} | {chars / secs:,.0f} |")
    if args.load:
        lines += ["", *load_folder(files, args.load)]
    print("\n".join(lines))


def load_folder(files: list[Path], copies: int) -> list[str]:
    """The whole `rlm load` of a folder of PDFs, and how much of it is conversion."""
    pdfs = [p for p in files if p.suffix == ".pdf"]
    data_dir = _util.isolated_env("documents")
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rlm-bench-pdfs-") as tmp:
        folder = Path(tmp) / "pdfs"
        folder.mkdir()
        for i in range(copies):
            for p in pdfs:
                shutil.copy(p, folder / f"{p.stem}-{i:03d}.pdf")
        size = sum(p.stat().st_size for p in folder.iterdir())
        t0 = time.perf_counter()
        for p in sorted(folder.iterdir()):
            read_document(p, p.name)
        convert_s = time.perf_counter() - t0
        env = {**os.environ, "PYTHONPATH": str(_util.REPO)}
        cmd = [sys.executable, "-m", "rlm_api.cli", "load", str(folder), "-b", "pdfs", "--format", "json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    try:
        _util.stop_servers(data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"rlm load failed: {proc.stderr.strip()[-500:]}")
    report = json.loads(proc.stdout)
    n = copies * len(pdfs)
    return [
        f"### `rlm load` of a folder of {n} PDFs ({size / 1e6:.1f} MB: {copies} copies of "
        f"{', '.join(p.name for p in pdfs)})",
        "",
        "| what | seconds | MB/s of PDF |",
        "| --- | ---: | ---: |",
        f"| conversion alone (`read_document`, one thread, this process) | {convert_s:.1f} | "
        f"{size / 1e6 / convert_s:.2f} |",
        f"| the load as the loader times it (convert, chunk, embed, write) | {report['seconds']:.1f} | "
        f"{size / 1e6 / report['seconds']:.2f} |",
        f"| the whole `rlm load` process (imports, embedded servers, model) | {wall:.1f} | {size / 1e6 / wall:.2f} |",
        "",
        f"{report['files_loaded']} files, {report['chunks_written']:,} chunks, {report['windows_embedded']:,} windows "
        "embedded (runtime: the default).",
    ]


if __name__ == "__main__":
    main()
