"""BM25 over several buffers through the search service, against real PostgreSQL: the buffers' mapped cache files,
scored with the statistics of their union, rank as rank_bm25 and the merged index over all their chunks."""

from __future__ import annotations

import pytest
from rank_bm25 import BM25Okapi

from rlm_workers.ingest.loader import load_paths
from rlm_workers.search import bm25_cache
from rlm_workers.search.bm25 import BM25Index
from rlm_workers.search.service import rank
from rlm_workers.search.tokenize import tokenize
from rlm_workers.store import buffers as store

# "cache" is in most chunks of every buffer (its idf is floored by the union's average idf), "eviction" in a
# few, "ttl" only in one buffer; one sentence is in two buffers, so their chunks tie
TEXTS = {
    "alpha": [
        "The cache keeps recent rows; eviction drops the least recently used.",
        "A cache miss reads the row from disk and fills the cache.",
        "Workers share one cache through the broker.",
        "Deploys build a container image and push it to the registry.",
    ],
    "beta": [
        "Each cache entry has a ttl after which it expires.",
        "The cache warms up on start by reading the hot keys.",
        "Workers share one cache through the broker.",
        "Cache eviction under memory pressure follows the ttl first.",
        "Invoices include tax computed from the region.",
    ],
    "gamma": [
        "A cache of compiled templates saves parsing time.",
        "Rate limits are shared by every worker through a lease.",
        "The cache is cleared when a template changes on disk.",
    ],
}
QUERY = "cache eviction ttl workers share"


def _load(conn, root, name: str, texts: list[str], embedder) -> None:
    folder = root / name
    folder.mkdir(exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"{name}-{i}.txt").write_text(text + "\n")
    load_paths(conn, buffer=name, paths=[folder], embedder=embedder)
    conn.commit()


@pytest.fixture(scope="module")
def names(conn, tmp_path_factory, embedder) -> list[str]:
    root = tmp_path_factory.mktemp("bm25many")
    for name, texts in TEXTS.items():
        _load(conn, root, name, texts, embedder)
    return list(TEXTS)


def _rows(conn, names: list[str]) -> list[store.BufferRow]:
    return store.require_buffers(conn, tenant="local", names=names)


def _expected(conn, rows, query: str) -> list[tuple[int, float]]:
    """rank_bm25 over every chunk of the buffers, in buffer order then id order; ties by ascending chunk id."""
    docs = [
        d
        for r in rows
        for d in conn.execute("SELECT id, terms FROM chunks WHERE buffer_id = %s ORDER BY id", (r.id,)).fetchall()
    ]
    tokens = tokenize(query)
    scores = BM25Okapi([t.split() for _, t in docs]).get_scores(tokens)
    hit = [i for i, (_, t) in enumerate(docs) if set(t.split()) & set(tokens)]
    return sorted(((docs[i][0], float(scores[i])) for i in hit), key=lambda x: (-x[1], x[0]))


def _bm25(conn, settings, db_url, rows, query: str = QUERY, top_k: int = 100):
    return rank(conn, settings=settings, url=db_url, rows=rows, query=query, mode="bm25", top_k=top_k, threshold=None)


def test_several_buffers_rank_as_rank_bm25_over_their_union(conn, settings, db_url, names):
    rows = _rows(conn, names)
    got = _bm25(conn, settings, db_url, rows)
    want = _expected(conn, rows, QUERY)
    assert [r.chunk_id for r in got] == [c for c, _ in want]
    for r, (_, score) in zip(got, want, strict=True):
        assert r.score == pytest.approx(score, rel=1e-9)
    # the sentence in two buffers ties, and the smaller chunk id goes first
    tied = [r for r in got if r.score == got[0].score]
    assert len(tied) >= 2 and tied == sorted(tied, key=lambda r: r.chunk_id)
    # and exactly the merged index over the buffers' cache files, to the last bit
    dbk = bm25_cache.db_key(db_url)
    parts = [bm25_cache.index_for(conn, r, cache_dir=settings.data_dir / "cache", dbk=dbk) for r in rows]
    assert [(r.chunk_id, r.score) for r in got] == BM25Index.merge(parts).top_k(tokenize(QUERY), 100)
    assert [r.chunk_id for r in _bm25(conn, settings, db_url, rows, top_k=3)] == [c for c, _ in want[:3]]


def test_a_fresh_process_maps_the_cache_files(conn, settings, db_url, names):
    rows = _rows(conn, names)
    before = _bm25(conn, settings, db_url, rows)
    with bm25_cache._lock:  # what a restarted worker starts with
        bm25_cache._mem.clear()
        bm25_cache._stats.clear()
    assert _bm25(conn, settings, db_url, rows) == before
    with bm25_cache._lock:
        held = list(bm25_cache._mem.values())
    assert len(held) == len(rows)
    assert all(not idx.post_doc.flags.owndata and not idx.post_doc.flags.writeable for idx in held)


def test_a_new_version_of_one_buffer_changes_the_union(conn, settings, db_url, names, embedder, tmp_path):
    rows = _rows(conn, names)
    _bm25(conn, settings, db_url, rows)  # the union's statistics of these versions are cached
    _load(conn, tmp_path, "beta", ["Eviction, eviction: the ttl decides.", "Nothing about it here."], embedder)
    newer = _rows(conn, names)
    assert [r.version for r in newer] != [r.version for r in rows]
    got = _bm25(conn, settings, db_url, newer)
    want = _expected(conn, newer, QUERY)
    assert [r.chunk_id for r in got] == [c for c, _ in want]
    assert [r.score for r in got] == pytest.approx([s for _, s in want], rel=1e-9)
