"""Okapi BM25 over a term-major sparse index, score-identical to ``rank_bm25.BM25Okapi``.

``rank_bm25`` keeps one dict per document and scans every document for every
query term, which is far too slow at 100k chunks.  Here postings are stored
CSC-style (``indptr`` per term, then document indexes and term frequencies),
so a query touches only the postings of its own terms.

Parity with ``BM25Okapi`` (k1=1.5, b=0.75, epsilon=0.25) is deliberate, down
to its quirks: ``idf = log(N - df + 0.5) - log(df + 0.5)``; negative idfs are
replaced by ``epsilon * average_idf`` (mean over the whole vocabulary, taken
before the replacement); duplicated query tokens count once per occurrence;
unknown tokens add nothing.  The per-document length norm is computed with the
same float64 operations in the same order, so scores match to the last bits
(but for the mean idf, which numpy sums pairwise where rank_bm25 adds one by one).

Several buffers are scored as one corpus by ``BM25Union`` without merging
their indexes: each buffer's postings are scored with the statistics of the
union (N, average length, each query term's document frequency summed over the
buffers, and the average idf over the union's vocabulary, ``union_stats``), and
each buffer's best k are merged.  The result is the one an index built over all
their documents would give (``BM25Index.merge`` is that reference).

Terms are ordered by a 64-bit hash of their UTF-8 bytes and looked up by binary
search, with the bytes compared, so an index needs no dict and no Python
strings.  Files are uncompressed .npz archives whose arrays start on 64-byte
boundaries: ``load`` maps the file and views the arrays in place, so an index
costs the worker a few hundred bytes of heap and the kernel's page cache holds
its bytes.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import struct
import tempfile
import threading
import zipfile
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import count
from pathlib import Path

import numpy as np

__all__ = ["B", "EPSILON", "K1", "BM25Index", "BM25Union", "CorpusStats", "union_stats"]

K1 = 1.5
B = 0.75
EPSILON = 0.25
_FORMAT_VERSION = 2
#: numpy's own .npy alignment; every array of a saved index starts on such a boundary in the file
_ALIGN = 64
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature, ..., name length, extra length
_PAD_EXTRA_ID = 0xA11A  # a private zip extra-field id that only pads
#: numpy reads a .npy header with ast.literal_eval, and CPython 3.11 can raise a spurious SystemError ("AST
#: constructor recursion depth mismatch", python/cpython#106905) when threads build ASTs at once
_HEADER_LOCK = threading.Lock()
#: the union's vocabulary is counted in this many slices of the hash range: a sort of one slice
#: stays in the CPU cache and the temporary arrays stay small (4x faster than one sort of everything)
_STAT_SLICES = 16
_SLICE_BOUNDS = np.array([(i << 64) // _STAT_SLICES for i in range(1, _STAT_SLICES)], dtype=np.uint64)


def _utf8(term: str) -> bytes:
    return term.encode("utf-8", "surrogatepass")


def _hashes(encoded: Iterable[bytes]) -> np.ndarray:
    """Stable 64-bit hashes (blake2b) of UTF-8 terms; Python's own ``hash`` differs per process."""
    return np.frombuffer(b"".join(hashlib.blake2b(e, digest_size=8).digest() for e in encoded), dtype="<u8")


def _raw_idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    d = df.astype(np.float64)
    return np.log(n_docs - d + 0.5) - np.log(d + 0.5)


def _floor(raw: np.ndarray, average_idf: float) -> np.ndarray:
    # "< 0" exactly as rank_bm25: an idf of exactly 0 (df == N/2) stays 0
    return np.where(raw < 0, EPSILON * average_idf, raw)


