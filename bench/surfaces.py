"""The two read paths issue #13 reworked, timed at growing table sizes: neither may grow with the history.

    .venv/bin/python bench/surfaces.py [--calls 0,100k,1m] [--jobs 10k,200k] [--repeats 20] [--old-repeats 5]
        [--no-write] [--keep-servers]

* **/metrics**: ``rlm_api.routes.health.render_metrics`` (the Redis hashes ``rlm_workers/runtime/metrics.py`` keeps,
  plus one count over the partial index ``jobs_unfinished``) with ``llm_calls`` at each ``--calls`` size,
  10 calls per synthetic finished job.  For comparison, the aggregate the scrape ran on every request before
  #13 (its SQL is kept below, since it no longer exists in the code) on the same tables.
* **GET /v1/queries**: ``job_page``, exactly what the route runs for one page (the cursor's check,
  ``list_jobs``, ``job_summaries``), for one tenant holding each ``--jobs`` size (2 llm_calls per job), beside
  the other tenants' rows of the first part:
  the first page, a page 90 % down (``before`` = the id there), and both again with ``status=failed``.

Called in-process against the embedded PostgreSQL and Valkey under bench/_data/surfaces (no HTTP: the
route's own work is what grows, if anything does).  Every figure is the median over ``--repeats`` calls
after one warm-up.  The synthetic rows are deleted, the servers stopped and bench/_data/surfaces removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))

#: every synthetic id starts with this, so the clean-up cannot touch anything else
PREFIX = "bench-surf-"
TENANT = "bench-surfaces"
OTHER_TENANT = "bench-surfaces-other"
CALLS_PER_JOB = 10  # llm_calls per finished job of the /metrics part
LIST_CALLS_PER_JOB = 2  # llm_calls per job of the listed tenant (what job_summaries sums)
MODELS = ("plan-model", "analyst-model", "synth-model")
STAGES = ("plan", "search", "fan_out", "collect", "synthesize")

#: the pre-#13 scrape: what /metrics ran on every request before the counters moved to Redis
PRE13_SCRAPE = (
    "SELECT model, status, count(*), sum(tokens_in), sum(tokens_out) FROM llm_calls GROUP BY model, status",
    "SELECT t.key, sum(t.value::float8), count(*) FROM jobs, jsonb_each_text(jobs.timings) t GROUP BY t.key",
)

# Synthetic rows in one INSERT … SELECT generate_series each; created_at a fixed step apart going back in time,
# so the newest-first order is the id order and a cursor is unambiguous.
_INSERT_JOBS = """
INSERT INTO jobs (id, tenant, status, stage, query, buffers, options, timings, result, created_at, started_at,
                  finished_at, stage_at)
SELECT %(prefix)s || %(tag)s || lpad(i::text, 8, '0'), %(tenant)s,
       CASE WHEN %(in_flight)s::boolean AND i %% 5000 = 1 THEN 'running'
            WHEN %(in_flight)s::boolean AND i %% 5000 = 2 THEN 'queued'
            WHEN i %% 20 = 3 THEN 'failed' WHEN i %% 50 = 7 THEN 'cancelled' ELSE 'done' END,
       'done', 'synthetic question number ' || i || ' about the code base', ARRAY['bench'],
       '{"mode": "auto"}'::jsonb,
       jsonb_build_object('plan', 0.4 + (i %% 7) / 10.0, 'search', 0.05, 'fan_out', 2.0 + (i %% 13) / 10.0,
                          'collect', 0.01, 'synthesize', 1.5),
       jsonb_build_object('report', repeat('A synthetic report line. ', 20)),
       at, at, at + interval '5 seconds', at + interval '5 seconds'
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i,
     LATERAL (SELECT %(t0)s::timestamptz - make_interval(secs => i * %(step)s::float8) AS at) AS a
"""
_INSERT_CALLS = """
INSERT INTO llm_calls (job_id, stage, batch_no, provider, model, tokens_in, tokens_out, cached_tokens, latency_ms,
                       status, cost_usd, created_at)
