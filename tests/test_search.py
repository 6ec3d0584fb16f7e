"""Search against real PostgreSQL+pgvector: BM25 parity, hybrid paraphrase, multi-buffer."""

from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from rlm_workers.ingest.loader import load_paths
from rlm_workers.search.service import rank, search
from rlm_workers.search.tokenize import tokenize
from rlm_workers.store import buffers as store
from tests.support.corpus import GUIDE_MD, PY_MODULE

NOTES = [
    "The deploy pipeline builds a container image and pushes it to the registry before rollout.",
    "Our cat sat on the mat all afternoon, purring loudly in the sunshine.",
    "Database migrations are append-only and recorded in a table so upgrades are repeatable.",
    "Rate limits are shared by every worker through a lease-based semaphore in Redis.",
    "The invoice total includes tax computed from the customer's region.",
]


@pytest.fixture(scope="module")
def loaded(conn, tmp_path_factory, embedder):
    root = tmp_path_factory.mktemp("search")
    notes = root / "notes"
    notes.mkdir()
    for i, text in enumerate(NOTES):
        (notes / f"note{i}.txt").write_text(text + "\n")
    ops = root / "ops"
    ops.mkdir()
    (ops / "guide.md").write_text(GUIDE_MD)
    (ops / "billing.py").write_text(PY_MODULE)
    load_paths(conn, buffer="notes", paths=[notes], embedder=embedder)
    load_paths(conn, buffer="ops", paths=[ops], embedder=embedder, chunker="semantic", chunk_size=300, overlap=0)
    conn.commit()
    return root


def _paths(hits):
    return [h.path for h in hits]


def test_bm25_scores_match_rank_bm25(conn, settings, db_url, loaded):
    buf = store.get_buffer(conn, tenant="local", name="ops")
    docs = conn.execute("SELECT id, terms FROM chunks WHERE buffer_id = %s ORDER BY id", (buf.id,)).fetchall()
    ids = [d[0] for d in docs]
    ref = BM25Okapi([d[1].split() for d in docs])
    query = "backups restore tested monday engineer"
    expected = ref.get_scores(tokenize(query))
    got = rank(conn, settings=settings, url=db_url, rows=[buf], query=query, mode="bm25", top_k=100, threshold=None)
    by_id = {r.chunk_id: r.score for r in got}
    for cid, exp in zip(ids, expected, strict=True):
        if exp != 0:
            assert by_id[cid] == pytest.approx(exp, rel=1e-9)
        else:
            assert cid not in by_id
    assert got[0].score == pytest.approx(float(np.max(expected)), rel=1e-9)
    # and the stored tokens are exactly tokenize(text): nothing is re-tokenised at query time
    for cid, terms in docs:
        text = conn.execute("SELECT text FROM chunks WHERE id = %s", (cid,)).fetchone()[0]
        assert terms.split() == tokenize(text)


def test_hybrid_finds_paraphrase_that_bm25_misses(conn, settings, db_url, loaded):
    query = "a feline resting on a rug"
    lexical = search(
        conn,
        settings=settings,
        url=db_url,
        tenant="local",
        buffers=["notes"],
        query=query,
        mode="bm25",
        top_k=5,
    )
    assert "notes/note1.txt" not in _paths(lexical)
    hybrid = search(
        conn,
        settings=settings,
        url=db_url,
        tenant="local",
        buffers=["notes"],
        query=query,
        mode="hybrid",
        top_k=5,
        threshold=0.2,
    )
    assert hybrid[0].path == "notes/note1.txt"
    assert "sat on the mat" in hybrid[0].text


def test_hybrid_is_the_fusion_of_the_arms_as_searched(conn, settings, db_url, loaded):
    from rlm_workers.search.fusion import RANK_K, fused_top

    rows = [store.get_buffer(conn, tenant="local", name="notes")]
    query = "semaphore shared by workers"
    lex = rank(conn, settings=settings, url=db_url, rows=rows, query=query, mode="bm25", top_k=10, threshold=None)
    sem = rank(conn, settings=settings, url=db_url, rows=rows, query=query, mode="semantic", top_k=10, threshold=0.0)
    hyb = rank(conn, settings=settings, url=db_url, rows=rows, query=query, mode="hybrid", top_k=5, threshold=0.0)
    want = fused_top([(r.chunk_id, r.score) for r in lex], [(r.chunk_id, r.score) for r in sem], 5)
    assert [r.chunk_id for r in hyb] == [c for c, _ in want]
    assert [r.score for r in hyb] == pytest.approx([s for _, s in want])
    assert hyb[0].chunk_id == lex[0].chunk_id == sem[0].chunk_id  # the rate-limit note wins both arms
    assert hyb[0].score >= 1 / (RANK_K + 1)


