"""One run of a mode in ``bench/modes.py``: the query submitted, its job tree and the scripted server's calls
attributed to the plan's steps and waves, with the CPU each process used.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from modes_setup import MAX_CONCURRENCY, Server, user_text  # noqa: E402


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
    #: PostgreSQL transactions (each statement outside a transaction is one) and Valkey commands, whole run
    round_trips: dict[str, int] = field(default_factory=dict)


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
        text = user_text(body)
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
    trips0 = _round_trips(conn)
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
    res = job.result.model_dump(mode="json") if job.result else {}
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
    # a backend flushes its statistics at most once a second: wait that out before counting (after the timing)
    time.sleep(STATS_FLUSH_S)
    trips = {k: v - trips0[k] for k, v in _round_trips(conn).items()}
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
        round_trips=trips,
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


#: process ids of each part of the system the bench runs (PostgreSQL is read from its data dir)
CPU_GROUPS: dict[str, list[int]] = {}
CPU_DATA_DIR: list[Path] = []


#: how long PostgreSQL may keep a backend's counts before they show in pg_stat_database
STATS_FLUSH_S = 1.5


def _round_trips(conn) -> dict[str, int]:
    """PostgreSQL's transactions so far in the bench's database (committed or not) and Valkey's commands so far:
    every statement the workers send outside a transaction is one transaction, so with the commands these count the
    round trips the system made, whatever the machine's speed."""
    import redis

    from rlm_workers.config import get_settings
    from rlm_workers.runtime.local_servers import broker_url

    row = conn.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    cmds = redis.Redis.from_url(broker_url(get_settings())).info("stats")["total_commands_processed"]
    return {"pg_xacts": int(row[0]), "valkey_cmds": int(cmds)}


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds used so far by each part: this process (client), the scripted server, each worker,
    PostgreSQL (postmaster, backends, and those already gone) and Valkey."""
    out = {"bench process (client)": harness.process_cpu(os.getpid())}
    for name, pids in CPU_GROUPS.items():
        out[name] = sum(harness.process_cpu(p) for p in pids)
    if CPU_DATA_DIR:
        pg = harness.postgres_cpu(CPU_DATA_DIR[0])
        out["PostgreSQL"] = 0.0 if math.isnan(pg) else pg
    return out


def asyncio_floor(srv: Server, repeats: int) -> list[float]:
    """Seconds the calls of the server's last run take when one asyncio process sends them itself: the same
    request bodies through ``openai.AsyncOpenAI``, the plan first, then the analysts at most ``MAX_CONCURRENCY``
    at once (each reply's JSON parsed), then the rest in order.  No queue, database, limiter or second process:
    what the model client alone costs on this machine, the floor under any orchestration of these calls."""
    import asyncio

    import openai

    bodies = [r["body"] for r in srv.requests() if r["path"].endswith("/chat/completions")]
    plan = [b for b in bodies if b.get("model") == "plan-model"]
    analysts = [b for b in bodies if b.get("model") == "analyst-model"]
    rest = [b for b in bodies if b.get("model") not in ("plan-model", "analyst-model")]

    async def series() -> list[float]:
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="bench", max_retries=0, timeout=120)
        gate = asyncio.Semaphore(MAX_CONCURRENCY)

        async def analyst(body: dict) -> None:
            async with gate:
                reply = await client.chat.completions.create(**body)
                json.loads(reply.choices[0].message.content or "null")

        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for body in plan:
                await client.chat.completions.create(**body)
            await asyncio.gather(*(analyst(b) for b in analysts))
            for body in rest:
                await client.chat.completions.create(**body)
            out.append(time.perf_counter() - t0)
        await client.close()
        return out

    return asyncio.run(series())
