"""Embedding windows: which spans of a chunk get their own vector (docs/architecture.md#embedding-windows).

A chunk (3,000 characters by default, ~700 word pieces) holds far more than one
vector can say: averaged over 256 word pieces, one sentence's meaning is lost
among the others (measured in bench/RESULTS.md#retrieval).  So a chunk is
cut into short windows, each window gets a vector, and a chunk scores by its
best window.

Windows are packed from whole sentences (or lines, for code) up to the size
limit, so a sentence that fits a window is never cut in two; consecutive windows
share up to ``overlap`` word pieces of whole sentences, for context.  A sentence
longer than a window is cut by word pieces that share a quarter of a window (or
``overlap``, if more).

The cut depends only on the tokenizer's offsets, so ingest (sentence-
transformers) and query time (the small encoder in ``fastbert``) cut alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowSpec:
    #: word pieces per window at most (the model's own limit still applies)
    tokens: int
    #: word pieces of whole sentences two consecutive windows may share (a sentence longer than a window
    #: is cut into pieces that share a quarter of a window, or ``overlap`` if more)
    overlap: int
    #: pack whole sentences/lines; False cuts every ``tokens - overlap`` word pieces
    sentences: bool = True

    def __post_init__(self) -> None:
        if self.tokens < 8 or not (0 <= self.overlap < self.tokens // 2 + 1):
            raise ValueError(f"bad window spec: {self.tokens} tokens with {self.overlap} overlap")

    @property
    def label(self) -> str:
        """Recorded on each buffer (``buffers.embedding_windows``); search never mixes two labels."""
        return f"{'sentences' if self.sentences else 'tokens'}:{self.tokens}/{self.overlap}"

    @classmethod
    def from_label(cls, label: str) -> WindowSpec:
        kind, _, sizes = label.partition(":")
        tokens, _, overlap = sizes.partition("/")
        if kind not in ("sentences", "tokens") or not tokens.isdigit() or not overlap.isdigit():
            raise ValueError(f"not a window label: {label!r}")
        return cls(int(tokens), int(overlap), kind == "sentences")

    def capped(self, model_tokens: int) -> WindowSpec:
        """This spec within a model's sequence budget."""
        if self.tokens <= model_tokens:
            return self
        return WindowSpec(model_tokens, min(self.overlap, model_tokens // 2), self.sentences)


#: chosen by bench/retrieval.py (bench/RESULTS.md#retrieval)
DEFAULT_WINDOWS = WindowSpec(tokens=32, overlap=0, sentences=True)
#: what buffers embedded before windows were recorded used: 254 word pieces, 32 shared, cut anywhere
LEGACY_WINDOWS_LABEL = "tokens:254/32"


def query_windows(model_tokens: int) -> WindowSpec:
    """A query is embedded whole when it fits the model; a longer one by model-sized pieces, averaged."""
    return WindowSpec(model_tokens, 32, sentences=False)


# A unit starts after a sentence end followed by space, or at a line start.
_UNIT_START = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+(?=\S)|\n\s*(?=\S)")


def unit_starts(text: str) -> list[int]:
    """Char offsets where a sentence or line begins (always 0 first)."""
    return [0] + [m.end() for m in _UNIT_START.finditer(text) if m.end() < len(text)]


def cut(text: str, offsets: Sequence[tuple[int, int]], spec: WindowSpec) -> list[tuple[int, int]]:
    """Char spans of ``text`` to embed, given the tokenizer's word-piece offsets (no special tokens)."""
    n = len(offsets)
    if n <= spec.tokens:
        return [(0, len(text))]
    if not spec.sentences:
        return [(offsets[a][0], offsets[b][1]) for a, b in _token_steps(0, n, spec, overlap=spec.overlap)]
    # units as [first token, last token] ranges
    starts = unit_starts(text)
    firsts: list[int] = []
    si = -1
    for t, (s, _e) in enumerate(offsets):
        moved = False
        while si + 1 < len(starts) and starts[si + 1] <= s:
            si, moved = si + 1, True
        if moved or t == 0:
            firsts.append(t)
    units = [(a, (firsts[i + 1] - 1 if i + 1 < len(firsts) else n - 1)) for i, a in enumerate(firsts)]
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(units):
        a, b = units[i]
        if b - a + 1 > spec.tokens:  # one unit longer than a window: cut it by word pieces, overlapping
            spans.extend(_token_steps(a, b + 1, spec, overlap=max(spec.overlap, spec.tokens // 4)))
            i += 1
            continue
        k = i
        while k + 1 < len(units) and units[k + 1][1] - a + 1 <= spec.tokens:
            k += 1
        spans.append((a, units[k][1]))
        if k == len(units) - 1:
            break
        # the next window starts at the earliest unit after i whose tail to units[k] fits the overlap
        j = k + 1
        while j - 1 > i and units[k][1] - units[j - 1][0] + 1 <= spec.overlap:
            j -= 1
        i = j
    return [(offsets[a][0], offsets[b][1]) for a, b in spans]


def _token_steps(first: int, end: int, spec: WindowSpec, *, overlap: int) -> list[tuple[int, int]]:
    out = []
    step = spec.tokens - overlap
    for a in range(first, end, step):
        b = min(a + spec.tokens, end) - 1
        out.append((a, b))
        if b == end - 1:
            break
    return out
