"""Finding JSON in a model's reply, leniently (PaperQA2 style), for the stages that parse one.

Models wrap JSON in prose or fences, or rename the wrapping key; the parsers of
plan and analyst replies accept all of that, cap what the limits cap
(docs/contract.md#limits), and raise ``ParseError`` only when no JSON of the
right shape can be found at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from ..limits import MAX_FINDING_BYTES

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)


def json_candidates(text: str) -> Iterator[Any]:
    """Every JSON value we can find, lazily, most likely first: the whole text, fenced blocks, then the
    outermost brackets.  Lazy because callers stop at the first of the right shape, and a 50-chunk reply
    parsed three times over is CPU an analyst worker's other threads wait for."""
    stripped = text.strip()

    def pieces() -> Iterator[str]:
        yield stripped
        for m in _FENCE.finditer(text):
            yield m.group(1).strip()
        for open_, close in (("[", "]"), ("{", "}")):
            i, j = stripped.find(open_), stripped.rfind(close)
            if 0 <= i < j:
                yield stripped[i : j + 1]

    for piece in pieces():
        try:
            yield json.loads(piece)
        except (ValueError, RecursionError):
            continue


def leading_objects(text: str) -> list[dict]:
    """The complete objects at the head of the first JSON array in ``text``, for a reply cut off mid-array:
    ``[{…}, {…}, {"chunk_id": 7, "rel`` gives the first two."""
    start = text.find("[")
    if start < 0:
        return []
    decoder = json.JSONDecoder()
    out: list[dict] = []
    i = start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != "{":
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return out
        if isinstance(value, dict):
            out.append(value)


def clip(s: Any, limit: int = MAX_FINDING_BYTES) -> str:
    """Text of at most ``limit`` UTF-8 bytes (an ellipsis marks a cut); non-strings as JSON."""
    text = s if isinstance(s, str) else json.dumps(s, ensure_ascii=False) if s is not None else ""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", "ignore") + "…"


# "chunk 12", "[chunk 12, a.md:3-9]", "chunks 3, 5 and 7."; a number joined by "." ":" "/" "-" to what follows is
# a path or a line range ("[chunk 3, 2024.log:1-5]"), not another chunk
_CITATION = re.compile(r"\bchunks?\s*#?\s*(\d+)((?:\s*(?:,|and|&)\s*#?\d+\b(?![.:/-]\w))*)", re.I)
_NUMBER = re.compile(r"\d+")


def cited_chunk_ids(report: str, allowed: Iterable[int]) -> list[int]:
    """The chunk ids ``report`` cites, in order of first citation, only those in ``allowed`` (a model may cite a
    chunk it was never shown)."""
    ok = set(allowed)
    out: dict[int, None] = {}
    for m in _CITATION.finditer(report or ""):
        for n in [m.group(1), *_NUMBER.findall(m.group(2))]:
            if int(n) in ok:
                out.setdefault(int(n))
    return list(out)
