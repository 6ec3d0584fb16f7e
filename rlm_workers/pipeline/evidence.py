"""The lines a short answer rests on: an answering analyst's words pointed back at its chunks' own text.

A small model that answers from a batch (RLM_ANALYST_FINDINGS=answers) gets the gist right more often than the
value: it may write "1.4 metres" beside a line that says 2.4, or "1.2 petabytes" from a batch that says nothing of
the kind.  So its answer is only a pointer.  A chunk counts as evidence when it holds most of what the answer
says beyond the question (``grounded``), and the finding is that chunk's lines that best match the question and
the answer together (Okapi BM25 over the batch's lines, in the search's own tokens), verbatim: the synthesizer
reads the file's words, never the small model's (docs/contract.md#analyst-message).  A line is quoted with its
neighbours in the same paragraph, and a list with the line that introduces it, because text is wrapped: the line
that holds a value often leaves its subject on the line above, and one item of a list cannot be counted.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from ..llm.stage_input import ChunkForPrompt
from ..search.tokenize import tokenize

#: lines quoted per cited chunk, and how long one may be
EVIDENCE_LINES = 2
#: an uncited chunk's line that matches the question this well (a share of the batch's best line) is kept too,
#: graded low: a small model answering the whole question passes over a chunk that holds only one step of it
CONTEXT_SHARE = 0.6
MAX_LINE_CHARS = 400
#: lines of the same paragraph (no blank line between) quoted on each side of a best-matching line, where its
#: sentence runs on
NEIGHBOUR_LINES = 1
#: a list is quoted whole with the line that introduces it ("…, in this order:"), up to this many lines
MAX_LIST_LINES = 12
#: Okapi BM25's usual constants
K1, B = 1.2, 0.75
#: the share of an answer's own words (those the question does not use) a chunk must hold to ground it
GROUNDED_SHARE = 0.5


#: words of a count: an answer that is only a number (or a count in words) says nothing a chunk must hold
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty hundred thousand million".split()
)


#: a number as written, thousands separated by commas or not, perhaps with a decimal part ("26379", "1,150", "2.4")
_NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")
#: a line that ends a sentence (a full stop, a question or an exclamation, perhaps inside quotes or brackets)
_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d]*\s*$")
#: a line that is an item of a list: a bullet or a number, then a space
_LIST_ITEM = re.compile(r"\s*(?:[-*+\u2022]|\d{1,3}[.)])\s")


def grounded(answer: str, question: str, chunks: Sequence[ChunkForPrompt], cited: Iterable[int]) -> set[int]:
    """The chunks that hold what ``answer`` says beyond ``question``: of those cited, or, when none of them does
    (a small model misreads ids more often than words), of the whole batch.  A chunk holds the answer when it
    holds most of its own words and most of the numbers it gives that the batch has anywhere (a number no chunk
    holds is a count or a misreading, never a pointer); an answer that is only a count is taken at its
    citations, and one that says nothing is grounded nowhere."""
    if not answer.strip():
        return set()
    own = {t for t in set(tokenize(answer)) - set(tokenize(question)) if not t.isdigit() and t not in _NUMBER_WORDS}
    wanted = {c.chunk_id for c in chunks} & set(cited)
    numbers = {c.chunk_id: _numbers(c.text) for c in chunks}
    values = (_numbers(answer) - _numbers(question)) & set().union(*numbers.values())
    if not own:
        # a lone digit answering on its own is far more often a count than a value read off the page
        values = {v for v in values if len(v.replace(".", "")) > 1}
        if not values:
            return wanted
    if own:
        by_words = {c.chunk_id for c in chunks if len(own & set(tokenize(c.text))) >= GROUNDED_SHARE * len(own)}
    else:
        by_words = set(numbers)  # an answer of numbers alone: every chunk holds its (no) words
    by_values = {cid for cid in by_words if len(values & numbers[cid]) >= GROUNDED_SHARE * len(values)}
    holding = by_values or by_words
    return (holding & wanted) or holding


def evidence_lines(
    text: str,
    chunks: Sequence[ChunkForPrompt],
    cited: Iterable[int],
    *,
    per_chunk: int = EVIDENCE_LINES,
    share: float = 0.0,
) -> dict[int, list[str]]:
    """For each cited chunk, the passages (``line 12: …``, ``lines 12-14: …``) of its ``per_chunk`` lines that
    best match ``text`` (the question and the answer), best first; lines that share no term with it, or score
    under ``share`` of the batch's best line, are never quoted."""
    query = set(tokenize(text))
    split = {c.chunk_id: c.text.split("\n") for c in chunks}
    lines = [
        (c.chunk_id, i, tokenize(line)) for c in chunks for i, line in enumerate(split[c.chunk_id]) if line.strip()
    ]
    if not query or not lines:
        return {}
    df = Counter(t for *_, terms in lines for t in set(terms))
    n = len(lines)
    avg = sum(len(terms) for *_, terms in lines) / n or 1.0
    wanted = set(cited)
    scored: dict[int, list[tuple[float, int]]] = {}  # a cited chunk's (score, index of the line)
    best_of_batch = 0.0
    for cid, i, terms in lines:
        tf = Counter(terms)
        score = sum(
            math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
            * tf[t]
            * (K1 + 1)
            / (tf[t] + K1 * (1 - B + B * len(terms) / avg))
            for t in query & tf.keys()
        )
        best_of_batch = max(best_of_batch, score)
        if score > 0 and cid in wanted:
            scored.setdefault(cid, []).append((score, i))
    start_line = {c.chunk_id: c.start_line for c in chunks}
    out = {}
    for cid, found in scored.items():
        ranked = sorted(found, key=lambda s: (-s[0], s[1]))
        best = [i for score, i in ranked if score >= share * best_of_batch][:per_chunk]
        spans: list[tuple[int, int]] = []  # best first; one that overlaps an earlier one joins it
        for hit in best:
            first, last = _passage(split[cid], hit)
            for k, (a, b) in enumerate(spans):
                if first <= b + 1 and a <= last + 1:
                    spans[k] = (min(a, first), max(b, last))
                    break
            else:
                spans.append((first, last))
        if spans:
            out[cid] = [_quote(split[cid], start_line[cid], a, b) for a, b in spans]
    return out


