"""The lines a short answer rests on: an answering analyst's words pointed back at its chunks' own text.

A small model that answers from a batch (RLM_ANALYST_FINDINGS=answers) gets the gist right more often than the
value: it may write "1.4 metres" beside a line that says 2.4, or "1.2 petabytes" from a batch that says nothing of
the kind.  So its answer is only a pointer.  A chunk counts as evidence when it holds most of what the answer
says beyond the question (``grounded``), and the finding is that chunk's lines that best match the question and
the answer together (Okapi BM25 over the batch's lines, in the search's own tokens), verbatim: the synthesizer
reads the file's words, never the small model's (docs/contract.md#analyst-message).
"""

from __future__ import annotations

import math
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
#: Okapi BM25's usual constants
K1, B = 1.2, 0.75
#: the share of an answer's own words (those the question does not use) a chunk must hold to ground it
GROUNDED_SHARE = 0.5


#: words of a count: an answer that is only a number (or a count in words) says nothing a chunk must hold
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty hundred thousand million".split()
)


def grounded(answer: str, question: str, chunks: Sequence[ChunkForPrompt], cited: Iterable[int]) -> set[int]:
    """The chunks that hold what ``answer`` says beyond ``question``: of those cited, or, when none of them does
    (a small model misreads ids more often than words), of the whole batch.  An answer that is only a number (a
    count is never written out) is taken at its citations; one that says nothing is grounded nowhere."""
    if not answer.strip():
        return set()
    own = {t for t in set(tokenize(answer)) - set(tokenize(question)) if not t.isdigit() and t not in _NUMBER_WORDS}
    wanted = {c.chunk_id for c in chunks} & set(cited)
    if not own:
        return wanted
    holding = {c.chunk_id for c in chunks if len(own & set(tokenize(c.text))) >= GROUNDED_SHARE * len(own)}
    return (holding & wanted) or holding


def evidence_lines(
    text: str,
    chunks: Sequence[ChunkForPrompt],
    cited: Iterable[int],
    *,
    per_chunk: int = EVIDENCE_LINES,
    share: float = 0.0,
) -> dict[int, list[str]]:
    """For each cited chunk, its ``per_chunk`` lines (``line 12: …``) that best match ``text`` (the question and the
    answer), best first; lines that share no term with it, or score under ``share`` of the batch's best line,
    are never quoted."""
    query = set(tokenize(text))
    lines = [
        (c.chunk_id, c.start_line + i, line.strip(), tokenize(line))
        for c in chunks
        for i, line in enumerate(c.text.split("\n"))
        if line.strip()
    ]
    if not query or not lines:
        return {}
    df = Counter(t for *_, terms in lines for t in set(terms))
    n = len(lines)
    avg = sum(len(terms) for *_, terms in lines) / n or 1.0
    wanted = set(cited)
    scored: dict[int, list[tuple[float, int, str]]] = {}
    best_of_batch = 0.0
    for cid, number, line, terms in lines:
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
            scored.setdefault(cid, []).append((score, number, line))
    out = {}
    for cid, found in scored.items():
        ranked = sorted(found, key=lambda s: (-s[0], s[1]))
        best = [f for f in ranked if f[0] >= share * best_of_batch][:per_chunk]
        if best:
            out[cid] = [f"line {number}: {_clip(line)}" for _, number, line in best]
    return out


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…"
