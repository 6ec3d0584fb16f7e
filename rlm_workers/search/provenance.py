"""Where a chunk sits in its document, as reports, listings and JSON show it (docs/contract.md#documents).

Plain text and code are cited by lines, as always (``src/x.py:10-14``).  A converted document's lines are those of
its converted text, which a reader cannot look up, so a PDF or a slide deck is cited by page (``spec.pdf p. 4–5``);
either way the innermost heading follows (``§ 2.1 Transport``) when the chunk lies in a section.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import Location

#: what joins a heading path when it is shown or asked for as one string ("Transport › Framing")
PATH_SEPARATOR = " › "


def page_span(page_start: int | None, page_end: int | None) -> str | None:
    """``p. 4``, ``p. 4–5``, or None for a chunk of a format without pages."""
    if page_start is None:
        return None
    if page_end is None or page_end == page_start:
        return f"p. {int(page_start)}"
    return f"p. {int(page_start)}–{int(page_end)}"


def section_of(heading_path: Sequence[str] | None) -> str | None:
    """The innermost heading, or None outside any section."""
    return heading_path[-1] if heading_path else None


def cite(
    path: str,
    start_line: int,
    end_line: int,
    page_start: int | None = None,
    page_end: int | None = None,
    heading_path: Sequence[str] | None = None,
) -> str:
    """``spec.pdf p. 4–5 § 2.1 Transport``, ``guide.docx:10-14 § Install`` or ``src/x.py:10-14``."""
    pages = page_span(page_start, page_end)
    where = f"{path} {pages}" if pages else f"{path}:{int(start_line)}-{int(end_line)}"
    section = section_of(heading_path)
    return f"{where} § {section}" if section else where


def cite_of(c: Location, path: str | None = None) -> str:
    """``cite`` of anything that says where it sits: a stored chunk, a hit, a prompt record, a section; ``path``
    overrides the path when the caller shows it otherwise (quoted, with its buffer)."""
    return cite(c.path if path is None else path, c.start_line, c.end_line, c.page_start, c.page_end, c.heading_path)


def fields(page_start: int | None, page_end: int | None, heading_path: Sequence[str] | None) -> dict[str, Any]:
    """The provenance fields every JSON chunk, hit and source carries."""
    path = list(heading_path or [])
    return {
        "page_start": page_start,
        "page_end": page_end if page_start is not None else None,
        "section": section_of(path),
        "heading_path": path,
    }
