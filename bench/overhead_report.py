"""The markdown ``bench/overhead.py`` writes into RESULTS.md: Celery against the ideal and asyncio, per size."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from overhead_runs import CeleryRun  # noqa: E402
from overhead_setup import TARGET  # noqa: E402


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
