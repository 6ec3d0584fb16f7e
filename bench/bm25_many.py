"""BM25 over 100 buffers × 10k chunks of real text: warm and cold latency, the worker's memory.

    .venv/bin/python bench/bm25_many.py [--buffers 100] [--rounds 2] [--cold-runs 3] [--no-merged]
                                        [--wait-quiet 60] [--no-write]

The text is ``bench/search.py --million``'s: its first 100k real chunks (``build_corpus``, cached
under bench/_data/search-corpus and shared with it), ten distinct sets of 10k, each written to ten
buffers under fresh chunk ids.  No PostgreSQL and no vectors: each buffer's index is built by
``BM25Index.build`` from the stored terms and saved where ``bm25_cache`` looks for it
(``cache_path``), which is what ``rlm load`` leaves behind.  The queries then run through
``service._bm25_index`` (the function ``rank`` calls) and ``top_k``, exactly as ``rlm search
--mode bm25`` over the 100 buffers would after its buffer lookup; the connection is never used
because every buffer's file exists.  Built files are reused by the next run.

- warm: the 50 questions of bench/search.py × ``--rounds``, top 10 (and one round at top 20, the
  depth a hybrid search asks of BM25), in this process;
- cold: a fresh Python process per run, timing its first query (files mapped, the union's
  statistics computed) apart from its imports;
- memory: the process's RSS split into anonymous (heap) and file-backed (the mapped indexes,
  page cache), and the mapped index files;
- the merged index (``BM25Index.merge``, what a multi-buffer query built before) for comparison:
  its build time, size and top-k latency, and whether its top 10 equals the union's for every query.

Everything lives under bench/_data/bm25-many.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

N_CHUNKS = 10_000
N_DISTINCT = 10  # distinct sets of N_CHUNKS chunks, as bench/search.py --million
DB_URL = "bench-bm25-many"  # only hashed into the cache file names (bm25_cache.db_key)
TARGET_P50_MS = 150.0
TARGET_COLD_S = 2.0


def _rows(n_buffers: int) -> list:
    from rlm_workers.store.buffers import DEFAULT_TENANT, BufferRow

    return [
        BufferRow(
            id=i + 1,
            tenant=DEFAULT_TENANT,
            name=f"m{i:03d}",
            version=1,
            chunker="semantic",
            chunk_size=3000,
            chunk_overlap=500,
            embedding_model=None,
            embedding_dim=None,
        )
        for i in range(n_buffers)
    ]


def _paths(n_buffers: int) -> list[Path]:
    from rlm_workers.config import get_settings
    from rlm_workers.search import bm25_cache

    cache = get_settings().data_dir / "cache"
    return [bm25_cache.cache_path(cache, bm25_cache.db_key(DB_URL), r) for r in _rows(n_buffers)]


def build(n_buffers: int) -> dict:
    """Write the index files an earlier run did not leave; seconds per buffer built."""
    import search_corpus  # bench/search.py's corpus

    from rlm_workers.search.bm25 import BM25Index

    todo = [(i, p) for i, p in enumerate(_paths(n_buffers)) if not p.exists()]
    if not todo:
        return {}
    t0 = time.perf_counter()
    corpus = search_corpus.build_corpus(N_CHUNKS * N_DISTINCT, search_corpus.CORPUS_DIR)
    print(f"corpus: {corpus.n_chunks:,} chunks in {time.perf_counter() - t0:.0f} s", flush=True)
    took = {}
    for i, path in todo:
        base = (i % N_DISTINCT) * N_CHUNKS
        t0 = time.perf_counter()
        idx = BM25Index.build((i * N_CHUNKS + j + 1, corpus.terms[base + j].split()) for j in range(N_CHUNKS))
        path.parent.mkdir(parents=True, exist_ok=True)
        idx.save(path)
        took[path.name] = time.perf_counter() - t0
        print(f"built {path.name}: {idx} in {took[path.name]:.1f} s", flush=True)
    return took


def memory() -> dict:
    """RSS of this process split into heap and file-backed pages, and the index files it maps."""
    status: dict = harness.own_memory_mb("VmRSS", "RssAnon", "RssFile", "VmHWM")
    maps = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(".npz")}
    status["mapped_files"] = len(maps)
    status["mapped_mb"] = sum(os.path.getsize(m) for m in maps if os.path.exists(m)) / 1e6
    return status


def _query(rows, tokens: list[str], k: int):
    from rlm_workers.config import get_settings
    from rlm_workers.search import service

    return service._bm25_index(None, rows, get_settings(), DB_URL).top_k(tokens, k)


def cold_child(n_buffers: int, query: str) -> None:
    """One fresh process: its imports, then its first query over all buffers, as JSON on stdout."""
    t0 = time.perf_counter()
    from rlm_workers.search import service  # noqa: F401 - what a worker has imported before its first query
    from rlm_workers.search.tokenize import tokenize

    imported = time.perf_counter() - t0
    rows = _rows(n_buffers)
    t1 = time.perf_counter()
    hits = _query(rows, tokenize(query), 10)
    first = time.perf_counter() - t1
    t2 = time.perf_counter()
    _query(rows, tokenize(query), 10)
    second = time.perf_counter() - t2
    print(json.dumps({"import_s": imported, "first_s": first, "second_s": second, "hits": len(hits), **memory()}))


def warm(n_buffers: int, rounds: int) -> dict:
    import search_corpus

    from rlm_workers.search import bm25_cache, service
    from rlm_workers.search.tokenize import tokenize

    rows = _rows(n_buffers)
    out: dict = {"mem_start": memory()}
    t0 = time.perf_counter()
    _query(rows, tokenize(search_corpus.QUERIES[0]), 10)
    out["first_ms"] = (time.perf_counter() - t0) * 1000
    # where a query's time goes: the indexes and statistics (cache lookups) vs the scoring
    series: dict[str, list[float]] = {"total": [], "index": [], "top_k": []}
    from rlm_workers.config import get_settings

    settings = get_settings()
    for _ in range(rounds):
        for q in search_corpus.QUERIES:
            t0 = time.perf_counter()
            index = service._bm25_index(None, rows, settings, DB_URL)
            t1 = time.perf_counter()
            index.top_k(tokenize(q), 10)
            t2 = time.perf_counter()
            series["index"].append((t1 - t0) * 1000)
            series["top_k"].append((t2 - t1) * 1000)
            series["total"].append((t2 - t0) * 1000)
    out["series"] = series
    out["top20"] = []
    for q in search_corpus.QUERIES:
        t0 = time.perf_counter()
        _query(rows, tokenize(q), 20)
        out["top20"].append((time.perf_counter() - t0) * 1000)
    out["mem_after"] = memory()
    parts = [
        bm25_cache.index_for(None, r, cache_dir=settings.data_dir / "cache", dbk=bm25_cache.db_key(DB_URL))
        for r in rows
    ]
    out["index"] = {
        "terms_median": statistics.median(p.n_terms for p in parts),
        "postings_median": statistics.median(len(p.post_doc) for p in parts),
        "union_terms": service._bm25_index(None, rows, settings, DB_URL).stats.n_terms,
        "file_mb_median": statistics.median(os.path.getsize(p) for p in _paths(n_buffers)) / 1e6,
        "files_mb": sum(os.path.getsize(p) for p in _paths(n_buffers)) / 1e6,
    }
    t0 = time.perf_counter()
    from rlm_workers.search.bm25 import union_stats

    union_stats(parts)
    out["union_stats_ms"] = (time.perf_counter() - t0) * 1000
    return out


def merged(n_buffers: int) -> dict:
    """The old path's merged index over the same buffers: cost, size, latency, and equality of results."""
    import search_corpus

    from rlm_workers.config import get_settings
    from rlm_workers.search import bm25_cache
    from rlm_workers.search.bm25 import BM25Index
    from rlm_workers.search.tokenize import tokenize

    settings = get_settings()
    rows = _rows(n_buffers)
    parts = [
        bm25_cache.index_for(None, r, cache_dir=settings.data_dir / "cache", dbk=bm25_cache.db_key(DB_URL))
        for r in rows
    ]
    t0 = time.perf_counter()
    big = BM25Index.merge(parts)
    out: dict = {"merge_s": time.perf_counter() - t0}
    out["mb"] = (
        sum(
            a.nbytes
            for a in (
                big.chunk_ids,
                big.doc_len,
                big.term_hash,
                big.term_off,
                big.term_blob,
                big.indptr,
                big.post_doc,
                big.post_tf,
            )
        )
        / 1e6
    )
    ms, same = [], 0
    for q in search_corpus.QUERIES:
        tokens = tokenize(q)
        t0 = time.perf_counter()
        want = big.top_k(tokens, 10)
        ms.append((time.perf_counter() - t0) * 1000)
        same += _query(rows, tokens, 10) == want
    out["top_k_ms"] = ms
    out["same"] = same
    out["queries"] = len(search_corpus.QUERIES)
    out["mem"] = memory()
    return out


