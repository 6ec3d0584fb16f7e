"""BM25Index: score parity with rank_bm25.BM25Okapi, persistence, merge, top_k ordering."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from rlm_workers.search.bm25 import EPSILON, BM25Index
from rlm_workers.search.tokenize import tokenize

RTOL = 1e-9

HAND_TEXTS = [
    "The cat sat on the mat with another cat.",
    "Dogs and cats living together: mass hysteria.",
    "def parse_config(path): return load_yaml(path)",
    "class HTTPServer: serves requests over HTTP",
    "The quick brown fox jumps over the lazy dog",
    "Configuration files are parsed by parse_config at startup",
    "cat cat cat cat cat",
    "",
    "Error 404: the requested page was not found on this server",
    "Server configuration: set max_connections and timeout for the HTTP server",
]
HAND_DOCS = [tokenize(t) for t in HAND_TEXTS]
HAND_QUERIES = [
    ["cat"],
    ["server", "http"],
    ["parse_config"],
    ["config", "config"],
    ["nonexistent"],
    ["cat", "unknown", "server", "cat"],
    ["404", "page", "found"],
    [],
]


def _zipf_corpus(n_docs: int, vocab: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()
    lengths = rng.integers(0, 80, size=n_docs)
    return [[f"w{i}" for i in rng.choice(vocab, size=n, p=p)] for n in lengths]


@pytest.fixture(scope="module")
def zipf_docs() -> list[list[str]]:
    return _zipf_corpus(500, 400, seed=7)


def _build(docs: list[list[str]], first_id: int = 100) -> BM25Index:
    return BM25Index.build((first_id + i, d) for i, d in enumerate(docs))


def _assert_parity(idx: BM25Index, ref: BM25Okapi, queries: list[list[str]]) -> None:
    for q in queries:
        np.testing.assert_allclose(idx.get_scores(q), ref.get_scores(q), rtol=RTOL, atol=1e-12, err_msg=str(q))


def _zipf_queries(docs: list[list[str]]) -> list[list[str]]:
    return [
        ["w0"],
        ["w0", "w1", "w2"],
        ["w5", "w5", "w17"],
        ["w399", "w398", "nope"],
        ["w50", "w120", "w3"],
        ["w1", "w1", "w1"],
        ["w250"],
        ["w300", "w300", "w399"],
        ["missing", "also_missing"],
    ]


def test_hand_corpus_matches_rank_bm25() -> None:
    idx = _build(HAND_DOCS)
    ref = BM25Okapi(HAND_DOCS)
    _assert_parity(idx, ref, HAND_QUERIES)
    assert len(idx) == 10
    assert idx.n_terms == len(ref.idf)
    assert idx.average_idf == pytest.approx(ref.average_idf, rel=1e-12)
    for term, tid in idx.vocab.items():
        assert idx.idf[tid] == pytest.approx(ref.idf[term], rel=1e-12)


def test_hand_corpus_score_by_hand() -> None:
    # "cat" occurs in docs 0 (tf 2, len 5) and 6 (tf 5, len 5); N=10, df=2 -> idf = ln(8.5/2.5)
    idx = _build(HAND_DOCS)
    avgdl = sum(map(len, HAND_DOCS)) / 10
    idf = np.log(8.5) - np.log(2.5)
    norm = 1.5 * (1 - 0.75 + 0.75 * 5 / avgdl)
    scores = idx.get_scores(["cat"])
    assert scores[0] == pytest.approx(idf * 2 * 2.5 / (2 + norm), rel=1e-12)
    assert scores[6] == pytest.approx(idf * 5 * 2.5 / (5 + norm), rel=1e-12)
    assert np.count_nonzero(scores) == 2


def test_zipf_corpus_matches_rank_bm25(zipf_docs: list[list[str]]) -> None:
    idx = _build(zipf_docs)
    ref = BM25Okapi(zipf_docs)
    # the corpus must exercise the epsilon path: frequent terms in more than half the docs
    df_w0 = idx.df[idx.vocab["w0"]]
    assert df_w0 > len(zipf_docs) / 2
    assert idx.idf[idx.vocab["w0"]] == pytest.approx(EPSILON * ref.average_idf, rel=1e-12)
    assert ref.idf["w0"] == pytest.approx(EPSILON * ref.average_idf, rel=1e-12)
    _assert_parity(idx, ref, _zipf_queries(zipf_docs))


def test_duplicate_query_terms_count_each_time(zipf_docs: list[list[str]]) -> None:
    idx = _build(zipf_docs)
    np.testing.assert_allclose(idx.get_scores(["w5", "w5"]), 2 * idx.get_scores(["w5"]), rtol=1e-12)


def test_degenerate_tiny_corpus_negative_idf_matches() -> None:
    # every term is in > half the docs: all idfs negative, average negative, eps negative
    docs = [["x", "y"], ["x", "y", "y"], ["x"]]
    idx = _build(docs)
    ref = BM25Okapi(docs)
    assert ref.average_idf < 0
    _assert_parity(idx, ref, [["x"], ["y"], ["x", "y", "z"]])
    # docs containing a term are still returned even with negative scores
    top = idx.top_k(["y"], 10)
    assert [c for c, _ in top] == [100, 101]
    assert all(s < 0 for _, s in top)


def test_save_load_round_trip(tmp_path: Path, zipf_docs: list[list[str]]) -> None:
    idx = _build(zipf_docs + [["café", "日本語", "w0"]])
    path = tmp_path / "idx.npz"
    idx.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx.npz"]  # no temp file left
    back = BM25Index.load(path)
    assert back.terms == idx.terms
    np.testing.assert_array_equal(back.chunk_ids, idx.chunk_ids)
    ref = BM25Okapi(zipf_docs + [["café", "日本語", "w0"]])
    _assert_parity(back, ref, _zipf_queries(zipf_docs) + [["café", "日本語"]])
    assert back.top_k(["w3", "w9"], 20) == idx.top_k(["w3", "w9"], 20)


def test_save_overwrites_and_empty_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "idx.npz"
    _build(HAND_DOCS).save(path)
    BM25Index.build([]).save(path)
    back = BM25Index.load(path)
    assert len(back) == 0 and back.n_terms == 0
    assert back.top_k(["cat"], 5) == []


def test_load_rejects_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    path.write_bytes(b"not an npz file")
    with pytest.raises(Exception):  # noqa: B017 - any error; the cache layer rebuilds
        BM25Index.load(path)


def test_merge_equals_building_over_concatenation(zipf_docs: list[list[str]]) -> None:
    a, b, c = zipf_docs[:200], zipf_docs[200:], HAND_DOCS
    merged = BM25Index.merge([_build(a, 0), BM25Index.build([]), _build(b, 1000), _build(c, 5000)])
    whole = BM25Index.build(
        [(i, d) for i, d in enumerate(a)]
        + [(1000 + i, d) for i, d in enumerate(b)]
        + [(5000 + i, d) for i, d in enumerate(c)]
    )
    ref = BM25Okapi(a + b + c)
    np.testing.assert_array_equal(merged.chunk_ids, whole.chunk_ids)
    assert set(merged.terms) == set(whole.terms)
    np.testing.assert_array_equal(merged.doc_len, whole.doc_len)
    _assert_parity(merged, ref, _zipf_queries(zipf_docs) + HAND_QUERIES)
    assert merged.top_k(["w2", "cat", "server"], 50) == whole.top_k(["w2", "cat", "server"], 50)


def test_merge_of_one_is_itself() -> None:
    idx = _build(HAND_DOCS)
    assert BM25Index.merge([idx]) is idx


def _brute_top_k(idx: BM25Index, query: list[str], k: int) -> list[tuple[int, float]]:
    contains = np.zeros(len(idx), dtype=bool)
    for q in query:
        if q in idx.vocab:
            t = idx.vocab[q]
            contains[idx.post_doc[idx.indptr[t] : idx.indptr[t + 1]]] = True
    scores = idx.get_scores(query)
    rows = [(int(idx.chunk_ids[i]), float(scores[i])) for i in np.flatnonzero(contains)]
    return sorted(rows, key=lambda r: (-r[1], r[0]))[:k]


@pytest.mark.parametrize("k", [1, 3, 10, 57, 1000])
def test_top_k_matches_brute_force(zipf_docs: list[list[str]], k: int) -> None:
    idx = _build(zipf_docs)
    for q in _zipf_queries(zipf_docs):
        got = idx.top_k(q, k)
        want = _brute_top_k(idx, q, k)
        assert [c for c, _ in got] == [c for c, _ in want]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-12)


@pytest.mark.parametrize("filler", [0, 300])  # 300 filler docs switch top_k to its sparse path
def test_top_k_ties_break_by_ascending_chunk_id(filler: int) -> None:
    # identical docs under shuffled ids, plus a weaker and a non-matching doc
    docs = [
        (30, ["alpha", "beta"]),
        (10, ["alpha", "beta"]),
        (99, ["gamma"]),
        (20, ["alpha", "beta"]),
        (5, ["alpha", "beta", "beta", "delta", "delta", "delta"]),
        (7, ["gamma", "gamma"]),
    ]
    docs += [(1000 + i, ["filler", f"f{i}"]) for i in range(filler)]
    idx = BM25Index.build(docs)
    full = idx.top_k(["alpha"], 10)
    assert [c for c, _ in full] == [10, 20, 30, 5]
    assert full[0][1] == full[1][1] == full[2][1] > full[3][1] > 0
    # the cut falls inside the tie: the smallest ids must win, whatever argpartition picks
    assert [c for c, _ in idx.top_k(["alpha"], 2)] == [10, 20]
    assert [c for c, _ in idx.top_k(["alpha"], 1)] == [10]


def test_top_k_only_returns_docs_with_a_query_term() -> None:
    idx = _build(HAND_DOCS)
    got = idx.top_k(["cat"], 10)
    assert [c for c, _ in got] == [106, 100]  # doc 6 (tf 5) beats doc 0 (tf 2)


def test_empty_index_and_empty_query() -> None:
    empty = BM25Index.build([])
    assert len(empty) == 0 and empty.n_terms == 0
    assert empty.get_scores(["a"]).shape == (0,)
    assert empty.top_k(["a"], 5) == []
    idx = _build(HAND_DOCS)
    assert idx.top_k([], 5) == []
    assert idx.top_k(["nonexistent"], 5) == []
    assert idx.top_k(["cat"], 0) == []
    np.testing.assert_array_equal(idx.get_scores([]), np.zeros(10))
