"""What ``bench/search.py`` measures: timed searches split into phases, the recall study against exact search,
the million-chunk build and queries, the cold start, PostgreSQL's memory.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from search_corpus import (  # noqa: E402
    QUERIES,
    SEED,
    TARGET_HYBRID_P50_MS,
    Corpus,
    Plan,
    existing_ok,
    vacuum,
    warm_bm25,
    write_buffer,
)

EF_VALUES = (40, 100, 200, 400)
TARGET_RECALL = 0.95


def timed_search(conn, settings, url: str, names: list[str], query: str, mode: str) -> float:
    """Milliseconds of one top-10 `rlm search` call, query encoding included (as a fresh `rlm search` pays it)."""
    from rlm_workers.search.service import query_vector, search
    from rlm_workers.store.buffers import DEFAULT_TENANT

    query_vector.cache_clear()
    t0 = time.perf_counter()
    search(
        conn,
        settings=settings,
        url=url,
        tenant=DEFAULT_TENANT,
        buffers=names,
        query=query,
        mode=mode,
        top_k=10,
        threshold=-1.0,
    )
    return (time.perf_counter() - t0) * 1000


def _exact_top(conn, buffer_ids: list[int], vec, k: int, windows: int | None) -> list[int]:
    """Chunk ids of the exact top ``k`` as semantic_search ranks them (best window per chunk), no index used.

    ``windows`` None: over every window.  An int: only the ``windows`` nearest windows of each buffer,
    as nearest_windows fetches them, so a miss can be put on the graph or on that fetch depth.
    """
    from rlm_workers.store import vectors

    if windows is None:
        arms = " UNION ALL ".join(f"SELECT chunk_id, embedding FROM {vectors.vector_table(b)}" for b in buffer_ids)
        sql = (
            f"SELECT chunk_id, max(1 - (embedding::vector <=> %(q)s)) AS s FROM ({arms}) AS w "
            "GROUP BY chunk_id ORDER BY s DESC, chunk_id LIMIT %(k)s"
        )
    else:
        arms = " UNION ALL ".join(
            f"(SELECT chunk_id, embedding::vector <=> %(q)s AS d FROM {vectors.vector_table(b)} ORDER BY d LIMIT %(n)s)"
            for b in buffer_ids
        )
        sql = (
            f"SELECT chunk_id, max(1 - d) AS s FROM ({arms}) AS w "
            "GROUP BY chunk_id ORDER BY s DESC, chunk_id LIMIT %(k)s"
        )
    with conn.transaction():
        conn.execute("SET LOCAL enable_indexscan = off")
        conn.execute("SET LOCAL enable_bitmapscan = off")
        rows = conn.execute(sql, {"q": vec, "k": k, "n": windows}).fetchall()
    return [r[0] for r in rows]


def recall_study(conn, settings, url: str, cases: dict[str, list[str]], efs: tuple[int, ...], rounds: int) -> dict:
    """HNSW recall@10 against exact search, and search latency, for each case (a list of buffers) and ef_search.

    Recall compares chunk ids: the semantic arm's top 10 (``semantic_search`` with the ef under test) against
    the exact top 10 of the same query (every window, best window per chunk, no index).  Both the
    semantic-mode depth (top_k 10) and the hybrid arm's depth (2 × top_k) are measured.
    """
    from rlm_workers.search import semantic
    from rlm_workers.search.service import query_vector
    from rlm_workers.store.buffers import DEFAULT_TENANT, require_buffers

    vecs = [query_vector(settings.embedding_model, q, "torch") for q in QUERIES]
    fanout = semantic._WINDOW_FANOUT
    out: dict = {"cases": {}}
    saved = semantic.EF_SEARCH
    try:
        for label, names in cases.items():
            ids = [r.id for r in require_buffers(conn, tenant=DEFAULT_TENANT, names=names)]
            conn.commit()
            truth = [_exact_top(conn, ids, v, 10, None) for v in vecs]
            capped = {d: [_exact_top(conn, ids, v, 10, d * fanout) for v in vecs] for d in (10, 20)}
            res: dict = {"buffers": names, "ef": {}}
            res["fanout_recall"] = {
                d: statistics.mean(len(set(c) & set(t)) / max(1, len(t)) for c, t in zip(cs, truth, strict=True))
                for d, cs in capped.items()
            }
            for ef in efs:
                semantic.EF_SEARCH = ef
                rec = {}
                for depth in (10, 20):
                    got = [
                        [
                            n.chunk_id
                            for n in semantic.semantic_search(
                                conn, buffer_ids=ids, query_vec=v, limit=depth, threshold=None
                            )
                        ][:10]
                        for v in vecs
                    ]
                    rec[depth] = [len(set(g) & set(t)) / max(1, len(t)) for g, t in zip(got, truth, strict=True)]
                conn.commit()
                res["ef"][ef] = {"recall": rec, "semantic": [], "hybrid": []}
            # latency: ef values take turns query by query, so a burst of other load hits them alike; each
            # (ef, mode) gets a different query at each turn, or the later ones would find the graph pages of
            # the same query vector still in shared_buffers and look faster than they are
            for _ in range(rounds):
                for i in range(len(QUERIES)):
                    for j, ef in enumerate(efs):
                        semantic.EF_SEARCH = ef
                        for m, mode in enumerate(("semantic", "hybrid")):
                            qq = QUERIES[(i + 6 * (2 * j + m)) % len(QUERIES)]
                            res["ef"][ef][mode].append(timed_search(conn, settings, url, names, qq, mode))
            out["cases"][label] = res
            line = ", ".join(
                f"ef {ef}: recall {statistics.mean(r['recall'][10]):.3f}/{statistics.mean(r['recall'][20]):.3f} "
                f"hybrid p50 {harness.percentile(r['hybrid'], 50):.1f} ms"
                for ef, r in res["ef"].items()
            )
            print(f"recall {label}: {line}", flush=True)
    finally:
        semantic.EF_SEARCH = saved
    return out


def choose_ef(study: dict, efs: tuple[int, ...]) -> int | None:
    """The smallest ef_search meeting the recall target (both depths) in every case at hybrid p50 within target."""
    for ef in sorted(efs):
        ok = True
        for res in study["cases"].values():
            r = res["ef"][ef]
            if min(statistics.mean(r["recall"][10]), statistics.mean(r["recall"][20])) < TARGET_RECALL:
                ok = False
            if harness.percentile(r["hybrid"], 50) > TARGET_HYBRID_P50_MS:
                ok = False
        if ok:
            return ef
    return None


MILLION_BUFFERS, MILLION_CHUNKS = 100, 10_000
TARGET_MILLION_P50_MS = 150.0


def postgres_memory(data_dir: Path) -> dict:
    """RSS and PSS (shared pages split among the processes that map them) of the embedded server's processes."""
    out = {"procs": 0, "rss_mb": 0.0, "pss_mb": 0.0}
    try:
        pid = int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return out
    pids = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    out["rss_mb"] += int(line.split()[1]) / 1024
                elif line.startswith("Pss:"):
                    out["pss_mb"] += int(line.split()[1]) / 1024
            out["procs"] += 1
        except (OSError, ValueError, IndexError):
            continue
    return out


