"""Documents converted to text that keeps its structure: pages and headings (docs/contract.md#documents).

``read_document`` is what the loader calls for every file: PDF, DOCX, PPTX, XLSX, HTML and EPUB are converted
to Markdown-like text (each heading a ``#`` line at its level) with the offsets of their headings and pages;
Markdown keeps its text byte for byte and only has its headings found; everything else goes the plain-text
path of ``files.decode_text`` unchanged.

Nothing here raises on bad content.  A file that cannot be converted comes back as a skip reason (encrypted,
corrupt, no-text-layer, unpack-limit, or the plain-text ones); one that is too long or too slow is cut and
loaded, the cut named in ``Document.cuts``.  The document libraries are imported inside the converter that
needs them: the API and the CLI import this module and must not pay for pypdf, lxml and the rest at start.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import logging
import posixpath
import re
import time
import unicodedata
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote
from xml.etree import ElementTree

from ..limits import MAX_CONVERT_SECONDS, MAX_DOCUMENT_CHARS, MAX_DOCUMENT_PAGES, MAX_UNPACKED_BYTES, MAX_ZIP_RATIO
from .files import decode_text, looks_binary

log = logging.getLogger(__name__)

MAX_HEADING_CHARS = 200
# Members smaller than this may pack as tightly as they like: the ratio only matters where the bytes are many.
_RATIO_FLOOR_BYTES = 1024 * 1024
# Markdown has six heading levels; a deeper PDF outline entry is shown (and nested) as a sixth-level one.
_MAX_LEVEL = 6
# Encrypted Office files are not zips but OLE compound files holding the encrypted package.
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_ZIP_FORMATS = frozenset({"docx", "pptx", "xlsx", "epub"})
_EXTENSIONS = {
    "pdf": "pdf",
    "docx": "docx",
    "pptx": "pptx",
    "xlsx": "xlsx",
    "epub": "epub",
    "html": "html",
    "htm": "html",
    "xhtml": "html",
    "md": "markdown",
    "markdown": "markdown",
}
_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Heading:
    start: int  # char offset in Document.text where the heading line starts
    level: int  # 1 = top
    title: str  # one line, whitespace collapsed, at most MAX_HEADING_CHARS
    path: tuple[str, ...]  # titles from the top level down to this one (this one last)


@dataclass
class Document:
    text: str  # what is stored, chunked and quoted; headings rendered as "#" * level + " " + title lines
    format: str  # "text" | "markdown" | "pdf" | "docx" | "pptx" | "xlsx" | "html" | "epub"
    headings: list[Heading] = field(default_factory=list)  # in text order
    #: pages[k] = offset where page k+1 starts (pages[0] == 0); PDF pages, PPTX slides; [] for other formats
    pages: list[int] = field(default_factory=list)
    cuts: list[str] = field(default_factory=list)  # why the text was shortened: cut-pages, cut-text, cut-time


class _Skip(Exception):
    """A converter's verdict that the file is not loaded, with the reason the loader counts."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_document(path: Path, rel_path: str) -> tuple[Document | None, str | None, str]:
    """``(document, None, sha256 of the raw bytes)`` or ``(None, skip_reason, sha256 or "")``.  The bytes read
    decide, so a file that grew after discovery checked ``RLM_MAX_FILE_BYTES`` is still read whole."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None, "unreadable", ""
    digest = hashlib.sha256(data).hexdigest()
    fmt = format_of(rel_path, data)
    if fmt in ("text", "markdown"):
        text, reason = decode_text(data)
        if text is None:
            return None, reason, digest
        headings = markdown_headings(text) if fmt == "markdown" else []
        return Document(text=text, format=fmt, headings=headings), None, digest
    if not data:
        return None, "empty", digest
    try:
        doc = _convert(fmt, data)
    except _Skip as skip:
        return None, skip.reason, digest
    except Exception as exc:  # any library's failure on bad bytes: the file is skipped, never the load
        log.debug("%s: %s conversion failed: %s", rel_path, fmt, type(exc).__name__)
        return None, "corrupt", digest
    return doc, None, digest


def format_of(rel_path: str, data: bytes) -> str:
    """The format a file is converted as: by extension (case-insensitive), and a PDF also by its header."""
    if data.startswith(b"%PDF-"):
        return "pdf"
    name = rel_path.rsplit("/", 1)[-1]
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return _EXTENSIONS.get(ext, "text")


def _convert(fmt: str, data: bytes) -> Document:
    """One document's bytes converted; raises ``_Skip`` for a file that is not loaded, and whatever its library
    raises on bytes it cannot parse (``read_document`` turns that into "corrupt")."""
    if fmt in _ZIP_FORMATS:
        if data.startswith(_OLE_MAGIC) and fmt != "epub":
            raise _Skip("encrypted")
        _check_zip(data)
    if fmt == "html" and looks_binary(data) and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise _Skip("binary")  # an image or archive named .html; UTF-16 HTML (with its BOM) has NULs too
    out = _Builder(fmt)
    _CONVERTERS[fmt](data, out)
    if not out.size:
        raise _Skip("empty")  # a page of scripts, a workbook of empty sheets: nothing to store
    return out.document()


# --- the text being built ------------------------------------------------------------------------------------


def clean(text: str) -> str:
    """Text as it may be stored: no NUL (PostgreSQL text cannot hold one), no lone surrogate (not encodable as
    UTF-8), ``\\n`` line ends."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _SURROGATES.sub("\ufffd", text)


