"""Recovery (issue #41): how soon the stack answers again after a restart or a killed worker, default settings.

1. ``rlm services stop`` under a running ``rlm api`` (embedded PostgreSQL and Valkey, its pool warmed by 40
   requests at once), PostgreSQL started again: seconds until the next request's answer, and its status.
2. The same with requests made while PostgreSQL is away (20 s of outage, or ``--outage``): the pool is retrying.
3. An ingest worker (prefork, one child) SIGKILLed with its children mid-load: seconds from the kill until the
   upload is started again (``attempts`` 2) and until it is done, with the default ``RLM_RECONCILE_SECONDS`` and
   ``RLM_WORKER_LOST_SECONDS`` (the visibility timeout, an hour, plays no part).

No LLM is involved.  Runs under bench/_data/recovery, removed first.

    .venv/bin/python bench/recovery.py [--outage 20] [--skip-worker]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import REPO, free_port, isolated_env, stop_servers  # noqa: E402

RLM = [sys.executable, "-m", "rlm_api.cli"]
WORDS = "river ledger harbour copper lantern orchard signal meadow quarry beacon granite willow compass".split()


def rlm(*args: str) -> str:
    return subprocess.run([*RLM, *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def timed_get(client: httpx.Client, path: str) -> tuple[float, int]:
    t0 = time.monotonic()
    r = client.get(path)
    return time.monotonic() - t0, r.status_code


def warm(client: httpx.Client) -> None:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: client.get("/v1/buffers"), range(40)))


def restarts(data_dir: Path, outage: float) -> list[str]:
    from rlm_workers.runtime import local_servers as services

    key = rlm("keys", "create", "--tenant", "bench").strip()
    port = free_port()
    api = subprocess.Popen(
        [*RLM, "api", "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    lines = []
    try:
        headers = {"Authorization": f"Bearer {key}"}
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=90)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        warm(client)
        rlm("services", "stop")
        services.embedded_postgres_url(data_dir)
        seconds, status = timed_get(client, "/v1/buffers")
        lines.append(f"first request after `rlm services stop` and a restart: {status} in {seconds:.2f} s")

        warm(client)
        assert services.stop_embedded_postgres(data_dir)
        t_stop = time.monotonic()
        try:
            client.get("/v1/buffers", timeout=3)  # waits for the database; the server keeps it after we go
        except httpx.TimeoutException:
            pass
        time.sleep(max(0.0, outage - (time.monotonic() - t_stop)))
        services.embedded_postgres_url(data_dir)
        seconds, status = timed_get(client, "/v1/buffers")
        lines.append(f"first request after a {outage:.0f} s outage, asked during it: {status} in {seconds:.2f} s")
        ready_s, ready = timed_get(client, "/readyz")
        lines.append(f"/readyz then: {ready} in {ready_s:.2f} s")
    finally:
        api.terminate()
        api.wait(20)
    return lines


def killed_worker(data_dir: Path) -> list[str]:
    from rlm_workers.celery_app import get_app
    from rlm_workers.config import get_settings
    from rlm_workers.store.db import connect
    from rlm_workers.store.uploads import create_upload, get_upload
    from tests.support.workers import WorkerProcess

    rnd = random.Random(41)
    files = [(f"doc{i:02d}.md", " ".join(rnd.choice(WORDS) for _ in range(6000)).encode()) for i in range(24)]
    conn = connect(get_settings())
    create_upload(conn, upload_id="recovery-bench", tenant="local", buffer="recovery", options={}, files=files)
    conn.commit()

    def state() -> tuple[str, int]:
        up = get_upload(conn, upload_id="recovery-bench")
        conn.commit()
        return up.status, up.attempts

    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    worker = WorkerProcess("ing", queues="rlm.ingest", env={}, log_dir=logs, concurrency=1, pool="prefork").start()
    try:
        get_app().send_task("rlm.ingest", ("recovery-bench",))
        while state() != ("running", 1):
            time.sleep(0.1)
        time.sleep(1.0)
        for child in psutil.Process(worker.proc.pid).children(recursive=True):
            child.kill()
        worker.kill()
        killed = time.monotonic()
        if state()[0] != "running":
            return ["the load ended before the kill: make it larger"]
        worker.start()
        while state()[1] < 2:
            time.sleep(0.2)
        restarted = time.monotonic() - killed
        while state()[0] == "running":
            time.sleep(0.2)
        done = time.monotonic() - killed
        return [
            f"ingest worker killed mid-load: started again after {restarted:.1f} s, {state()[0]} after {done:.1f} s "
            f"(RLM_RECONCILE_SECONDS {get_settings().reconcile_seconds:.0f}, "
            f"RLM_WORKER_LOST_SECONDS {get_settings().worker_lost_seconds:.0f})"
        ]
    finally:
        worker.stop()
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage", type=float, default=20.0)
    ap.add_argument("--skip-worker", action="store_true")
    args = ap.parse_args()
    data_dir = isolated_env("recovery")
    stop_servers(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir = isolated_env("recovery")
    try:
        lines = restarts(data_dir, args.outage)
        if not args.skip_worker:
            lines += killed_worker(data_dir)
    finally:
        stop_servers(data_dir)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