def _bm25_mb(idx) -> float:
    """Bytes one BM25 index's arrays span (mapped from its cache file since issue #29: page cache, not heap)."""
    names = ("chunk_ids", "doc_len", "term_hash", "term_off", "term_blob", "indptr", "post_doc", "post_tf")
    return sum(getattr(idx, n).nbytes for n in names if hasattr(idx, n)) / 1e6


def _du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6 if path.exists() else 0.0


def million_build(conn, corpus: Corpus, per_chunk: int, data_dir: Path) -> dict:
    """100 buffers × 10k chunks, each written and indexed in its own transaction; resumable buffer by buffer."""
    import json

    path = data_dir / "build-1m.json"
    try:
        done = json.loads(path.read_text())
    except (OSError, ValueError):
        done = {}
    span = corpus.n_chunks // MILLION_CHUNKS
    t_all, built = time.perf_counter(), 0
    for i in range(MILLION_BUFFERS):
        # ten distinct sets of text, each in ten buffers (fresh chunk ids, fresh random vectors)
        lo = (i % span) * MILLION_CHUNKS
        plan = Plan(f"m{i:03d}", list(range(lo, lo + MILLION_CHUNKS)), per_chunk=per_chunk, seed=SEED + 1000 + i)
        if plan.name in done and existing_ok(conn, plan, per_chunk * MILLION_CHUNKS):
            conn.rollback()
            continue
        conn.rollback()
        st = write_buffer(conn, plan, corpus)
        vacuum(conn, [f"chunk_vectors_b{st['id']}"])
        st["bm25_s"] = warm_bm25(conn, plan.name)
        done[plan.name] = st
        path.write_text(json.dumps(done))
        built += 1
        left = MILLION_BUFFERS - len(done)
        print(
            f"{plan.name}: copy {st['copy_s']:.1f} s, index {st['index_s']:.1f} s, bm25 {st['bm25_s']:.1f} s; "
            f"{left} left (~{left * (time.perf_counter() - t_all) / built / 60:.0f} min)",
            flush=True,
        )
    vacuum(conn, ["buffers", "files", "chunks"])
    return done


