"""Fan-out wall time against the number of batches (issue #43, part 4): ``--scope all`` over 10 to 1,000 batches
of 50 chunks, against a scripted model of fixed latency, with one and with four analyst processes.

    .venv/bin/python bench/fanout_curve.py [--sizes 10,100,200,1000] [--parts exhaustive,exhaustive-4p]
        [--repeats 3] [--latency-ms 1000] [--no-write] [--replot]

Each size is one run of ``bench/modes.py --parts … --batches N --json …`` (its workers, buffers and scripted
server; RESULTS.md#modes says how a run is timed and what its ideal is), one warm-up and ``--repeats`` measured
runs per series, and after each series the same calls from one asyncio process (the model client's floor).  The
medians go into a table and a picture (``bench/curves/fanout.png``, its figures in ``fanout.json`` beside it:
``--replot`` draws it again from them); a straight line through the overhead
(client − ideal) against the batches says what a count over 100M chunks would cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

CHART = harness.BENCH_DIR / "curves" / "fanout.png"
#: the medians behind the picture, kept beside it so ``--replot`` can draw it again
DATA = CHART.with_suffix(".json")
#: what the prediction is for: chunks of a count, cut into batches of the xlarge tier's 50
PREDICT_CHUNKS = 100_000_000
CHUNKS_PER_BATCH = 50
LABELS = {"exhaustive": "1 analyst process × 100 threads", "exhaustive-4p": "4 analyst processes × 25 threads"}


def draw(rows: list[dict], parts: list[str], latency_ms: float) -> None:
    """The picture of a run's medians: each series' client time, the ideal and the asyncio floor."""
    lines = {LABELS.get(p, p): [(r["batches"], r["client_s"]) for r in rows if r["part"] == p] for p in parts}
    ideal = {r["batches"]: r["ideal_s"] for r in rows}
    lines["ideal (the calls end to end, each L)"] = sorted(ideal.items())
    floors = {r["batches"]: r["floor_s"] for r in rows if r["part"] == parts[0] and r["floor_s"]}
    lines["the same calls from one asyncio process"] = sorted(floors.items())
    harness.line_chart(
        CHART,
        f"--scope all: wall time against batches of 50 chunks (L = {latency_ms:g} ms, 100 calls in flight)",
        "batches (log scale)",
        "seconds",
        lines,
        log_x=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100,200,1000", help="batch counts, multiples of 5 up to 1000")
    ap.add_argument("--parts", default="exhaustive,exhaustive-4p", help="modes.py's --scope all series to run")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per series")
    ap.add_argument("--latency-ms", type=float, default=1000.0, help="the scripted model's fixed latency")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md and the PNG alone")
    ap.add_argument("--replot", action="store_true", help=f"only draw the PNG again from {DATA.name}")
    args = ap.parse_args()
    if args.replot:
        if not DATA.exists():
            ap.error(f"--replot: no {DATA} (a run writes it)")
        draw(json.loads(DATA.read_text()), args.parts.split(","), args.latency_ms)
        print(f"wrote {CHART}")
        return
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError:
        ap.error("--sizes: comma-separated whole numbers")
    if not sizes or any(n <= 0 or n > 1000 or n % 5 for n in sizes):
        ap.error("--sizes: batch counts that are multiples of 5, from 5 to 1000 (modes.py's --batches)")
    machine = harness.machine_markdown()
    t0 = time.time()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            out = Path(tmp) / f"{n}.json"
            cmd = [
                sys.executable,
                str(harness.BENCH_DIR / "modes.py"),
                "--parts",
                args.parts,
                "--batches",
                str(n),
                "--exhaustive-repeats",
                str(args.repeats),
                "--latency-ms",
                f"{args.latency_ms:g}",
                "--no-write",
                "--json",
                str(out),
            ]
            print(f"== {n} batches: {' '.join(cmd[1:])}", flush=True)
            proc = subprocess.run(cmd, cwd=harness.REPO, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise SystemExit(f"modes.py failed at {n} batches (exit {proc.returncode})")
            got = json.loads(out.read_text())
            for r in got:
                print(
                    f"   {r['part']}: client {r['client_s']:.2f} s, ideal {r['ideal_s']:.2f} s, "
                    f"floor {r['floor_s'] or float('nan'):.2f} s",
                    flush=True,
                )
            rows += got
    parts = [p for p in args.parts.split(",") if p]

    md = [
        "## Fan-out wall time against batches (`bench/fanout_curve.py`, issue #43)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}; "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"- each size is `bench/modes.py --parts {args.parts} --batches N --exhaustive-repeats {args.repeats}`: "
        f"`--scope all` over N batches of 50 chunks of synthetic logs, scripted model L = {args.latency_ms:g} ms, "
        "at most 100 calls in flight; median of the measured runs after one warm-up. The floor is the last run's "
        "calls sent again from one asyncio process (`openai.AsyncOpenAI`, no queue, database or limiter).",
        f"- picture: [`bench/curves/fanout.png`](curves/{CHART.name})",
        "",
        "| batches | chunks | series | client | ideal | × ideal | client − ideal | floor | CPU s (all processes) |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["batches"], r["part"])):
        fl = f"{r['floor_s']:.2f} s" if r["floor_s"] else "–"
        md.append(
            f"| {r['batches']:,} | {r['batches'] * CHUNKS_PER_BATCH:,} | {LABELS.get(r['part'], r['part'])} | "
            f"{r['client_s']:.2f} s | {r['ideal_s']:.2f} s | {r['client_s'] / r['ideal_s']:.3f} | "
            f"{r['client_s'] - r['ideal_s']:.2f} s | {fl} | {r['cpu_s']:.1f} |"
        )
    md.append("")
    batches_at = PREDICT_CHUNKS // CHUNKS_PER_BATCH
    for p in parts:
        pts = [(r["batches"], r["client_s"] - r["ideal_s"]) for r in rows if r["part"] == p]
        if len(pts) < 2:
            continue
        a, b = harness.fit_line(pts)
        waves = -(-batches_at // 100)
        ideal_at = (2 + waves) * args.latency_ms / 1000
        over = a + b * batches_at
        md.append(
            f"- **{LABELS.get(p, p)}**: the overhead grows by {b * 1000:.1f} ms a batch (least squares over "
            f"{len(pts)} sizes, {a:+.2f} s at none). At {PREDICT_CHUNKS:,} chunks ({batches_at:,} batches, "
            f"{waves:,} waves of 100): ideal {ideal_at:,.0f} s, predicted {ideal_at + over:,.0f} s "
            f"({(ideal_at + over) / ideal_at:.2f} × ideal), if nothing else bends."
        )
    md += ["", f"Whole bench run: {time.time() - t0:.0f} s."]
    if not args.no_write:
        DATA.write_text(json.dumps(rows, indent=1))
        draw(rows, parts, args.latency_ms)
        print(f"wrote {CHART} and {DATA}")
    harness.publish("fanout-curve", "\n".join(md), machine, write=not args.no_write)


if __name__ == "__main__":
    main()