def report(run: dict) -> str:
    w, s = run["warm"], run["warm"]["series"]
    p50, p95 = harness.percentile(s["total"], 50), harness.percentile(s["total"], 95)
    cold = run["cold"]
    cold_first = [c["first_s"] for c in cold]
    mem = w["mem_after"]
    ix = w["index"]
    lines = [
        "### BM25 over all 100 buffers (`bench/bm25_many.py`)",
        "",
        f"- command: `{run['command']}`",
        f"- run finished (`date -u`): {run['finished']}; machine: {run['machine']}; revision {run['revision']}",
        f"- share of the CPU used by other processes just before / during the timed queries: "
        f"{run['busy_before']:.0%} / {run['busy_during']:.0%}; load average before / after: "
        f"{run['load_before']} / {run['load_after']}"
        + (" (**busy machine**: other processes shared the CPU)" if run["busy_during"] >= 0.15 else ""),
        f"- {run['buffers']} buffers × {N_CHUNKS:,} chunks: the million bench's text (its first 100k real chunks, "
        "ten distinct sets of 10k, each in ten buffers under fresh chunk ids), BM25 only: each buffer's index "
        "built by `BM25Index.build` and saved where `bm25_cache` finds it, as `rlm load` leaves it; no "
        f"PostgreSQL. Per buffer: {ix['terms_median']:,.0f} terms, {ix['postings_median']:,.0f} postings, a "
        f"{ix['file_mb_median']:.1f} MB file (median); {ix['files_mb']:.0f} MB for all; the union's vocabulary: "
        f"{ix['union_terms']:,} terms.",
        f"- queries: the 50 questions of `bench/search.py` × {run['rounds']} rounds through `service._bm25_index` "
        "(what `rank` calls) and `top_k(tokenize(q), 10)`, one process, one thread.",
        "",
        "| what | value |",
        "| --- | ---: |",
        f"| warm, top 10 over {run['buffers']} buffers: p50 / p95 / mean / max | **{p50:.1f}** / {p95:.1f} / "
        f"{statistics.mean(s['total']):.1f} / {max(s['total']):.1f} ms |",
        f"| of which finding the indexes and the union's statistics (cached), p50 | "
        f"{harness.percentile(s['index'], 50):.2f} ms |",
        f"| of which scoring (`top_k`), p50 | {harness.percentile(s['top_k'], 50):.1f} ms |",
        f"| warm, top 20 (a hybrid search's depth): p50 / p95 | {harness.percentile(w['top20'], 50):.1f} / "
        f"{harness.percentile(w['top20'], 95):.1f} ms |",
        f"| first query in a fresh process (map {run['buffers']} files, the union's statistics, score), "
        f"{len(cold)} runs | **{' / '.join(f'{x * 1000:.0f}' for x in cold_first)} ms** |",
        f"| its imports before that (`search.service`), median | "
        f"{statistics.median(c['import_s'] for c in cold) * 1000:.0f} ms |",
        f"| its second query | {statistics.median(c['second_s'] for c in cold) * 1000:.0f} ms |",
        f"| the union's statistics alone ({run['buffers']} buffers, once per set of buffer versions) | "
        f"{w['union_stats_ms']:.0f} ms |",
        f"| first query of the warm process (same work as a cold one, imports aside) | {w['first_ms']:.0f} ms |",
        f"| worker RSS after the queries: heap (RssAnon) / mapped files (RssFile) | {mem['RssAnon']:.0f} MB / "
        f"{mem['RssFile']:.0f} MB |",
        f"| heap before the first query (imports only) | {w['mem_start']['RssAnon']:.0f} MB |",
        f"| index files mapped | {mem['mapped_files']} ({mem['mapped_mb']:.0f} MB) |",
        "| fresh process after its first query: heap / mapped | "
        f"{statistics.median(c['RssAnon'] for c in cold):.0f} MB / "
        f"{statistics.median(c['RssFile'] for c in cold):.0f} MB |",
    ]
    if "merged" in run:
        m = run["merged"]
        lines += [
            f"| for comparison, the merged index the old path built: build (`BM25Index.merge`, files mapped) | "
            f"{m['merge_s']:.1f} s |",
            f"| its size | {m['mb']:.0f} MB |",
            f"| top 10 on it alone, p50 / p95 | {harness.percentile(m['top_k_ms'], 50):.1f} / "
            f"{harness.percentile(m['top_k_ms'], 95):.1f} ms |",
            f"| queries whose top 10 (ids and scores) equal the union's exactly | {m['same']} of {m['queries']} |",
        ]
    lines += [
        "",
        "RssFile counts the pages of the mapped index files this process touched: page cache, shared with every "
        "other process mapping the same files and dropped by the kernel under memory pressure, not heap. The cold "
        "runs found the files in the page cache (the build or an earlier run had read them), as a restarted "
        "worker on a live machine would; a cold page cache adds the disk reads of the postings a query touches.",
        "",
        f"- warm p50 ≤ {TARGET_P50_MS:.0f} ms: **{'met' if p50 <= TARGET_P50_MS else 'MISSED'}** ({p50:.1f} ms); "
        f"first query after a restart ≤ {TARGET_COLD_S:.0f} s: "
        f"**{'met' if max(cold_first) <= TARGET_COLD_S else 'MISSED'}** (worst {max(cold_first):.2f} s; "
        f"{max(c['first_s'] + c['import_s'] for c in cold):.2f} s counting the process's imports).",
    ]
    return "\n".join(lines)


