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
same float64 operations in the same order, so scores match to the last bits.
"""

from __future__ import annotations

import os
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from itertools import count
from pathlib import Path

import numpy as np

__all__ = ["B", "EPSILON", "K1", "BM25Index"]

K1 = 1.5
B = 0.75
EPSILON = 0.25
_FORMAT_VERSION = 1
# Terms are stored as one UTF-8 blob joined by NUL: a fixed-width numpy str
# array would cost 4 bytes × longest term × vocabulary size.
_SEP = "\x00"


def _idf(df: np.ndarray, n_docs: int) -> tuple[np.ndarray, float]:
    """rank_bm25's idf with its epsilon floor; returns (idf, average_idf)."""
    if df.size == 0:
        return np.zeros(0, dtype=np.float64), 0.0
    d = df.astype(np.float64)
    raw = np.log(n_docs - d + 0.5) - np.log(d + 0.5)
    average = float(raw.sum() / raw.size)
    # "< 0" exactly as rank_bm25: an idf of exactly 0 (df == N/2) stays 0
    return np.where(raw < 0, EPSILON * average, raw), average


def _length_norm(doc_len: np.ndarray, total_len: int) -> np.ndarray:
    """k1 * (1 - b + b * dl / avgdl), evaluated in rank_bm25's operation order."""
    n = doc_len.size
    if n == 0 or total_len == 0:
        # no postings can exist; any positive value avoids 0/0 in scoring
        return np.full(n, K1 * (1 - B), dtype=np.float64)
    avgdl = total_len / n
    return K1 * (1 - B + B * doc_len / avgdl)


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


