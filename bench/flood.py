"""Flood: many concurrent clients against one `rlm api` process (issue 25, item 2), loopback only.

The clients are spread over ``--procs`` processes, each an asyncio event loop with its share (one process
could not drive thousands of connections and became the bottleneck), each client with its own keep-alive
connection.  Each sends a fixed number of requests, one after the other, mixed over ``GET /v1/buffers``,
``POST /v1/queries`` and ``POST /v1/search`` (bm25) across 4 tenants, while a separate process asks
``/healthz`` every 50 ms.  Reports answers by status (the promise: no 503 and no client timeout while the
database is up; a 429 ``overloaded`` is a fair answer), connection errors with what caused them, requests/s,
latency per route, the /healthz latency during the flood and the kernel's listen-queue and reset counters.
The API runs alone (no workers: submitted queries stay queued), on embedded PostgreSQL + Valkey under
bench/_data/flood.

    .venv/bin/python bench/flood.py [--clients 1000 5000] [--requests 5] [--procs 4] [--limit 900] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import resource
import ssl
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    REPO,
    command_line,
    free_port,
    isolated_env,
    loadavg,
    percentile,
    stop_servers,
    update_results,
)

TENANTS = ("flood-a", "flood-b", "flood-c", "flood-d")
#: a client gives up on one request after this long (counted as a timeout)
CLIENT_TIMEOUT_S = 60.0
DOC = (
    "Retries of a failed call wait for the Retry-After header the provider sends. "
    "A job that lost its worker is delivered again after the visibility timeout. "
) * 20


def _keys(rlm: list[str]) -> dict[str, str]:
    out = {}
    for tenant in TENANTS:
        done = subprocess.run([*rlm, "keys", "create", "--tenant", tenant], capture_output=True, text=True, check=True)
        out[tenant] = done.stdout.strip()
    return out


def _start_api(rlm: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*rlm, "api", "--port", str(port), "--backlog", "4096"],
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
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


#: the server's keep-alive timeout (uvicorn's default, `rlm api` keeps it) and the client's, kept shorter: a
#: client that reuses a connection the server is closing at that very moment gets it reset (ReadError)
SERVER_KEEPALIVE_S = 5.0
CLIENT_KEEPALIVE_S = 2.0


def _lift_open_files_limit() -> None:
    """Every client is a socket: lift the soft limit to the hard one (as `rlm api` does for itself)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _net_counters() -> dict[str, int]:
    """The kernel's TCP counters that tell a full listen queue and reset connections apart (all of the box)."""
    out: dict[str, int] = {}
    for name in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            prefix, keys = head.split(":", 1)
            for key, value in zip(keys.split(), values.split(":", 1)[1].split(), strict=False):
                if value.lstrip("-").isdigit():
                    out[f"{prefix}{key}"] = int(value)
    return out


#: ListenOverflows/ListenDrops: a connection dropped because the listen queue was full (the client retries its
#: SYN, so it is slower, not refused); TCPAbortOnClose: a socket closed with data unread, which answers that data
#: with a reset; OutRsts: resets sent
NET_COUNTERS = ("TcpExtListenOverflows", "TcpExtListenDrops", "TcpExtTCPAbortOnClose", "TcpOutRsts")


def _describe(exc: BaseException) -> str:
    """``ReadError ← ConnectionResetError: [Errno 104] …``: the exception and what it came from."""
    chain, seen = [type(exc).__name__], {id(exc)}
    inner = exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        chain.append(type(inner).__name__)
        last = inner
        inner = inner.__cause__ or inner.__context__
    detail = str(last if len(chain) > 1 else exc)[:80]
    return " ← ".join(dict.fromkeys(chain)) + (f": {detail}" if detail else "")