def _own_cpu() -> float:
    """CPU seconds of this process and its finished children (the cold runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--buffers", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--no-merged", action="store_true", help="skip the merged-index comparison (~1 GB, minutes)")
    ap.add_argument("--wait-quiet", type=float, default=60, help="seconds to wait for a quiet CPU before timing")
    ap.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cold", metavar="QUERY", help=argparse.SUPPRESS)
    args = ap.parse_args()
    harness.isolated_env("bm25-many")
    if args.cold is not None:
        cold_child(args.buffers, args.cold)
        return
    if args.build_only:
        print(json.dumps(build(args.buffers)))
        return

    import search_corpus

    t_start = time.perf_counter()
    # the corpus (~1 GB in memory) is built in a child, so this process's memory is a worker's
    subprocess.run([sys.executable, __file__, "--build-only", "--buffers", str(args.buffers)], check=True)
    run: dict = {"buffers": args.buffers, "rounds": args.rounds, "command": harness.command_line()}
    run["machine"] = harness.machine_line()
    run["revision"] = harness.revision()
    run["busy_before"] = harness.wait_for_quiet(args.wait_quiet)
    run["load_before"] = harness.loadavg()
    others, cpu0 = harness.OtherCpu(), _own_cpu()
    cold = []
    for i in range(args.cold_runs):
        proc = subprocess.run(
            [sys.executable, __file__, "--cold", search_corpus.QUERIES[3 + i], "--buffers", str(args.buffers)],
            check=True,
            capture_output=True,
            text=True,
        )
        cold.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"cold: {cold[-1]}", flush=True)
    run["cold"] = cold
    run["warm"] = warm(args.buffers, args.rounds)
    run["busy_during"] = others.share(_own_cpu() - cpu0)
    run["load_after"] = harness.loadavg()
    print(f"warm p50 {harness.percentile(run['warm']['series']['total'], 50):.1f} ms", flush=True)
    if not args.no_merged:
        run["merged"] = merged(args.buffers)
        print(f"merged: { {k: v for k, v in run['merged'].items() if k != 'top_k_ms'} }", flush=True)
    run["finished"] = time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())
    md = report(run) + f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s."
    harness.publish("bm25-many", md, None, write=not args.no_write)


if __name__ == "__main__":
    main()
