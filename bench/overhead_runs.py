"""The two sides ``bench/overhead.py`` compares: a query through Celery workers, its calls and events laid
against the design's critical path, and the same messages sent by one asyncio process.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from overhead_setup import BUFFER, CHAIN, COARSE_CHAIN, QUERY, CpuMeter, EventLog, Model  # noqa: E402


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
    res = job.result.model_dump(mode="json") if job.result else {}
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
