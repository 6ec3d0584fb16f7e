"""BM25Index: score parity with rank_bm25.BM25Okapi, persistence, merge, top_k ordering; BM25Union over buffers."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from rlm_workers.search.bm25 import EPSILON, BM25Index, BM25Union
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


def test_threads_saving_one_index_at_once_leave_a_whole_file(tmp_path: Path, zipf_docs: list[list[str]]) -> None:
    # Worker threads of one process may build the same buffer's index at once; each must write its own
    # temp file, so whichever rename lands last leaves a whole index, never bytes of two writers mixed.
    idx = _build(zipf_docs * 8)
    path = tmp_path / "idx.npz"
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def save_then_load() -> None:
        try:
            for _ in range(15):
                barrier.wait()
                idx.save(path)
                back = BM25Index.load(path)
                assert back.top_k(["w3", "w9"], 5) == idx.top_k(["w3", "w9"], 5)
        except BaseException as exc:  # noqa: BLE001 - collected and raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=save_then_load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx.npz"]  # no temp file left


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


# ---- several buffers scored as one corpus (BM25Union) against the merged index and rank_bm25 ----


def _parts(zipf_docs: list[list[str]]) -> tuple[list[BM25Index], list[list[str]]]:
    """Four buffers with overlapping vocabularies (one empty) and distinct chunk ids, and their docs in order."""
    chunks = [zipf_docs[:150], [], zipf_docs[150:420], zipf_docs[420:] + HAND_DOCS]
    return [_build(docs, 10_000 * (i + 1)) for i, docs in enumerate(chunks)], [d for docs in chunks for d in docs]


def _union_queries(zipf_docs: list[list[str]]) -> list[list[str]]:
    return _zipf_queries(zipf_docs) + HAND_QUERIES + [["w0", "cat", "w0", "server"], ["w1", "w399", "w1"]]


def test_union_scores_equal_the_merged_index_and_rank_bm25(zipf_docs: list[list[str]]) -> None:
    parts, docs = _parts(zipf_docs)
    union, merged, ref = BM25Union(parts), BM25Index.merge(parts), BM25Okapi(docs)
    assert len(union) == len(merged) == len(docs)
    assert union.stats.n_terms == merged.n_terms == len(ref.idf)
    assert union.stats == merged.stats  # the same sum in the same order: the epsilon floor has the same bits
    assert union.stats.average_idf == pytest.approx(ref.average_idf, rel=1e-12)
    # the frequent terms take the epsilon floor of the union's average idf
    assert merged.idf[merged.vocab["w0"]] == pytest.approx(EPSILON * ref.average_idf, rel=1e-12)
    for q in _union_queries(zipf_docs):
        got = union.get_scores(q)
        np.testing.assert_array_equal(got, merged.get_scores(q), err_msg=str(q))
        np.testing.assert_allclose(got, ref.get_scores(q), rtol=RTOL, atol=1e-12, err_msg=str(q))


@pytest.mark.parametrize("k", [1, 4, 10, 57, 2000])
def test_union_top_k_equals_the_merged_index(zipf_docs: list[list[str]], k: int) -> None:
    parts, _ = _parts(zipf_docs)
    union, merged = BM25Union(parts), BM25Index.merge(parts)
    for q in _union_queries(zipf_docs):
        # the same float operations in the same order: equal to the last bit, ties included
        assert union.top_k(q, k) == merged.top_k(q, k), q


def test_union_uses_the_statistics_of_all_buffers() -> None:
    # "x" is in 4 of A's 5 docs (negative idf in A alone) but 4 of 10 overall (positive); "y" is the
    # reverse: rare in A, in every doc of B, so negative overall and floored by the union's average idf
    a = [["x", "y"], ["x", "p"], ["x", "q"], ["x", "r"], ["s"]]
    b = [["y", "t"], ["y"], ["y", "u", "u"], ["y", "v"], ["y", "w"]]
    parts = [_build(a, 100), _build(b, 200)]
    ref = BM25Okapi(a + b)
    union = BM25Union(parts)
    for q in (["x"], ["y"], ["x", "y", "y"], ["u", "x"]):
        np.testing.assert_allclose(union.get_scores(q), ref.get_scores(q), rtol=RTOL, atol=1e-12, err_msg=str(q))
    assert ref.idf["y"] == pytest.approx(EPSILON * ref.average_idf)
    # scoring each buffer on its own statistics would rank differently: the union must not do that
    alone = np.concatenate([p.get_scores(["x", "y"]) for p in parts])
    assert not np.allclose(alone, ref.get_scores(["x", "y"]))
    assert union.top_k(["x", "y"], 3) == BM25Index.merge(parts).top_k(["x", "y"], 3)


def test_union_ties_across_buffers_break_by_ascending_chunk_id() -> None:
    # the same text in three buffers under interleaved ids; the cut at k falls inside the tie
    parts = [
        BM25Index.build([(30, ["alpha", "beta"]), (2, ["gamma"])]),
        BM25Index.build([(10, ["alpha", "beta"]), (40, ["alpha", "beta", "beta", "delta"])]),
        BM25Index.build([(20, ["alpha", "beta"]), (5, ["alpha", "beta"])]),
        BM25Index.build((100 + i, ["filler", f"f{i}"]) for i in range(10)),  # alpha in 5 of 16 docs: idf > 0
    ]
    union = BM25Union(parts)
    full = union.top_k(["alpha"], 10)
    assert [c for c, _ in full] == [5, 10, 20, 30, 40]
    assert full[0][1] == full[3][1] > full[4][1]
    assert [c for c, _ in union.top_k(["alpha"], 2)] == [5, 10]
    assert full == BM25Index.merge(parts).top_k(["alpha"], 10)
    assert union.top_k(["nothing"], 3) == [] and union.top_k(["alpha"], 0) == [] and union.top_k([], 3) == []


def test_union_of_empty_buffers_finds_nothing() -> None:
    union = BM25Union([BM25Index.build([]), BM25Index.build([(1, [])])])
    assert union.top_k(["a"], 5) == []
    assert union.get_scores(["a"]).tolist() == [0.0]


def test_saved_index_is_mapped_not_read(tmp_path: Path, zipf_docs: list[list[str]]) -> None:
    idx = _build(zipf_docs)
    path = tmp_path / "idx.npz"
    idx.save(path)
    back = BM25Index.load(path)
    for name in ("chunk_ids", "doc_len", "term_hash", "term_off", "indptr", "post_doc", "post_tf"):
        arr = getattr(back, name)
        # a view of the file's map: no heap copy, aligned for numpy's fast paths, never written through
        assert not arr.flags.owndata and not arr.flags.writeable and arr.flags.aligned, name
    with np.load(path) as z:  # still an ordinary .npz
        np.testing.assert_array_equal(z["post_doc"], idx.post_doc)
    assert back.top_k(["w3", "w9"], 20) == idx.top_k(["w3", "w9"], 20)


def test_load_rejects_an_older_format(tmp_path: Path) -> None:
    path = tmp_path / "old.npz"
    np.savez(path, version=np.int64(1), chunk_ids=np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match="format 1"):
        BM25Index.load(path)


def test_term_lookup_compares_the_bytes_not_only_the_hash() -> None:
    idx = _build(HAND_DOCS)
    terms = ["cat", "cats", "nonexistent", "café"]
    encoded = [t.encode() for t in terms]
    hashes = np.array([int(idx.term_hash[idx.vocab["cat"]])] * 4, dtype=np.uint64)  # every hash "cat"'s
    assert idx.find(encoded, hashes).tolist() == [idx.vocab["cat"], -1, -1, -1]


def test_union_stats_are_kept_per_set_of_buffer_versions(zipf_docs: list[list[str]]) -> None:
    from rlm_workers.search import bm25_cache
    from rlm_workers.store.buffers import BufferRow

    parts, _ = _parts(zipf_docs)

    def rows(version: int) -> list[BufferRow]:
        blank = dict.fromkeys(("chunker", "chunk_size", "chunk_overlap", "embedding_model", "embedding_dim"))
        return [BufferRow(id=i + 1, tenant="t", name=f"b{i}", version=version, **blank) for i in range(len(parts))]

    first = bm25_cache.union_of("db-test", rows(1), parts)
    again = bm25_cache.union_of("db-test", rows(1), parts)
    assert again.stats is first.stats  # computed once per set
    assert first.stats == BM25Union(parts).stats
    fewer = bm25_cache.union_of("db-test", rows(2)[:2], parts[:2])
    assert fewer.stats.n_docs == len(parts[0]) + len(parts[1])