SELECT %(prefix)s || %(tag)s || lpad((c / %(per)s::int)::text, 8, '0'),
       (ARRAY['plan', 'fan_out', 'fan_out', 'fan_out', 'synthesize'])[1 + c %% 5], c %% 8, 'openai',
       (ARRAY['plan-model', 'analyst-model', 'analyst-model', 'synth-model'])[1 + c %% 4],
       800 + c %% 3000, 100 + c %% 700, c %% 300, 300 + c %% 4000,
       CASE WHEN c %% 97 = 0 THEN 'error' WHEN c %% 31 = 0 THEN 'retried' ELSE 'ok' END, 0.0004, now()
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS c
"""


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def size_name(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def timed_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: plans cached, pages in shared buffers, as for a server that has been up a while
    return [s * 1000 for s in harness.timed_runs(fn, repeats)]


def _fill_jobs(conn: Any, *, tag: str, tenant: str, lo: int, hi: int, step: float, in_flight: bool, t0: Any) -> None:
    if hi < lo:
        return
    conn.execute(
        _INSERT_JOBS,
        {
            "prefix": PREFIX,
            "tag": tag,
            "tenant": tenant,
            "lo": lo,
            "hi": hi,
            "step": step,
            "in_flight": in_flight,
            "t0": t0,
        },
    )


def _fill_calls(conn: Any, *, tag: str, per: int, jobs_lo: int, jobs_hi: int) -> None:
    """``per`` calls for each job numbered jobs_lo..jobs_hi (call c belongs to job c // per)."""
    if jobs_hi < jobs_lo:
        return
    conn.execute(
        _INSERT_CALLS, {"prefix": PREFIX, "tag": tag, "per": per, "lo": jobs_lo * per, "hi": (jobs_hi + 1) * per - 1}
    )


def _analyze(conn: Any) -> None:
    # what autovacuum would have done by the time a table reached this size (the visibility map matters for
    # the index-only count over jobs_unfinished)
    conn.execute("VACUUM ANALYZE jobs")
    conn.execute("VACUUM ANALYZE llm_calls")


def _seed_counters() -> None:
    """The Redis series a running deployment has: every model × status, every stage, the limiter."""
    from rlm_workers.models import LLMCall
    from rlm_workers.runtime import metrics

    for i, model in enumerate(MODELS):
        for status in ("ok", "retried", "error"):
            metrics.llm_calls(
                model,
                [
                    LLMCall(
                        stage="fan_out",
                        model=model,
                        provider="openai",
                        tokens_in=900 + i,
                        tokens_out=200,
                        cached_tokens=100,
                        cost_usd=0.0004,
                        latency_ms=latency,
                        status=status,
                    )
                    for latency in (120, 800, 2500, 9000)
                ],
            )
    for stage in STAGES:
        for seconds in (0.04, 0.7, 3.0, 40.0):
            metrics.stage_timed(stage, seconds)
    for status in ("done", "failed", "cancelled"):
        metrics.job_finished(status)
    for seconds in (0.0, 0.02, 1.5):
        metrics.limiter_waited(seconds)


def bench_metrics(conn: Any, sizes: list[int], repeats: int, old_repeats: int, t0: Any) -> list[dict]:
    from rlm_api.routes.health import render_metrics

    rows = []
    jobs_done = 0
    for n in sizes:
        jobs = n // CALLS_PER_JOB
        t = time.perf_counter()
        # the first rows of the first size also carry the in-flight jobs the partial index holds
        _fill_jobs(conn, tag="m-", tenant=OTHER_TENANT, lo=jobs_done, hi=jobs - 1, step=0.5, in_flight=True, t0=t0)
        _fill_calls(conn, tag="m-", per=CALLS_PER_JOB, jobs_lo=jobs_done, jobs_hi=jobs - 1)
        jobs_done = max(jobs_done, jobs)
        _analyze(conn)
        fill = time.perf_counter() - t
        n_calls, n_jobs = conn.execute(
            "SELECT (SELECT count(*) FROM llm_calls), (SELECT count(*) FROM jobs)"
        ).fetchone()
        body = render_metrics(conn)
        if b"rlm_llm_calls_total{" not in body or b'rlm_jobs{status="running"}' not in body:
            raise SystemExit("render_metrics did not show the seeded series: is the embedded Valkey up?")
        new = timed_ms(lambda: render_metrics(conn), repeats)

        def old() -> None:
            for sql in PRE13_SCRAPE:
                conn.execute(sql).fetchall()

        before = timed_ms(old, old_repeats)
        rows.append({"calls": n_calls, "jobs": n_jobs, "new": new, "old": before, "fill": fill, "bytes": len(body)})
        print(
            f"/metrics llm_calls={n_calls:>9,} jobs={n_jobs:>8,}: render_metrics {statistics.median(new):.2f} ms, "
            f"pre-#13 aggregate {statistics.median(before):.1f} ms (fill {fill:.0f} s)",
            flush=True,
        )
    return rows


def bench_list(conn: Any, sizes: list[int], repeats: int, t0: Any) -> list[dict]:
    from rlm_api.routes.queries import job_page

    def page(status: str | None = None, before: str | None = None) -> Callable[[], object]:
        def run() -> object:
            # what GET /v1/queries runs: the cursor's check, one row past the page, the usage of the page's jobs
            got = job_page(conn, tenant=TENANT, status=status, limit=50, cursor=before)
            # a filtered page 90 % down may hold fewer than 50 (5 % of the last 10 % of 10k jobs is 50)
            if not got.jobs or (before is None and (len(got.jobs) != 50 or got.next_cursor is None)):
                raise SystemExit(f"job_page returned {len(got.jobs)} jobs for status={status} before={before}")
            return got

        return run

    out = []
    have = 0
    for n in sizes:
        t = time.perf_counter()
        # one job every 0.7 s against the other tenant's 0.5 s: the two interleave in time, as tenants do
        _fill_jobs(conn, tag="l-", tenant=TENANT, lo=have, hi=n - 1, step=0.7, in_flight=False, t0=t0)
        _fill_calls(conn, tag="l-", per=LIST_CALLS_PER_JOB, jobs_lo=have, jobs_hi=n - 1)
        have = max(have, n)
        _analyze(conn)
        fill = time.perf_counter() - t
        n_jobs, n_calls = conn.execute(
            "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM llm_calls)"
        ).fetchone()
        deep = f"{PREFIX}l-{int(n * 0.9):08d}"
        # the failed job nearest 90 % down (ids i with i % 20 == 3 are failed)
        deep_failed = f"{PREFIX}l-{int(n * 0.9) // 20 * 20 + 3:08d}"
        r = {
            "n": n,
            "jobs": n_jobs,
            "calls": n_calls,
            "fill": fill,
            "first": timed_ms(page(), repeats),
            "deep": timed_ms(page(before=deep), repeats),
            "first_failed": timed_ms(page(status="failed"), repeats),
            "deep_failed": timed_ms(page(status="failed", before=deep_failed), repeats),
        }
        out.append(r)
        print(
            f"list tenant jobs={n:>7,} (all jobs {n_jobs:,}): first {statistics.median(r['first']):.2f} ms, "
            f"90 % down {statistics.median(r['deep']):.2f} ms, failed first "
            f"{statistics.median(r['first_failed']):.2f} ms, failed 90 % down "
            f"{statistics.median(r['deep_failed']):.2f} ms (fill {fill:.0f} s)",
            flush=True,
        )
    return out


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}"