def one_line(text: str) -> str:
    """Whitespace (newlines included) collapsed to single spaces: a heading title or a table cell."""
    return " ".join(clean(text).split())


def _heading_title(raw: str) -> str:
    """A heading's title as stored: one line, at most MAX_HEADING_CHARS ("" when there is nothing to show)."""
    return one_line(raw)[:MAX_HEADING_CHARS].rstrip()


class _Nesting:
    """Headings in text order, each given its path from the top level down: a heading closes every open one
    of its level or deeper."""

    def __init__(self) -> None:
        self.headings: list[Heading] = []
        self._open: list[Heading] = []

    def add(self, start: int, level: int, title: str) -> None:
        while self._open and self._open[-1].level >= level:
            self._open.pop()
        h = Heading(start, level, title, (*(o.title for o in self._open), title))
        self._open.append(h)
        self.headings.append(h)


class _Builder:
    """The converted text as it grows, with its headings, pages and cuts; the limits are checked here."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.parts: list[str] = []
        self.size = 0
        self.nesting = _Nesting()
        self.pages: list[int] = []
        self.cuts: list[str] = []
        self.deadline = time.monotonic() + MAX_CONVERT_SECONDS
        self._ends_with = "\n\n"  # the last two characters written; nothing written counts as a paragraph break
        self.has_text = False  # any text besides heading lines

    def _write(self, s: str) -> None:
        if s:
            self.parts.append(s)
            self.size += len(s)
            self._ends_with = (self._ends_with + s[-2:])[-2:]

    def _break(self, blank: bool) -> None:
        """End the current line (and leave a blank one after it when ``blank``) unless that is done already."""
        if not self._ends_with.endswith("\n"):
            self._write("\n")
        if blank and self._ends_with != "\n\n":
            self._write("\n")

    def page(self) -> None:
        """A new page (slide) starts at the next character."""
        if self.pages:
            self._break(blank=True)
        self.pages.append(self.size)

    def heading(self, level: int, title: str) -> None:
        title = _heading_title(title)
        if not title:
            return
        level = max(1, min(level, _MAX_LEVEL))
        self._break(blank=True)
        self.nesting.add(self.size, level, title)
        self._write("#" * level + " " + title + "\n")

    def gap(self) -> None:
        """A blank line before what comes next (a table's rows)."""
        self._break(blank=True)

    def para(self, text: str) -> None:
        """A block of text (a paragraph, a page's text) after a blank line."""
        text = clean(text).strip("\n")
        if text.strip():
            self._break(blank=True)
            self._write(text + "\n")
            self.has_text = True

    def line(self, text: str) -> None:
        """One line right below the one before: a table row, a list item."""
        text = clean(text).strip("\n")
        if text.strip():
            self._break(blank=False)
            self._write(text + "\n")
            self.has_text = True

    def row(self, cells: list[str]) -> None:
        """A table row as one line of ``|``-joined cells; an empty row is left out."""
        if any(cells):
            self.line(" | ".join(cells))

    def done(self) -> bool:
        """Whether conversion must stop here (checked between pages and elements), recording why."""
        if self.size >= MAX_DOCUMENT_CHARS:
            self.cut("cut-text")
            return True
        if time.monotonic() > self.deadline:
            self.cut("cut-time")
            return True
        return False

    def cut(self, reason: str) -> None:
        if reason not in self.cuts:
            self.cuts.append(reason)

    def document(self) -> Document:
        text = "".join(self.parts)
        headings, pages = self.nesting.headings, self.pages
        if len(text) > MAX_DOCUMENT_CHARS:
            self.cut("cut-text")
            text = text[:MAX_DOCUMENT_CHARS]
            headings = [h for h in headings if h.start < len(text)]
            pages = [p for i, p in enumerate(pages) if i == 0 or p < len(text)]
        return Document(text=text, format=self.fmt, headings=headings, pages=pages, cuts=self.cuts)


# --- zip containers ------------------------------------------------------------------------------------------


def _check_zip(data: bytes) -> None:
    """Refuse a zip bomb from its directory alone, before a byte is unpacked.  The declared sizes bound what is
    unpacked: zipfile stops at a member's declared size and fails its CRC, so a lying header cannot get past."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise _Skip("corrupt") from exc
    total = 0
    for info in infos:
        total += info.file_size
        if info.file_size > _RATIO_FLOOR_BYTES and info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
            raise _Skip("unpack-limit")
    if total > MAX_UNPACKED_BYTES:
        raise _Skip("unpack-limit")


# --- PDF -----------------------------------------------------------------------------------------------------


def _pdf(data: bytes, out: _Builder) -> None:
    from pypdf import PdfReader

    # pypdf logs each repair it makes ("incorrect startxref pointer") as a warning: noise on a load's terminal,
    # where the file either loads or is counted corrupt.  An application that set pypdf's level keeps it.
    pypdf_log = logging.getLogger("pypdf")
    if pypdf_log.level == logging.NOTSET:
        pypdf_log.setLevel(logging.ERROR)
    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        try:
            opened = reader.decrypt("")
        except Exception as exc:  # AES without the cryptography package, an unknown handler, a broken dictionary
            raise _Skip("encrypted") from exc
        if not opened:
            raise _Skip("encrypted")
    n = len(reader.pages)
    if n == 0:
        raise _Skip("empty")
    outline = _pdf_outline(reader, min(n, MAX_DOCUMENT_PAGES))
    failed = 0
    for i in range(min(n, MAX_DOCUMENT_PAGES)):
        try:
            text = clean(reader.pages[i].extract_text() or "")
        except Exception as exc:  # one broken page (a bad font, a bad stream) costs its text, not the document
            log.debug("pdf page %d: text extraction failed: %s", i + 1, type(exc).__name__)
            text, failed = "", failed + 1
        out.page()
        _pdf_page(out, text, outline.get(i, []))
        if i + 1 < n and out.done():
            break
    else:
        if n > MAX_DOCUMENT_PAGES:
            out.cut("cut-pages")
    if not out.has_text:
        if failed:
            raise ValueError(f"no page's text could be extracted ({failed} failed)")
        raise _Skip("no-text-layer")


def _pdf_outline(reader: Any, n_pages: int) -> dict[int, list[tuple[int, str]]]:
    """Page index -> (level, title) of the outline (bookmark) entries pointing into it, in outline order.  An
    outline that cannot be read costs the headings only."""
    found: dict[int, list[tuple[int, str]]] = {}
    try:
        outline = reader.outline
    except Exception as exc:
        log.debug("pdf outline unreadable: %s", type(exc).__name__)
        return found
    # An explicit stack (an outline can nest deep or, broken, loop): a list after an entry holds its children.
    stack: list[tuple[Iterator[Any], int]] = [(iter(outline), 1)]
    seen = 0
    while stack and seen < 100_000:
        item = next(stack[-1][0], None)
        if item is None:
            stack.pop()
            continue
        seen += 1
        level = stack[-1][1]
        if isinstance(item, list):
            stack.append((iter(item), level + 1))
            continue
        try:
            page = reader.get_destination_page_number(item)
            title = one_line(str(item.title or ""))
        except Exception:  # a destination to nowhere: the entry is no heading
            continue
        if title and page is not None and 0 <= page < n_pages:
            found.setdefault(page, []).append((level, title))
    return found


# Section numbers and words that may stand before an outline title on its page: "3.2.3 Voting", "Chapter 4 …".
_NUMBERING = re.compile(r"(?:chapter|section|appendix|part)?(?:\d+|[a-z]|[ivxlc]+)?(?:[.\-]\d+)*[.:)]?")
_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})


def _squash(s: str) -> str:
    """A line or title compared without case, spaces (pypdf drops some), ligatures and typographic quotes."""
    return "".join(unicodedata.normalize("NFKC", s).translate(_QUOTES).lower().split())


def _title_at(lines: list[str], squashed: list[str], title: str, start: int) -> int | None:
    """The index of the line at or after ``start`` where an outline title is printed, or None (``squashed``:
    the lines through ``_squash``).

    Tried in order: the line is the title (maybe behind a section number); two lines are (a title that wraps,
    maybe hyphenated);
    the line starts with the title.
    """
    want = _squash(title)
    if not want:
        return None

    def numbered(s: str) -> bool:
        return s.endswith(want) and _NUMBERING.fullmatch(s[: len(s) - len(want)]) is not None

    for i in range(start, len(lines)):
        if numbered(squashed[i]):
            return i
    for i in range(start, len(lines) - 1):
        if numbered(squashed[i] + squashed[i + 1]) or numbered(squashed[i].removesuffix("-") + squashed[i + 1]):
            return i
    for i in range(start, len(lines)):
        s = squashed[i]
        if want in s and len(s) <= 2 * len(want) + 10 and _NUMBERING.fullmatch(s[: s.index(want)]):
            return i
    return None


def _pdf_page(out: _Builder, text: str, entries: list[tuple[int, str]]) -> None:
    """A page's text with its outline entries' heading lines put before the lines that print their titles.  An
    entry whose title is not found goes at the page's start, or below the entry before it on this page, so the
    headings keep the outline's order."""
    lines = text.split("\n")
    squashed = [_squash(line) for line in lines] if entries else []
    before: dict[int, list[tuple[int, str]]] = {}
    cursor = 0
    for level, title in entries:
        at = _title_at(lines, squashed, title, cursor)
        if at is None:
            at = cursor
        else:
            cursor = at + 1
        before.setdefault(at, []).append((level, title))
    start = 0
    for at in sorted(before):
        out.para("\n".join(lines[start:at]))
        for level, title in before[at]:
            out.heading(level, title)
        start = at
    out.para("\n".join(lines[start:]))


# --- DOCX ----------------------------------------------------------------------------------------------------

_W_NS = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_HEADING_STYLE = re.compile(r"heading\s*([1-9])")


def _docx(data: bytes, out: _Builder) -> None:
    import docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    document = docx.Document(io.BytesIO(data))
    body = document.element.body
    # The body's own children, in order, so a table stays between the paragraphs around it; content controls
    # (w:sdt: a cover page, a table of contents) are opened, not skipped.
    stack: list[Iterator[Any]] = [iter(body)]
    while stack:
        el = next(stack[-1], None)
        if el is None:
            stack.pop()
            continue
        tag = el.tag if isinstance(el.tag, str) else ""
        if tag == _W_NS + "p":
            _docx_paragraph(out, Paragraph(el, document))
        elif tag == _W_NS + "tbl":
            _docx_table(out, Table(el, document))
        elif tag == _W_NS + "sdt":
            content = el.find(_W_NS + "sdtContent")
            if content is not None:
                stack.append(iter(content))
        if out.done():
            break


def _docx_paragraph(out: _Builder, p: Any) -> None:
    text = p.text
    if not text.strip():
        return
    try:
        style = (p.style.name or "") if p.style is not None else ""
    except Exception:  # a style id the styles part does not define
        style = ""
    lowered = style.lower()
    if lowered == "title":
        out.heading(1, text)
    elif m := _HEADING_STYLE.fullmatch(lowered):
        out.heading(int(m.group(1)), text)
    elif lowered.startswith("list"):
        out.line("- " + one_line(text))
    else:
        out.para(text)


def _docx_table(out: _Builder, table: Any) -> None:
    out.gap()
    for row in table.rows:
        cells: list[str] = []
        spanned = 0
        for cell in row.cells:
            # A merged cell is returned once per grid column it spans; it is one cell of text.
            if spanned:
                spanned -= 1
                continue
            cells.append(one_line(cell.text))
            spanned = max(cell.grid_span, 1) - 1
        out.row(cells)


# --- PPTX ----------------------------------------------------------------------------------------------------


def _pptx(data: bytes, out: _Builder) -> None:
    from pptx import Presentation

    slides = list(Presentation(io.BytesIO(data)).slides)
    for number, slide in enumerate(slides[:MAX_DOCUMENT_PAGES], 1):
        out.page()
        title_shape = slide.shapes.title
        title = one_line(title_shape.text_frame.text) if title_shape is not None else ""
        # The title alone: the page already says which slide it is (citations read "deck.pptx p. 4 § Results").
        out.heading(1, title or f"Slide {number}")
        for shape in _pptx_shapes(slide.shapes):
            if title_shape is not None and shape.shape_id == title_shape.shape_id:
                continue
            _pptx_shape(out, shape)
        if slide.has_notes_slide:
            frame = slide.notes_slide.notes_text_frame
            notes = frame.text if frame is not None else ""
            if notes.strip():
                out.para("Notes:")
                out.line(notes)
        if number < len(slides) and out.done():
            break
    else:
        if len(slides) > MAX_DOCUMENT_PAGES:
            out.cut("cut-pages")


def _pptx_shapes(shapes: Any) -> list[Any]:
    """A slide's shapes in reading order (top to bottom, then left to right), groups opened."""
    flat: list[Any] = []
    stack = [iter(shapes)]
    while stack:
        shape = next(stack[-1], None)
        if shape is None:
            stack.pop()
        elif getattr(shape, "shapes", None) is not None:  # a group
            stack.append(iter(shape.shapes))
        else:
            flat.append(shape)
    return sorted(flat, key=lambda s: (s.top or 0, s.left or 0))


def _pptx_shape(out: _Builder, shape: Any) -> None:
    if getattr(shape, "has_table", False) and shape.has_table:
        out.gap()
        for row in shape.table.rows:
            out.row([one_line(cell.text) for cell in row.cells])
    elif getattr(shape, "has_text_frame", False) and shape.has_text_frame:
        out.para(shape.text_frame.text.replace("\x0b", "\n"))  # a vertical tab is a soft line break in a run


# --- XLSX ----------------------------------------------------------------------------------------------------


def _xlsx(data: bytes, out: _Builder) -> None:
    import openpyxl

    book = openpyxl.load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    try:
        sheets = book.worksheets
        for sheet in sheets[:MAX_DOCUMENT_PAGES]:
            out.heading(1, sheet.title)
            # Some writers declare a sheet's size as A1; read-only mode would trust that and stop at the first
            # row, so the size comes from the rows themselves.
            if hasattr(sheet, "reset_dimensions"):
                sheet.reset_dimensions()
            out.gap()
            for n, row in enumerate(sheet.iter_rows(values_only=True), 1):
                cells = [_cell(v) for v in row]
                while cells and not cells[-1]:
                    cells.pop()
                out.row(cells)
                if n % 1000 == 0 and out.done():
                    return
            if out.done():
                return
        if len(sheets) > MAX_DOCUMENT_PAGES:
            out.cut("cut-pages")
    finally:
        book.close()  # read-only mode keeps the archive open until then


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, datetime.datetime) and value.time() == datetime.time(0):
        return value.date().isoformat()  # a date typed into a cell is read back as midnight of that day
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return one_line(str(value))


