"""The markdown ``bench/modes.py`` writes into RESULTS.md: the series of runs per mode against their targets."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)
from modes_runs import Run  # noqa: E402
from modes_setup import (  # noqa: E402
    ANALYST_THREADS,
    BATCHES_PER_FILE,
    CODE_BUFFER,
    CONTROL_THREADS,
    LEVELS,
    LOG_FILES,
    MAX_CONCURRENCY,
    SMALL_EXHAUSTIVE_TARGET,
    TARGETS,
)


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
    floor: list[float] = field(default_factory=list)  # the last run's calls from one asyncio process (s)


def medians(s: Series) -> dict:
    """A series as the numbers a curve needs (``--json``): medians over its runs."""
    return {
        "part": s.part,
        "batches": s.batches,
        "analyst_processes": s.analyst_processes,
        "runs": len(s.runs),
        "client_s": _med([r.client for r in s.runs]),
        "ideal_s": _med([r.ideal for r in s.runs]),
        "floor_s": _med(s.floor) if s.floor else None,
        "cpu_s": _med([sum(r.cpu.values()) for r in s.runs]),
        **{k: _med([r.round_trips.get(k, 0) for r in s.runs]) for k in ("pg_xacts", "valkey_cmds")},
    }


def _target(s: Series) -> float | None:
    target = TARGETS.get(s.part)
    if target is not None and s.part.startswith("exhaustive") and s.batches != LOG_FILES * BATCHES_PER_FILE:
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
        f"`exhaustive-2p`: two processes of {args.analyst_threads // 2} threads, `exhaustive-4p`: four of "
        f"{args.analyst_threads // 4}); RLM_MAX_CONCURRENCY={MAX_CONCURRENCY}, "
        f"RLM_MAX_CHUNKS_PER_JOB={max(10_000, setup['logs']['chunks'])}, "
        f"RLM_MAX_BATCHES_PER_JOB={max(200, args.batches)}, RLM_CHECK_MODEL=check-model; embedded Valkey and "
        "PostgreSQL+pgvector.",
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
            + _trips_text(s)
            + _floor_text(s, ideal)
        )
    return head + "."


def _trips_text(s: Series) -> str:
    per = {k: _med([r.round_trips.get(k, 0) for r in s.runs]) / max(1, s.batches) for k in ("pg_xacts", "valkey_cmds")}
    return (
        f" Round trips a batch (the whole run's, over its batches): {per['pg_xacts']:.1f} PostgreSQL transactions, "
        f"{per['valkey_cmds']:.1f} Valkey commands."
    )


def _floor_text(s: Series, ideal: float) -> str:
    if not s.floor:
        return ""
    fl = _med(s.floor)
    return (
        f" The same {s.runs[-1].result.get('llm_calls')} calls sent by one asyncio process (`openai.AsyncOpenAI`, no "
        f"queue, database or limiter; {len(s.floor)} runs): {fl:.2f} s = {fl / ideal:.3f} × ideal, the floor of "
        "the model client alone on this machine."
    )


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