async def _clients(
    base: str, keys: dict[str, str], first: int, count: int, requests: int, shared: bool, ready, go
) -> dict:
    """``count`` clients, numbered from ``first``, on this event loop: each with its own keep-alive connection, or
    (``shared``, how this bench first ran) all drawing on one pool with httpx's default 5 s keep-alive."""
    statuses: Counter[str] = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    # one TLS context for all (httpx would build one per client, which alone takes seconds at thousands)
    tls = ssl.create_default_context()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=CLIENT_KEEPALIVE_S)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
    https = [httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout, verify=tls) for _ in range(count)]
    if shared:
        one_pool = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
        https = [httpx.AsyncClient(base_url=base, limits=one_pool, timeout=timeout, verify=tls)] * count

    async def client(n: int, http: httpx.AsyncClient) -> None:
        auth = {"Authorization": f"Bearer {keys[TENANTS[n % len(TENANTS)]]}"}
        ended = None
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
                ended = None  # httpx drops the connection
                continue
            except httpx.HTTPError as exc:
                # how long the connection sat idle tells a keep-alive race (idle near the server's timeout) apart
                idle = "new connection" if ended is None else f"connection idle {t0 - ended:.1f} s"
                idle = "shared pool" if shared else idle
                errors[f"{_describe(exc)} (request {i + 1}, {idle})"] += 1
                ended = None
                continue
            ended = time.perf_counter()
            statuses[str(r.status_code)] += 1
            if r.status_code < 400:
                latency[kind].append(time.perf_counter() - t0)
            elif r.status_code >= 500 or r.status_code == 429 and not r.headers.get("retry-after"):
                errors[f"{r.status_code} {r.text[:120]}"] += 1

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ready.wait)
    await loop.run_in_executor(None, go.wait)
    started = time.monotonic()
    await asyncio.gather(*(client(first + k, http) for k, http in enumerate(https)))
    ended_at = time.monotonic()
    await asyncio.gather(*(http.aclose() for http in set(https)))
    return {"statuses": statuses, "latency": latency, "errors": errors, "start": started, "end": ended_at}


def _client_process(
    base: str, keys: dict[str, str], first: int, count: int, requests: int, shared: bool, ready, go, out
) -> None:
    _lift_open_files_limit()
    try:
        out.put(asyncio.run(_clients(base, keys, first, count, requests, shared, ready, go)))
    except BaseException as exc:  # the parent waits for one result per process: send the failure instead
        out.put({"failed": repr(exc)})


