"""Search cost against buffer size (issue #43, part 4): hybrid p50/p99 and HNSW recall@10 at 10k, 100k and 1M
chunks in one buffer each, and what the curve predicts for 100M chunks.

    .venv/bin/python bench/search_curve.py [--sizes 10000,100000,1000000] [--queries 100] [--no-write]
        [--wait-quiet 180] [--keep-servers]

Each size (chunks; ``10k``, ``1M`` style suffixes accepted) is ONE buffer in its own embedded PostgreSQL under
``bench/_data/search-curve/<size>/``, written by ``bench/search_corpus.write_buffer`` as ``bench/search.py``
writes its buffers: the store's COPY helpers in one transaction, the HNSW graph built by ``ensure_index`` after
the COPY, the BM25 cache file built as ``rlm load`` does last.  The text is the search bench's real corpus (the
installed packages' sources, cut by the loader's chunker; its 100k-chunk cache under bench/_data/search-corpus
is shared with ``bench/search.py``); a size past 100k chunks repeats those chunks under ``repK/`` paths with
fresh ids, as ``--million`` repeats them across its buffers.

Vectors are **random unit vectors (dim 384), 2 per chunk**, not MiniLM's.  Real vectors at these sizes cannot
be made here: DEFAULT_WINDOWS cuts this corpus into ~32 windows per chunk, and the fastest encoder runtime
does ~860 windows/s on these 2 cores (RESULTS.md#ingest), so real-density vectors would take ~10 h at 1M
chunks (even 2 real windows per chunk ~40 min), and past 100k chunks the repeated text would give repeated
vectors anyway.  Random vectors are HNSW's worst case (no clusters), so recall here is a floor, not what real
text gets; recall on real vectors is measured by ``bench/search.py``'s real-* buffers.

Per size: warm latency of ``service.search`` (top_k 10, threshold -1, the query embedded anew each call, as
``search_measure.timed_search`` does) over ``--queries`` queries for each of bm25, semantic and hybrid, modes
interleaved query by query, the first query of the size (BM25 index load from its cache file) apart;
recall@10 of the semantic arm (``semantic_search``, shipped EF_SEARCH) against exact search (every window
scanned, index off: ``search_measure._exact_top``) on the first min(30, --queries) bench queries, encoded by
MiniLM as ``recall_study`` does (against isotropic random vectors any query direction is statistically the
same as a random one); build times (COPY, graph, BM25) and database sizes.  Least-squares fits of the points
give the prediction at 10M and 100M chunks; the picture goes to ``bench/curves/search_latency.png`` and
``bench/curves/search_recall.png``, the markdown to RESULTS.md#search-curve.

One stand-in while building: ``spans_once`` cuts each base chunk's window spans once rather than once per copy
(``search_corpus._vector_rows`` would cut the same text again for every copy of it).

Builds are cached per size: a rerun reuses a size whose buffer is complete (build times from its build.json).
A size is one transaction, so a build stopped midway starts that size again.  Expected time of the default run
on this machine: ~1-2 h, nearly all of it the 1M graph (2M vectors, ~4 GB of graph: past the store's 512 MB
BUILD_MEMORY the pgvector build goes on inserting into the graph on disk, several times slower), plus a few
minutes for the corpus if search.py has not cached it.  ``--sizes 10M`` is accepted but not in the default: it
needs ~100 GB of disk (checked before building: a size that does not fit is skipped), several GB of memory in
this process for the rows, and many hours (~20M vectors inserted into an on-disk graph, likely 5-10 h).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import re
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from search import _load_build, _save_build, ensure_buffers  # noqa: E402
from search_corpus import (  # noqa: E402
    CORPUS_DIR,
    DIM,
    QUERIES,
    SEED,
    Corpus,
    FilePart,
    Plan,
    build_corpus,
    vacuum,
)
from search_measure import _exact_top, million_facts, postgres_memory, timed_search  # noqa: E402

SECTION = "search-curve"
CURVE_DIR = harness.BENCH_DIR / "_data" / "search-curve"
CHART_LATENCY = harness.BENCH_DIR / "curves" / "search_latency.png"
CHART_RECALL = harness.BENCH_DIR / "curves" / "search_recall.png"
PER_CHUNK = 2
#: the search bench's corpus (its cache is shared with search.py); larger sizes repeat it
BASE_CHUNKS = 100_000
RECALL_QUERIES = 30
MODES = ("bm25", "semantic", "hybrid")
PREDICT = (10_000_000, 100_000_000)
#: disk a size takes before one has been measured here (database, WAL, BM25 cache): ~7.5 kB measured per chunk
#: at 1M (RESULTS.md#search-1m, scaled to halfvec), rounded up
EST_BYTES_PER_CHUNK = 10_000


def parse_chunks(spec: str) -> int:
    """``10000``, ``100k``, ``1M``, ``2.5M``: a chunk count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", spec)
    if not m:
        raise ValueError(spec)
    return int(round(float(m.group(1)) * {"": 1, "k": 1_000, "m": 1_000_000}[m.group(2).lower()]))