def million_facts(conn, data_dir: Path) -> dict:
    def one(sql: str):
        return conn.execute(sql).fetchone()[0]

    facts = {
        "pg": one("SHOW server_version"),
        "vector": one("SELECT extversion FROM pg_extension WHERE extname = 'vector'"),
        "shared_buffers": one("SHOW shared_buffers"),
        "db_bytes": int(one("SELECT pg_database_size(current_database())")),
        "chunks_bytes": int(one("SELECT pg_total_relation_size('chunks')")),
        "vec_heap_bytes": int(
            one(
                "SELECT coalesce(sum(pg_relation_size(oid)), 0) FROM pg_class WHERE relname ~ '^chunk_vectors_b[0-9]+$'"
            )
        ),
        "hnsw_bytes": int(
            one(
                "SELECT coalesce(sum(pg_relation_size(oid)), 0) FROM pg_class "
                "WHERE relname ~ '^chunk_vectors_b[0-9]+_hnsw$'"
            )
        ),
        "chunks": int(one("SELECT count(*) FROM chunks")),
        "vector_tables": int(one("SELECT count(*) FROM pg_class WHERE relname ~ '^chunk_vectors_b[0-9]+$'")),
    }
    conn.commit()
    facts["pg_dir_mb"] = _du_mb(data_dir / "pg")
    facts["bm25_cache_mb"] = _du_mb(data_dir / "cache" / "bm25")
    return facts


