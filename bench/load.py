"""Load: clients submitting queries and polling them against `rlm up`, for two minutes.

Reports sustained submissions/s, finished jobs/s, API latency p50/p99 per endpoint, and how many
requests failed (the target is none).  The stack is the real one `rlm up` starts (embedded
PostgreSQL + Valkey under bench/_data/load, control/analyst/ingest workers, the API); the LLM
stages use the offline extractive provider, so the numbers measure the system, not a model.

    .venv/bin/python bench/load.py [--seconds 120] [--clients 8]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    REPO,
    command_line,
    free_port,
    isolated_env,
    loadavg,
    machine_markdown,
    percentile,
    stop_servers,
    update_results,
)

QUESTIONS = [
    "How does a job end when a worker dies?",
    "Where is the visibility timeout configured?",
    "How are API keys stored?",
    "What does the reconciler do with stuck jobs?",
    "How is chunk text kept from acting as instructions?",
    "Which search modes exist and how are they fused?",
    "How are batches scheduled next to interactive queries?",
    "What happens when the database is unavailable?",
]


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.failures: list[str] = []
        self.submitted = 0
        self.finished: list[float] = []

    def add(self, endpoint: str, seconds: float, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.latency[endpoint].append(seconds)
            if not ok:
                self.failures.append(f"{endpoint}: {detail}")


def client(base: str, key: str, stop: threading.Event, rec: Recorder, seed: int) -> None:
    import httpx

    rnd = random.Random(seed)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        while not stop.is_set():
            body = {"query": rnd.choice(QUESTIONS), "buffers": ["self"], "options": {"max_chunks": 10}}
            t0 = time.perf_counter()
            try:
                r = c.post("/v1/queries", json=body)
                ok = r.status_code == 202
                rec.add("POST /v1/queries", time.perf_counter() - t0, ok, f"{r.status_code} {r.text[:200]}")
            except Exception as exc:
                rec.add("POST /v1/queries", time.perf_counter() - t0, False, repr(exc))
                continue
            if not ok:
                continue
            with rec.lock:
                rec.submitted += 1
            job_id, started = r.json()["job_id"], time.perf_counter()
            while not stop.is_set():
                time.sleep(0.5)
                t0 = time.perf_counter()
                try:
                    v = c.get(f"/v1/queries/{job_id}")
                    rec.add(
                        "GET /v1/queries/{id}",
                        time.perf_counter() - t0,
                        v.status_code == 200,
                        f"{v.status_code} {v.text[:200]}",
                    )
                except Exception as exc:
                    rec.add("GET /v1/queries/{id}", time.perf_counter() - t0, False, repr(exc))
                    continue
                status = v.json().get("status")
                if status in ("done", "failed", "cancelled"):
                    if status != "done":
                        rec.add("job", 0.0, False, f"{job_id} ended {status}: {v.json().get('error')}")
                    with rec.lock:
                        rec.finished.append(time.perf_counter() - started)
                    break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()

    data_dir = isolated_env("load")
    for var in ("OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL"):
        os.environ.pop(var, None)  # the offline provider: this measures the system, not a model
    rlm = [sys.executable, "-m", "rlm_api.cli"]
    subprocess.run(
        rlm + ["load", "rlm_workers", "rlm_api", "README.md", "--buffer", "self"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    api_port, flower_port = free_port(), free_port()
    log = open(data_dir / "up.log", "w+")
    up = subprocess.Popen(
        rlm + ["up", "--api-port", str(api_port), "--flower-port", str(flower_port), "--analysts", "16"],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{api_port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit(f"rlm up did not become ready; see {data_dir / 'up.log'}")
            time.sleep(0.5)
        log.flush()
        key = re.search(r"api key\s+(rlm_\S+)", (data_dir / "up.log").read_text()).group(1)
        time.sleep(5)  # let every worker report in
        rec, stop = Recorder(), threading.Event()
        threads = [
            threading.Thread(target=client, args=(base, key, stop, rec, i), daemon=True) for i in range(args.clients)
        ]
        load_before = loadavg()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        wall = time.perf_counter() - t0
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
        stop_servers(data_dir)

    requests = sum(len(v) for k, v in rec.latency.items() if k != "job")
    rows = [
        f"| {ep} | {len(v)} | {percentile(v, 50) * 1000:.1f} | {percentile(v, 99) * 1000:.1f} |"
        for ep, v in sorted(rec.latency.items())
        if ep != "job"
    ]
    body = "\n".join(
        [
            "## Load (`bench/load.py`)",
            "",
            f"- command: `{command_line()}`",
            f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average before: {load_before}, "
            f"after: {loadavg()}",
            f"- stack: `rlm up` (embedded PostgreSQL + Valkey, control worker -c 4, analyst worker -c 16 threads, "
            f"ingest worker, API with 1 uvicorn process); {args.clients} clients each submitting a query to a "
            "buffer of the project's own source, then polling it every 0.5 s until it ends; offline "
            "extractive provider.",
            "",
            "| measure | value |",
            "| --- | ---: |",
            f"| duration | {wall:.0f} s |",
            f"| queries submitted | {rec.submitted} ({rec.submitted / wall:.2f}/s sustained) |",
            f"| queries finished | {len(rec.finished)} ({len(rec.finished) / wall:.2f}/s) |",
            f"| job wall time p50 / p99 | {percentile(rec.finished, 50):.2f} s / "
            f"{percentile(rec.finished, 99):.2f} s |",
            f"| API requests | {requests} |",
            f"| failed requests or jobs | **{len(rec.failures)}** |",
            "",
            "| endpoint | requests | p50 ms | p99 ms |",
            "| --- | ---: | ---: | ---: |",
            *rows,
        ]
    )
    if rec.failures:
        body += "\n\nFailures (first 5):\n\n" + "\n".join(f"- `{f}`" for f in rec.failures[:5])
    print(body)
    if not args.no_write:
        update_results("load", body)
        update_results("machine", "## Machine\n\n" + machine_markdown())


if __name__ == "__main__":
    main()
