"""Loading into real PostgreSQL+pgvector: mixed trees, re-loads, failures, long chunks."""

from __future__ import annotations

import numpy as np
import pytest

from rlm_workers.errors import InvalidInput
from rlm_workers.ingest.loader import load_paths
from rlm_workers.store import buffers as store
from tests.support.corpus import long_chunk_text, write_mixed_tree


def _chunk_ids(conn, buffer_id):
    return {
        r[0]: (r[1], r[2])
        for r in conn.execute("SELECT id, path, content_hash FROM chunks WHERE buffer_id = %s", (buffer_id,))
    }


def _emb_count(conn, buffer_id):
    from rlm_workers.store import vectors

    return vectors.count(conn, buffer_id=buffer_id)


def _vectors_match_chunks(conn, buffer_id, embedder) -> None:
    """Every live chunk has exactly its windows' vectors, and no vector outlives its chunk."""
    want = {
        (cid, w, a, b)
        for cid, text in conn.execute("SELECT id, text FROM chunks WHERE buffer_id = %s", (buffer_id,))
        for w, (a, b) in enumerate(embedder.window_spans(text, embedder.spec))
    }
    have = set(conn.execute(f"SELECT chunk_id, win, span_start, span_end FROM chunk_vectors_b{buffer_id}").fetchall())
    assert have == want


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return write_mixed_tree(tmp_path_factory.mktemp("mixed") / "proj")


def test_schema_is_migrated_and_versioned(conn):
    from rlm_workers.store.migrations import MIGRATIONS, migrate, schema_version

    assert schema_version(conn) == MIGRATIONS[-1][0]
    assert migrate(conn) == []  # idempotent: a second start applies nothing
    ext = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    assert ext is not None


def test_load_mixed_tree(conn, tree, embedder):
    report = load_paths(conn, buffer="mixed", paths=[tree], embedder=embedder, chunk_size=400, overlap=50)
    assert report.files_loaded == 2  # billing.py and guide.md
    assert report.skipped == {"binary": 1, "not-utf8": 1, "empty": 1}
    buf = store.get_buffer(conn, tenant="local", name="mixed")
    assert buf.version == 1 and buf.embedding_dim == 384
    paths = {p for p, _ in _chunk_ids(conn, buf.id).values()}
    assert paths == {"proj/pkg/billing.py", "proj/docs/guide.md"}
    # every chunk has at least one window vector, and the line numbers point at its text
    assert _emb_count(conn, buf.id) >= len(_chunk_ids(conn, buf.id))
    guide = (tree / "docs" / "guide.md").read_text().splitlines()
    for start, end, text in conn.execute(
        "SELECT start_line, end_line, text FROM chunks WHERE buffer_id = %s AND path = 'proj/docs/guide.md'",
        (buf.id,),
    ):
        assert text.strip().splitlines()[0] in guide[start - 1]
        assert text.strip().splitlines()[-1] in guide[end - 1]


def test_reload_unchanged_does_not_reembed(conn, tree, embedder):
    buf = store.get_buffer(conn, tenant="local", name="mixed")
    before = _chunk_ids(conn, buf.id)
    report = load_paths(conn, buffer="mixed", paths=[tree], embedder=embedder, chunk_size=400, overlap=50)
    assert report.files_unchanged == 2 and report.files_loaded == 0
    assert report.windows_embedded == 0
    assert report.version == buf.version
    assert _chunk_ids(conn, buf.id) == before


def test_changed_file_replaces_only_its_chunks(conn, tree, embedder):
    buf = store.get_buffer(conn, tenant="local", name="mixed")
    before = _chunk_ids(conn, buf.id)
    (tree / "docs" / "guide.md").write_text(
        (tree / "docs" / "guide.md").read_text() + "\n## Audits\n\nAudits happen yearly.\n"
    )
    report = load_paths(conn, buffer="mixed", paths=[tree], embedder=embedder, chunk_size=400, overlap=50)
    assert report.files_loaded == 1 and report.files_unchanged == 1
    after = _chunk_ids(conn, buf.id)
    kept = {cid for cid, (path, _) in before.items() if path.endswith("billing.py")}
    assert kept <= set(after)  # untouched file keeps its chunk ids
    assert not ({cid for cid, (p, _) in before.items() if p.endswith("guide.md")} & set(after))
    assert report.version == buf.version + 1
    assert any(
        "Audits happen yearly" in t for (t,) in conn.execute("SELECT text FROM chunks WHERE buffer_id = %s", (buf.id,))
    )
    _vectors_match_chunks(conn, buf.id, embedder)