def million_queries(conn, settings, url: str, groups: dict[str, list[str]], modes: list[str], rounds: int) -> dict:
    """p50/p95 per (group, mode) at top_k 10; the first query of each group (BM25 loads, merge) apart."""
    from rlm_workers.search import bm25_cache

    def one(names: list[str], query: str, mode: str) -> float:
        return timed_search(conn, settings, url, names, query, mode)

    with bm25_cache._lock:
        bm25_cache._mem.clear()
    out: dict = {"first": {}, "series": {}}
    one(["m099"], QUERIES[0], "semantic")  # loads the query encoder, so the first-query times below are BM25's
    for label, names in groups.items():
        out["first"][label] = one(names, QUERIES[0], "hybrid")
        print(f"1M first {label}: {out['first'][label]:.0f} ms", flush=True)
    series = {(label, mode): [] for label in groups for mode in modes}
    n = len(QUERIES)
    for _ in range(rounds):
        for i in range(n):
            for c, (label, mode) in enumerate(series):
                series[(label, mode)].append(one(groups[label], QUERIES[(i + 5 * c) % n], mode))
    out["series"] = series
    with bm25_cache._lock:
        held = dict(bm25_cache._mem)
    # Past the in-memory slots: bm25 over all 100 buffers (1M chunks), the first query and ten more.
    every = [f"m{i:03d}" for i in range(MILLION_BUFFERS)]
    times = [one(every, QUERIES[i], "bm25") for i in range(11)]
    with bm25_cache._lock:
        merged_all = [x for key, x in bm25_cache._mem.items() if key[1] == "merged" and len(key[2]) == len(every)]
    out["bm25_all"] = {
        "first": times[0],
        "p50": statistics.median(times[1:]),
        "max": max(times[1:]),
        "merged_mb": _bm25_mb(merged_all[0]) if merged_all else float("nan"),
        "slots": bm25_cache._MEMORY_SLOTS,
    }
    if merged_all:
        # what such a query would cost if the merged index were found before its parts are loaded
        from rlm_workers.search.tokenize import tokenize

        ms = []
        for qq in QUERIES:
            t0 = time.perf_counter()
            merged_all[0].top_k(tokenize(qq), 20)
            ms.append((time.perf_counter() - t0) * 1000)
        out["bm25_all"]["merged_top_k_p50"] = statistics.median(ms)
        out["bm25_all"]["merged_top_k_p95"] = harness.percentile(ms, 95)
    print(f"1M bm25 over all buffers: {out['bm25_all']}", flush=True)
    sizes = {key: _bm25_mb(x) for key, x in held.items()}
    merged = [mb for key, mb in sizes.items() if key[1] == "merged"]
    single = [mb for key, mb in sizes.items() if key[1] != "merged"]
    out["bm25_mb"] = {
        "held": len(held),
        "total": sum(sizes.values()),
        "single": statistics.median(single) if single else float("nan"),
        "merged": max(merged) if merged else float("nan"),
    }
    return out


class Phases:
    """Per-call time spent in the functions service.search() calls, by wrapping them."""

    LABELS = (
        "buffers",
        "bm25_index",
        "bm25_top_k",
        "encoder_load",
        "encode_query",
        "pgvector",
        "fusion",
        "fetch",
        "passage",
    )

    def __init__(self) -> None:
        self.cur: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def install(self) -> None:
        from rlm_workers.ingest import embed, fastbert, onnxenc
        from rlm_workers.search import bm25, service

        # service imports these names at module level, so patch them where service looks them up
        self.wrap(service, "require_buffers", "buffers")
        self.wrap(service, "_bm25_index", "bm25_index")
        self.wrap(service, "get_chunks", "fetch")
        self.wrap(service, "_passage", "passage")  # per hit: a slice of the chunk, or a re-cut of an old row
        self.wrap(service, "semantic_search", "pgvector")
        self.wrap(embed, "get_query_encoder", "encoder_load")  # a dict lookup once loaded
        self.wrap(service, "fuse_arms", "fusion")
        self.wrap(bm25.BM25Index, "top_k", "bm25_top_k")
        self.wrap(bm25.BM25Union, "top_k", "bm25_top_k")  # several buffers
        self.wrap(fastbert.FastBertEncoder, "encode_query", "encode_query")
        self.wrap(embed.Embedder, "encode_query", "encode_query")
        self.wrap(onnxenc.OnnxEncoder, "encode_query", "encode_query")

    def take(self) -> dict[str, float]:
        out, self.cur = dict(self.cur), defaultdict(float)
        return out


@dataclass
class Series:
    total: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    hits: list[int] = field(default_factory=list)

    def add(self, seconds: float, phases: dict[str, float], hits: int) -> None:
        self.total.append(seconds * 1000)
        for label in Phases.LABELS:
            self.phases[label].append(phases.get(label, 0.0) * 1000)
        self.phases["other"].append(seconds * 1000 - sum(phases.values()) * 1000)
        self.hits.append(hits)


