"""Splitting file text into chunks: ``semantic`` (default), ``fixed`` and ``code``.

Every chunker works on character spans of the file text, so a chunk is always
an exact slice: its line numbers and UTF-8 byte offsets point at precisely
the text the analyst quoted.  Invariants, for every chunker:

* chunks are in file order, never empty or whitespace-only, and together
  cover every non-whitespace character;
* no chunk is longer than ``chunk_size`` characters (a hard split is the last
  resort, e.g. for a minified line);
* consecutive chunks overlap by at most ``overlap`` characters.

The semantic and code chunkers share one engine: split a span with the
coarsest splitter that applies (paragraphs, sentences, words / definitions,
blank lines, lines), recurse into pieces that are still too long, then pack
the pieces greedily, repeating whole trailing pieces as overlap.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import pairwise
from typing import TYPE_CHECKING

from ..limits import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

if TYPE_CHECKING:
    from .documents import Document

CHUNKERS = ("semantic", "fixed", "code")
#: formats whose chunks each stay on one page (docs/contract.md#documents); a slide deck's slides are too short
#: to stand alone and still join
PAGE_BOUNDED_FORMATS = frozenset({"pdf"})


@dataclass(frozen=True)
class Chunk:
    text: str
    start_line: int  # 1-based line of the first char in the file
    end_line: int  # 1-based line of the last char (inclusive)
    start_byte: int  # UTF-8 byte offset in the (newline-normalised) file text
    end_byte: int  # exclusive
    # Where a converted document's chunk sits (docs/contract.md#documents); None / () for plain text and code.
    page_start: int | None = None
    page_end: int | None = None
    heading_path: tuple[str, ...] = ()


def validate_chunk_params(chunker: str, chunk_size: int, overlap: int) -> None:
    if chunker not in CHUNKERS:
        raise ValueError(f"unknown chunker {chunker!r}: use one of {', '.join(CHUNKERS)}")
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE)
    ):
        raise ValueError(
            f"chunk size must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE:,} characters (got {chunk_size!r})"
        )
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap must be a whole number of characters, 0 or more (got {overlap!r})")
    if overlap >= chunk_size:
        raise ValueError(f"overlap ({overlap}) must be smaller than the chunk size ({chunk_size})")


def chunk_text(
    text: str, *, path: str, chunker: str = "semantic", chunk_size: int = 3000, overlap: int = 500
) -> list[Chunk]:
    validate_chunk_params(chunker, chunk_size, overlap)
    if chunker == "fixed":
        spans = _fixed_spans(text, chunk_size, overlap)
    elif chunker == "code" and (lang := language_for(path)) is not None:
        spans = _code_spans(text, lang, chunk_size, overlap)
    else:  # semantic, and code for files whose language we do not know
        units = _split(text, 0, len(text), chunk_size, _prose_splitters(chunk_size, overlap))
        spans = _pack(units, chunk_size, overlap)
    return _to_chunks(text, spans)


# --- spans → chunks -------------------------------------------------------------------------------


class _Locator:
    """Char offset → line number and UTF-8 byte offset.

    A cursor rather than a table: chunks arrive in file order (stepping back only by the overlap),
    so counting newlines / encoding just the gap since the last call keeps a 10 MB file linear,
    where a precomputed newline list alone costs a Python int per line.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.ascii = text.isascii()
        self._char = 0
        self._line = 1
        self._byte = 0

    def _move(self, i: int) -> None:
        a, b = sorted((self._char, i))
        sign = 1 if i >= self._char else -1
        self._line += sign * self.text.count("\n", a, b)
        if not self.ascii:
            self._byte += sign * len(self.text[a:b].encode("utf-8", "surrogatepass"))
        self._char = i

    def line(self, i: int) -> int:
        """1-based line of the character at ``i``."""
        self._move(i)
        return self._line

    def byte(self, i: int) -> int:
        self._move(i)
        return i if self.ascii else self._byte


def _trim(text: str, s: int, e: int) -> tuple[int, int]:
    """Drop surrounding whitespace, but keep the indentation of a first line that starts the span."""
    body = text[s:e].rstrip()
    if not body:
        return s, s
    end = s + len(body)
    first = end - len(body.lstrip())
    nl = text.rfind("\n", s, first)
    if nl != -1:  # leading blank lines go, the first line's indentation stays
        s = nl + 1
    elif not (s == 0 or text[s - 1] == "\n"):  # mid-line start (fixed, word splits): start at the word
        s = first
    return s, end