def _prober_process(base: str, go, stop, out) -> None:
    """/healthz every 50 ms from its own process: its latency is the API's, not a busy client loop's."""
    health: list[float] = []
    errors: Counter[str] = Counter()
    go.wait()
    with httpx.Client(base_url=base, timeout=CLIENT_TIMEOUT_S) as probe:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = probe.get("/healthz")
                if r.status_code == 200:
                    health.append(time.perf_counter() - t0)
                else:
                    errors[f"healthz {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                errors[f"healthz {_describe(exc)}"] += 1
            stop.wait(0.05)
    out.put({"health": health, "errors": errors})


def _flood(
    base: str, keys: dict[str, str], clients: int, requests: int, procs: int, limit_s: float, shared: bool
) -> dict:
    """``clients`` spread over ``procs`` processes, all let go at once; the results merged."""
    ctx = mp.get_context("spawn")  # a clean interpreter each: nothing of the parent's state comes along
    procs = max(1, min(procs, clients))
    ready, go, stop = ctx.Barrier(procs + 1), ctx.Event(), ctx.Event()
    results, probe_out = ctx.Queue(), ctx.Queue()
    shares = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    firsts = [sum(shares[:k]) for k in range(procs)]
    workers = [
        ctx.Process(
            target=_client_process, args=(base, keys, firsts[k], shares[k], requests, shared, ready, go, results)
        )
        for k in range(procs)
    ]
    prober = ctx.Process(target=_prober_process, args=(base, go, stop, probe_out))
    for w in [*workers, prober]:
        w.start()
    try:
        ready.wait(timeout=120)
        before = _net_counters()
        go.set()
        deadline = time.monotonic() + limit_s
        parts = []
        for _ in workers:
            try:
                parts.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(f"{clients} clients did not finish within {limit_s:.0f} s") from None
        after = _net_counters()
        stop.set()
        probe = probe_out.get(timeout=CLIENT_TIMEOUT_S + 30)
    finally:
        stop.set()
        for w in [*workers, prober]:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    failed = [p["failed"] for p in parts if "failed" in p]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    statuses: Counter[str] = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter(probe["errors"])
    for p in parts:
        statuses.update(p["statuses"])
        errors.update(p["errors"])
        for kind, values in p["latency"].items():
            latency[kind] += values
    return {
        "statuses": statuses,
        "latency": latency,
        "health": probe["health"],
        "errors": errors,
        "wall": max(p["end"] for p in parts) - min(p["start"] for p in parts),
        "procs": procs,
        "shared": shared,
        "net": {k: after.get(k, 0) - before.get(k, 0) for k in NET_COUNTERS},
    }


def _section(runs: list[tuple[int, int, dict]], slots: str) -> str:
    rows = [
        "| clients × requests | client processes | wall s | answered/s | 2xx | 429 | 503 | other 4xx/5xx | "
        "timeouts | connection errors | /healthz p50 / p99 / max ms (probes) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lat_rows = ["| clients | route | p50 ms | p99 ms | n |", "| --- | --- | --- | --- | --- |"]
    net_rows = [f"| clients | {' | '.join(NET_COUNTERS)} |", "| --- |" + " --- |" * len(NET_COUNTERS)]
    for clients, requests, res in runs:
        st = res["statuses"]
        total = sum(st.values())
        ok = sum(v for k, v in st.items() if k.startswith("2"))
        other = sum(v for k, v in st.items() if k not in ("429", "503", "timeout") and not k.startswith("2"))
        dropped = clients * requests - total
        h = res["health"]
        p50, p99, top = percentile(h, 50) * 1000, percentile(h, 99) * 1000, max(h, default=0) * 1000
        hp = f"{p50:.0f} / {p99:.0f} / {top:.0f} ({len(h)})"
        rows.append(
            f"| {clients:,} × {requests} | {res['procs']} | {res['wall']:.1f} | {total / res['wall']:.0f} | {ok:,} | "
            f"{st.get('429', 0):,} | {st.get('503', 0)} | {other} | {st.get('timeout', 0)} | {dropped} | {hp} |"
        )
        for kind, values in sorted(res["latency"].items()):
            lat_rows.append(
                f"| {clients:,} | {kind} | {percentile(values, 50) * 1000:.0f} | "
                f"{percentile(values, 99) * 1000:.0f} | {len(values):,} |"
            )
        net_rows.append(f"| {clients:,} | " + " | ".join(str(res["net"][k]) for k in NET_COUNTERS) + " |")
    if any(res.get("shared") for _, _, res in runs):
        pooling = "`--shared-pool`: one httpx pool per process, idle connections kept 5 s as by the server"
    else:
        pooling = (
            f"each client its own httpx keep-alive connection, dropped after {CLIENT_KEEPALIVE_S:g} s idle, "
            f"under the server's {SERVER_KEEPALIVE_S:g} s"
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
        "- one `rlm api` process (uvicorn, 1 worker, `--backlog 4096`) on loopback, embedded PostgreSQL + Valkey, "
        f"no Celery workers; {slots}",
        f"- the clients are spread over several processes (each an asyncio event loop with its share, {pooling}), "
        "on the same 2 cores as the API, all let go at once; each client sends its "
        "requests one after the other, mixed over `GET /v1/buffers`, `POST /v1/queries` and `POST /v1/search` "
        "(bm25) across 4 tenants; a 429 is not retried; a request unanswered after "
        f"{CLIENT_TIMEOUT_S:.0f} s is a timeout, one whose connection failed a connection error; "
        "a separate process asks `/healthz` every 50 ms throughout",
        "",
        *rows,
        "",
        "Latency of the answered (2xx) requests, from send to answer (waiting for a database slot included):",
        "",
        *lat_rows,
        "",
        "The kernel's TCP counters over each run (the whole machine's: other work on it counts too; "
        "ListenOverflows/ListenDrops: a connection dropped by a full listen queue, retried by the client; "
        "TCPAbortOnClose: a socket closed with data unread, answered with a reset):",
        "",
        *net_rows,
    ]
    if errors:
        out += ["", "Errors (first 5 kinds):", "", *(f"- `{k}` × {v}" for k, v in errors.most_common(5))]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000], help="concurrent clients, one run each")
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--procs", type=int, default=4, help="client processes the clients are spread over")
    ap.add_argument("--limit", type=float, default=900, help="seconds one run may take before it is abandoned")
    ap.add_argument(
        "--shared-pool",
        action="store_true",
        help="the first client's way: one connection pool per process, httpx's 5 s keep-alive (the server's too)",
    )
    ap.add_argument("--no-write", action="store_true", help="print, do not update bench/RESULTS.md")
    args = ap.parse_args()

    _lift_open_files_limit()
    data_dir = isolated_env("flood")
    # every query is stored and queued (no worker runs it): the per-tenant cap is not what is measured
    os.environ["RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT"] = "1000000"
    rlm = [sys.executable, "-m", "rlm_api.cli"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    keys = _keys(rlm)
    api = _start_api(rlm, port, data_dir / "api.log")
    runs = []
    unfinished: list[str] = []
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
            try:
                res = _flood(base, keys, clients, args.requests, args.procs, args.limit, args.shared_pool)
            except RuntimeError as exc:  # a run past its limit is a result too: it did not hold
                print(f"{clients} clients: {exc}", flush=True)
                unfinished.append(f"{clients:,} × {args.requests}: {exc}")
                break
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
    if unfinished:
        body += "\n\nDid not finish:\n\n" + "\n".join(f"- {line}" for line in unfinished)
    print(body)
    if not args.no_write:
        update_results("flood", body)


if __name__ == "__main__":
    main()