def test_threshold_filters_semantic_arm(conn, settings, db_url, loaded):
    def semantic(threshold):
        return search(
            conn,
            settings=settings,
            url=db_url,
            tenant="local",
            buffers=["notes"],
            query="a feline resting on a rug",
            mode="semantic",
            top_k=5,
            threshold=threshold,
        )

    everything = semantic(-1.0)
    assert len(everything) == len(NOTES)  # a broken semantic arm returns nothing at every threshold
    assert everything[0].path == "notes/note1.txt"
    scores = [h.score for h in everything]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[-1]
    cut = (scores[0] + scores[-1]) / 2
    kept = semantic(cut)
    # exactly the hits at or above the threshold, in the same order: a strict, non-empty filtering
    assert [h.chunk_id for h in kept] == [h.chunk_id for h in everything if h.score >= cut]
    assert 0 < len(kept) < len(everything)
    assert semantic(0.99) == []


def test_multi_buffer_search(conn, settings, db_url, loaded):
    hits = search(
        conn,
        settings=settings,
        url=db_url,
        tenant="local",
        buffers=["notes", "ops"],
        query="invoice tax total",
        mode="hybrid",
        top_k=6,
    )
    assert {h.buffer for h in hits} == {"notes", "ops"}
    assert hits[0].path in ("notes/note4.txt", "ops/billing.py")


def test_unknown_buffer_and_bad_params(conn, settings, db_url, loaded):
    from rlm_workers.errors import BufferNotFound, InvalidInput

    with pytest.raises(BufferNotFound):
        search(conn, settings=settings, url=db_url, tenant="local", buffers=["nope"], query="x")
    with pytest.raises(InvalidInput, match="empty"):
        search(conn, settings=settings, url=db_url, tenant="local", buffers=["notes"], query="   ")
    with pytest.raises(InvalidInput, match="10 KB"):
        search(conn, settings=settings, url=db_url, tenant="local", buffers=["notes"], query="x" * 10241)
    with pytest.raises(InvalidInput, match="search mode"):
        search(conn, settings=settings, url=db_url, tenant="local", buffers=["notes"], query="x", mode="fuzzy")


def test_bm25_cache_is_written_and_invalidated_by_version(conn, settings, db_url, loaded, embedder, tmp_path):
    from rlm_workers.search import bm25_cache

    buf = store.get_buffer(conn, tenant="local", name="notes")
    rank(conn, settings=settings, url=db_url, rows=[buf], query="cat", mode="bm25", top_k=3, threshold=None)
    files = sorted((settings.data_dir / "cache" / "bm25").glob(f"*-b{buf.id}-v{buf.version}-*.npz"))
    assert len(files) == 1
    extra = tmp_path / "more"
    extra.mkdir()
    (extra / "dog.txt").write_text("The dog chased a frisbee across the park.\n")
    load_paths(conn, buffer="notes", paths=[extra], embedder=embedder)
    conn.commit()
    new = store.get_buffer(conn, tenant="local", name="notes")
    assert new.version == buf.version + 1
    hits = rank(conn, settings=settings, url=db_url, rows=[new], query="frisbee", mode="bm25", top_k=3, threshold=None)
    assert len(hits) == 1
    assert not files[0].exists()  # the stale version's cache file was pruned
    # the new version's cache file names the tokenizer: bumping TOKENIZER_VERSION can never reuse an old file
    [now] = (settings.data_dir / "cache" / "bm25").glob(f"*-b{new.id}-v{new.version}-*.npz")
    assert now.name.endswith(f"-t{bm25_cache.TOKENIZER_VERSION}.npz")
