"""The passage of a hit a person should see: the lines of the chunk where the query's words are, and text cut
to a length without cutting a word (``shorten``).

A chunk is up to a few thousand characters; its first lines are often a heading or imports, not what
matched.  This picks the run of ``width`` consecutive lines with the most query-term hits (the same
tokenizer as BM25, so ``refund_window`` matches ``refund``), and gives their real line numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .tokenize import tokenize

#: what marks a cut: a reader must see the text goes on, not take a cut word for the file's own
CUT = "…"
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


@dataclass(frozen=True)
class Preview:
    #: (line number in the file, text) of each line shown; blank lines are left out
    lines: list[tuple[int, str]]
    #: query-term occurrences in those lines (0: nothing matched literally, e.g. a semantic-only hit)
    hits: int
    #: distinct query terms in those lines, and in the query
    found: int = 0
    terms: int = 0

    @property
    def literal(self) -> bool:
        """The lines hold at least half the query's terms: the words themselves matched, not a stray one."""
        return self.hits > 0 and 2 * self.found >= self.terms


def matched_lines(text: str, query: str, *, start_line: int = 1, width: int = 3) -> Preview:
    """The ``width`` consecutive non-blank lines of ``text`` holding the most query terms; the first
    non-blank lines when none holds any.  Among equal runs the earliest that starts on a matching line wins,
    so the match is the first line shown rather than the last."""
    terms = set(tokenize(query))
    numbered = [(start_line + i, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if not numbered:
        return Preview(lines=[], hits=0, terms=len(terms))
    tokens = [tokenize(ln) for _, ln in numbered]
    scores = [sum(t in terms for t in toks) for toks in tokens]
    # a run may be cut short by the chunk's end, so a match on its last line can still be the first shown
    best = max(range(len(numbered)), key=lambda i: (sum(scores[i : i + width]), scores[i] > 0, -i))
    found = terms.intersection(t for toks in tokens[best : best + width] for t in toks)
    return Preview(
        lines=numbered[best : best + width], hits=sum(scores[best : best + width]), found=len(found), terms=len(terms)
    )


def shorten(text: str, limit: int, *, sentences: bool = False) -> str:
    """``text`` in at most ``limit`` characters: whole, or cut after a whole word and marked `` …`` (after a whole
    sentence with ``sentences``, where one ends in the last quarter of what fits).  A single word longer than half
    the limit (a long path, a hash) is the one thing cut inside, since nothing else would show any of it."""
    if len(text) <= limit:
        return text
    room = max(1, limit - len(CUT) - 1)  # the marker and the space before it
    head = text[: room + 1]  # one more: a word that ends exactly at the limit is whole
    if sentences and (ends := [m.end() for m in _SENTENCE_END.finditer(head) if m.end() <= room]):
        if ends[-1] >= room * 3 // 4:
            return f"{head[: ends[-1]]} {CUT}"
    space = max(head.rfind(" "), head.rfind("\n"), head.rfind("\t"))
    if space >= room // 2:
        return f"{head[:space].rstrip()} {CUT}"
    return head[:room] + CUT
