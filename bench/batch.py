"""Batch throughput under a provider's requests-per-minute limit.

    .venv/bin/python bench/batch.py [--items 200] [--rpm 120] [--headroom 0.05] [--latency-ms 200] [--parallel 4]
                                    [--no-write]

A scripted OpenAI-protocol server (tests/support/scripted_llm.py, in this process) enforces an RPM limit the
way a provider does: a request arriving when ``--rpm`` requests were already accepted in the last 60 s gets a
429 with ``Retry-After``; others are answered after ``--latency-ms``.  The workers share ``RLM_RPM`` =
``--rpm`` × (1 - ``--headroom``) through the Redis ``RateBudget``, so every HTTP attempt waits for room in the
window before it leaves.  The headroom absorbs requests that reach the provider in a different order (or a few
ms later) than the limiter charged them: at the window's edge such a request is one too many for the provider.

One batch of ``--items`` (query, buffer) items (queries × 4 buffers, ``skip_plan``, one chunk per query: an
analyst call and a synthesizer call per item) runs on real worker processes: ``ctl`` (rlm.control, which also
runs the batch ticks) and two analyst workers ``an1``/``an2`` (rlm.analyst), the embedded Valkey and
PostgreSQL+pgvector, all under bench/_data/batch.

Reported:

* **share of the RPM budget** (the provider's ``--rpm``): for every full 60 s window from the first request
  until the batch ran out of
  items to schedule (after that the tail cannot use the budget), accepted requests in the window / RPM;
  mean and minimum over windows slid by 1 s.  Target >= 90 %.
* **429 rate**: 429 answers / all requests the server saw.  Target < 1 %.
* wall time, items per minute, item latency (submitted → finished).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

WINDOW = 60.0
BUFFERS = ("batch-a", "batch-b", "batch-c", "batch-d")
TOPICS = (
    "tidal power",
    "sourdough",
    "bookbinding",
    "glaciers",
    "bee colonies",
    "railway signals",
    "coral reefs",
    "chess openings",
    "violin varnish",
    "irrigation",
    "lighthouses",
    "marbling",
)
_CHUNK_ID = re.compile(r"### Chunk (\d+)\n")
SHARE_TARGET, RATE_429_TARGET = 0.90, 0.01


class RpmModel:
    """A provider with a sliding-window RPM limit over accepted requests, answering by model name."""

    def __init__(self, rpm: int, latency: float) -> None:
        self.rpm, self.latency = rpm, latency
        self.lock = threading.Lock()
        self.window: deque[float] = deque()
        self.accepted: list[float] = []
        self.rejected: list[float] = []

    def __call__(self, req: dict) -> Any:
        from tests.support.scripted_llm import Reply, last_user_message

        now = time.time()
        with self.lock:
            while self.window and self.window[0] <= now - WINDOW:
                self.window.popleft()
            if len(self.window) >= self.rpm:
                wait = self.window[0] + WINDOW - now
                self.rejected.append(now)
                return Reply.http_error(
                    429,
                    f"Rate limit reached: {self.rpm} requests per min",
                    type="requests",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": f"{max(wait, 0.05):.2f}"},
                )
            self.window.append(now)
            self.accepted.append(now)
        if req.get("model") == "analyst-model":
            ids = _CHUNK_ID.findall(last_user_message(req))
            content = json.dumps(
                [
                    {
                        "chunk_id": int(cid),
                        "relevance": "medium",
                        "findings": [f"Chunk {cid} notes."],
                        "summary": "notes",
                        "follow_up": [],
                    }
                    for cid in ids
                ]
            )
        elif req.get("model") == "plan-model":
            content = json.dumps({"search_mode": "hybrid", "threshold": -1.0})
        else:
            content = "## Answer\n\nA scripted answer [chunk 1]."
        return Reply.text(content, delay=self.latency)


def build_corpus(root: Path) -> dict[str, Path]:
    out = {}
    for b, name in enumerate(BUFFERS):
        d = root / "corpus" / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(3):
            topic = TOPICS[(b * 3 + i) % len(TOPICS)]
            (d / f"{i}.md").write_text(
                f"# Notes on {topic}\n\nPeople who study {topic} keep careful records. "
                f"The history of {topic} is long and practitioners disagree about methods.\n"
            )
        out[name] = d
    return out


def window_shares(accepted: list[float], start: float, end: float, rpm: int) -> list[float]:
    """accepted-in-window / rpm for every full 60 s window [t, t + 60) with start <= t and t + 60 <= end."""
    xs = sorted(accepted)
    out, t = [], start
    import bisect

    while t + WINDOW <= end + 1e-9:
        n = bisect.bisect_left(xs, t + WINDOW) - bisect.bisect_left(xs, t)
        out.append(n / rpm)
        t += 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200, help="(query, buffer) items; rounded up to a multiple of 4")
    ap.add_argument("--rpm", type=int, default=120, help="the provider's limit and RLM_RPM (default 120)")
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        help="RLM_RPM = floor(rpm × (1 - headroom)): room for requests that reach the provider in a "
        "different order than the limiter charged them (default 0.05; 0 = RLM_RPM equal to the limit)",
    )
    ap.add_argument("--latency-ms", type=float, default=200.0, help="latency of every accepted call")
    ap.add_argument("--parallel", type=int, default=None, help="RLM_BATCH_PARALLEL (default: the setting's, 4)")
    ap.add_argument("--tick", type=float, default=None, help="RLM_BATCH_TICK_SECONDS (default: the setting's, 2)")
    ap.add_argument("--analyst-concurrency", type=int, default=8, help="threads per analyst worker")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL and Valkey running")
    ap.add_argument(
        "--case", choices=("rpm", "shared"), default="rpm", help="rpm: throughput under RPM; shared: shared reads"
    )
    ap.add_argument("--questions", type=int, default=10, help="shared: questions over the one buffer")
    ap.add_argument("--chunks", type=int, default=500, help="shared: chunks in the buffer")
    ap.add_argument("--batch-size", type=int, default=10, help="shared: chunks per analyst batch")
    args = ap.parse_args()
    if args.case == "shared":
        import _shared_case

        _shared_case.run(args)
        return
    n_queries = -(-args.items // len(BUFFERS))
    if n_queries < 1 or args.rpm < 1:
        ap.error("--items and --rpm must be >= 1")
    if not 0 <= args.headroom < 1:
        ap.error("--headroom is a fraction in [0, 1)")
    budget = max(1, int(args.rpm * (1 - args.headroom)))

    extra = {"RLM_RPM": str(budget)}
    if args.parallel:
        extra["RLM_BATCH_PARALLEL"] = str(args.parallel)
    if args.tick:
        extra["RLM_BATCH_TICK_SECONDS"] = str(args.tick)
    model = RpmModel(args.rpm, args.latency_ms / 1000)
    run = harness.ScriptedRun("batch", model, extra, ("RLM_API_KEY", "RLM_BASE_URL", "RLM_TPM"))
    srv, conn, settings = run.srv, run.conn, run.settings
    workers: list = []
    md = ""
    try:
        import redis

        from rlm_workers.overnight.submit import submit_overnight
        from rlm_workers.runtime.local_servers import broker_url
        from rlm_workers.store import overnight as store

        for name, d in build_corpus(run.data_dir).items():
            run.load(name, d)  # unchanged files are skipped on later runs
        run.ready()
        conn.execute("DELETE FROM result_cache")  # the bench's own database: every item must really run
        redis.Redis.from_url(broker_url(settings)).flushdb()
        workers = [run.worker("ctl", "rlm.control", 4)]
        workers += [run.worker(f"an{i}", "rlm.analyst", args.analyst_concurrency) for i in (1, 2)]
        for w in workers:
            w.start()

        nonce = time.strftime("%H%M%S")
        queries = [f"Run {nonce}: what do the notes say about question {i}?" for i in range(n_queries)]
        srv.reset()
        t0 = time.time()
        batch_id, _ = submit_overnight(
            conn,
            tenant="local",
            queries=queries,
            buffers=list(BUFFERS),
            options={"skip_plan": True, "threshold": -1.0, "max_chunks": 1},
        )
        n_items = n_queries * len(BUFFERS)
        print(f"batch {batch_id}: {n_items} items, rpm {args.rpm}", flush=True)
        last_print = 0.0
        while True:
            b = store.get_overnight(conn, overnight_batch_id=batch_id)
            p = store.progress(conn, overnight_batch_id=batch_id)
            if time.time() - last_print > 10:
                print(
                    f"  {time.time() - t0:6.0f}s {p.counts} accepted={len(model.accepted)} 429={len(model.rejected)}",
                    flush=True,
                )
                last_print = time.time()
            if b.status == "done":
                break
            if time.time() - t0 > 3600:
                raise RuntimeError(f"batch {batch_id} not done after an hour: {p.counts}")
            time.sleep(0.5)
        t_end = time.time()
        p = store.progress(conn, overnight_batch_id=batch_id)
        (last_submit,) = conn.execute(
            "SELECT extract(epoch FROM max(submitted_at)) FROM overnight_batch_items WHERE overnight_batch_id = %s",
            (batch_id,),
        ).fetchone()
        lat = [
            float(r[0])
            for r in conn.execute(
                "SELECT extract(epoch FROM finished_at - submitted_at) FROM overnight_batch_items "
                "WHERE overnight_batch_id = %s "
                "AND submitted_at IS NOT NULL",
                (batch_id,),
            )
        ]
        accepted, rejected = list(model.accepted), list(model.rejected)
        first = min(accepted)
        shares = window_shares(accepted, first, float(last_submit), args.rpm)
        total = len(accepted) + len(rejected)
        rate429 = len(rejected) / total if total else 0.0
        elapsed = t_end - t0
        mean_share = sum(shares) / len(shares) if shares else float("nan")
        min_share = min(shares) if shares else float("nan")
        ok = shares and mean_share >= SHARE_TARGET and rate429 < RATE_429_TARGET and p.counts["done"] == n_items
        md = "\n".join(
            [
                f"## Batch throughput under a provider RPM limit (`bench/batch.py`, headroom {args.headroom:.0%})",
                "",
                f"Command: `{harness.command_line()}`",
                "",
                harness.machine_markdown(),
                "",
                f"Setup: one batch of {n_items} items ({n_queries} queries × {len(BUFFERS)} buffers, `skip_plan`, one "
                f"chunk each: 1 analyst + 1 synthesizer call per item); scripted provider limit {args.rpm} RPM "
                f"(sliding 60 s window over accepted requests, 429 + Retry-After beyond it), {args.latency_ms:.0f} ms "
                f"per call; `RLM_RPM={budget}` ({args.headroom:.0%} headroom) shared by the workers through Redis; "
                "workers `ctl` (rlm.control, -c 4) "
                f"+ `an1`, `an2` (rlm.analyst, -c {args.analyst_concurrency}); `RLM_BATCH_PARALLEL="
                f"{settings.batch_parallel}`, `RLM_BATCH_TICK_SECONDS={settings.batch_tick_seconds:g}`.",
                "",
                "| metric | value | target |",
                "| --- | --- | --- |",
                f"| items done / total | {p.counts['done']} / {n_items} (failed {p.counts['failed']}) | all |",
                f"| share of the RPM budget, mean over full 60 s windows (first request → last item scheduled, "
                f"{len(shares)} windows) | {mean_share:.1%} | ≥ {SHARE_TARGET:.0%} |",
                f"| share of the RPM budget, worst window | {min_share:.1%} | |",
                f"| 429 answers / requests | {len(rejected)} / {total} = {rate429:.2%} | < {RATE_429_TARGET:.0%} |",
                f"| wall time (submit → batch done) | {elapsed:.0f} s | |",
                f"| accepted requests per minute, whole run (incl. the tail) | "
                f"{len(accepted) / (max(accepted) - first) * 60:.0f} | {args.rpm} |",
                f"| item latency submitted → finished, p50 / p95 | {harness.percentile(lat, 50):.1f} s / "
                f"{harness.percentile(lat, 95):.1f} s | |",
                "",
                f"Result: {'meets both targets' if ok else 'MISSES a target (see above)'}.",
            ]
        )
        print(md, flush=True)
    finally:
        run.stop(workers, keep_servers=args.keep_servers)
    if md and not args.no_write and harness.RESULTS.exists():
        section = "batch" if args.headroom == 0.05 else f"batch-headroom-{args.headroom:g}"
        harness.update_results(section, md)


if __name__ == "__main__":
    main()