def _numbers(text: str) -> set[str]:
    """The numbers ``text`` writes, each in one form: "1,150" is 1150 and "5.0" is 5."""
    out = set()
    for m in _NUMBER.finditer(text):
        value = m.group().replace(",", "")
        out.add(value.rstrip("0").rstrip(".") if "." in value else value)
    return out


def _passage(lines: Sequence[str], hit: int) -> tuple[int, int]:
    """The lines (first, last; indexes into ``lines``) quoted for the line at ``hit``: with the neighbour above
    when the sentence starts there and the one below when it goes on there (same paragraph only), or the whole
    paragraph when that is a list; then the list a paragraph ending with a colon introduces, and the line that
    introduces a list the quote starts with."""

    def blank(i: int) -> bool:
        return not lines[i].strip()

    def block(i: int) -> tuple[int, int]:
        a, b = i, i
        while a > 0 and not blank(a - 1):
            a -= 1
        while b < len(lines) - 1 and not blank(b + 1):
            b += 1
        return a, b

    start, end = block(hit)
    if end - start < MAX_LIST_LINES and sum(bool(_LIST_ITEM.match(lines[i])) for i in range(start, end + 1)) > 1:
        first, last = start, end
    else:
        first, last = hit, hit
        while first > max(start, hit - NEIGHBOUR_LINES) and not _SENTENCE_END.search(lines[first - 1]):
            first -= 1
        while last < min(end, hit + NEIGHBOUR_LINES) and not _SENTENCE_END.search(lines[last]):
            last += 1
    if last == end and lines[end].rstrip().endswith(":"):
        nxt = next((i for i in range(end + 1, len(lines)) if not blank(i)), None)
        if nxt is not None:
            last = min(block(nxt)[1], first + MAX_LIST_LINES - 1)
    if first == start and _LIST_ITEM.match(lines[start]):
        prev = next((i for i in range(start - 1, -1, -1) if not blank(i)), None)
        if prev is not None and lines[prev].rstrip().endswith(":"):
            first = prev
    return first, last


def _quote(chunk_lines: Sequence[str], start_line: int, first: int, last: int) -> str:
    lines = chunk_lines[first : last + 1]
    if first == last:
        return f"line {start_line + first}: {_clip(lines[0].strip())}"
    body = "\n".join(f"  {_clip(line.rstrip())}" for line in lines if line.strip())
    # said outright: a small model asked "how many" miscounts even a short list it can read
    items = sum(bool(_LIST_ITEM.match(line)) for line in lines)
    listed = f" (a list of {items} items)" if items > 1 else ""
    return f"lines {start_line + first}-{start_line + last}{listed}:\n{body}"


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…"