def test_deleted_file_is_removed_on_reload(conn, tree, embedder):
    buf = store.get_buffer(conn, tenant="local", name="mixed")
    (tree / "pkg" / "billing.py").unlink()
    report = load_paths(conn, buffer="mixed", paths=[tree], embedder=embedder, chunk_size=400, overlap=50)
    assert report.files_removed == 1
    paths = {p for p, _ in _chunk_ids(conn, buf.id).values()}
    assert paths == {"proj/docs/guide.md"}
    _vectors_match_chunks(conn, buf.id, embedder)


def test_deleting_a_buffer_drops_its_vectors(conn, tmp_path, embedder):
    src = tmp_path / "gone"
    src.mkdir()
    (src / "a.txt").write_text("A note about tides and the moon. " * 20)
    load_paths(conn, buffer="short-lived", paths=[src], embedder=embedder)
    buf = store.get_buffer(conn, tenant="local", name="short-lived")
    _vectors_match_chunks(conn, buf.id, embedder)
    assert store.delete_buffer(conn, tenant="local", name="short-lived")
    conn.commit()
    assert conn.execute("SELECT to_regclass(%s)", (f"chunk_vectors_b{buf.id}",)).fetchone()[0] is None


def test_a_buffer_embedded_with_other_windows_is_re_embedded_whole_on_reload(conn, tmp_path, embedder):
    """Unchanged text is not skipped when the buffer was cut into windows another way."""
    src = tmp_path / "recut"
    src.mkdir()
    (src / "a.txt").write_text("The harbour master logs every ship. " * 80)
    load_paths(conn, buffer="recut", paths=[src], embedder=embedder)
    buf = store.get_buffer(conn, tenant="local", name="recut")
    conn.execute("UPDATE buffers SET embedding_windows = 'tokens:254/32' WHERE id = %s", (buf.id,))
    conn.execute(f"DELETE FROM chunk_vectors_b{buf.id} WHERE win > 0")  # as the old cut left it: fewer windows
    conn.commit()
    report = load_paths(conn, buffer="recut", paths=[src], embedder=embedder)
    assert report.files_loaded == 1 and report.files_unchanged == 0
    assert store.get_buffer(conn, tenant="local", name="recut").embedding_windows == embedder.spec.label
    _vectors_match_chunks(conn, buf.id, embedder)


class _ExplodingEmbedder:
    """Encodes the first batch, then fails: a crash half-way through a load."""

    def __init__(self, real):
        self.real, self.calls = real, 0
        self.model_id, self.dim, self.spec, self.runtime = real.model_id, real.dim, real.spec, real.runtime

    def window_spans(self, text, spec):
        return self.real.window_spans(text, spec)

    def encode(self, texts, batch_size=64):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("encoder died")
        return self.real.encode(texts, batch_size=batch_size)


def test_failed_load_keeps_previous_version(conn, tmp_path, embedder):
    src = tmp_path / "notes"
    src.mkdir()
    for i in range(6):
        (src / f"n{i}.md").write_text(f"Note {i}. " + "Words about release planning and dates. " * 20)
    load_paths(conn, buffer="atomic", paths=[src], embedder=embedder, chunk_size=300, overlap=0)
    buf = store.get_buffer(conn, tenant="local", name="atomic")
    before = _chunk_ids(conn, buf.id)
    emb_before = _emb_count(conn, buf.id)
    for i in range(6):
        (src / f"n{i}.md").write_text(f"Rewritten {i}. " + "Entirely new content about budgets. " * 80)
    with pytest.raises(RuntimeError, match="encoder died"):
        load_paths(
            conn,
            buffer="atomic",
            paths=[src],
            embedder=_ExplodingEmbedder(embedder),
            chunk_size=300,
            overlap=0,
            embed_batch_size=1,  # groups of 32 windows: several encode calls
        )
    after_buf = store.get_buffer(conn, tenant="local", name="atomic")
    assert after_buf.version == buf.version
    assert _chunk_ids(conn, buf.id) == before
    assert _emb_count(conn, buf.id) == emb_before


