"""Deterministic tokenizer for BM25 over prose and source code.

The same function runs at load time (tokens are stored with each chunk) and
at query time, so any change here must bump ``bm25_cache.TOKENIZER_VERSION``.

Identifiers are emitted whole *and* split into their parts, so a query for
``parse_config`` matches exactly while ``config`` alone still finds it.
"""

from __future__ import annotations

import re

__all__ = ["STOPWORDS", "tokenize"]

# Common English function words: they carry no topical signal and would only
# inflate posting lists.  Kept small on purpose: code keywords are not here.
STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have
    having he her here hers herself him himself his how i if in into is it its itself just me more most
    my myself no nor not now of off on once only or other our ours ourselves out over own same she should
    so some such than that the their theirs them themselves then there these they this those through to
    too under until up very was we were what when where which while who whom why will with would you
    your yours yourself yourselves
    """.split()
)

_WORD = re.compile(r"\w+")
# ASCII camelCase boundaries; acronyms stay together ("HTTPServer" -> HTTP, Server),
# digits stick to the letters before them ("utf8Decode" -> utf8, Decode).
_CAMEL = re.compile(r"[A-Z0-9]+(?=[A-Z][a-z])|[A-Z]?[a-z0-9]+|[A-Z0-9]+")


def _camel_parts_unicode(word: str) -> list[str]:
    """Rare path: camelCase split for non-ASCII words, mirroring ``_CAMEL``."""
    parts: list[str] = []
    start = 0
    n = len(word)
    for i in range(1, n):
        prev, cur = word[i - 1], word[i]
        lower_to_upper = cur.isupper() and not prev.isupper()
        # end of an acronym: "ÉTATUnis" splits before the "U" followed by lowercase
        acronym_end = cur.isupper() and prev.isupper() and i + 1 < n and word[i + 1].islower()
        if lower_to_upper or acronym_end:
            parts.append(word[start:i])
            start = i
    parts.append(word[start:])
    return parts


def _parts(word: str) -> list[str]:
    """Lowercased sub-words of an identifier (snake_case and camelCase)."""
    out: list[str] = []
    for piece in word.split("_"):
        if not piece:
            continue
        if not any(c.isupper() for c in piece):
            out.append(piece)
        elif piece.isascii():
            out.extend(p.lower() for p in _CAMEL.findall(piece))
        else:
            out.extend(p.lower() for p in _camel_parts_unicode(piece))
    return out


def _keep(tok: str) -> bool:
    return len(tok) > 1 and tok not in STOPWORDS


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens, plus the parts of snake_case / camelCase identifiers.

    Order follows the text; an identifier is followed by its parts.  Tokens of
    length 1, pure underscores and stopwords are dropped.
    """
    out: list[str] = []
    append = out.append
    stop = STOPWORDS
    for tok in _WORD.findall(text):
        # fast path: plain lowercase word (the vast majority of prose)
        if tok.islower() and "_" not in tok:
            if len(tok) > 1 and tok not in stop:
                append(tok)
            continue
        low = tok.lower()
        if "_" not in tok and low == tok:
            # digits or caseless scripts (e.g. CJK): nothing to split
            if _keep(low):
                append(low)
            continue
        if not low.strip("_"):
            continue
        if _keep(low):
            append(low)
        for p in _parts(tok):
            # a part equal to the whole ("Hello", "HTTP") would double its term frequency
            if p != low and _keep(p):
                append(p)
    return out