def run_queries(
    conn, settings, url: str, names: list[str], modes: list[str], top_ks: list[int], phases: Phases, rounds: int
) -> tuple[dict, dict[tuple[str, int], Series]]:
    from rlm_workers.search import bm25_cache
    from rlm_workers.search.service import query_vector, search
    from rlm_workers.store.buffers import DEFAULT_TENANT

    def one(query: str, mode: str, k: int) -> tuple[float, dict[str, float], int]:
        phases.take()
        query_vector.cache_clear()  # each timed search encodes its query, as a fresh `rlm search` does
        t0 = time.perf_counter()
        # threshold -1: random vectors never reach the default 0.3, and an empty semantic
        # arm would make semantic/hybrid skip the work a real buffer makes them do
        hits = search(
            conn,
            settings=settings,
            url=url,
            tenant=DEFAULT_TENANT,
            buffers=names,
            query=query,
            mode=mode,
            top_k=k,
            threshold=-1.0,
        )
        dt = time.perf_counter() - t0
        return dt, phases.take(), len(hits)

    # The first query of a process loads the BM25 index from its cache file (as a fresh
    # `rlm search` would) and, on first use, the query encoder: reported apart, not in p50/p95.
    with bm25_cache._lock:
        bm25_cache._mem.clear()
    dt, ph, n = one(QUERIES[0], "hybrid", top_ks[0])
    first = {"ms": dt * 1000, "phases": {k: v * 1000 for k, v in ph.items()}, "hits": n}
    series = {(mode, k): Series() for mode in modes for k in top_ks}
    # Configurations take turns query by query, so a burst of load from another process on
    # this small box hits them all alike.  Each turn gives each configuration a *different*
    # query (rotated by `stride`), or the later ones would find the HNSW pages of the same
    # query vector still in shared_buffers and look faster than they are.
    n, stride = len(QUERIES), max(1, len(QUERIES) // len(series))
    for _ in range(rounds):
        for i in range(n):
            for c, ((mode, k), s) in enumerate(series.items()):
                dt, ph, hits = one(QUERIES[(i + c * stride) % n], mode, k)
                s.add(dt, ph, hits)
    return first, series


def query_encoder_threads(n_threads: tuple[int, ...] = (2, 1)) -> dict[int, list[float]]:
    """encode_query latency (ms) over the query set with each torch thread count; restores the count."""
    import torch

    from rlm_workers.ingest.embed import get_query_encoder

    enc = get_query_encoder(None)
    before = torch.get_num_threads()
    out = {}
    try:
        for n in n_threads:
            torch.set_num_threads(n)
            enc.encode_query(QUERIES[0])  # warm-up
            times = []
            for q in QUERIES:
                t0 = time.perf_counter()
                enc.encode_query(q)
                times.append((time.perf_counter() - t0) * 1000)
            out[n] = times
    finally:
        torch.set_num_threads(before)
    return out


def explain_semantic(conn, name: str, k: int) -> str:
    """One full plan of the semantic arm (nearest_windows' SQL and settings) for a hybrid top_k=k search."""
    from rlm_workers.ingest.embed import get_query_encoder
    from rlm_workers.search import semantic
    from rlm_workers.store import vectors
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    from pgvector import HalfVector

    vec = HalfVector(get_query_encoder(None).encode_query(QUERIES[1]))  # the column is halfvec
    want = 2 * k * semantic._WINDOW_FANOUT
    sql = (
        f"SELECT chunk_id, 1 - d FROM ((SELECT chunk_id, embedding <=> %(q)s AS d FROM {vectors.vector_table(buf.id)} "
        "ORDER BY d LIMIT %(n)s)) AS arms"
    )
    with conn.transaction():
        conn.execute(f"SET LOCAL hnsw.ef_search = {min(vectors.MAX_EF_SEARCH, max(semantic.EF_SEARCH, want))}")
        plan = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, {"q": vec, "n": want}).fetchall()]
    # the 384 floats of the query vector say nothing and fill a screen
    return re.sub(r"'\[[^\]]*\]'::vector", "'[query vector]'::vector", "\n".join(plan))


def cold_start(name: str, query: str, mode: str | None) -> float:
    """Wall time of `rlm search` as a fresh process (embedded server already running, OS cache warm)."""
    rlm = Path(sys.executable).with_name("rlm")
    cmd = [str(rlm), "search", query, "--buffer", name] + (["--mode", mode] if mode else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    dt = time.perf_counter() - t0
    if proc.returncode not in (0, 3):  # 3 = no chunks, still a complete search
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return dt
