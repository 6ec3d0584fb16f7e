"""BM25 indexes per buffer version: on disk, mapped into memory, rebuilt only on change.

A query must never re-tokenise a buffer.  Chunk tokens are stored with the
chunk at load time; the index built from them is saved under
``RLM_DATA_DIR/cache/bm25`` keyed by (buffer id, version, tokenizer version),
and every process maps that file read-only (``BM25Index.load``), so a fresh
``rlm search`` or a restarted worker maps files instead of rebuilding, and the
kernel's page cache, shared by all processes, holds the bytes.  A new load
bumps the buffer version, which is the invalidation.

A search over several buffers scores their indexes as one corpus
(``BM25Union``); the statistics of that union are kept here per set of buffer
versions, small enough to keep many.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..store.buffers import BufferRow, iter_terms
from .bm25 import BM25Index, BM25Union, CorpusStats, union_stats

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.search")

#: bump when tokenize() changes, so old cache files are never read
TOKENIZER_VERSION = 1
#: mapped indexes kept open: each holds one file descriptor and ~1 KB of heap (its bytes are page cache)
_MEMORY_SLOTS = 256
#: statistics of buffer sets: four numbers each
_STATS_SLOTS = 1024

_mem: OrderedDict[tuple, BM25Index] = OrderedDict()
_stats: OrderedDict[tuple, CorpusStats] = OrderedDict()
_lock = threading.Lock()


def cache_path(cache_dir: Path, db_key: str, buf: BufferRow) -> Path:
    """Where the index of this buffer version lives."""
    return cache_dir / "bm25" / f"{db_key}-b{buf.id}-v{buf.version}-t{TOKENIZER_VERSION}.npz"


def db_key(url: str) -> str:
    """Different databases must not share cache files (ids collide across them)."""
    return hashlib.sha256(url.encode()).hexdigest()[:12]


def index_for(conn: psycopg.Connection, buf: BufferRow, *, cache_dir: Path, dbk: str) -> BM25Index:
    key = (dbk, buf.id, buf.version, TOKENIZER_VERSION)
    with _lock:
        idx = _mem.get(key)
        if idx is not None:
            _mem.move_to_end(key)
            return idx
    path = cache_path(cache_dir, dbk, buf)
    idx = None
    if path.exists():
        try:
            idx = BM25Index.load(path)
        except Exception as exc:  # a corrupt (or older-format) cache file is rebuilt, never fatal
            log.warning("rebuilding unreadable BM25 cache %s: %s", path, exc)
    if idx is None:
        idx = BM25Index.build(iter_terms(conn, buffer_id=buf.id))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            idx.save(path)
            _prune(path.parent, dbk, buf, keep=path)
            idx = BM25Index.load(path)  # the mapped file, so the built arrays leave the heap
        except Exception as exc:  # the cache is an optimisation: the index just built still answers
            log.warning("could not write or map BM25 cache %s: %s", path, exc)
    with _lock:
        _mem[key] = idx
        while len(_mem) > _MEMORY_SLOTS:
            _mem.popitem(last=False)
    return idx


def union_of(dbk: str, bufs: Sequence[BufferRow], parts: Sequence[BM25Index]) -> BM25Union:
    """Several buffers' indexes (``parts`` in ``bufs`` order) scored as one, their union's statistics kept."""
    key = (dbk, tuple((b.id, b.version) for b in bufs), TOKENIZER_VERSION)
    with _lock:
        stats = _stats.get(key)
        if stats is not None:
            _stats.move_to_end(key)
    if stats is None:
        stats = union_stats(parts)
        with _lock:
            _stats[key] = stats
            while len(_stats) > _STATS_SLOTS:
                _stats.popitem(last=False)
    return BM25Union(parts, stats)


def _prune(folder: Path, dbk: str, buf: BufferRow, *, keep: Path) -> None:
    for old in folder.glob(f"{dbk}-b{buf.id}-v*.npz"):
        if old != keep:
            old.unlink(missing_ok=True)