# --- HTML and EPUB -------------------------------------------------------------------------------------------

# Not the page's text: code, styling, embedded media, and the site around the article.
_DROP_TAGS = ("script", "style", "noscript", "template", "svg", "nav", "footer", "aside", "form", "iframe")
_DROP_ROLES = frozenset({"navigation", "banner", "contentinfo", "complementary", "search"})
_BLOCK_TAGS = frozenset(
    {
        "address",
        "article",
        "blockquote",
        "body",
        "caption",
        "center",
        "dd",
        "details",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "header",
        "hr",
        "html",
        "main",
        "ol",
        "p",
        "section",
        "summary",
        "table",
        "tbody",
        "tfoot",
        "thead",
        "ul",
    }
)
_HEADING_TAGS = {f"h{i}": i for i in range(1, 7)}


@cache
def _html_parser() -> str:
    try:
        import lxml  # noqa: F401 - only whether it is there
    except ImportError:
        return "html.parser"
    return "lxml"


def _html_into(data: bytes, out: _Builder) -> None:
    """One HTML page's main text into ``out``, headings continuing the levels already there (an EPUB's spine)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(data, _html_parser())
    for tag in soup.find_all(_DROP_TAGS):
        tag.decompose()
    for tag in soup.find_all(attrs={"role": True}):
        if not tag.decomposed and str(tag.get("role", "")).lower() in _DROP_ROLES:
            tag.decompose()
    # A page-level <header> is the site's banner; one inside an article or section holds that part's title.
    for tag in soup.find_all("header"):
        if not tag.decomposed and tag.find_parent(("article", "main", "section")) is None:
            tag.decompose()
    for tag in soup.select("a.headerlink"):  # Sphinx's "¶" after every heading
        tag.decompose()
    root = soup.find("main") or soup.find(attrs={"role": "main"})
    if root is None:
        articles = soup.find_all("article")
        root = max(articles, key=lambda a: len(a.get_text())) if articles else None
    if root is None:
        root = soup.body or soup
    _html_walk(root, out)


def _html_walk(root: Any, out: _Builder) -> None:
    from bs4.element import NavigableString, PreformattedString, Tag

    inline: list[str] = []
    # Inside a list item: "start" until its first line is out (that one gets the "- "), then "rest".
    item = [""]

    def flush() -> None:
        text = one_line("".join(inline))
        inline.clear()
        if not text:
            return
        if item[0]:
            out.line(("- " if item[0] == "start" else "") + text)
            item[0] = "rest"
        else:
            out.para(text)

    # An explicit stack, not recursion: a page nested thousands of tags deep must not hit the recursion limit.
    # An entry is a node to visit, or ("end", name) when a block closes.
    stack: list[Any] = [root]
    n = 0
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            flush()
            if node[1] == "li":
                item[0] = ""
            continue
        if isinstance(node, NavigableString):
            if not isinstance(node, PreformattedString):  # comments, CDATA, doctypes, processing instructions
                inline.append(str(node))
            continue
        if not isinstance(node, Tag):
            continue
        name = node.name
        n += 1
        if n % 1000 == 0 and out.done():
            return
        if name in _HEADING_TAGS:
            flush()
            out.heading(_HEADING_TAGS[name], node.get_text(" "))
        elif name == "pre":
            flush()
            out.para(node.get_text())
        elif name == "tr":
            flush()
            out.row([one_line(c.get_text(" ")) for c in node.find_all(("td", "th"), recursive=False)])
        elif name == "br":
            flush()
        elif name == "li":
            flush()
            item[0] = "start"
            stack.append(("end", "li"))
            stack.extend(reversed(node.contents))
        elif name in _BLOCK_TAGS:
            flush()
            if name == "table":
                out.gap()
            stack.append(("end", name))
            stack.extend(reversed(node.contents))
        else:
            stack.extend(reversed(node.contents))
    flush()


_CONTAINER_NS = "{urn:oasis:names:tc:opendocument:xmlns:container}"
_OPF_NS = "{http://www.idpf.org/2007/opf}"


def _epub(data: bytes, out: _Builder) -> None:
    """The book's spine (its reading order) through the HTML converter, one heading hierarchy for the whole."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        container = ElementTree.fromstring(zf.read("META-INF/container.xml"))
        rootfile = container.find(f".//{_CONTAINER_NS}rootfile")
        if rootfile is None or not rootfile.get("full-path"):
            raise ValueError("container.xml names no rootfile")
        opf_path = rootfile.get("full-path", "")
        opf = ElementTree.fromstring(zf.read(opf_path))
        base = posixpath.dirname(opf_path)
        manifest = {
            item.get("id"): item.get("href", "") for item in opf.iter(f"{_OPF_NS}item") if item.get("id") is not None
        }
        names = set(zf.namelist())
        spine = [ref.get("idref") for ref in opf.iter(f"{_OPF_NS}itemref")]
        for k, idref in enumerate(spine):
            href = manifest.get(idref)
            if not href:
                continue
            member = posixpath.normpath(posixpath.join(base, unquote(href.split("#", 1)[0])))
            if member not in names:
                continue
            _html_into(zf.read(member), out)
            if k + 1 < len(spine) and out.done():
                break