def label(n: int) -> str:
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


class _Cycled(Sequence):
    """A list read over and over: item i is ``base[i % len(base)]``, nothing copied."""

    def __init__(self, base: Sequence, reps: int) -> None:
        self.base, self.reps = base, reps

    def __len__(self) -> int:
        return len(self.base) * self.reps

    def __getitem__(self, i):  # ints only: write_buffer and _spans index one chunk at a time
        return self.base[i % len(self.base)]


class _CycledWhere(_Cycled):
    """``Corpus.where`` of the repeated corpus: copy k of a chunk lives in copy k of its file."""

    def __init__(self, base: Sequence, reps: int, n_files: int) -> None:
        super().__init__(base, reps)
        self.n_files = n_files

    def __getitem__(self, i):
        f, c = self.base[i % len(self.base)]
        return f + (i // len(self.base)) * self.n_files, c


def repeated(base: Corpus, n: int) -> Corpus:
    """``base`` when it holds ``n`` chunks, else its chunks again (files under ``repK/``) until it does: fresh
    ids and paths for the store, the same text, terms, hashes and window counts."""
    if n <= base.n_chunks:
        return base
    reps = -(-n // base.n_chunks)
    files = list(base.files) + [
        FilePart(f"rep{k}/{f.path}", f.digest, f.size, f.chunks) for k in range(1, reps) for f in base.files
    ]
    return Corpus(
        files=files,
        terms=_Cycled(base.terms, reps),
        token_counts=_Cycled(base.token_counts, reps),
        hashes=_Cycled(base.hashes, reps),
        windows=_Cycled(base.windows, reps),
        where=_CycledWhere(base.where, reps, len(base.files)),
    )


def _plan(n: int) -> Plan:
    return Plan(f"curve-{label(n)}", list(range(n)), per_chunk=PER_CHUNK, seed=SEED + n)


def _switch(n: int) -> tuple[Path, object]:
    """Point this process at size n's own data dir (and so its own embedded PostgreSQL); fresh settings."""
    from rlm_workers.config import get_settings, reset_settings

    data_dir = harness.isolated_env(f"search-curve/{label(n)}")
    reset_settings()
    return data_dir, get_settings()


@contextlib.contextmanager
def spans_once(base: Corpus) -> Iterator[None]:
    """While building: each base chunk's window spans cut once, not once per copy and size.

    ``search_corpus._vector_rows`` cuts every chunk's windows with the tokenizer to store the spans beside its
    random vectors (~1-2 ms a chunk here: ~20-30 min at 1M chunks, for ten copies of the same 100k texts).  The
    cut depends on the text alone, so the first ``PER_CHUNK`` spans of each base chunk (all that
    ``_span(spans, w)`` reads for w < PER_CHUNK) are kept and handed to every copy."""
    import search_corpus

    real = search_corpus._spans
    memo: dict[int, list[tuple[int, int]]] = {}
    n_base = base.n_chunks

    def spans(corpus: Corpus, idx: Sequence[int]) -> dict[int, list[tuple[int, int]]]:
        todo = sorted({i % n_base for i in idx} - memo.keys())
        if todo:
            for b, cut in real(base, todo).items():
                memo[b] = cut[:PER_CHUNK]
        return {i: memo[i % n_base] for i in idx}

    search_corpus._spans = spans
    try:
        yield
    finally:
        search_corpus._spans = real


def build_size(n: int, base: Corpus, keep: bool) -> dict | None:
    """Write size n's buffer unless an earlier run left it; its build record, or None if it cannot fit on disk."""
    from rlm_workers.store.db import connect, resolve_url

    data_dir, settings = _switch(n)
    plan = _plan(n)
    build = _load_build(data_dir)
    if plan.name not in build:
        free = shutil.disk_usage(data_dir).free
        need = n * EST_BYTES_PER_CHUNK * 1.2
        if free < need:
            print(f"{label(n)}: skipped, needs ~{need / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB free", flush=True)
            return None
    notices: list[str] = []
    try:
        conn = connect(settings, url=resolve_url(settings))
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        t0 = time.perf_counter()
        written = ensure_buffers(conn, [plan], repeated(base, n), build, data_dir, rebuild=False)
        if written:
            vacuum(conn, ["buffers", "files", "chunks"])
            st = build[plan.name]
            st["vacuum_s"] = time.perf_counter() - t0 - st["seconds"] - (st.get("bm25_s") or 0)
            st["notices"] = [m for m in notices if "hnsw" in m.lower()]
            _save_build(data_dir, build)
        print(f"{label(n)}: {'built' if written else 'reused'} {plan.name}", flush=True)
        conn.close()
    finally:
        if not keep:
            harness.stop_servers(data_dir)
    return dict(build[plan.name], reused=not written)


def measure_size(n: int, n_queries: int, wait_quiet: float, keep: bool) -> dict:
    """Warm latency per mode, recall@10 against exact search, sizes on disk: one size, its own server."""
    from rlm_workers.search import bm25_cache
    from rlm_workers.search.service import query_vector
    from rlm_workers.store.db import connection, resolve_url
    from rlm_workers.store.vectors import BUILD_MEMORY

    data_dir, settings = _switch(n)
    url = resolve_url(settings)
    name = _plan(n).name
    out: dict = {}
    try:
        with connection(settings) as conn:
            conn.execute("SELECT 1")
            out["facts"] = million_facts(conn, data_dir)
            out["facts"]["shared_buffers_bytes"] = int(
                conn.execute("SELECT setting::bigint * 8192 FROM pg_settings WHERE name = 'shared_buffers'").fetchone()[
                    0
                ]
            )
            out["facts"]["build_memory_bytes"] = int(
                conn.execute("SELECT pg_size_bytes(%s)", (BUILD_MEMORY,)).fetchone()[0]
            )
            # the encoder loads once per process: load it before the first query, so every size's first query
            # is its BM25 index load (from the cache file) and a graph not yet in shared_buffers
            query_vector(settings.embedding_model, "load the query encoder", "torch")
            with bm25_cache._lock:
                bm25_cache._mem.clear()
            out["busy_before"] = harness.wait_for_quiet(wait_quiet)
            out["load_before"] = harness.loadavg()
            out["first_ms"] = timed_search(conn, settings, url, [name], QUERIES[0], "hybrid")
            others, cpu0, pg0 = harness.OtherCpu(), time.process_time(), harness.postgres_cpu(data_dir)
            series: dict[str, list[float]] = {m: [] for m in MODES}
            # modes take turns query by query, each turn a different query per mode (as run_queries rotates them)
            stride = len(QUERIES) // len(MODES)
            for i in range(n_queries):
                for c, mode in enumerate(MODES):
                    q = QUERIES[(i + 1 + c * stride) % len(QUERIES)]
                    series[mode].append(timed_search(conn, settings, url, [name], q, mode))
            out["busy_during"] = others.share(time.process_time() - cpu0 + harness.postgres_cpu(data_dir) - pg0)
            out["load_after"] = harness.loadavg()
            out["series"] = series
            out["recall"] = recall_at_10(conn, settings, name, min(RECALL_QUERIES, n_queries))
            out["pg_mem"] = postgres_memory(data_dir)
        for mode, s in series.items():
            print(
                f"{label(n):>5} {mode:>8}: p50 {harness.percentile(s, 50):6.1f} ms  "
                f"p99 {harness.percentile(s, 99):6.1f} ms",
                flush=True,
            )
        r = out["recall"]
        print(
            f"{label(n):>5} recall@10 semantic {statistics.mean(r['semantic']):.3f}, hybrid arm "
            f"{statistics.mean(r['hybrid']):.3f}; exact scan p50 {statistics.median(r['exact_ms']):.0f} ms",
            flush=True,
        )
    finally:
        if not keep:
            harness.stop_servers(data_dir)
    return out


def recall_at_10(conn, settings, name: str, n: int) -> dict:
    """Share of the exact top 10 chunks (every window, index off, best window per chunk) that the semantic arm
    returns in its top 10: at the semantic depth (10 chunks) and the hybrid arm's (20, of which the first 10)."""
    from rlm_workers.search import semantic
    from rlm_workers.search.service import query_vector
    from rlm_workers.store.buffers import DEFAULT_TENANT, require_buffers

    ids = [r.id for r in require_buffers(conn, tenant=DEFAULT_TENANT, names=[name])]
    out: dict = {"semantic": [], "hybrid": [], "exact_ms": [], "ef": semantic.EF_SEARCH, "queries": n}
    for q in QUERIES[:n]:
        v = query_vector(settings.embedding_model, q, "torch")
        t0 = time.perf_counter()
        truth = set(_exact_top(conn, ids, v, 10, None))
        out["exact_ms"].append((time.perf_counter() - t0) * 1000)
        for key, depth in (("semantic", 10), ("hybrid", 20)):
            got = semantic.semantic_search(conn, buffer_ids=ids, query_vec=v, limit=depth, threshold=None)
            out[key].append(len({h.chunk_id for h in got[:10]} & truth) / max(1, len(truth)))
    return out


# ------------------------------------------------------------------------------------------------ the curve


def curve_fits(points: list[tuple[float, float]]) -> dict:
    """Least-squares lines of y against log10(chunks) and against chunks, with their residuals; which is used.

    HNSW's search cost grows with the log of the graph size while everything fits in memory, so the log model is
    the default; the straight line in chunks is used where it fits the points better (a bend upwards)."""
    out: dict = {}
    for model, tx in (("log", math.log10), ("linear", float)):
        pts = [(tx(x), y) for x, y in points]
        a, b = harness.fit_line(pts)
        out[model] = {"a": a, "b": b, "rss": sum((y - a - b * x) ** 2 for x, y in pts), "tx": tx}
    out["use"] = "linear" if len(points) >= 3 and out["linear"]["rss"] < out["log"]["rss"] else "log"
    return out


def predict(fits: dict, n: float, model: str | None = None) -> float:
    f = fits[model or fits["use"]]
    return f["a"] + f["b"] * f["tx"](n)


def per_decade(points: list[tuple[float, float]]) -> list[tuple[int, int, float]]:
    """(from, to, rise per tenfold) between consecutive sizes."""
    return [
        (int(x0), int(x1), (y1 - y0) / (math.log10(x1) - math.log10(x0)))
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False)
    ]


def _approx(n: float) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.0f}k"


