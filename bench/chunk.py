"""Chunker throughput: how many MB/s ``chunk_text`` cuts, for each chunker, on source code and on prose.

    .venv/bin/python bench/chunk.py [--repeats 5] [--prose-mb 10] [--wait-quiet 0] [--no-write]

Two corpora, each cut by every chunker of ``rlm_workers.ingest.chunkers`` at the ``rlm load`` defaults
(3000 characters, 500 overlap), in this process, on one thread:

* **source**: the .py files of the installed celery package (the corpus of bench/ingest.py), one
  ``chunk_text`` call per file as the loader makes them, so ``code`` cuts at Python's blocks;
* **prose**: the ~10 MB non-ASCII text of tests/test_chunkers.py (its byte offsets take the slow path), one
  call over the whole file, named ``big.txt``; ``code`` knows no language for it and cuts it as ``semantic``.

Chunking is a small share of ``rlm load`` (encoding the windows dominates, bench/ingest.py), so no target is
set; the test this figure came out of asserted "< 2 s" for the prose text.  Every figure is the median and the
minimum over ``--repeats`` rounds, the chunkers interleaved within a round so drift on a shared machine spreads
over all of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))

from rlm_workers.ingest.chunkers import CHUNKERS, chunk_text  # noqa: E402

PACKAGE = "celery"


def source_corpus() -> list[tuple[str, str]]:
    """(path relative to site-packages, text) of every non-empty .py file of the installed celery."""
    root = harness.SITE_PACKAGES / PACKAGE
    files = sorted(root.rglob("*.py"))
    out = [(str(f.relative_to(harness.SITE_PACKAGES)), f.read_text(encoding="utf-8")) for f in files]
    return [(p, t) for p, t in out if t.strip()]


def prose_corpus(mb: float) -> list[tuple[str, str]]:
    """The test's text, repeated to about ``mb`` million characters."""
    para = "Lorem ipsum dolor sit amet, é consectetur adipiscing elit. " * 20
    block = para + "\n\n"
    return [("big.txt", block * max(1, round(mb * 1e6 / len(block))))]


def run(corpora: dict[str, list[tuple[str, str]]], repeats: int) -> tuple[dict, float]:
    """Seconds per (corpus, chunker) and round, chunk counts, and the CPU share others took meanwhile."""
    times: dict[tuple[str, str], list[float]] = {(c, k): [] for c in corpora for k in CHUNKERS}
    counts: dict[tuple[str, str], int] = {}
    others = harness.OtherCpu()
    cpu0 = time.process_time()
    for _ in range(repeats):
        for corpus, files in corpora.items():
            for chunker in CHUNKERS:
                t0 = time.perf_counter()
                n = sum(len(chunk_text(text, path=path, chunker=chunker)) for path, text in files)
                times[corpus, chunker].append(time.perf_counter() - t0)
                counts[corpus, chunker] = n
    share = others.share(time.process_time() - cpu0)
    return {"times": times, "counts": counts}, share


def report(corpora: dict, result: dict, args: argparse.Namespace, busy: float, during: float) -> str:
    lines = [
        "## Chunker throughput (`bench/chunk.py`)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}",
        f"- run finished (`date -u`): {harness.sh('date -u')}; {harness.machine_line()}; share of the CPU used by "
        f"other processes just before / during the timed rounds: {busy:.0%} / {during:.0%}",
        f"- corpora: **source** = the {len(corpora['source']):,} non-empty .py files of the installed `{PACKAGE}`, "
        "one call per file; **prose** = tests/test_chunkers.py's non-ASCII text as one file `big.txt` "
        "(`code` cuts it as `semantic`: no language for .txt)",
        f"- `chunk_text` at the `rlm load` defaults (3000 chars, 500 overlap), one thread; median (min) of "
        f"{args.repeats} rounds, chunkers interleaved; MB = 10^6 UTF-8 bytes",
        "",
        "| corpus | chunker | MB | chunks | median s | min s | MB/s (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for corpus, files in corpora.items():
        mb = sum(len(text.encode()) for _, text in files) / 1e6
        for chunker in CHUNKERS:
            ts = result["times"][corpus, chunker]
            med = statistics.median(ts)
            lines.append(
                f"| {corpus} | `{chunker}` | {mb:.2f} | {result['counts'][corpus, chunker]:,} | {med:.3f} | "
                f"{min(ts):.3f} | **{mb / med:.1f}** |"
            )
    lines += ["", "No target: chunking is a small share of `rlm load`; its test once asserted < 2 s for the prose."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="rounds over every corpus and chunker")
    ap.add_argument("--prose-mb", type=float, default=10.0, help="size of the prose text, million characters")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="seconds to wait for a quiet CPU first")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    args = ap.parse_args()
    corpora = {"source": source_corpus(), "prose": prose_corpus(args.prose_mb)}
    busy = harness.wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else harness.other_cpu_busy()
    result, during = run(corpora, args.repeats)
    harness.publish("chunk", report(corpora, result, args, busy, during), None, write=not args.no_write)


if __name__ == "__main__":
    main()