def report(metrics_rows: list[dict], list_rows: list[dict], args: argparse.Namespace, busy: float) -> str:
    lines = [
        "## Read paths at growing table sizes: /metrics and the job list (`bench/surfaces.py`)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}",
        f"- run finished (`date -u`): {harness.sh('date -u')}; `nproc` {harness.sh('nproc')}; load average "
        f"{harness.loadavg()}; share of the CPU used by other processes just before: {busy:.0%}",
        "- in-process calls against the embedded PostgreSQL+pgvector and Valkey (bench/_data/surfaces), tables "
        "filled with synthetic rows (`INSERT … SELECT generate_series`) then `VACUUM ANALYZE`d; median of "
        f"{args.repeats} calls after one warm-up (the pre-#13 aggregate: {args.old_repeats})",
        "",
        f"**/metrics**: `render_metrics(conn)` (Redis hashes with {len(MODELS)} models × 3 statuses, "
        f"{len(STAGES)} stages, limiter waits; one `count(*)` over the partial index `jobs_unfinished`) against "
        "the aggregate every scrape ran before #13 (`llm_calls GROUP BY model, status` + "
        "`jsonb_each_text(jobs.timings) GROUP BY key`, kept in bench/surfaces.py). "
        f"{CALLS_PER_JOB} llm_calls per finished job; a few queued/running jobs among them.",
        "",
        "| llm_calls rows | jobs rows | `render_metrics` ms | pre-#13 scrape aggregate ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in metrics_rows:
        lines.append(f"| {r['calls']:,} | {r['jobs']:,} | {_med(r['new'])} | {_med(r['old'])} |")
    lines += [
        "",
        "**GET /v1/queries**: `job_page(conn, tenant=…, limit=50, cursor=…)`, what the route runs for one page, "
        "for one tenant "
        f"({LIST_CALLS_PER_JOB} llm_calls per job, 5 % failed), the other tenant's rows above still in the table; "
        '"90 % down" passes `cursor=` the id of the job 90 % of the way down the tenant\'s history.',
        "",
        "| tenant's jobs | all jobs / llm_calls rows | first page ms | 90 % down ms | `status=failed` first page ms "
        "| `status=failed` 90 % down ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in list_rows:
        lines.append(
            f"| {r['n']:,} | {r['jobs']:,} / {r['calls']:,} | {_med(r['first'])} | {_med(r['deep'])} "
            f"| {_med(r['first_failed'])} | {_med(r['deep_failed'])} |"
        )
    return "\n".join(lines)


def cleanup(conn: Any) -> None:
    # llm_calls go with their jobs (ON DELETE CASCADE)
    conn.execute("DELETE FROM jobs WHERE id LIKE %s", (PREFIX + "%",))
    from rlm_workers.runtime import metrics

    metrics.client().delete(metrics.COUNTERS_KEY, metrics.HISTOGRAMS_KEY)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", default="0,100k,1m", help="llm_calls sizes for /metrics, comma separated")
    ap.add_argument("--jobs", default="10k,200k", help="the listed tenant's job counts, comma separated")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per figure (after one warm-up)")
    ap.add_argument("--old-repeats", type=int, default=5, help="timed runs of the pre-#13 aggregate")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL and Valkey running")
    args = ap.parse_args()
    calls = sorted(parse_size(s) for s in args.calls.split(","))
    jobs = sorted(parse_size(s) for s in args.jobs.split(","))
    if min(calls) < 0 or min(jobs) < 1000 or args.repeats < 1 or args.old_repeats < 1:
        ap.error("--calls >= 0, --jobs >= 1000 (a page 90 % down must exist), --repeats/--old-repeats >= 1")

    data_dir = harness.isolated_env("surfaces")
    machine = harness.machine_markdown()
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.store.db import connect

    reset_settings()
    conn = None
    t_start = time.perf_counter()
    try:
        conn = connect(get_settings())
        conn.autocommit = True  # VACUUM, and no snapshot held open across the timed calls
        cleanup(conn)  # an interrupted earlier run's rows
        _seed_counters()
        t0 = conn.execute("SELECT now()").fetchone()[0]
        busy = harness.other_cpu_busy()
        metrics_rows = bench_metrics(conn, calls, args.repeats, args.old_repeats, t0)
        list_rows = bench_list(conn, jobs, args.repeats, t0)
        cleanup(conn)
    finally:
        if conn is not None:
            conn.close()
        if not args.keep_servers:
            harness.stop_servers(data_dir)
            # a few hundred MB of table files the next run would not reuse (it fills its own rows)
            if not (data_dir / "pg" / "postmaster.pid").exists():
                shutil.rmtree(data_dir, ignore_errors=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    harness.publish("surfaces", report(metrics_rows, list_rows, args, busy), machine, write=not args.no_write)


if __name__ == "__main__":
    main()