def _csc_from_triples(
    term: np.ndarray, doc: np.ndarray, tf: np.ndarray, n_terms: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort (term, doc, tf) triples term-major; docs stay ascending within a term.

    For each term, its triples must already come in ascending doc order; the
    stable sort preserves that.
    """
    # Stable sort by term via one int64 key (term, position): np.sort's SIMD path
    # is ~3x faster than argsort(kind="stable") on tens of millions of postings.
    key = term.astype(np.int64) << 32
    key |= np.arange(len(term), dtype=np.int64)
    key.sort()
    order = key & 0xFFFFFFFF
    indptr = np.zeros(n_terms + 1, dtype=np.int64)
    np.cumsum(np.bincount(term, minlength=n_terms), out=indptr[1:])
    return indptr, doc[order].astype(np.int32, copy=False), tf[order].astype(np.float32, copy=False)


def _vocab_arrays(terms: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(new id of each term, hashes, byte offsets, UTF-8 blob), terms renumbered in hash order."""
    encoded = [_utf8(t) for t in terms]
    hashes = _hashes(encoded)
    order = np.argsort(hashes, kind="stable")
    new_id = np.empty(len(terms), dtype=np.int64)
    new_id[order] = np.arange(len(terms), dtype=np.int64)
    ordered = [encoded[i] for i in order]
    offsets = np.zeros(len(terms) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in ordered], out=offsets[1:])
    blob = np.frombuffer(b"".join(ordered), dtype=np.uint8)
    return new_id, hashes[order], offsets, blob


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _write_npz(fh, arrays: dict[str, np.ndarray | np.generic]) -> None:
    """An uncompressed .npz (``np.load`` reads it) whose array data start at multiples of ``_ALIGN``.

    A zip entry's data follow its local header (30 bytes, the name, the extra field) and the
    .npy header; a padding extra field moves them onto the boundary.
    """
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            arr = np.asarray(arr)
            if not arr.flags.c_contiguous:
                arr = arr.copy()
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(arr))
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.file_size = len(head.getvalue()) + arr.nbytes
            zip64 = info.file_size * 1.05 > zipfile.ZIP64_LIMIT  # as ZipFile.open decides
            start = fh.tell() + 30 + len(info.filename.encode()) + (20 if zip64 else 0) + len(head.getvalue())
            pad = -start % _ALIGN
            if pad:
                pad += _ALIGN if pad < 4 else 0  # an extra field is at least its 4-byte header
                info.extra = struct.pack("<HH", _PAD_EXTRA_ID, pad - 4) + bytes(pad - 4)
            with zf.open(info, "w") as out:
                out.write(head.getvalue())
                out.write(arr.data.cast("B"))