class BM25Index:
    """Immutable BM25 index over (chunk_id, tokens) documents."""

    def __init__(
        self,
        *,
        chunk_ids: np.ndarray,
        doc_len: np.ndarray,
        terms: list[str],
        indptr: np.ndarray,
        post_doc: np.ndarray,
        post_tf: np.ndarray,
    ) -> None:
        self.chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        self.doc_len = np.asarray(doc_len, dtype=np.float64)
        self.terms = terms
        self.vocab: dict[str, int] = dict(zip(terms, range(len(terms)), strict=True))
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.post_doc = np.asarray(post_doc, dtype=np.int32)
        self.post_tf = np.asarray(post_tf, dtype=np.float32)
        self._check()
        self.df = np.diff(self.indptr).astype(np.int32)
        # rank_bm25 sums lengths as Python ints; int64 keeps that exact
        self.total_len = int(self.doc_len.astype(np.int64).sum())
        self.idf, self.average_idf = _idf(self.df, len(self.chunk_ids))
        self._norm = _length_norm(self.doc_len, self.total_len)

    def _check(self) -> None:
        """Cheap consistency checks so a corrupt cache file fails loudly, not with wrong scores."""
        n, v = len(self.chunk_ids), len(self.terms)
        nnz = len(self.post_doc)
        if len(self.doc_len) != n or len(self.vocab) != v or len(self.indptr) != v + 1:
            raise ValueError("BM25 index arrays have inconsistent lengths")
        if (
            len(self.post_tf) != nnz
            or self.indptr[0] != 0
            or self.indptr[-1] != nnz
            or np.any(self.indptr[1:] < self.indptr[:-1])
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
        return len(self.terms)

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
        p_doc = np.repeat(np.arange(len(ids), dtype=np.int32), np.frombuffer(n_unique, dtype=np.int64))
        indptr, post_doc, post_tf = _csc_from_triples(
            np.frombuffer(p_term, dtype=np.int32), p_doc, np.frombuffer(p_tf, dtype=np.int32), len(vocab)
        )
        return cls(
            chunk_ids=np.frombuffer(ids, dtype=np.int64).copy(),
            doc_len=np.frombuffer(lens, dtype=np.int64).astype(np.float64),
            terms=list(vocab),
            indptr=indptr,
            post_doc=post_doc,
            post_tf=post_tf,
        )

    @classmethod
    def merge(cls, indexes: Sequence[BM25Index]) -> BM25Index:
        """One index over the union of the documents, statistics as if built together.

        Documents keep their order (first index's docs, then the next...).
        """
        if len(indexes) == 1:
            return indexes[0]  # immutable, and its statistics are already the union's
        vocab: defaultdict[str, int] = defaultdict(count().__next__)  # numbers new terms in C
        remaps = [np.fromiter(map(vocab.__getitem__, idx.terms), dtype=np.int64, count=idx.n_terms) for idx in indexes]
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
            terms=list(vocab),
            indptr=indptr,
            post_doc=post_doc,
            post_tf=post_tf,
        )

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename): readers never see a half-written index."""
        path = Path(path)
        blob = _SEP.join(self.terms)
        if blob.count(_SEP) != max(self.n_terms - 1, 0):
            raise ValueError("BM25 terms must not contain NUL characters")
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            # a file object stops np.savez from appending ".npz" to the temp name
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    version=np.int64(_FORMAT_VERSION),
                    chunk_ids=self.chunk_ids,
                    doc_len=self.doc_len,
                    terms=np.frombuffer(blob.encode(), dtype=np.uint8),
                    n_terms=np.int64(self.n_terms),
                    indptr=self.indptr,
                    post_doc=self.post_doc,
                    post_tf=self.post_tf,
                )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> BM25Index:
        with np.load(Path(path), allow_pickle=False) as z:
            if int(z["version"]) != _FORMAT_VERSION:
                raise ValueError(f"unsupported BM25 index format {int(z['version'])}")
            n_terms = int(z["n_terms"])
            terms = z["terms"].tobytes().decode().split(_SEP) if n_terms else []
            if len(terms) != n_terms:
                raise ValueError("BM25 vocabulary is corrupt")
            return cls(
                chunk_ids=z["chunk_ids"],
                doc_len=z["doc_len"],
                terms=terms,
                indptr=z["indptr"],
                post_doc=z["post_doc"],
                post_tf=z["post_tf"],
            )

    def _term_contribs(self, query_tokens: Sequence[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(doc indexes, score contributions) per query token, unknown tokens skipped."""
        for q in query_tokens:
            tid = self.vocab.get(q)
            if tid is None:
                continue
            lo, hi = self.indptr[tid], self.indptr[tid + 1]
            docs = self.post_doc[lo:hi]
            tf = self.post_tf[lo:hi].astype(np.float64)
            yield docs, self.idf[tid] * (tf * (K1 + 1) / (tf + self._norm[docs]))

    def get_scores(self, query_tokens: Sequence[str]) -> np.ndarray:
        """Dense (N,) float64 scores in document order, as ``BM25Okapi.get_scores``."""
        scores = np.zeros(len(self), dtype=np.float64)
        for docs, contrib in self._term_contribs(query_tokens):
            scores[docs] += contrib  # docs are unique within one posting list
        return scores

    def _accumulate(self, hits: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """Candidate doc indexes (ascending) and their summed scores."""
        n_post = sum(len(d) for d, _ in hits)
        if n_post * 16 < len(self):
            # rare terms: sorting the few postings beats a pass over all N docs
            cand = np.unique(np.concatenate([d for d, _ in hits]))
            scores = np.zeros(len(cand), dtype=np.float64)
            for docs, contrib in hits:
                scores[np.searchsorted(cand, docs)] += contrib
            return cand, scores
        # frequent terms: dense accumulators are O(N + postings) with no sort
        dense = np.zeros(len(self), dtype=np.float64)
        seen = np.zeros(len(self), dtype=bool)
        for docs, contrib in hits:
            dense[docs] += contrib
            seen[docs] = True
        cand = np.flatnonzero(seen)
        return cand, dense[cand]

    def top_k(self, query_tokens: Sequence[str], k: int) -> list[tuple[int, float]]:
        """Best k (chunk_id, score) among docs containing a query term; ties by ascending chunk_id."""
        if k <= 0:
            return []
        hits = list(self._term_contribs(query_tokens))
        if not hits:
            return []
        cand, scores = self._accumulate(hits)
        cids = self.chunk_ids[cand]
        if k < len(cand):
            # argpartition picks arbitrarily among ties at the cut, so keep every
            # candidate tied with the k-th score and let the full sort decide
            kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
            keep = np.flatnonzero(scores >= kth)
            scores, cids = scores[keep], cids[keep]
        order = np.lexsort((cids, -scores))[:k]
        return [(int(c), float(s)) for c, s in zip(cids[order], scores[order], strict=True)]
