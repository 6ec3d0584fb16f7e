"""Flood: many concurrent clients against one `rlm api` process (issue 25, item 2), loopback only.

Each client sends a fixed number of requests, one after the other, mixed over ``GET /v1/buffers``,
``POST /v1/queries`` and ``POST /v1/search`` (bm25) across 4 tenants, while a prober asks ``/healthz``
every 50 ms.  Reports answers by status (the promise: no 503 and no client timeout while the database is up;
a 429 ``overloaded`` is a fair answer), requests/s, latency per route and the /healthz latency during the
flood.  The API runs alone (no workers: submitted queries stay queued), on embedded PostgreSQL + Valkey
under bench/_data/flood.

    .venv/bin/python bench/flood.py [--clients 1000] [--requests 5] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import REPO, command_line, isolated_env, loadavg, percentile, stop_servers, update_results  # noqa: E402

TENANTS = ("flood-a", "flood-b", "flood-c", "flood-d")
#: a client gives up on one request after this long (counted as a timeout)
CLIENT_TIMEOUT_S = 60.0
DOC = (
    "Retries of a failed call wait for the Retry-After header the provider sends. "
    "A job that lost its worker is delivered again after the visibility timeout. "
) * 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(rlm: list[str]) -> dict[str, str]:
    out = {}
    for tenant in TENANTS:
        done = subprocess.run([*rlm, "keys", "create", "--tenant", tenant], capture_output=True, text=True, check=True)
        out[tenant] = done.stdout.strip()
    return out


def _start_api(rlm: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*rlm, "api", "--port", str(port)], cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the API did not start: {log.read_text()[-2000:]}")


async def _flood(base: str, keys: dict[str, str], clients: int, requests: int) -> dict:
    statuses: Counter[str] = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    health: list[float] = []
    errors: Counter[str] = Counter()
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:

        async def client(n: int) -> None:
            auth = {"Authorization": f"Bearer {keys[TENANTS[n % len(TENANTS)]]}"}
            for i in range(requests):
                kind = ("buffers", "queries", "search")[(n + i) % 3]
                t0 = time.perf_counter()
                try:
                    if kind == "buffers":
                        r = await http.get("/v1/buffers", headers=auth)
                    elif kind == "queries":
                        body = {"query": f"How are retries done? ({n}.{i})", "buffers": ["docs"]}
                        r = await http.post("/v1/queries", json=body, headers=auth)
                    else:
                        body = {"query": "retry after header", "buffer": "docs", "mode": "bm25", "top_k": 5}
                        r = await http.post("/v1/search", json=body, headers=auth)
                except httpx.TimeoutException:
                    statuses["timeout"] += 1
                    continue
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] += 1
                    continue
                statuses[str(r.status_code)] += 1
                if r.status_code < 400:
                    latency[kind].append(time.perf_counter() - t0)
                elif r.status_code >= 500 or r.status_code == 429 and not r.headers.get("retry-after"):
                    errors[f"{r.status_code} {r.text[:120]}"] += 1

        async def prober() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=timeout) as probe:
                while not done.is_set():
                    t0 = time.perf_counter()
                    try:
                        r = await probe.get("/healthz")
                        if r.status_code == 200:
                            health.append(time.perf_counter() - t0)
                        else:
                            errors[f"healthz {r.status_code}"] += 1
                    except httpx.HTTPError as exc:
                        errors[f"healthz {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.05)

        probe_task = asyncio.create_task(prober())
        t0 = time.perf_counter()
        await asyncio.gather(*(client(n) for n in range(clients)))
        wall = time.perf_counter() - t0
        done.set()
        await probe_task
    return {"statuses": statuses, "latency": latency, "health": health, "errors": errors, "wall": wall}


def _section(runs: list[tuple[int, int, dict]], slots: str) -> str:
    rows = [
        "| clients × requests | wall s | answered/s | 2xx | 429 | 503 | other 4xx/5xx | timeouts | "
        "/healthz p50 / p99 / max ms (probes) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lat_rows = ["| clients | route | p50 ms | p99 ms | n |", "| --- | --- | --- | --- | --- |"]
    for clients, requests, res in runs:
        st = res["statuses"]
        total = sum(st.values())
        ok = sum(v for k, v in st.items() if k.startswith("2"))
        other = sum(v for k, v in st.items() if k not in ("429", "503", "timeout") and not k.startswith("2"))
        h = res["health"]
        p50, p99, top = percentile(h, 50) * 1000, percentile(h, 99) * 1000, max(h, default=0) * 1000
        hp = f"{p50:.0f} / {p99:.0f} / {top:.0f} ({len(h)})"
        rows.append(
            f"| {clients:,} × {requests} | {res['wall']:.1f} | {total / res['wall']:.0f} | {ok:,} | "
            f"{st.get('429', 0):,} | {st.get('503', 0)} | {other} | {st.get('timeout', 0)} | {hp} |"
        )
        for kind, values in sorted(res["latency"].items()):
            lat_rows.append(
                f"| {clients:,} | {kind} | {percentile(values, 50) * 1000:.0f} | "
                f"{percentile(values, 99) * 1000:.0f} | {len(values):,} |"
            )
    errors = Counter()
    for _, _, res in runs:
        errors.update(res["errors"])
    out = [
        "## API flood (`bench/flood.py`)",
        "",
        f"- command: `{command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; "
        f"`nproc`: {os.cpu_count()}; load average after: {loadavg()}",
        "- one `rlm api` process (uvicorn, 1 worker) on loopback, embedded PostgreSQL + Valkey, no Celery workers; "
        f"the clients (one asyncio process, httpx) share the same 2 cores; {slots}",
        "- each client sends its requests one after the other, mixed over `GET /v1/buffers`, `POST /v1/queries` "
        "and `POST /v1/search` (bm25) across 4 tenants; a 429 is not retried; a request unanswered after "
        f"{CLIENT_TIMEOUT_S:.0f} s is a timeout; a prober asks `/healthz` every 50 ms throughout",
        "",
        *rows,
        "",
        "Latency of the answered (2xx) requests, from send to answer (waiting for a database slot included):",
        "",
        *lat_rows,
    ]
    if errors:
        out += ["", "Errors (first 5 kinds):", "", *(f"- `{k}` × {v}" for k, v in errors.most_common(5))]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000], help="concurrent clients, one run each")
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--no-write", action="store_true", help="print, do not update bench/RESULTS.md")
    args = ap.parse_args()

    data_dir = isolated_env("flood")
    # every query is stored and queued (no worker runs it): the per-tenant cap is not what is measured
    os.environ["RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT"] = "1000000"
    rlm = [sys.executable, "-m", "rlm_api.cli"]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    keys = _keys(rlm)
    api = _start_api(rlm, port, data_dir / "api.log")
    runs = []
    try:
        for tenant, key in keys.items():
            r = httpx.post(
                f"{base}/v1/buffers?wait=true",
                json={"name": "docs", "chunk_size": 1000, "overlap": 0, "documents": [{"path": "a.md", "text": DOC}]},
                headers={"Authorization": f"Bearer {key}"},
                timeout=300,
            )
            r.raise_for_status()
            print(f"buffer docs of {tenant}: {r.json()['chunks_written']} chunks", flush=True)
        for clients in args.clients:
            res = asyncio.run(_flood(base, keys, clients, args.requests))
            runs.append((clients, args.requests, res))
            print(_section([runs[-1]], "(partial)"), flush=True)  # a later, larger run may not finish
    finally:
        api.terminate()
        api.wait(timeout=30)
        stop_servers(data_dir)
    from rlm_workers.store.db import POOL_MAX_SIZE

    slots = (
        f"admission: {POOL_MAX_SIZE // 2} database slots (half the pool of {POOL_MAX_SIZE}), "
        f"RLM_API_QUEUE={os.environ.get('RLM_API_QUEUE', '500')} waiting"
    )
    body = _section(runs, slots)
    print(body)
    if not args.no_write:
        update_results("flood", body)


if __name__ == "__main__":
    main()
