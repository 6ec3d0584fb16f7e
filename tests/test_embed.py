"""Embedding windows and the two encoders (ingest: sentence-transformers; query time: ingest/fastbert.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rlm_workers.ingest.windows import DEFAULT_WINDOWS, WindowSpec, cut, query_windows, unit_starts

PROSE = (
    "The lighthouse stood on a rock that the sea covered twice a day. Its keeper, a quiet man, "
    "wrote the weather into a ledger every morning! Did anyone read it? Nobody knows; the ledger "
    "was lost in a storm.\nA second line starts here without a full stop\n\nAnd a new paragraph "
    "after a blank line, which is long enough to need a few more words than the others have."
)


def _offsets(text: str) -> list[tuple[int, int]]:
    """Word-ish pieces with their char offsets: enough to exercise the cutter without a model."""
    import re

    return [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]", text)]


def _tokens_in(offsets, a: int, b: int) -> int:
    return sum(1 for s, e in offsets if s >= a and e <= b)


@pytest.mark.parametrize(
    "spec", [WindowSpec(12, 4), WindowSpec(16, 0), WindowSpec(24, 6), WindowSpec(8, 0), WindowSpec(10, 3, False)]
)
def test_windows_cover_the_text_fit_the_size_and_keep_sentences_whole(spec):
    text = PROSE * 3
    offsets = _offsets(text)
    spans = cut(text, offsets, spec)
    assert spans[0][0] == 0 and spans[-1][1] == offsets[-1][1]
    assert all(_tokens_in(offsets, a, b) <= spec.tokens for a, b in spans)
    # no word piece is left out
    assert all(any(a <= s and e <= b for a, b in spans) for s, e in offsets)
    if spec.sentences:
        starts = unit_starts(text) + [len(text)]
        for u in range(len(starts) - 1):
            a, b = starts[u], len(text[: starts[u + 1]].rstrip())
            if _tokens_in(offsets, a, b) <= spec.tokens:
                assert any(x <= a and b <= y for x, y in spans), f"sentence cut in two: {text[a:b]!r}"
    # consecutive windows share at most `overlap` word pieces (a quarter window inside an over-long sentence)
    shared = max(spec.overlap, spec.tokens // 4) if spec.sentences else spec.overlap
    for (a1, b1), (a2, b2) in zip(spans, spans[1:], strict=False):
        assert a2 > a1 and _tokens_in(offsets, a2, min(b1, b2)) <= shared


def test_sentences_and_lines_start_units():
    starts = unit_starts(PROSE)
    begins = {PROSE[s : s + 6] for s in starts}
    assert {"The li", "Its ke", "Did an", "Nobody", "A seco", "And a "} <= begins
    assert not any(PROSE[s - 1].isalnum() for s in starts if s)


def test_a_short_text_is_one_window_and_labels_name_the_setting():
    assert cut("a short one.", _offsets("a short one."), DEFAULT_WINDOWS) == [(0, 12)]
    assert WindowSpec(64, 16).label == "sentences:64/16" and WindowSpec(254, 32, False).label == "tokens:254/32"
    assert WindowSpec(512, 64).capped(254) == WindowSpec(254, 64)
    with pytest.raises(ValueError):
        WindowSpec(16, 12)


def test_the_query_encoder_gives_the_ingest_encoders_vectors(torch_embedder):
    """ingest/fastbert.py (fast start for `rlm search`) must agree with sentence-transformers to 1e-5."""
    from pathlib import Path

    from rlm_workers.ingest.embed import _resolve_model
    from rlm_workers.ingest.fastbert import FastBertEncoder, supports

    embedder = torch_embedder
    _, path = _resolve_model(None)
    assert supports(Path(path))
    fast = FastBertEncoder(Path(path), embedder.model_id)
    queries = [
        "where is the spare key hidden?",
        "x",
        "Ünïcödé — naïve café, 東京 and emoji 🚀 in one query",
        "def retry(self, exc=None, countdown=None):\n    raise self.Retry(exc)",
        " ".join(["a long question about fog signals and lighthouse keepers"] * 60),  # over the model's 256
    ]
    for q in queries:
        assert fast.window_texts(q) == embedder.window_texts(q, query_windows(embedder.window_tokens))
        a, b = fast.encode_query(q), embedder.encode_query(q)
        assert a.shape == b.shape == (embedder.dim,)
        assert float(np.max(np.abs(a - b))) < 1e-5, q[:40]


def test_the_query_encoder_cuts_chunks_as_ingest_did(torch_embedder):
    """`rlm search` shows the matched window: its cut (fastbert's tokenizer) must be ingest's."""
    from pathlib import Path

    from rlm_workers.ingest.embed import _resolve_model
    from rlm_workers.ingest.fastbert import FastBertEncoder
    from rlm_workers.ingest.windows import LEGACY_WINDOWS_LABEL

    embedder = torch_embedder
    fast = FastBertEncoder(Path(_resolve_model(None)[1]), embedder.model_id)
    texts = [
        PROSE * 4,
        "def f(x):\n    return x * 2  # doubles\n\n" * 30,
        "Ünïcödé — naïve café, 東京. Emoji 🚀 here! " * 25,
    ]
    for spec in (DEFAULT_WINDOWS, WindowSpec.from_label(LEGACY_WINDOWS_LABEL), WindowSpec(64, 16)):
        for text in texts:
            assert fast.window_spans(text, spec) == embedder.window_spans(text, spec)
    assert WindowSpec.from_label(DEFAULT_WINDOWS.label) == DEFAULT_WINDOWS
    with pytest.raises(ValueError):
        WindowSpec.from_label("sentences:many/0")


def test_windows_cut_while_another_thread_encodes_are_the_same_windows(torch_embedder):
    """The loader cuts the next files' windows while a group encodes on another thread; the model's tokenizer
    truncates at max_seq_length for each encode, so a cutter sharing it could see a text cut short."""
    import threading

    embedder = torch_embedder
    long_text = PROSE * 4  # longer than the model's 256 tokens
    want = embedder.window_spans(long_text, embedder.spec)
    assert want[-1][1] > len(long_text) - 200  # the windows reach the end of the text
    stop = threading.Event()
    errors: list[BaseException] = []

    def encode_until_stopped() -> None:
        try:
            while not stop.is_set():
                embedder.encode(["short one", PROSE] * 4, batch_size=1)  # a tokenizer call per text
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=encode_until_stopped)
    t.start()
    try:
        got = [embedder.window_spans(long_text, embedder.spec) for _ in range(3000)]
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert all(g == want for g in got), sum(g != want for g in got)