# --- Markdown ------------------------------------------------------------------------------------------------

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*")
_FRONT_MATTER_END = frozenset({"---", "..."})


def markdown_headings(text: str) -> list[Heading]:
    """The ATX (``# Title``) and setext (a line underlined with ``===``/``---``) headings of Markdown text,
    never inside fenced code or a YAML front matter block.  A setext underline counts below a one-line
    paragraph only: under a longer paragraph a ``---`` is far more often meant as a rule than as a heading."""
    lines = text.split("\n")
    offsets = []
    pos = 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    i = 0
    if lines and lines[0].rstrip() == "---":  # front matter: its "key: value" lines above "---" are no headings
        for j in range(1, len(lines)):
            if lines[j].rstrip() in _FRONT_MATTER_END:
                i = j + 1
                break
    found: list[tuple[int, int, str]] = []
    fence: tuple[str, int] | None = None
    prev_text: int | None = None  # index of the line before, when it is a one-line paragraph
    para_len = 0
    for k in range(i, len(lines)):
        line = lines[k]
        if fence is not None:
            m = _FENCE.fullmatch(line.rstrip())
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not m.group(2).strip():
                fence = None
            continue
        m = _FENCE.fullmatch(line)
        if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
            fence = (m.group(1)[0], len(m.group(1)))
            prev_text, para_len = None, 0
            continue
        if not line.strip():
            prev_text, para_len = None, 0
            continue
        if m := _SETEXT.fullmatch(line):
            if prev_text is not None and para_len == 1:
                found.append((offsets[prev_text], 1 if m.group(1)[0] == "=" else 2, lines[prev_text]))
            prev_text, para_len = None, 0  # a heading's underline, or a rule: either way the paragraph ends
            continue
        if m := _ATX.fullmatch(line):
            found.append((offsets[k], len(m.group(1)), m.group(2) or ""))
            prev_text, para_len = None, 0
            continue
        indented = line.startswith(("    ", "\t")) and para_len == 0  # indented code, not a paragraph
        quoted_or_listed = line.lstrip().startswith((">", "- ", "* ", "+ ", "|"))
        para_len += 1
        prev_text = None if indented or quoted_or_listed else k
    nesting = _Nesting()
    for start, level, raw in found:
        if title := _heading_title(raw):
            nesting.add(start, level, title)
    return nesting.headings


_CONVERTERS: dict[str, Callable[[bytes, _Builder], None]] = {
    "pdf": _pdf,
    "docx": _docx,
    "pptx": _pptx,
    "xlsx": _xlsx,
    "html": _html_into,
    "epub": _epub,
}