def _npz_views(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an uncompressed .npz, viewing one read-only map of the file (copied only if unaligned)."""
    with open(path, "rb") as fh:
        names = {i.filename: i for i in zipfile.ZipFile(fh).infolist()}
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # keeps its own handle on the file
    out = {}
    for filename, info in names.items():
        if info.compress_type != zipfile.ZIP_STORED or not filename.endswith(".npy"):
            raise ValueError(f"{filename} is not an uncompressed array")
        sig, n_name, n_extra = _LOCAL_HEADER.unpack_from(mm, info.header_offset)
        if sig != b"PK\x03\x04":
            raise ValueError(f"{filename}: bad zip header")
        start = info.header_offset + _LOCAL_HEADER.size + n_name + n_extra
        head = io.BytesIO(mm[start : start + min(info.file_size, 1 << 16)])
        read_header = _HEADER_READERS.get(np.lib.format.read_magic(head))
        if read_header is None:
            raise ValueError(f"{filename}: unsupported .npy version")
        with _HEADER_LOCK:
            shape, fortran, dtype = read_header(head)
        if fortran or dtype.hasobject:
            raise ValueError(f"{filename}: unsupported array layout")
        offset = start + head.tell()
        n = int(np.prod(shape, dtype=np.int64))
        if offset + n * dtype.itemsize > start + info.file_size:
            raise ValueError(f"{filename}: truncated")
        arr = np.frombuffer(mm, dtype=dtype, count=n, offset=offset).reshape(shape)
        out[filename[:-4]] = arr if offset % dtype.alignment == 0 else arr.copy()
    return out


@dataclass(frozen=True)
class CorpusStats:
    """What BM25 needs of a whole corpus besides postings: N, total length, vocabulary size, sum of raw idfs."""

    n_docs: int
    total_len: int
    n_terms: int
    #: sum over the vocabulary of log(N - df + 0.5) - log(df + 0.5), before the epsilon floor
    idf_sum: float

    @property
    def average_idf(self) -> float:
        return self.idf_sum / self.n_terms if self.n_terms else 0.0


class BM25Index:
    """Immutable BM25 index over (chunk_id, tokens) documents."""

    def __init__(
        self,
        *,
        chunk_ids: np.ndarray,
        doc_len: np.ndarray,
        term_hash: np.ndarray,
        term_off: np.ndarray,
        term_blob: np.ndarray,
        indptr: np.ndarray,
        post_doc: np.ndarray,
        post_tf: np.ndarray,
    ) -> None:
        # asarray keeps a mapped file's views as they are: no copy when the dtype already matches
        self.chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        self.doc_len = np.asarray(doc_len, dtype=np.float64)
        self.term_hash = np.asarray(term_hash, dtype=np.uint64)
        self.term_off = np.asarray(term_off, dtype=np.int64)
        self.term_blob = np.asarray(term_blob, dtype=np.uint8)
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.post_doc = np.asarray(post_doc, dtype=np.int32)
        self.post_tf = np.asarray(post_tf, dtype=np.float32)
        self._check()
        # rank_bm25 sums lengths as Python ints; int64 keeps that exact
        self.total_len = int(self.doc_len.astype(np.int64).sum())

    def _check(self) -> None:
        """Consistency checks so a corrupt cache file fails loudly, not with wrong scores.

        All are O(vocabulary) but the postings' range check, one pass over them: a doc index out
        of range would otherwise wrap around (negative) in numpy indexing.
        """
        n, v, nnz = len(self.chunk_ids), len(self.term_hash), len(self.post_doc)
        if len(self.doc_len) != n or len(self.term_off) != v + 1 or len(self.indptr) != v + 1:
            raise ValueError("BM25 index arrays have inconsistent lengths")
        if self.term_off[0] != 0 or self.term_off[-1] != len(self.term_blob) or np.any(np.diff(self.term_off) < 0):
            raise ValueError("BM25 vocabulary is corrupt")
        if v and np.any(self.term_hash[1:] < self.term_hash[:-1]):
            raise ValueError("BM25 vocabulary is not in hash order")
        if (
            len(self.post_tf) != nnz
            or self.indptr[0] != 0
            or self.indptr[-1] != nnz
            or np.any(np.diff(self.indptr) < 0)
        ):
            raise ValueError("BM25 postings do not match indptr")
        if nnz and (self.post_doc.min() < 0 or self.post_doc.max() >= n):
            raise ValueError("BM25 postings reference unknown documents")

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def __repr__(self) -> str:
        return f"BM25Index(docs={len(self)}, terms={self.n_terms}, postings={len(self.post_doc)})"

    @property
    def n_terms(self) -> int:
        return len(self.term_hash)

    # ---- views for inspection and the tests; scoring uses none of them (they cost heap) ----

    @cached_property
    def terms(self) -> list[str]:
        """The vocabulary in term-id (hash) order."""
        blob, off = self.term_blob.tobytes(), self.term_off.tolist()
        return [blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip(off, off[1:], strict=False)]

    @cached_property
    def vocab(self) -> dict[str, int]:
        return dict(zip(self.terms, range(self.n_terms), strict=True))

    @cached_property
    def df(self) -> np.ndarray:
        return np.diff(self.indptr).astype(np.int32)

    @cached_property
    def idf(self) -> np.ndarray:
        return _floor(_raw_idf(self.df, len(self)), self.average_idf)

    @property
    def average_idf(self) -> float:
        return self.stats.average_idf

    @cached_property
    def stats(self) -> CorpusStats:
        raw = _raw_idf(np.diff(self.indptr), len(self))
        return CorpusStats(len(self), self.total_len, self.n_terms, float(raw.sum()))

    # ---- building, merging, files ----

    @classmethod
    def build(cls, docs: Iterable[tuple[int, Sequence[str]]]) -> BM25Index:
        """Index (chunk_id, tokens) pairs; document order is kept as given."""
        # Per-token work dominates build time, so it all runs in C: Counter counts,
        # and a defaultdict numbers unseen terms without a Python-level call.
        vocab: defaultdict[str, int] = defaultdict(count().__next__)
        ids, lens, n_unique = array("q"), array("q"), array("q")
        p_term, p_tf = array("i"), array("i")
        for cid, tokens in docs:
            counts = Counter(tokens)
            ids.append(cid)
            lens.append(len(tokens))
            n_unique.append(len(counts))
            # fromlist(list(...)) preallocates; extend() grows item by item
            p_term.fromlist(list(map(vocab.__getitem__, counts)))
            p_tf.fromlist(list(counts.values()))
        new_id, term_hash, term_off, term_blob = _vocab_arrays(list(vocab))
        p_doc = np.repeat(np.arange(len(ids), dtype=np.int32), np.frombuffer(n_unique, dtype=np.int64))
        indptr, post_doc, post_tf = _csc_from_triples(
            new_id[np.frombuffer(p_term, dtype=np.int32)], p_doc, np.frombuffer(p_tf, dtype=np.int32), len(vocab)
        )
        return cls(
            chunk_ids=np.frombuffer(ids, dtype=np.int64).copy(),
            doc_len=np.frombuffer(lens, dtype=np.int64).astype(np.float64),
            term_hash=term_hash,
            term_off=term_off,
            term_blob=term_blob,
            indptr=indptr,
            post_doc=post_doc,
            post_tf=post_tf,
        )

    @classmethod
    def merge(cls, indexes: Sequence[BM25Index]) -> BM25Index:
        """One index over the union of the documents, statistics as if built together.

        Documents keep their order (first index's docs, then the next...).  Searches use
        ``BM25Union`` instead, which gives the same ranking without building this; it stays as
        the reference the union is tested and measured against.
        """
        if len(indexes) == 1:
            return indexes[0]  # immutable, and its statistics are already the union's
        vocab: defaultdict[str, int] = defaultdict(count().__next__)  # numbers new terms in C
        first = [np.fromiter(map(vocab.__getitem__, idx.terms), dtype=np.int64, count=idx.n_terms) for idx in indexes]
        new_id, term_hash, term_off, term_blob = _vocab_arrays(list(vocab))
        remaps = [new_id[r] for r in first]
        df = np.zeros(len(vocab), dtype=np.int64)
        for idx, remap in zip(indexes, remaps, strict=True):
            df[remap] += idx.df  # remap has no repeats within one index
        indptr = np.zeros(len(vocab) + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        post_doc = np.empty(indptr[-1], dtype=np.int32)
        post_tf = np.empty(indptr[-1], dtype=np.float32)
        # No sort needed: each global posting list is the parts' lists laid end to end,
        # in index order, so docs stay ascending.  cursor[g] = next free slot of term g.
        cursor = indptr[:-1].copy()
        offset = 0
        for idx, remap in zip(indexes, remaps, strict=True):
            base = cursor[remap] - idx.indptr[:-1]
            dest = np.repeat(base, idx.df) + np.arange(len(idx.post_doc), dtype=np.int64)
            post_doc[dest] = idx.post_doc + offset
            post_tf[dest] = idx.post_tf
            cursor[remap] += idx.df
            offset += len(idx)

        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        return cls(
            chunk_ids=cat([i.chunk_ids for i in indexes], np.int64),
            doc_len=cat([i.doc_len for i in indexes], np.float64),
            term_hash=term_hash,
            term_off=term_off,
            term_blob=term_blob,
            indptr=indptr,
            post_doc=post_doc,
            post_tf=post_tf,
        )

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename): readers never see a half-written index.

        The temp name is unique per call, not per process: threads of one worker
        building the same buffer's index at once must not write into one file.
        """
        path = Path(path)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o644)  # mkstemp's 0600 would hide the file from a worker run as another user
                _write_npz(
                    fh,
                    {
                        "version": np.int64(_FORMAT_VERSION),
                        "chunk_ids": self.chunk_ids,
                        "doc_len": self.doc_len,
                        "term_hash": self.term_hash,
                        "term_off": self.term_off,
                        "term_blob": self.term_blob,
                        "indptr": self.indptr,
                        "post_doc": self.post_doc,
                        "post_tf": self.post_tf,
                    },
                )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> BM25Index:
        """The index of a file ``save`` wrote, its arrays viewing a read-only map of the file."""
        z = _npz_views(Path(path))
        version = int(z["version"]) if "version" in z else None
        if version != _FORMAT_VERSION:
            raise ValueError(f"unsupported BM25 index format {version}")
        return cls(**{k: v for k, v in z.items() if k != "version"})

    # ---- queries ----

    def find(self, encoded: Sequence[bytes], hashes: np.ndarray) -> np.ndarray:
        """Term ids of UTF-8 terms with their ``_hashes``; -1 for a term not in this index."""
        pos = np.searchsorted(self.term_hash, hashes)
        out = np.full(len(encoded), -1, dtype=np.int64)
        n = self.n_terms
        for j, (p, h) in enumerate(zip(pos.tolist(), hashes.tolist(), strict=True)):
            # the bytes decide: two terms may share a hash (then they sit side by side)
            while p < n and int(self.term_hash[p]) == h:
                if self.term_blob[self.term_off[p] : self.term_off[p + 1]].tobytes() == encoded[j]:
                    out[j] = p
                    break
                p += 1
        return out

    def get_scores(self, query_tokens: Sequence[str]) -> np.ndarray:
        """Dense (N,) float64 scores in document order, as ``BM25Okapi.get_scores``."""
        return BM25Union([self], self.stats).get_scores(query_tokens)

    def top_k(self, query_tokens: Sequence[str], k: int) -> list[tuple[int, float]]:
        """Best k (chunk_id, score) among docs containing a query term; ties by ascending chunk_id."""
        return BM25Union([self], self.stats).top_k(query_tokens, k)


def union_stats(parts: Sequence[BM25Index]) -> CorpusStats:
    """Statistics of the corpus made of ``parts``' documents, without merging their postings.

    The vocabulary is the union of the parts' term hashes: a term's df is the sum of its dfs.
    Two distinct terms sharing a 64-bit hash would count as one (odds ~V²/2^65: about 1e-8 at a
    million distinct terms), moving only the average idf of the epsilon floor, by ~1/V.
    Memory: the parts' hashes and dfs of one slice of the hash range at a time (~1/16 of them),
    and one float64 per distinct term.
    """
    if len(parts) == 1:
        return parts[0].stats
    n_docs = sum(len(p) for p in parts)
    total_len = sum(p.total_len for p in parts)
    cuts = [np.concatenate(([0], np.searchsorted(p.term_hash, _SLICE_BOUNDS), [p.n_terms])) for p in parts]
    raw = []
    for s in range(_STAT_SLICES):
        hashes = np.concatenate([p.term_hash[c[s] : c[s + 1]] for p, c in zip(parts, cuts, strict=True)])
        if not len(hashes):
            continue
        dfs = np.concatenate([np.diff(p.indptr[c[s] : c[s + 1] + 1]) for p, c in zip(parts, cuts, strict=True)])
        order = np.argsort(hashes)
        hashes, dfs = hashes[order], dfs[order]
        starts = np.flatnonzero(np.concatenate(([True], hashes[1:] != hashes[:-1])))
        raw.append(_raw_idf(np.add.reduceat(dfs, starts), n_docs))
    # one sum over the whole vocabulary in hash order, as a merged index sums it: the same bits
    idf = np.concatenate(raw) if raw else np.zeros(0)
    return CorpusStats(n_docs, total_len, len(idf), float(idf.sum()))


def _accumulate(hits: list[tuple[np.ndarray, np.ndarray]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate doc indexes (ascending) of one part and their summed scores, added in ``hits`` order."""
    n_post = sum(len(d) for d, _ in hits)
    if n_post * 16 < n:
        # rare terms: sorting the few postings beats a pass over all N docs
        cand = np.unique(np.concatenate([d for d, _ in hits]))
        scores = np.zeros(len(cand), dtype=np.float64)
        for docs, contrib in hits:
            scores[np.searchsorted(cand, docs)] += contrib
        return cand, scores
    # frequent terms: dense accumulators are O(N + postings) with no sort
    dense = np.zeros(n, dtype=np.float64)
    seen = np.zeros(n, dtype=bool)
    for docs, contrib in hits:
        dense[docs] += contrib  # docs are unique within one posting list
        seen[docs] = True
    cand = np.flatnonzero(seen)
    return cand, dense[cand]


def _at_least_kth(cids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every candidate scoring at least the k-th best: the best k and all tied with the k-th."""
    if k >= len(scores):
        return cids, scores
    # argpartition picks arbitrarily among ties at the cut, so every tie is kept for the final sort
    kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
    keep = np.flatnonzero(scores >= kth)
    return cids[keep], scores[keep]


class BM25Union:
    """Several indexes scored as one corpus: their documents in order, with ``stats`` of the union.

    Scores and order are those of ``BM25Index.merge(parts)`` (chunk ids must be distinct across
    parts, as database ids are); nothing of size N or vocabulary is built per query.
    """

    def __init__(self, parts: Sequence[BM25Index], stats: CorpusStats | None = None) -> None:
        self.parts = list(parts)
        self.stats = stats if stats is not None else union_stats(self.parts)

    def __len__(self) -> int:
        return self.stats.n_docs

    def _contributions(self, query_tokens: Sequence[str]):
        """Per part with a hit: (its position, [(doc indexes, contributions)] in query-token order)."""
        st = self.stats
        if not query_tokens or st.n_docs == 0 or st.total_len == 0:
            return  # no postings anywhere
        distinct = list(dict.fromkeys(query_tokens))
        encoded = [_utf8(t) for t in distinct]
        hashes = _hashes(encoded)
        tids = [p.find(encoded, hashes) for p in self.parts]
        df = np.zeros(len(distinct), dtype=np.int64)
        for p, t in zip(self.parts, tids, strict=True):
            have = t >= 0
            df[have] += p.indptr[t[have] + 1] - p.indptr[t[have]]
        idf = _floor(_raw_idf(df, st.n_docs), st.average_idf)
        avgdl = st.total_len / st.n_docs
        slot = {q: j for j, q in enumerate(distinct)}
        order = [slot[q] for q in query_tokens]
        for i, (p, t) in enumerate(zip(self.parts, tids, strict=True)):
            per_term = {}
            for j in np.flatnonzero(t >= 0).tolist():
                lo, hi = p.indptr[t[j]], p.indptr[t[j] + 1]
                docs = p.post_doc[lo:hi]
                tf = p.post_tf[lo:hi].astype(np.float64)
                # k1 * (1 - b + b * dl / avgdl) in rank_bm25's operation order, for these docs only
                norm = K1 * (1 - B + B * p.doc_len[docs] / avgdl)
                per_term[j] = (docs, idf[j] * (tf * (K1 + 1) / (tf + norm)))
            if per_term:
                # a duplicated query token adds its contribution again, in token order as rank_bm25
                yield i, [per_term[j] for j in order if j in per_term]

    def get_scores(self, query_tokens: Sequence[str]) -> np.ndarray:
        """Dense scores over all parts' documents, part after part, as ``BM25Okapi.get_scores``."""
        scores = np.zeros(len(self), dtype=np.float64)
        starts = np.cumsum([0] + [len(p) for p in self.parts]).tolist()
        for i, hits in self._contributions(query_tokens):
            part = scores[starts[i] : starts[i + 1]]
            for docs, contrib in hits:
                part[docs] += contrib
        return scores

    def top_k(self, query_tokens: Sequence[str], k: int) -> list[tuple[int, float]]:
        """Best k (chunk_id, score) among docs containing a query term; ties by ascending chunk_id."""
        if k <= 0:
            return []
        found = []
        for i, hits in self._contributions(query_tokens):
            p = self.parts[i]
            cand, scores = _accumulate(hits, len(p))
            # a part's best k with their ties hold every member of the union's best k
            found.append(_at_least_kth(p.chunk_ids[cand], scores, k))
        if not found:
            return []
        cids, scores = _at_least_kth(np.concatenate([c for c, _ in found]), np.concatenate([s for _, s in found]), k)
        order = np.lexsort((cids, -scores))[:k]
        return [(int(c), float(s)) for c, s in zip(cids[order], scores[order], strict=True)]