def test_failed_first_load_leaves_no_half_buffer(conn, tmp_path, embedder):
    src = tmp_path / "fresh"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.txt").write_text("Some text about lighthouses and tides. " * 120)
    with pytest.raises(RuntimeError):
        load_paths(
            conn,
            buffer="never",
            paths=[src],
            embedder=_ExplodingEmbedder(embedder),
            chunk_size=300,
            overlap=0,
            embed_batch_size=1,  # groups of 32 windows: several encode calls
        )
    assert store.get_buffer(conn, tenant="local", name="never") is None


def test_bad_input_is_rejected_before_writing(conn, tmp_path, embedder):
    with pytest.raises(InvalidInput, match="nope"):
        load_paths(conn, buffer="x", paths=[tmp_path / "nope"], embedder=embedder)
    with pytest.raises(InvalidInput, match="buffer name"):
        load_paths(conn, buffer="../etc", paths=[tmp_path], embedder=embedder)
    with pytest.raises(InvalidInput, match="overlap"):
        load_paths(conn, buffer="x", paths=[tmp_path], embedder=embedder, chunk_size=500, overlap=500)
    assert store.get_buffer(conn, tenant="local", name="x") is None


def test_passages_are_the_stored_window_spans_and_old_rows_are_cut_again(conn, tmp_path, embedder, settings, db_url):
    """A hit's passage is the slice its window's stored span names; a row stored before spans were (NULL) gets
    the same passage by cutting the chunk again."""
    from rlm_workers.search.service import search

    needle = "The lighthouse keeper logged every passing ship in a green leather book."
    src = tmp_path / "spans"
    src.mkdir()
    (src / "keeper.txt").write_text(long_chunk_text(needle))
    (src / "decoy.txt").write_text(long_chunk_text("Tomato plants need a sunny spot and steady watering."))
    load_paths(conn, buffer="spans", paths=[src], embedder=embedder)
    buf = store.get_buffer(conn, tenant="local", name="spans")
    _vectors_match_chunks(conn, buf.id, embedder)

    def passages() -> list[tuple[int, str | None]]:
        hits = search(
            conn,
            settings=settings,
            url=db_url,
            tenant="local",
            buffers=["spans"],
            query="Where did the keeper write down the ships he saw?",
            mode="hybrid",
            top_k=5,
            threshold=-1,
        )
        conn.commit()
        return [(h.chunk_id, h.passage) for h in hits]

    stored = passages()
    assert any(p and needle in p for _, p in stored)
    assert all(p is not None for _, p in stored)  # every hit was seen by the semantic arm here
    conn.execute(f"UPDATE chunk_vectors_b{buf.id} SET span_start = NULL, span_end = NULL")
    conn.commit()
    assert passages() == stored


def test_long_chunk_is_embedded_whole(conn, tmp_path, embedder):
    """A sentence at the END of a ~2,900-char chunk must still be findable semantically."""
    from rlm_workers.search.semantic import semantic_search

    needle = "The submarine's periscope was painted bright orange so that divers could spot it."
    src = tmp_path / "long"
    src.mkdir()
    (src / "target.txt").write_text(long_chunk_text(needle))
    for i in range(3):
        (src / f"decoy{i}.txt").write_text(long_chunk_text(f"Tomato plant number {i} grew taller than the fence."))
    load_paths(conn, buffer="long", paths=[src], embedder=embedder)
    buf = store.get_buffer(conn, tenant="local", name="long")
    ((target_id, ntext),) = conn.execute(
        "SELECT id, text FROM chunks WHERE buffer_id = %s AND path = 'long/target.txt'", (buf.id,)
    ).fetchall()
    assert ntext.rstrip().endswith(needle) and len(ntext) > 2500
    windows = conn.execute(
        f"SELECT count(*) FROM chunk_vectors_b{buf.id} WHERE chunk_id = %s", (target_id,)
    ).fetchone()[0]
    assert windows >= 2, "a chunk longer than the model window must get several vectors"

    q = embedder.encode_query("What colour was the submarine periscope?")
    hits = semantic_search(conn, buffer_ids=[buf.id], query_vec=q, limit=4, threshold=None)
    assert hits[0].chunk_id == target_id
    # the first window alone (what a truncating embedder sees) does not know about the periscope
    first_window = embedder.encode([embedder.window_texts(ntext)[0]])[0]
    assert float(np.dot(first_window, q)) < hits[0].similarity - 0.15


