"""A document's outline and the text of one of its sections, read back from the store (docs/contract.md#documents).

The synthesizer's ``get_outline`` / ``get_section`` tools and the MCP tools of the same names both come here, so
the two surfaces match a heading and cut a section the same way.  Every argument is untrusted (a model or an agent
wrote it): the buffer is looked up among the tenant's own, and a bad path or heading is a one-line ``InvalidInput``
that says what would work instead.

A section runs from its heading to the next heading of the same or a higher level, subsections included (the
outline stored at load time already holds those lines).  Its text is stitched from the file's chunks by their
byte offsets: chunks overlap, and the overlap is taken once.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ConfigDict

from ..errors import InvalidInput
from ..models import Location, check_storable_text
from ..store.buffers import SpanChunk, chunks_in_lines, file_outline, list_files, paths_ending, require_buffers
from .provenance import PATH_SEPARATOR, cite_of

if TYPE_CHECKING:
    import psycopg

    from ..store.buffers import FileOutline

#: longest path or heading argument taken; a stored path is at most a few hundred characters
MAX_ARG_CHARS = 2000
#: candidates named in an ambiguous-heading error, and close titles in an unknown-heading one
MAX_CANDIDATES = 12
#: what ends a section's text that was cut short
CUT_MARK = "[… section cut at"
#: how many of a buffer's paths an unknown path is compared with for a suggestion
MAX_PATHS_COMPARED = 20_000
# "A › B", "A > B" and "A›B" all name the same path; a title's own "/" (TCP/IP) is no separator
_SPLIT = re.compile(r"\s*[›>]\s*")


@dataclass(frozen=True)
class Heading:
    level: int
    title: str
    path: tuple[str, ...]
    start_line: int
    #: the section's last line, subsections included
    end_line: int
    page: int | None

    @property
    def joined(self) -> str:
        return PATH_SEPARATOR.join(self.path)


@dataclass(frozen=True)
class Outline:
    buffer: str
    path: str
    format: str
    headings: list[Heading]


class Section(Location):
    """A section read back: its heading and text, and where the text sits: the lines it covers (fewer than the
    section's when it was cut) and the heading's path."""

    model_config = ConfigDict(frozen=True)

    heading: Heading
    text: str
    #: the text stops before the section's end (``max_chars``)
    truncated: bool
    #: start lines of other sections with exactly this heading path (this one is the first)
    same_path_at: tuple[int, ...] = ()

    @property
    def cite(self) -> str:
        return cite_of(self)


def _arg(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{name} must be a non-empty string")
    if len(value) > MAX_ARG_CHARS:
        raise InvalidInput(f"{name} is {len(value)} characters; the limit is {MAX_ARG_CHARS}")
    try:
        return check_storable_text(value, name)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _headings(stored: list[dict] | None) -> list[Heading]:
    return [
        Heading(
            level=int(h["level"]),
            title=str(h["title"]),
            path=tuple(str(t) for t in h.get("path") or [h["title"]]),
            start_line=int(h["start_line"]),
            end_line=int(h["end_line"]),
            page=None if h.get("page") is None else int(h["page"]),
        )
        for h in stored or []
    ]


def _find_file(conn: psycopg.Connection, *, tenant: str, buffer: object, path: object) -> tuple[str, int, FileOutline]:
    """(buffer name, buffer id, file) for the tenant's ``buffer`` and a path given whole or by its tail
    (``guide.md`` for ``docs/guide.md``) when only one file ends so."""
    name = _arg(buffer, "buffer")
    wanted = _arg(path, "path")
    [buf] = require_buffers(conn, tenant=tenant, names=[name])
    found = file_outline(conn, buffer_id=buf.id, path=wanted)
    if found is not None:
        return name, buf.id, found
    tails = paths_ending(conn, buffer_id=buf.id, suffix="/" + wanted.lstrip("/"), limit=MAX_CANDIDATES)
    if len(tails) == 1:
        found = file_outline(conn, buffer_id=buf.id, path=tails[0])
        if found is not None:
            return name, buf.id, found
    if tails:
        listed = ", ".join(repr(p) for p in tails)
        raise InvalidInput(f"path {wanted!r} ends {len(tails)} files of buffer {name!r}: {listed}; give the whole path")
    known = [f.path for f in list_files(conn, buffer_id=buf.id, limit=MAX_PATHS_COMPARED)]
    close = difflib.get_close_matches(wanted, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(p) for p in close)}?" if close else ""
    raise InvalidInput(f"no file {wanted!r} in buffer {name!r}{hint}")


def read_outline(conn: psycopg.Connection, *, tenant: str, buffer: object, path: object) -> Outline:
    """The file's headings in text order ([] for a file without any: plain text, code, a flat document)."""
    name, _, f = _find_file(conn, tenant=tenant, buffer=buffer, path=path)
    return Outline(buffer=name, path=f.path, format=f.format, headings=_headings(f.outline))


def match_headings(headings: Sequence[Heading], query: str) -> list[Heading]:
    """The headings ``query`` names, case and spacing aside: a whole path (``A › B``, ``A > B``), the tail of
    one (``B › C``), or a last title alone.  A whole path that matches wins over tails and titles, so a
    top-level ``Setup`` can still be asked for when ``Install › Setup`` exists too."""
    parts = [p for p in (_norm(x) for x in _SPLIT.split(query)) if p]
    if not parts:
        return []
    paths = [[_norm(t) for t in h.path] for h in headings]
    whole = [h for h, p in zip(headings, paths, strict=True) if p == parts]
    if whole:
        return whole
    title = _norm(query)  # a title holding ">" itself is matched whole
    return [
        h
        for h, p in zip(headings, paths, strict=True)
        if _norm(h.title) == title or (len(p) >= len(parts) and p[-len(parts) :] == parts)
    ]


def _not_found(headings: Sequence[Heading], query: str, path: str) -> InvalidInput:
    if not headings:
        return InvalidInput(f"{path!r} has no headings; read it with search or get_chunks")
    by_key: dict[str, str] = {}
    for h in headings:
        by_key.setdefault(_norm(h.joined), h.joined)
        by_key.setdefault(_norm(h.title), h.joined)
    close = difflib.get_close_matches(_norm(query), list(by_key), n=MAX_CANDIDATES, cutoff=0.5)
    names = list(dict.fromkeys(by_key[k] for k in close))[:5]
    hint = f"; closest: {', '.join(repr(n) for n in names)}" if names else "; get_outline lists its headings"
    return InvalidInput(f"no heading {query!r} in {path!r}{hint}")


def stitch(chunks: Sequence[SpanChunk]) -> tuple[str, int]:
    """(the text the chunks cover, the line it starts on), each overlap taken once.

    Chunks are exact slices of the file, so an overlap is cut by UTF-8 byte offset.  A gap between two chunks
    held only whitespace (chunkers trim it, and together chunks cover every other character): it comes back as
    its line breaks, after as many spaces as it had other whitespace characters.
    """
    if not chunks:
        return "", 0
    first = chunks[0]
    parts, end, last_line = [first.text], first.end_byte, first.end_line
    for ch in chunks[1:]:
        if ch.end_byte <= end:  # wholly inside what is there already
            continue
        if ch.start_byte < end:
            parts.append(ch.text.encode()[end - ch.start_byte :].decode("utf-8", "replace"))
        else:
            breaks = max(0, ch.start_line - last_line)
            # what is not a line break was most likely the end of the line before (a trailing space)
            parts.append(" " * max(0, ch.start_byte - end - breaks) + "\n" * breaks)
            parts.append(ch.text)
        end, last_line = ch.end_byte, ch.end_line
    return "".join(parts), first.start_line


def read_section(
    conn: psycopg.Connection, *, tenant: str, buffer: object, path: object, heading: object, max_chars: int
) -> Section:
    """The text of the section ``heading`` names, cut at ``max_chars`` characters (``truncated``).  Several
    sections matching is an error naming their paths; none, one naming the closest titles."""
    query = _arg(heading, "heading")
    name, buffer_id, f = _find_file(conn, tenant=tenant, buffer=buffer, path=path)
    headings = _headings(f.outline)
    found = match_headings(headings, query)
    if not found:
        raise _not_found(headings, query, f.path)
    distinct = list(dict.fromkeys(h.path for h in found))
    if len(distinct) > 1:
        listed = [f"{h.joined!r} (line {h.start_line})" for h in found[:MAX_CANDIDATES]]
        more = f" and {len(found) - MAX_CANDIDATES} more" if len(found) > MAX_CANDIDATES else ""
        raise InvalidInput(
            f"heading {query!r} matches {len(found)} sections of {f.path!r}: {', '.join(listed)}{more}; "
            "ask again with one of these paths"
        )
    head = found[0]
    # twice the cap: overlapping chunks repeat text, and the stitched section is cut to the cap below
    chunks = chunks_in_lines(
        conn,
        buffer_id=buffer_id,
        file_id=f.id,
        start_line=head.start_line,
        end_line=head.end_line,
        max_chars=2 * max_chars,
    )
    text, first_line = stitch(chunks)
    lines = text.split("\n")[head.start_line - first_line : head.end_line - first_line + 1] if chunks else []
    body = "\n".join(lines).rstrip()
    truncated = bool(chunks) and chunks[-1].end_line < head.end_line
    if len(body) > max_chars:
        cut = body.rfind("\n", 0, max_chars)  # at a line's end, unless that throws away half the text
        body = body[: cut if cut > max_chars // 2 else max_chars].rstrip()
        truncated = True
    end_line = head.start_line + body.count("\n")
    if truncated:
        body += f"\n{CUT_MARK} {max_chars} characters; it runs to line {head.end_line}: ask for a subsection]"
    shown = [c for c in chunks if c.start_line <= end_line]
    page_start = head.page if head.page is not None else next((c.page_start for c in shown), None)
    pages = [c.page_end for c in shown if c.page_end is not None]
    page_end = None if page_start is None else max([page_start, *pages])
    return Section(
        buffer=name,
        path=f.path,
        heading=head,
        text=body,
        heading_path=list(head.path),
        start_line=head.start_line,
        end_line=end_line,
        page_start=page_start,
        page_end=page_end,
        truncated=truncated,
        same_path_at=tuple(h.start_line for h in found[1:]),
    )
