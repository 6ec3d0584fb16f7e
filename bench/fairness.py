"""Fair share between tenants on real workers: a small query's time while another tenant's large job runs.

    .venv/bin/python bench/fairness.py [--bulk 300] [--reps 3] [--no-write]

Tenant A submits one job of ``--bulk`` analyst batches (a chunk each); once it holds every slot and has the
rest of its batches queued, tenant B submits a 2-chunk query.  B's time from submission to done is compared
with B's time alone (issue #14's goal: within 2×).  Two layouts of the large job's fan-out are run:

- ``tail a step down`` (the shipped one): the first ``RLM_MAX_CONCURRENCY`` analyst tasks at the job's own
  broker priority, the rest one priority step down (docs/contract.md#fair-share);
- ``one priority``: every task at the job's own priority (the control worker that fans out is given a
  ``RLM_MAX_CONCURRENCY`` above the job's batch count; the limit the analyst workers enforce stays 4), so B's
  tasks queue behind A's and only stepping aside helps them through.

Scripted OpenAI-protocol server, 0.2 s per analyst call; ``RLM_MAX_CONCURRENCY=4``; one control worker
(4 threads) and one analyst worker (8 threads).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

ANALYST_SECONDS = 0.2
LIMIT = 4


class Model:
    def __call__(self, req: dict):
        from tests.support.scripted_llm import Reply, last_user_message

        if req.get("model") == "analyst-model":
            ids = re.findall(r"### Chunk (\d+)\n", last_user_message(req))
            out = [
                {"chunk_id": int(c), "relevance": "medium", "findings": ["notes"], "summary": "s", "follow_up": []}
                for c in ids
            ]
            return Reply.text(json.dumps(out), delay=ANALYST_SECONDS)
        return "## Answer\n\nA scripted answer."


def _corpus(root, name: str, n: int):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"{i:04d}.md").write_text(
            f"# Notes on {name} topic {i}\n\nPeople who study {name} topic {i} keep careful records and "
            "often disagree about methods.\n"
        )
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk", type=int, default=300, help="tenant A's analyst batches")
    ap.add_argument("--reps", type=int, default=3, help="runs of each measurement (the median is reported)")
    ap.add_argument("--no-write", action="store_true", help="print, do not rewrite bench/RESULTS.md")
    args = ap.parse_args()

    run = harness.ScriptedRun(
        "fairness",
        Model(),
        {
            "RLM_MAX_CONCURRENCY": str(LIMIT),
            "RLM_MAX_CHUNKS_PER_JOB": str(max(args.bulk, 1000)),
            "RLM_MAX_BATCHES_PER_JOB": str(max(args.bulk, 200)),
            "RLM_JOB_TIMEOUT": "600",
        },
        ("RLM_API_KEY", "RLM_RPM", "RLM_TPM", "RLM_TENANT_WEIGHTS"),
    )
    from rlm_workers.runtime.local_servers import broker_url
    from rlm_workers.submit import cancel_query, submit_query, wait_for_job

    srv, conn = run.srv, run.conn
    run.load("bulk", _corpus(run.data_dir, "bulk", args.bulk), tenant="ten-a")
    run.load("small", _corpus(run.data_dir, "small", 2), tenant="ten-b")
    run.ready()
    import redis

    r = redis.Redis.from_url(broker_url(run.settings))

    def submit(tenant: str, buffer: str, n: int, query: str) -> str:
        opts = {"skip_plan": True, "threshold": -1.0, "batch_size": 1, "top_k": n, "max_chunks": n}
        job_id, _ = submit_query(conn, tenant=tenant, query=query, buffers=[buffer], options=opts)
        return job_id

    def small_once(tag: str) -> float:
        t0 = time.monotonic()
        job = wait_for_job(conn, submit("ten-b", "small", 2, f"{tag}: what do the small notes say?"), timeout=600)
        if job.status != "done":
            raise RuntimeError(f"the small query ended {job.status}: {job.error}")
        return time.monotonic() - t0

    def analyst_requests() -> int:
        return sum(1 for q in srv.requests if q.body.get("model") == "analyst-model")

    def drained() -> bool:
        return not any(r.llen(k) for k in r.scan_iter("rlm.analyst*"))

    results: dict[str, dict[str, list[float]]] = {}
    an = run.worker("an", "rlm.analyst", 8).start()
    try:
        for label, head in (("tail a step down", LIMIT), ("one priority", args.bulk + 1000)):
            ctl = run.worker(f"ctl-{head}", "rlm.control", 4, {"RLM_MAX_CONCURRENCY": str(head)}).start()
            try:
                small_once(f"{label} warm-up")
                alone, shared = [], []
                for rep in range(args.reps):
                    harness.wait_for_quiet(60)
                    alone.append(small_once(f"{label} alone {rep}"))
                    srv.reset()
                    bulk = submit("ten-a", "bulk", args.bulk, f"{label} {rep}: what do the bulk notes say?")
                    while analyst_requests() < 2 * LIMIT:  # A holds every slot, the rest of its batches queued
                        time.sleep(0.05)
                    shared.append(small_once(f"{label} beside {rep}"))
                    cancel_query(conn, job_id=bulk, tenant="ten-a")  # its queued tasks end at once, unanswered
                    wait_for_job(conn, bulk, timeout=600)
                    while not drained():
                        time.sleep(0.2)
                    print(f"{label} rep {rep}: alone {alone[-1]:.2f} s, beside A {shared[-1]:.2f} s", flush=True)
                results[label] = {"alone": alone, "shared": shared}
            finally:
                ctl.stop()
    finally:
        run.stop([an])

    rows, ratios = [], {}
    for label, res in results.items():
        a, s = statistics.median(res["alone"]), statistics.median(res["shared"])
        ratios[label] = s / a
        rows.append(
            f"| {label} | {a:.2f} | {s:.2f} | **{s / a:.2f}×** | {', '.join(f'{x:.2f}' for x in res['shared'])} |"
        )
    md = "\n".join(
        [
            '<a id="fair-share"></a>',
            "## Fair share: a small query beside another tenant's large job (`bench/fairness.py`)",
            "",
            f"Command: `{harness.command_line()}` at {harness.revision()}",
            "",
            harness.machine_markdown(),
            "",
            f"Setup: tenant A's job of {args.bulk} analyst batches (a chunk each) holds every slot of "
            f"`RLM_MAX_CONCURRENCY={LIMIT}` with the rest of its batches queued; then tenant B submits a 2-chunk "
            f"query. Scripted OpenAI-protocol server, {ANALYST_SECONDS} s per analyst call; one control worker "
            "(4 threads), one analyst worker (8 threads). B's seconds from submission to done, median of "
            f"{args.reps} runs; A is cancelled after each run.",
            "",
            "| A's fan-out | B alone, s | B beside A, s | ratio | runs beside A, s |",
            "| --- | ---: | ---: | ---: | --- |",
            *rows,
            "",
            f"Goal (issue #14): B ends within 2× its time alone. Shipped layout: "
            f"**{ratios.get('tail a step down', float('nan')):.2f}×**. 'one priority' is every task of A at one "
            "broker priority, so B's analyst tasks queue behind all of A's and reach a thread only as A's tasks "
            "step aside one re-queue at a time.",
        ]
    )
    harness.publish("fair-share", md, harness.machine_markdown(), write=not args.no_write)


if __name__ == "__main__":
    main()
