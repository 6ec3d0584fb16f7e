"""BM25 indexes per buffer version: in memory, on disk, rebuilt only on change.

A query must never re-tokenise a buffer.  Chunk tokens are stored with the
chunk at load time; the index built from them is kept in this process and
saved under ``RLM_DATA_DIR/cache/bm25`` keyed by (buffer id, version,
tokenizer version), so a fresh ``rlm search`` process loads a file instead of
rebuilding.  A new load bumps the buffer version, which is the invalidation.
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
from .bm25 import BM25Index

if TYPE_CHECKING:
    import psycopg

    from .bm25 import BM25Index

log = logging.getLogger("rlm.search")

#: bump when tokenize() changes, so old cache files are never read
TOKENIZER_VERSION = 1
_MEMORY_SLOTS = 16

_mem: OrderedDict[tuple, BM25Index] = OrderedDict()
_lock = threading.Lock()


def _cache_path(cache_dir: Path, db_key: str, buf: BufferRow) -> Path:
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
    path = _cache_path(cache_dir, dbk, buf)
    idx = None
    if path.exists():
        try:
            idx = BM25Index.load(path)
        except Exception as exc:  # a corrupt cache file is rebuilt, never fatal
            log.warning("rebuilding unreadable BM25 cache %s: %s", path, exc)
    if idx is None:
        idx = BM25Index.build(iter_terms(conn, buffer_id=buf.id))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            idx.save(path)
            _prune(path.parent, dbk, buf, keep=path)
        except OSError as exc:
            log.warning("could not write BM25 cache %s: %s", path, exc)
    with _lock:
        _mem[key] = idx
        while len(_mem) > _MEMORY_SLOTS:
            _mem.popitem(last=False)
    return idx


def merged_index(dbk: str, bufs: Sequence[BufferRow], parts: Sequence[BM25Index]) -> BM25Index:
    """One index over several buffers (``parts`` in ``bufs`` order), kept in memory with the single ones."""
    key = (dbk, "merged", tuple((b.id, b.version) for b in bufs), TOKENIZER_VERSION)
    with _lock:
        merged = _mem.get(key)
    if merged is None:
        merged = BM25Index.merge(parts)
        with _lock:
            _mem[key] = merged
    return merged


def _prune(folder: Path, dbk: str, buf: BufferRow, *, keep: Path) -> None:
    for old in folder.glob(f"{dbk}-b{buf.id}-v*.npz"):
        if old != keep:
            old.unlink(missing_ok=True)