class _CountingEncoder:
    """The real encoder, with the texts of each ``encode`` call written down."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.inner.encode(texts, **kwargs)


def test_a_window_text_that_repeats_is_encoded_once_and_stored_for_each(conn, tmp_path, embedder):
    """Two files that open alike (a licence, the same imports) share windows: each text goes to the encoder once,
    yet every window of every chunk gets its row, and identical windows identical vectors."""
    shared = " ".join(f"Clause {i} of the shared licence grants the reader one more plain right." for i in range(40))
    src = tmp_path / "twins"
    src.mkdir()
    (src / "first.txt").write_text(shared + "\n\nThe first file then talks about lighthouses and their keepers.\n")
    (src / "second.txt").write_text(shared + "\n\nThe second file then talks about orchards and their pickers.\n")
    counting = _CountingEncoder(embedder)
    load_paths(conn, buffer="twins", paths=[src], embedder=counting)
    buf = store.get_buffer(conn, tenant="local", name="twins")
    _vectors_match_chunks(conn, buf.id, embedder)

    sent = [t for call in counting.calls for t in call]
    rows = conn.execute(
        f"SELECT c.text, v.span_start, v.span_end, v.embedding::text FROM chunk_vectors_b{buf.id} v "
        "JOIN chunks c ON c.id = v.chunk_id"
    ).fetchall()
    by_text: dict[str, set[str]] = {}
    for text, a, b, vec in rows:
        by_text.setdefault(text[a:b], set()).add(vec)
    assert len(sent) == len(set(sent)), "a repeated window text went to the encoder twice"
    assert set(sent) == set(by_text)
    assert len(rows) > len(sent), "the two files should share windows"
    assert all(len(vecs) == 1 for vecs in by_text.values())


def test_a_text_the_process_loaded_before_is_not_encoded_again(conn, tmp_path, embedder):
    """The same document in a second buffer costs the encoder nothing, and an edit only the windows it changed;
    the stored vectors are the first load's."""
    src = tmp_path / "again"
    src.mkdir()
    paras = [f"Paragraph {i} is about the tide tables of harbour number {i} and its pilots." for i in range(30)]
    (src / "tides.txt").write_text("\n\n".join(paras) + "\n")
    counting = _CountingEncoder(embedder)
    load_paths(conn, buffer="again-1", paths=[src], embedder=counting, chunk_size=300, overlap=0)
    first = [t for call in counting.calls for t in call]
    load_paths(conn, buffer="again-2", paths=[src], embedder=counting, chunk_size=300, overlap=0)
    assert [t for call in counting.calls for t in call] == first, "a text seen before went to the encoder again"

    def stored(name: str) -> dict[str, str]:
        buf = store.get_buffer(conn, tenant="local", name=name)
        rows = conn.execute(
            f"SELECT c.text, v.span_start, v.span_end, v.embedding::text FROM chunk_vectors_b{buf.id} v "
            "JOIN chunks c ON c.id = v.chunk_id"
        ).fetchall()
        return {text[a:b]: vec for text, a, b, vec in rows}

    assert stored("again-1") == stored("again-2") and len(stored("again-1")) == len(first)
    (src / "tides.txt").write_text("\n\n".join(paras + ["A new closing paragraph names the harbour master."]) + "\n")
    load_paths(conn, buffer="again-1", paths=[src], embedder=counting, chunk_size=300, overlap=0)
    sent = [t for call in counting.calls for t in call][len(first) :]
    assert sent and set(sent).isdisjoint(first), sent
    assert set(stored("again-1")) - set(first) == set(sent)