def _to_chunks(text: str, spans: list[tuple[int, int]]) -> list[Chunk]:
    return _chunks_at(text, _kept(text, spans))


def _kept(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans trimmed, empty ones dropped and ordering kept strict."""
    kept: list[tuple[int, int]] = []
    for raw_s, raw_e in spans:
        s, e = _trim(text, raw_s, raw_e)
        if s == e:
            continue
        # Defensive: a chunk wholly inside its neighbour adds nothing and would break ordering.
        if kept and e <= kept[-1][1]:
            continue
        while kept and s <= kept[-1][0]:
            kept.pop()
        kept.append((s, e))
    return kept


def _chunks_at(text: str, kept: list[tuple[int, int]]) -> list[Chunk]:
    loc = _Locator(text)
    out = []
    for s, e in kept:
        start_byte = loc.byte(s)
        out.append(
            Chunk(
                text=text[s:e],
                start_line=loc.line(s),
                end_line=loc.line(e - 1),
                start_byte=start_byte,
                end_byte=loc.byte(e),
            )
        )
    return out


# --- fixed ----------------------------------------------------------------------------------------

_LAST_WS = re.compile(r"\s\S*\Z")  # with endpos: the rightmost whitespace before endpos
_WS = re.compile(r"\s")


def _fixed_spans(text: str, size: int, overlap: int) -> list[tuple[int, int]]:
    n, slack = len(text), max(1, size // 10)
    spans: list[tuple[int, int]] = []
    pos = 0
    while pos < n:
        end = pos + size
        if end >= n:
            spans.append((pos, n))
            break
        if not (text[end].isspace() or text[end - 1].isspace()):
            m = _LAST_WS.search(text, end - slack, end)
            if m:  # cut before the word instead of through it
                end = m.start()
        spans.append((pos, end))
        nxt = max(end - overlap, pos + 1)
        if nxt < end and not (text[nxt].isspace() or text[nxt - 1].isspace()):
            m = _WS.search(text, nxt, min(nxt + slack, end))
            if m:  # start the overlap at a word, shrinking it rather than growing it
                nxt = m.start()
        pos = nxt
    return spans


# --- the split-and-pack engine --------------------------------------------------------------------

# A unit is (start, content_end, end): content_end drops the unit's trailing whitespace, which is
# what the size limit is measured on (trailing whitespace is trimmed off every chunk).
Unit = tuple[int, int, int]
Splitter = Callable[[str, int, int], list[int]]


def _regex_splitter(pattern: re.Pattern[str], step: int) -> Splitter:
    """Split points at the ends of ``pattern`` matches, at least ``step`` chars apart.

    One unit per line or word would cost a tuple each on a 10 MB log or dump; runs of a few
    lines/words keep that fast and are still fine-grained enough for packing and overlap.
    """

    def split(text: str, s: int, e: int) -> list[int]:
        points, p = [], s
        while (m := pattern.search(text, p + step, e)) is not None and m.end() < e:
            points.append(m.end())
            p = m.end()
        return points

    return split


def _unit_step(size: int, overlap: int) -> int:
    return max(8, min(size // 16, overlap // 3 if overlap else size))


def _content_end(text: str, s: int, e: int) -> int:
    body = text[s:e].rstrip()
    return s + len(body) if body else s


def _split(text: str, s: int, e: int, size: int, splitters: list[Splitter]) -> list[Unit]:
    """Cut [s, e) into contiguous units of at most ``size`` content chars, coarsest splitter first."""
    out: list[Unit] = []
    todo = [(s, e, 0)]
    while todo:
        a, b, level = todo.pop()
        c = _content_end(text, a, b)
        if c - a <= size:
            out.append((a, c, b))
        elif level == len(splitters):  # nothing natural left: hard split
            cuts = list(range(a, c, size))
            for x, y in pairwise([*cuts, b]):
                out.append((x, _content_end(text, x, y), y))
        else:
            points = splitters[level](text, a, b)
            bounds = [a, *points, b]
            todo.extend((x, y, level + 1) for x, y in reversed(list(pairwise(bounds))))
    return out


def _pack(units: list[Unit], size: int, overlap: int) -> list[tuple[int, int]]:
    """Greedy packing; each chunk after the first repeats whole trailing units worth ≤ overlap chars."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(units)
    while i < n:
        start, j = units[i][0], i
        while j + 1 < n and units[j + 1][1] - start <= size:
            j += 1
        spans.append((start, units[j][2]))
        if j + 1 >= n:
            break
        # Walk back from the first unit not yet emitted while the repeat fits the overlap and
        # still leaves room for that unit, so every chunk makes progress.
        k, last_content, must_fit = j + 1, units[j][1], units[j + 1][1]
        while k - 1 > i and last_content - units[k - 1][0] <= overlap and must_fit - units[k - 1][0] <= size:
            k -= 1
        i = k
    return spans


_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")
_SENTENCE_OR_LINE = re.compile(r"(?<=[.!?])\s+|\n")
_WS_RUN = re.compile(r"\s+")


@lru_cache(maxsize=64)
def _prose_splitters(size: int, overlap: int) -> list[Splitter]:
    step = _unit_step(size, overlap)
    return [_regex_splitter(p, step) for p in (_BLANK_LINES, _SENTENCE_OR_LINE, _WS_RUN)]


# --- code -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Language:
    name: str
    definition: re.Pattern[str]  # a zero-indent line that starts a top-level definition
    comment: re.Pattern[str]  # comment lines that belong to the definition below them
    decorator: re.Pattern[str] | None = None  # decorators/attributes; may continue over indented lines
    block_comments: bool = True  # /* ... */


_C_COMMENT = re.compile(r"(?: ?(?://|/\*|\*))")
_MODS_JAVA = r"(?:(?:public|private|protected|static|final|abstract|sealed|non-sealed|strictfp)\s+)*"
_MODS_CS = r"(?:(?:public|private|protected|internal|static|sealed|abstract|partial|readonly|unsafe|file|new)\s+)*"
_MODS_KT = (
    r"(?:(?:public|private|protected|internal|open|abstract|sealed|data|inline|value|enum|annotation|"
    r"override|suspend|inner|companion|expect|actual|const)\s+)*"
)


def _lang(
    name: str,
    definition: str,
    comment: re.Pattern[str] = _C_COMMENT,
    decorator: str | None = None,
    block_comments: bool = True,
) -> Language:
    return Language(
        name,
        re.compile(definition, re.M),
        comment,
        re.compile(decorator) if decorator else None,
        block_comments,
    )


_PY = _lang("python", r"^(?:async\s+def|def|class)\b", re.compile(r"#"), r"@", block_comments=False)
_JS = _lang(
    "javascript",
    r"^(?:export\b|(?:declare\s+)?(?:abstract\s+)?(?:async\s+)?"
    r"(?:function\b|class\b|interface\b|type\s|enum\b|const\b|let\b|var\b|namespace\b))",
    decorator=r"@",
)
_LANGUAGES: dict[str, Language] = {
    ".py": _PY,
    ".pyi": _PY,
    **dict.fromkeys((".js", ".jsx", ".mjs", ".cjs", ".ts", ".tsx", ".mts", ".cts"), _JS),
    ".go": _lang("go", r"^(?:func|type|var|const)\b"),
    ".rs": _lang(
        "rust",
        r"^(?:pub(?:\([^)]*\))?\s+)?(?:(?:unsafe|async|const|default|extern(?:\s+\"[^\"]*\")?)\s+)*"
        r"(?:fn|struct|enum|trait|impl|mod|type|const|static|union)\b|^macro_rules!",
        re.compile(r"(?: ?(?://|/\*|\*)|#!?\[)"),
        r"#!?\[",
    ),
    ".java": _lang("java", rf"^{_MODS_JAVA}(?:class|interface|enum|record|@interface)\b", decorator=r"@"),
    ".cs": _lang("csharp", rf"^{_MODS_CS}(?:class|interface|struct|enum|record|delegate|namespace)\b", decorator=r"\["),
    **dict.fromkeys(
        (".kt", ".kts"),
        _lang("kotlin", rf"^{_MODS_KT}(?:fun|class|object|interface|typealias|val|var)\b", decorator=r"@"),
    ),
    # C/C++: any zero-indent line that starts with a name (not a goto label) begins a declaration.
    **dict.fromkeys(
        (".c", ".h", ".cc", ".cpp", ".cxx", ".hh", ".hpp", ".hxx"),
        _lang(
            "c",
            r"^(?!(?:public|private|protected)\s*:)(?![A-Za-z_]\w*:\s*$)[A-Za-z_]|^#\s*define\b",
            decorator=r"template\b",
        ),
    ),
}
_CONTINUATION = re.compile(r"[ \t)\]}]")  # inside a multi-line decorator: indented or a closing bracket
_PROLOGUE_MAX_LINES = 200


def language_for(path: str) -> Language | None:
    dot = path.rfind(".")
    return _LANGUAGES.get(path[dot:].lower()) if dot > path.rfind("/") else None


def _prologue_start(text: str, line_start: int, lang: Language, floor: int) -> int:
    """Where the block of the definition at ``line_start`` begins, taking its decorators and comments.

    Stops at a blank line or at anything that is not a comment/decorator line; indented lines are
    taken only when a decorator above them shows they are its arguments.  Never goes above ``floor``.
    """
    start, pos, pending = line_start, line_start, False
    for _ in range(_PROLOGUE_MAX_LINES):
        if pos <= floor:
            break
        prev = text.rfind("\n", 0, pos - 1) + 1
        if prev < floor:
            break
        line = text[prev : pos - 1]
        if not line.strip():
            break
        if lang.decorator is not None and lang.decorator.match(line):
            start, pending = prev, False
        elif not pending and lang.block_comments and line.rstrip().endswith("*/") and "/*" not in line:
            # the end of a block comment, whose inner lines need not start with "*": jump to its "/*"
            opener = text.rfind("/*", floor, prev)
            if opener == -1:
                break
            prev = text.rfind("\n", 0, opener) + 1
            if prev < floor or text[prev:opener].strip():
                break  # "/*" after code on its line: not a comment block we can attach
            start = prev
        elif not pending and lang.comment.match(line):
            start = prev
        elif lang.decorator is not None and _CONTINUATION.match(line):
            pending = True
        else:
            break
        pos = prev
    return start


def _block_starts(text: str, lang: Language) -> list[int]:
    starts, prev_def = [0], -1
    for m in lang.definition.finditer(text):
        s = _prologue_start(text, m.start(), lang, floor=prev_def + 1)
        if s > starts[-1]:
            starts.append(s)
        prev_def = m.start()
    return starts


@lru_cache(maxsize=64)
def _code_splitters(indent: int, size: int, overlap: int) -> list[Splitter]:
    step = _unit_step(size, overlap)
    return [
        # blank lines before a line at the body's own indentation: between methods / statements
        _regex_splitter(re.compile(rf"\n(?:[ \t]*\n)+(?=[ \t]{{{indent}}}\S)"), step),
        _regex_splitter(_BLANK_LINES, step),
        _regex_splitter(re.compile(r"\n"), step),
    ]


# Indented lines, except " * " doc-comment continuations, which would fake a one-space body indent.
_INDENTED = re.compile(r"^([ \t]+)[^\s*]", re.M)


def _code_spans(text: str, lang: Language, size: int, overlap: int) -> list[tuple[int, int]]:
    """Whole definitions packed together without overlap; an oversized one is split with overlap."""
    bounds = [*_block_starts(text, lang), len(text)]
    spans: list[tuple[int, int]] = []
    small: list[Unit] = []
    for a, b in pairwise(bounds):
        c = _content_end(text, a, b)
        if c - a <= size:
            small.append((a, c, b))
            continue
        spans.extend(_pack(small, size, 0))
        small = []
        indent = min((len(m.group(1)) for m in _INDENTED.finditer(text, a, b)), default=0)
        spans.extend(_pack(_split(text, a, b, size, _code_splitters(indent, size, overlap)), size, overlap))
    spans.extend(_pack(small, size, 0))
    return spans


# --- documents ------------------------------------------------------------------------------------


def chunk_document(
    doc: Document, *, path: str, chunker: str = "semantic", chunk_size: int = 3000, overlap: int = 500
) -> list[Chunk]:
    """A converted document's chunks, broken at its headings where they can be, each with its heading path and
    pages (docs/contract.md#documents).  A document with neither headings nor pages is cut exactly as
    ``chunk_text`` cuts it, so plain text, code and heading-less Markdown keep their chunks."""
    if not doc.headings and not doc.pages:
        return chunk_text(doc.text, path=path, chunker=chunker, chunk_size=chunk_size, overlap=overlap)
    validate_chunk_params(chunker, chunk_size, overlap)
    text = doc.text
    # A PDF's pages are where a reader finds a passage: a chunk never runs over a page break, so the page a
    # citation names is the passage's own, not the span of a chunk that joined three short pages.
    parts = _page_bounds(doc.pages, len(text)) if doc.format in PAGE_BOUNDED_FORMATS else [(0, len(text))]
    heads = [h.start for h in doc.headings]
    spans: list[tuple[int, int]] = []
    for a, b in parts:
        if chunker == "fixed":
            found = _fixed_spans(text[a:b], chunk_size, overlap)
        else:
            found = _section_spans(text[a:b], [h - a for h in heads if a < h < b], chunk_size, overlap)
        spans.extend((a + s, a + e) for s, e in found)
    kept = _kept(text, spans)
    sections = _section_bounds(doc, len(text))
    return [
        replace(
            ch,
            page_start=_page_at(doc.pages, s),
            page_end=_page_at(doc.pages, e - 1),
            heading_path=_path_of(sections, s, e),
        )
        for ch, (s, e) in zip(_chunks_at(text, kept), kept, strict=True)
    ]


def _section_spans(text: str, starts: list[int], size: int, overlap: int) -> list[tuple[int, int]]:
    """Each section its own chunk; sections too small to stand alone (under a third of ``size``, e.g. a heading
    right above its first subheading) join the next while they fit; a section over ``size`` is cut like prose,
    with overlap inside it but never across a heading."""
    bounds = sorted({0, *(s for s in starts if 0 < s < len(text)), len(text)})
    spans: list[tuple[int, int]] = []
    open_start: int | None = None  # a chunk of small sections still taking more
    for a, b in pairwise(bounds):
        c = _content_end(text, a, b)
        if c - a > size:
            if open_start is not None:
                spans.append((open_start, a))
                open_start = None
            spans.extend(_pack(_split(text, a, b, size, _prose_splitters(size, overlap)), size, overlap))
            continue
        if open_start is not None and c - open_start > size:
            spans.append((open_start, a))
            open_start = None
        if open_start is None:
            open_start = a
        if c - open_start >= size // 3:
            spans.append((open_start, b))
            open_start = None
    if open_start is not None:
        spans.append((open_start, len(text)))
    return spans


def _page_bounds(pages: list[int], n: int) -> list[tuple[int, int]]:
    """Each page's [start, end) in a text of ``n`` characters (the whole text when it has no pages)."""
    starts = [p for p in pages if 0 < p < n]
    return list(pairwise([0, *starts, n]))


def _page_at(pages: list[int], i: int) -> int | None:
    """1-based page of the character at ``i``; None for a format without pages."""
    return bisect_right(pages, i) if pages else None


def _section_bounds(doc: Document, n: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """(start, end, heading path) of each heading's own text, up to the next heading of any level."""
    ends = [h.start for h in doc.headings[1:]] + [n]
    return [(h.start, end, h.path) for h, end in zip(doc.headings, ends, strict=False)]


def _path_of(sections: list[tuple[int, int, tuple[str, ...]]], s: int, e: int) -> tuple[str, ...]:
    """The heading path of the section holding most of [s, e): a chunk that starts with a section's last lines
    and then runs through the next is cited by the one it is mostly about."""
    best: tuple[str, ...] = ()
    best_len = 0
    before = sections[0][0] - s if sections else 0  # text above the first heading belongs to no section
    if before > 0:
        best_len = min(before, e - s)
    for a, b, path in sections:
        if a >= e:
            break
        covered = min(b, e) - max(a, s)
        if covered > best_len:
            best, best_len = path, covered
    return best


def outline(doc: Document) -> list[dict[str, object]]:
    """A document's headings as stored with its file: level, title, path, lines (a section runs to the next
    heading of its level or above, subsections included) and page."""
    text, heads = doc.text, doc.headings
    loc = _Locator(text)
    out: list[dict[str, object]] = []
    for i, h in enumerate(heads):
        end = next((n.start for n in heads[i + 1 :] if n.level <= h.level), len(text))
        last = max(h.start, _content_end(text, h.start, end) - 1)
        out.append(
            {
                "level": h.level,
                "title": h.title,
                "path": list(h.path),
                "start_line": loc.line(h.start),
                "end_line": loc.line(last),
                "page": _page_at(doc.pages, h.start),
            }
        )
    return out