def _value(v: float, unit: str) -> str:
    """A predicted latency, or a recall clamped to [0, 1]."""
    return f"{v:,.1f} {unit}" if unit else f"{min(1.0, max(0.0, v)):.3f}"


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def report(run: dict) -> str:
    rows, builds = run["rows"], run["builds"]
    sizes = sorted(rows)
    pct = harness.percentile
    md = [
        "## Search cost against size (`bench/search_curve.py`, issue #43)",
        "",
        f"- command: `{harness.command_line()}` at {harness.revision()}; finished "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        f"- machine: {harness.machine_line()}",
        "- buffers: one per size, each in its own embedded PostgreSQL (`bench/_data/search-curve/<size>/`), written "
        "by `search_corpus.write_buffer` as `bench/search.py` writes its buffers (the store's COPY helpers, one "
        "transaction, the HNSW graph by `ensure_index` after the COPY: halfvec, m 16, ef_construction 64; the BM25 "
        f"cache file as `rlm load` builds it). Text: the search bench's real corpus (first N of its "
        f"{BASE_CHUNKS:,} chunks of installed package sources, `semantic` chunker at the `rlm load` defaults)"
        + (
            f"; past {run['base_chunks']:,} chunks the same chunks again under `repK/` paths with fresh ids, as "
            "`--million` repeats them, so BM25's posting lists there are copies."
            if sizes[-1] > run["base_chunks"]
            else "; no size here goes past it, so no text repeats."
        ),
        f"- vectors: **random unit vectors (dim {DIM}), {PER_CHUNK} per chunk, not real MiniLM vectors**: real "
        "ones at ~32 windows per chunk would take ~10 h to encode at 1M chunks on these 2 cores (~860 windows/s, "
        "RESULTS.md#ingest), and repeated text would repeat them. Random vectors are HNSW's worst case (no "
        "clusters): the recall below is a floor for real text, whose recall RESULTS.md#search-latency measures.",
        f"- latency: `service.search` top_k 10, `threshold=-1`, in a warm process, each query embedded anew; "
        f"{run['queries']} queries per mode, bm25/semantic/hybrid interleaved query by query (the 50 bench "
        "queries in turn); the first query of each size (its BM25 index loaded from the cache file, the graph "
        "not yet in shared_buffers; the query encoder already loaded; the first size's also pays the process's "
        "first search) is apart. p99 of ~100 queries is about the second-slowest: read it as a tail, not a fine "
        "figure.",
        f"- recall@10: share of the exact top 10 chunks (every window scanned with the index off, best window per "
        f"chunk) that `semantic_search` returns in its top 10 at EF_SEARCH {run['ef']}; the semantic depth asks "
        "for 10 chunks, the hybrid arm's for 20 (first 10 counted). Queries: the first bench queries embedded by "
        "MiniLM, as `search_measure.recall_study` does; against isotropic random vectors any query direction is "
        "statistically the same as a random one.",
        "",
        "### Latency, ms",
        "",
        "| chunks | vectors | **hybrid p50** | **hybrid p99** | semantic p50 | semantic p99 | bm25 p50 | bm25 p99 | "
        "first hybrid query | others' CPU before / during |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in sizes:
        r, s = rows[n], rows[n]["series"]
        md.append(
            f"| {n:,} | {builds[n]['vectors']:,} | **{pct(s['hybrid'], 50):.1f}** | **{pct(s['hybrid'], 99):.1f}** | "
            f"{pct(s['semantic'], 50):.1f} | {pct(s['semantic'], 99):.1f} | {pct(s['bm25'], 50):.1f} | "
            f"{pct(s['bm25'], 99):.1f} | {r['first_ms']:.0f} | {r['busy_before']:.0%} / {r['busy_during']:.0%} |"
        )
    md += [
        "",
        "### Recall@10 against exact search",
        "",
        "| chunks | queries | recall@10 semantic | hybrid arm | worst query (semantic) | queries below 0.9 | "
        "exact scan (index off) p50 ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in sizes:
        rc = rows[n]["recall"]
        md.append(
            f"| {n:,} | {rc['queries']} | **{statistics.mean(rc['semantic']):.3f}** | "
            f"{statistics.mean(rc['hybrid']):.3f} | {min(rc['semantic']):.1f} | "
            f"{sum(x < 0.9 for x in rc['semantic'])} | {statistics.median(rc['exact_ms']):,.0f} |"
        )
    md += [
        "",
        "### Build and size",
        "",
        "| chunks | files | COPY (chunks + vectors) | HNSW graph | BM25 index | whole build | database | "
        "of it: chunks / vector heap / graph | pg dir on disk | BM25 cache file | built |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for n in sizes:
        b, f = builds[n], rows[n]["facts"]
        md.append(
            f"| {n:,} | {b['files']:,} | {b['copy_s']:.1f} s | {b['index_s']:.1f} s | {b.get('bm25_s') or 0:.1f} s | "
            f"{b['seconds'] + (b.get('bm25_s') or 0) + (b.get('vacuum_s') or 0):.0f} s | {_gb(f['db_bytes'])} | "
            f"{_gb(f['chunks_bytes'])} / {_gb(f['vec_heap_bytes'])} / {_gb(f['hnsw_bytes'])} | "
            f"{_gb(f['pg_dir_mb'] * 1e6)} | {_gb(f['bm25_cache_mb'] * 1e6)} | "
            f"{b.get('built_at', '?')}{' (reused)' if b['reused'] else ''} |"
        )
    notes = [f"{label(n)}: {m}" for n in sizes for m in builds[n].get("notices") or []]
    if notes:
        md += ["", "pgvector said during the builds: " + "; ".join(notes)]
    if run["skipped"]:
        md += ["", "Skipped (not enough disk): " + ", ".join(run["skipped"]) + "."]
    md += ["", *curve_text(run)]
    md += ["", f"Whole bench run: {run['whole_s']:.0f} s."]
    return "\n".join(md)


def curve_text(run: dict) -> list[str]:
    rows, builds = run["rows"], run["builds"]
    sizes = sorted(rows)
    if len(sizes) < 2:
        return ["One size only: no curve to fit."]
    pct = harness.percentile
    lines = ["### The curve and 100M chunks", ""]
    p50 = [(n, pct(rows[n]["series"]["hybrid"], 50)) for n in sizes]
    p99 = [(n, pct(rows[n]["series"]["hybrid"], 99)) for n in sizes]
    rec = [(n, statistics.mean(rows[n]["recall"]["semantic"])) for n in sizes]
    run["fits"] = {}
    for name, pts, unit in (("hybrid p50", p50, "ms"), ("hybrid p99", p99, "ms"), ("recall@10 semantic", rec, "")):
        fits = curve_fits(pts)
        run["fits"][name] = fits
        lg, ln = fits["log"], fits["linear"]
        use = fits["use"]
        other = "linear" if use == "log" else "log"
        slopes = ", ".join(f"{label(a)}→{label(b)} {s:+.3g}{' ' + unit if unit else ''}" for a, b, s in per_decade(pts))
        fitted = (
            f"log fit a {lg['a']:.3g}, b {lg['b']:.3g} per tenfold; line a {ln['a']:.3g}, b {ln['b']:.3g} per chunk"
        )
        if unit and fits[use]["b"] <= 0:
            lines.append(
                f"- **{name}**: does not rise with size over these points (rise per tenfold: {slopes}): noise, or a "
                f"floor that hides the graph's cost; no prediction beyond about {pts[-1][1]:,.1f} ms. ({fitted}.)"
            )
            continue
        at = ", ".join(f"{label(int(p))} **{_value(predict(fits, p), unit)}**" for p in PREDICT)
        if not unit and predict(fits, PREDICT[0]) <= 0:
            at += (
                " (the fit reaches 0 by then, clamped: recall of random vectors at this EF_SEARCH says nothing "
                "there; what real vectors get at such sizes is not measured)"
            )
        why = (
            "two points fit either model exactly, so the log model by assumption (HNSW's search cost grows with "
            "the log of the graph size while the graph stays in memory)"
            if len(pts) < 3
            else (
                f"it fits the points better (squared residuals {fits[use]['rss']:.3g} against "
                f"{fits[other]['rss']:.3g} for the {'straight line' if use == 'log' else 'log model'})"
            )
        )
        lines.append(
            f"- **{name}**: {'a + b·log10(chunks)' if use == 'log' else 'a + b·chunks'}, chosen because {why}. "
            f"Predicted: {at}; the {'straight line' if other == 'linear' else 'log model'} would say "
            f"{label(PREDICT[-1])} {_value(predict(fits, PREDICT[-1], other), unit)}. Rise per tenfold: {slopes}. "
            f"({fitted}.)"
        )
    big = sizes[-1]
    f = rows[big]["facts"]
    # bytes per chunk from the slope, so the empty database's few MB do not count at small sizes
    db0, db_per = harness.fit_line([(n, rows[n]["facts"]["db_bytes"]) for n in sizes])
    lines.append(
        f"- **database**: {db_per:,.0f} B per chunk ({PER_CHUNK} vectors per chunk; least squares over the sizes), "
        "so "
        + ", ".join(f"{label(p)} ≈ {_gb(db0 + db_per * p)}" for p in PREDICT)
        + ", plus WAL and the BM25 cache file; more at real window density (~32 windows a chunk: the vector heap "
        "and graph ~16× theirs here)."
    )
    idx = [(n, builds[n]["index_s"]) for n in sizes if builds[n].get("index_s")]
    if idx:
        n1, s1 = idx[-1]
        rate = builds[n1]["vectors"] / max(s1, 1e-9)
        lines.append(
            f"- **HNSW build**: {rate:,.0f} vectors/s at {label(n1)}, falling with size; at that rate "
            f"{label(PREDICT[-1])} chunks ({PER_CHUNK * PREDICT[-1]:,} vectors) would take at least "
            f"{PER_CHUNK * PREDICT[-1] / rate / 3600:,.0f} h in one graph."
        )
    # where it bends: the sizes at which the graph (or the database) leaves a memory it lived in
    graph_per = f["hnsw_bytes"] / big
    ram = _mem_total()
    marks = [
        (f["shared_buffers_bytes"], f"the graph outgrows shared_buffers ({_gb(f['shared_buffers_bytes'])})", graph_per),
        (
            f["build_memory_bytes"],
            f"the graph outgrows the build's memory (`vectors.BUILD_MEMORY`, {_gb(f['build_memory_bytes'])}): "
            "pgvector goes on inserting into the graph on disk, several times slower",
            graph_per,
        ),
        (ram, f"the database outgrows this machine's RAM ({_gb(ram)}): graph hops become disk reads", db_per),
    ]
    bends = [f"~{_approx(lim / per)} chunks: {what}" for lim, what, per in marks if per > 0]
    rises = per_decade(p50)
    steep = [(a, b, s) for a, b, s in rises[1:] if rises[0][2] > 0 and s > 2 * rises[0][2]]
    lines.append(
        f"- **where it bends**: the graph takes {graph_per:,.0f} B per chunk at {label(big)}, so with {PER_CHUNK} "
        "vectors per chunk: "
        + "; ".join(bends)
        + ". "
        + (
            "Measured: hybrid p50 rises faster per tenfold over "
            + ", ".join(f"{label(a)}→{label(b)} ({s:+.1f} ms)" for a, b, s in steep)
            + f" than over {label(rises[0][0])}→{label(rises[0][1])} ({rises[0][2]:+.1f} ms): the curve bends up "
            "there, and a log-model prediction past it is a floor."
            if steep
            else "The measured hybrid p50 shows no bend (no tenfold step rises more than twice the first). Past "
            "the RAM mark the log model stops holding: the 100M prediction is for a machine whose RAM holds the "
            "graph."
        )
    )
    return lines


def charts(run: dict) -> None:
    rows = run["rows"]
    sizes = sorted(rows)
    pct = harness.percentile
    lat = {
        "hybrid p50": [(n, pct(rows[n]["series"]["hybrid"], 50)) for n in sizes],
        "hybrid p99": [(n, pct(rows[n]["series"]["hybrid"], 99)) for n in sizes],
    }
    rec = {
        "recall@10 semantic (10 chunks)": [(n, statistics.mean(rows[n]["recall"]["semantic"])) for n in sizes],
        "recall@10 hybrid arm (20 chunks)": [(n, statistics.mean(rows[n]["recall"]["hybrid"])) for n in sizes],
    }
    fits = run.get("fits", {})
    xs = [*sizes, *PREDICT]
    log_y = False
    if "hybrid p50" in fits and fits["hybrid p50"][fits["hybrid p50"]["use"]]["b"] > 0:
        line = [(x, predict(fits["hybrid p50"], x)) for x in xs]
        if min(y for _, y in line) > 0:
            lat["hybrid p50, fitted curve to 100M"] = line
            log_y = True  # the prediction spans decades: the measured points stay readable on a log scale
    if "recall@10 semantic" in fits:
        f = fits["recall@10 semantic"]
        rec["recall@10 semantic, fitted curve to 100M"] = [(x, min(1.0, max(0.0, predict(f, x)))) for x in xs]
    vec = f"random vectors, {PER_CHUNK} per chunk"
    harness.line_chart(
        CHART_LATENCY,
        f"Warm hybrid search (top_k 10) against chunks in one buffer ({vec})",
        "chunks (log scale)",
        "ms (log scale)" if log_y else "ms",
        lat,
        log_x=True,
        log_y=log_y,
    )
    harness.line_chart(
        CHART_RECALL,
        f"HNSW recall@10 against exact search, EF_SEARCH {run['ef']} ({vec})",
        "chunks (log scale)",
        "recall@10",
        rec,
        log_x=True,
    )
    print(f"wrote {CHART_LATENCY} and {CHART_RECALL}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="chunks per size, comma separated (10k, 1M ok)")
    ap.add_argument("--queries", type=int, default=100, help="timed queries per mode and size (recall: ≤ 30)")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md and the PNGs alone")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=180,
        metavar="S",
        help="wait up to S seconds for other processes to leave the CPU idle before each size's timed queries",
    )
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL servers running")
    args = ap.parse_args()
    try:
        sizes = sorted({parse_chunks(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError as exc:
        ap.error(f"--sizes: {exc} is not a chunk count (10000, 100k, 1M)")
    if not sizes or sizes[0] < 100 or args.queries < 1:
        ap.error("--sizes: at least 100 chunks each; --queries: at least 1")

    CURVE_DIR.mkdir(parents=True, exist_ok=True)
    harness.isolated_env("search-curve")  # before anything reads the settings
    machine = harness.machine_markdown()
    t_start = time.perf_counter()
    from rlm_workers.search import semantic

    base_n = min(sizes[-1], BASE_CHUNKS)
    t0 = time.perf_counter()
    base = build_corpus(base_n, CORPUS_DIR)
    print(f"corpus: {base.n_chunks:,} chunks ({time.perf_counter() - t0:.0f} s)", flush=True)
    builds: dict[int, dict] = {}
    skipped = []
    with spans_once(base):
        for n in sizes:
            b = build_size(n, base, args.keep_servers)
            if b is None:
                skipped.append(f"{label(n)} chunks")
            else:
                builds[n] = b
    # the corpus is millions of objects: gone before the timed queries, so no full collection lands in one
    del base
    gc.collect()
    rows: dict[int, dict] = {}
    for n in builds:
        rows[n] = measure_size(n, args.queries, args.wait_quiet, args.keep_servers)
    if not rows:
        raise SystemExit("no size could be built")
    run = {
        "rows": rows,
        "builds": builds,
        "skipped": skipped,
        "queries": args.queries,
        "ef": semantic.EF_SEARCH,
        "base_chunks": base_n,
        "whole_s": time.perf_counter() - t_start,
    }
    md = report(run)
    if not args.no_write:
        charts(run)
    harness.publish(SECTION, md, machine, write=not args.no_write)


if __name__ == "__main__":
    main()
