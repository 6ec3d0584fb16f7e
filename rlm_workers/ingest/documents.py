"""Documents converted to text that keeps its structure: pages and headings (docs/contract.md#documents).

``read_document`` is what the loader calls for every file: PDF, DOCX, PPTX, XLSX, HTML and EPUB are converted
to Markdown-like text (each heading a ``#`` line at its level) with the offsets of their headings and pages;
Markdown keeps its text byte for byte and only has its headings found; everything else goes the plain-text
path of ``files.decode_text`` unchanged.

Nothing here raises on bad content.  A file that cannot be converted comes back as a skip reason (encrypted,
corrupt, no-text-layer, unpack-limit, convert-limit, or the plain-text ones); one that is too long or too slow
is cut and loaded, the cut named in ``Document.cuts``.  The document libraries are imported inside the
converter that needs them: the API and the CLI import this module and must not pay for pypdf, lxml and the rest
at start.

A large document (or a small one whose library hit a decoding limit) is converted in a child process under an
address-space limit and a wall-clock kill (``_convert_in_child``): no library, whatever it does with hostile
bytes, can take more than MAX_CONVERT_MEMORY_BYTES or MAX_CONVERT_SECONDS.  Small files stay in this process,
where a process start would cost more than the conversion.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import pickle
import posixpath
import re
import struct
import subprocess
import sys
import time
import unicodedata
import warnings
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote
from xml.etree import ElementTree

from ..limits import (
    MAX_CONVERT_MEMORY_BYTES,
    MAX_CONVERT_SECONDS,
    MAX_DOCUMENT_CHARS,
    MAX_DOCUMENT_PAGES,
    MAX_UNPACKED_BYTES,
    MAX_ZIP_RATIO,
)
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
# Files up to this size (and zips whose markup unpacks to at most _INPROCESS_MAX_MARKUP) convert in this process:
# a child's start and imports (~0.3 s) would cost more than they do, and their libraries' memory stays well under
# the bound.  A tree of tag-dense HTML takes ~50 bytes per byte of markup, so the markup is what is counted (by
# its content, not its name: the libraries follow relationships, whatever a part is called); a document's
# pictures cost the libraries nothing but their bytes.
_INPROCESS_MAX_BYTES = 4 * 1024 * 1024
_INPROCESS_MAX_MARKUP = 8 * 1024 * 1024
# In this process a PDF stream may not decode to more than this; one that does is converted again in a child,
# under pypdf's own (larger) limits and the child's memory and time bounds.
_INPROCESS_PDF_STREAM_BYTES = 16 * 1024 * 1024
# What the child gets to hand back its text and exit: it stops converting this long before it is killed.
_CHILD_MARGIN_SECONDS = 10


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

    @property
    def converted(self) -> bool:
        """Text made from a document format, which can be far longer than its file (a zip packs XML ~15:1)."""
        return self.format not in ("text", "markdown")

    def cut_at(self, end: int, reason: str) -> Document:
        """This document up to character ``end``: headings and pages past it dropped, ``reason`` added once."""
        return Document(
            text=self.text[:end],
            format=self.format,
            headings=[h for h in self.headings if h.start < end],
            pages=[p for p in self.pages if p < end or p == 0],
            cuts=self.cuts if reason in self.cuts else [*self.cuts, reason],
        )


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
        markup = _check(fmt, data)
        if len(data) > _INPROCESS_MAX_BYTES or markup > _INPROCESS_MAX_MARKUP:
            doc = _convert_in_child(fmt, data)
        else:
            try:
                doc = _convert(fmt, data, in_child=False)
            except _NeedsChild:
                doc = _convert_in_child(fmt, data)
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


def _check(fmt: str, data: bytes) -> int:
    """What is refused before conversion starts (raises ``_Skip``); what a zip's markup unpacks to, else 0."""
    if fmt in _ZIP_FORMATS:
        if data.startswith(_OLE_MAGIC) and fmt != "epub":
            raise _Skip("encrypted")
        return _check_zip(data)
    if fmt == "html" and looks_binary(data) and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise _Skip("binary")  # an image or archive named .html; UTF-16 HTML (with its BOM) has NULs too
    return 0


class _NeedsChild(Exception):
    """A small file that hit a decoding limit meant for this process: it is converted again in a child."""


def _convert(fmt: str, data: bytes, *, in_child: bool) -> Document:
    """One document's bytes converted (``_check`` passed); raises ``_Skip`` for a file that is not loaded, and
    whatever its library raises on bytes it cannot parse (``read_document`` turns that into "corrupt")."""
    out = _Builder(fmt)
    if fmt == "pdf" and not in_child:
        from pypdf import apply_configuration
        from pypdf.errors import LimitReachedError

        stream_limit = _INPROCESS_PDF_STREAM_BYTES
        try:
            # Held for this thread's conversion only (pypdf keeps its configuration in a context variable).
            with apply_configuration(
                zlib_maximum_output_length=stream_limit,
                lzw_maximum_output_length=stream_limit,
                run_length_maximum_output_length=stream_limit,
                array_based_stream_maximum_output_length=stream_limit,
                maximum_declared_stream_length=stream_limit,
            ):
                _pdf(data, out, in_child=False)
        except Exception as exc:
            if _caused_by(exc, LimitReachedError):
                raise _NeedsChild from exc
            raise
    else:
        _CONVERTERS[fmt](data, out)
    if not out.size:
        raise _Skip("empty")  # a page of scripts, a workbook of empty sheets: nothing to store
    return out.document()


# --- the child process ---------------------------------------------------------------------------------------

# The package's root, so the child imports this very module (and can unpickle nothing but what it sends).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD_CODE = "from rlm_workers.ingest.documents import _child_main; _child_main()"
_LIBRARIES = {
    "pdf": ("pypdf", "pypdfium2"),
    "docx": ("docx", "lxml.etree"),
    "pptx": ("pptx",),
    "xlsx": ("openpyxl",),
    "html": ("bs4", "lxml"),
    "epub": ("bs4", "lxml"),
}


def _convert_in_child(fmt: str, data: bytes) -> Document:
    """The conversion run by a fresh Python process under an address-space limit, killed when it runs past
    MAX_CONVERT_SECONDS.  A new process (not a fork of this one, which may hold threads and locks) that exits
    when done, so whatever a library allocated goes with it.  Raises ``_Skip("convert-limit")`` when the child
    ran out of memory or time without handing back a document."""
    kill_after = max(MAX_CONVERT_SECONDS, 1)
    limits = {
        "fmt": fmt,
        "seconds": max(MAX_CONVERT_SECONDS - _CHILD_MARGIN_SECONDS, 0),
        "memory": MAX_CONVERT_MEMORY_BYTES,
        "chars": MAX_DOCUMENT_CHARS,
        "pages": MAX_DOCUMENT_PAGES,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD_CODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        out, _ = proc.communicate(json.dumps(limits).encode() + b"\n" + data, timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise _Skip("convert-limit") from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        kind, value = pickle.loads(out)
    except Exception:  # killed by the kernel, or died mid-write: out of memory in C code
        raise _Skip("convert-limit") from None
    if kind == "skip":
        raise _Skip(value)
    if kind != "doc" or not isinstance(value, Document):
        raise _Skip("convert-limit")
    return value


def _vm_bytes() -> int:
    """This process's address space now (0 where /proc does not say)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _child_main() -> None:
    """The child's side of ``_convert_in_child``: a JSON line of limits and the file's bytes on stdin, one
    pickled ``("doc", Document)`` or ``("skip", reason)`` on stdout."""
    import resource

    stdin = sys.stdin.buffer
    limits = json.loads(stdin.readline())
    data = stdin.read()
    # The answer gets stdout to itself: whatever a library prints (from Python or C) goes to stderr instead.
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fmt = limits["fmt"]
    module = sys.modules[__name__]
    module.MAX_CONVERT_SECONDS = limits["seconds"]  # type: ignore[attr-defined]
    module.MAX_DOCUMENT_CHARS = limits["chars"]  # type: ignore[attr-defined]
    module.MAX_DOCUMENT_PAGES = limits["pages"]  # type: ignore[attr-defined]
    for name in _LIBRARIES.get(fmt, ()):
        __import__(name)  # before the limit: the libraries' code is the idle process, not the conversion
    if fmt == "docx":
        __import__("docx.table")
    base = _vm_bytes()
    if base:
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = base + limits["memory"]
        if hard == resource.RLIM_INFINITY or want < hard:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    try:
        result: tuple[str, Any] = ("doc", _convert(fmt, data, in_child=True))
    except _Skip as skip:
        result = ("skip", skip.reason)
    except MemoryError:
        result = ("skip", "convert-limit")
    except Exception:
        result = ("skip", "corrupt")
    del data
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        payload = pickle.dumps(("skip", "convert-limit"))
    answer.write(payload)
    answer.flush()


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


def _check_zip(data: bytes) -> int:
    """Refuse a zip bomb before any library unpacks it; what its markup (XML, HTML) unpacks to.  The declared sizes
    are checked first, then every member is inflated here, a piece at a time and thrown away, counting its real
    bytes: a header may lie, and zipfile's ``read`` inflates a member's whole stream in one call before it cuts
    it at the declared size (a member declaring 20 KB that holds 460 MB took 1.7 GB doing that)."""
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
    markup = 0
    for info in infos:
        size, head = _unpacked_size(data, info)
        if size > info.file_size:
            raise _Skip("unpack-limit")  # more than its header says: how a bomb gets past the declared sizes
        if _looks_like_markup(head):
            markup += size
    return markup


def _looks_like_markup(head: bytes) -> bool:
    """Whether a member's first bytes could start XML or HTML (what a parser would build a tree of)."""
    for bom in (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"):
        head = head.removeprefix(bom)
    return head.replace(b"\x00", b"").lstrip().startswith(b"<")


# Inflated per call while counting: small enough to cost nothing, large enough to make few calls.
_INFLATE_PIECE = 256 * 1024
# A member's first bytes kept to tell markup from pictures: room for a BOM and leading white space.
_HEAD_BYTES = 64


def _unpacked_size(data: bytes, info: zipfile.ZipInfo) -> tuple[int, bytes]:
    """A member's real unpacked size, counted by inflating its stream in pieces, and its first bytes; counting
    stops one byte past the declared size, so a lying header costs no more time than an honest one."""
    offset = info.header_offset
    if data[offset : offset + 4] != b"PK\x03\x04":
        raise _Skip("corrupt")
    name_len, extra_len = struct.unpack_from("<HH", data, offset + 26)
    start = offset + 30 + name_len + extra_len
    raw = memoryview(data)[start : start + info.compress_size]
    if info.compress_type == zipfile.ZIP_STORED:
        return len(raw), bytes(raw[:_HEAD_BYTES])
    if info.compress_type != zipfile.ZIP_DEFLATED:
        raise _Skip("corrupt")  # OOXML and EPUB allow stored and deflated members only
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    size, limit, head = 0, info.file_size, b""
    try:
        for at in range(0, len(raw), _INFLATE_PIECE):
            pending: bytes | memoryview = raw[at : at + _INFLATE_PIECE]
            while pending:
                piece = inflater.decompress(pending, _INFLATE_PIECE)
                if len(head) < _HEAD_BYTES:
                    head += piece[: _HEAD_BYTES - len(head)]
                size += len(piece)
                if size > limit or inflater.eof:
                    return size, head
                pending = inflater.unconsumed_tail
    except zlib.error as exc:
        raise _Skip("corrupt") from exc
    return size, head


# --- PDF -----------------------------------------------------------------------------------------------------


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is, or was raised while handling, a ``kind`` (pypdf wraps its limit errors)."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, kind):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


class _OutOfTime(Exception):
    """Raised from inside a library's loop (a PDF page's operators) when the conversion's time is up."""


def _pdf(data: bytes, out: _Builder, *, in_child: bool = True) -> None:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError

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
    pages = min(n, MAX_DOCUMENT_PAGES)
    outline = _pdf_outline(reader, pages)
    failed = 0
    deadline = out.deadline
    timed_out = False

    def check_time(_op: Any, _args: Any, _cm: Any, _tm: Any) -> None:
        # Called before every operator of a page's content: one page's stream can take minutes on its own.
        if time.monotonic() > deadline:
            raise _OutOfTime

    texts: list[str] = []
    size = 0
    pdfium_doc = _pdfium_open(data)
    try:
        for i in range(pages):
            if time.monotonic() > deadline:
                timed_out = True
                break
            try:
                if pdfium_doc is None:
                    text = reader.pages[i].extract_text(visitor_operand_before=check_time) or ""
                else:
                    text = _pdfium_page_text(reader.pages[i], pdfium_doc, i)
            except _OutOfTime:
                timed_out = True
                break
            except Exception as exc:  # one broken page (a bad font, a bad stream) costs its text, not the document
                if not in_child and _caused_by(exc, LimitReachedError):
                    raise  # this process's tighter stream limit: the file is converted again in a child
                log.debug("pdf page %d: text extraction failed: %s", i + 1, type(exc).__name__)
                text, failed = "", failed + 1
            texts.append(clean(text))
            size += len(texts[-1])
            if size >= MAX_DOCUMENT_CHARS:
                break
    finally:
        if pdfium_doc is not None:
            pdfium_doc.close()
    for i, text in enumerate(_without_running_lines(texts)):
        out.page()
        _pdf_page(out, text, outline.get(i, []))
        if i + 1 < n and out.done():
            break
    else:
        if n > MAX_DOCUMENT_PAGES and len(texts) == pages:
            out.cut("cut-pages")
    if timed_out:
        out.cut("cut-time")
        if not out.has_text:
            raise _Skip("convert-limit")
    if not out.has_text:
        if failed:
            raise ValueError(f"no page's text could be extracted ({failed} failed)")
        raise _Skip("no-text-layer")


def _pdfium_open(data: bytes) -> Any:
    """The PDF opened by PDFium for its page text, or None where PDFium cannot open what pypdf could (its text is
    then pypdf's).  The empty password is tried, as pypdf tried it."""
    import pypdfium2

    try:
        return pypdfium2.PdfDocument(data)
    except pypdfium2.PdfiumError as exc:
        log.debug("pdfium cannot open the pdf (%s): pypdf's text instead", exc)
        return None


def _pdfium_page_text(page: Any, pdfium_doc: Any, i: int) -> str:
    """Page ``i``'s text as PDFium lays it out.  What PDFium will parse (the page's content and its forms) is
    first decoded by pypdf under its stream limits, so a compression bomb is refused (or sent to the child)
    before PDFium inflates it, where no limit of ours applies."""
    _decode_page_streams(page)
    pdfium_page = pdfium_doc[i]
    try:
        textpage = pdfium_page.get_textpage()
        try:
            raw = textpage.get_text_range()
        finally:
            textpage.close()
    finally:
        pdfium_page.close()
    # PDFium ends lines with \r\n and marks a word it rejoined across a line-end hyphen with U+FFFE
    return raw.replace("\r\n", "\n").replace("\r", "\n").replace("\ufffe", "")


def _decode_page_streams(page: Any) -> None:
    from pypdf.generic import DictionaryObject, StreamObject

    page.get_contents()
    # Forms often share the page's resources (or each other's): each dictionary and form is read once, or a page
    # of three such forms went round them until _MAX_PAGE_FORMS.
    stack, visited, decoded = [page.get("/Resources")], set(), 0
    while stack and decoded < _MAX_PAGE_FORMS:
        resources = stack.pop()
        resources = resources.get_object() if resources is not None else None
        if not isinstance(resources, DictionaryObject) or id(resources) in visited:
            continue
        visited.add(id(resources))
        xobjects = resources.get("/XObject")
        xobjects = xobjects.get_object() if xobjects is not None else None
        if not isinstance(xobjects, DictionaryObject):
            continue
        for ref in xobjects.values():
            form = ref.get_object()
            if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form" and id(form) not in visited:
                visited.add(id(form))
                decoded += 1
                form.get_data()
                stack.append(form.get("/Resources"))


def _without_running_lines(pages: list[str]) -> list[str]:
    """The pages without their running heads and feet, which would otherwise sit inside every chunk: a line
    among the first or last two of a page that opens or closes at least a quarter of the pages (and three) word
    for word (a title, "Confidential"), or that has a number counting up with the pages on three pages or more
    (a bare page number, roman in the front matter, "Page 3 of 9", "4 Chapter 1. Scope").  A line that repeats
    with other numbers ("Total: 120" on every invoice) is kept."""
    with_text = sum(1 for p in pages if p.strip())
    if with_text < _RUNNING_MIN_PAGES:
        return pages
    split = [p.split("\n") for p in pages]
    # each page's edge lines: (index in the page, the line squeezed, the line with each of its numbers as #)
    edges: list[list[tuple[int, str, list[tuple[str, int]]]]] = []
    same: Counter[str] = Counter()
    # (the line with one of its numbers as #, that number minus the page's index): pages it is on
    counting: Counter[tuple[str, int]] = Counter()
    for index, lines in enumerate(split):
        filled = [k for k, line in enumerate(lines) if line.strip()]
        ks = sorted(set(filled[:_RUNNING_EDGE_LINES] + filled[-_RUNNING_EDGE_LINES:]))
        edge = [(k, _squeeze(lines[k]), _numbered_shapes(lines[k])) for k in ks]
        edges.append(edge)
        same.update({squeezed for _, squeezed, _ in edge})
        counting.update({(shape, number - index) for *_, shapes in edge for shape, number in shapes})
    least = max(_RUNNING_MIN_PAGES, with_text / 4)
    running = {line for line, c in same.items() if c >= least and len(line) <= _RUNNING_MAX_CHARS}
    out = []
    for index, (lines, edge) in enumerate(zip(split, edges, strict=True)):
        heads = {k for k, squeezed, _ in edge if squeezed in running}
        labels = {
            k for k, _, shapes in edge if any(counting[shape, n - index] >= _RUNNING_MIN_PAGES for shape, n in shapes)
        }
        if not heads and len(labels) == sum(1 for line in lines if line.strip()):
            labels = set()  # a page of numbered lines alone: they are its text, not a frame around it
        drop = heads | labels
        out.append("\n".join(line for k, line in enumerate(lines) if k not in drop))
    return out


def _squeeze(line: str) -> str:
    return " ".join(line.lower().split())


def _numbered_shapes(line: str) -> list[tuple[str, int]]:
    """For each number of a short line (arabic, or roman standing alone), the line with that number as ``#``
    and its value."""
    line = _squeeze(line)
    if len(line) > _RUNNING_MAX_CHARS:
        return []
    if _ROMAN.fullmatch(line):
        return [("#", value)] if (value := _roman(line)) else []
    return [(line[: m.start()] + "#" + line[m.end() :], int(m.group()[:9])) for m in _DIGITS.finditer(line)]


def _roman(s: str) -> int:
    """A lower-case roman numeral's value (0 when it is not written as one)."""
    values = {"i": 1, "v": 5, "x": 10, "l": 50, "c": 100}
    total = 0
    for a, b in zip(s, s[1:] + " ", strict=True):
        v = values[a]
        total += -v if values.get(b, 0) > v else v
    return total if total > 0 else 0


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


# A page whose forms nest or repeat past this many is read no further for its stream sizes.
_MAX_PAGE_FORMS = 1000
# Running heads and feet: looked for among a page's first and last lines, in documents of at least this many pages.
_RUNNING_EDGE_LINES = 2
_RUNNING_MIN_PAGES = 3
_RUNNING_MAX_CHARS = 120
_DIGITS = re.compile(r"\d+")
_ROMAN = re.compile(r"[ivxlc]+")
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


_PKG_RELS_NS = "{http://schemas.openxmlformats.org/package/2006/relationships}"
# Read from the zip per call while parsing the body: the XML is fed to the parser a piece at a time.
_FEED_PIECE = 256 * 1024


class _DocxStyles:
    """What python-docx's Paragraph and Table ask of their parent to name a style: ``part.get_style``, answered
    from the styles part alone (python-docx's own Document would first load the whole body into memory)."""

    def __init__(self, styles: Any) -> None:
        self.part = self
        self._styles = styles
        self._found: dict[tuple[str | None, Any], Any] = {}

    def get_style(self, style_id: str | None, style_type: Any) -> Any:
        # Each lookup is an XPath search of the styles part; a body of 100,000 paragraphs names a dozen styles.
        key = (style_id, style_type)
        if key not in self._found:
            self._found[key] = self._styles.get_by_id(style_id, style_type)
        return self._found[key]


def _rels_target(zf: zipfile.ZipFile, source: str, rel_type: str) -> str | None:
    """The part a relationship of ``rel_type`` (matched by its last path segment, so Strict OOXML's URIs too)
    points to from ``source`` ("" for the package), or None."""
    folder, name = posixpath.split(source)
    rels = posixpath.join(folder, "_rels", name + ".rels")
    try:
        root = _xml(zf.read(rels))
    except KeyError:
        return None
    for rel in root.iter(_PKG_RELS_NS + "Relationship"):
        if rel.get("Type", "").rsplit("/", 1)[-1] == rel_type and rel.get("TargetMode") != "External":
            target = rel.get("Target", "")
            joined = target.lstrip("/") if target.startswith("/") else posixpath.join(folder, target)
            return posixpath.normpath(joined)
    return None


def _xml(data: bytes) -> Any:
    """A small XML part parsed by python-docx's parser (its element classes; entities never resolved)."""
    from docx.oxml.parser import parse_xml

    return parse_xml(data)


def _docx(data: bytes, out: _Builder) -> None:
    """The body streamed from the zip through an incremental parser, one top-level element (paragraph, table,
    content control) at a time, each dropped once converted: memory follows the largest element, not the
    body, and the character and time limits stop the parse itself, so a body of hundreds of megabytes is
    loaded cut instead of being parsed whole first."""
    import docx
    from docx.enum.style import WD_STYLE_TYPE  # noqa: F401 - the styles' element classes are registered with it
    from docx.oxml.parser import element_class_lookup
    from docx.styles.styles import Styles
    from lxml import etree

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        main = _rels_target(zf, "", "officeDocument")
        if main is None:
            raise ValueError("no main document part")
        styles_part = _rels_target(zf, main, "styles")
        try:
            styles_xml = zf.read(styles_part) if styles_part else None
        except KeyError:
            styles_xml = None
        if styles_xml is None:  # as python-docx does: a document without styles gets its default ones
            styles_xml = (Path(docx.__file__).parent / "templates" / "default-styles.xml").read_bytes()
        parent = _DocxStyles(Styles(_xml(styles_xml)))
        # python-docx's parser options and element classes, so Paragraph and Table read the elements as ever.
        parser = etree.XMLPullParser(events=("start", "end"), remove_blank_text=True, resolve_entities=False)
        parser.set_element_class_lookup(element_class_lookup)
        depth = 0
        with zf.open(main) as body_xml:
            while piece := body_xml.read(_FEED_PIECE):
                parser.feed(piece)
                for event, el in parser.read_events():
                    if not isinstance(el, etree._Element):  # only namespace events yield other things; none asked
                        continue
                    if event == "start":
                        depth += 1
                        if depth == 1 and el.tag != _W_NS + "document":
                            raise ValueError("the main part is not a Word document")
                        continue
                    depth -= 1
                    if depth != 2:  # the body's own children, in order, so a table stays between its paragraphs
                        continue
                    _docx_block(out, el, parent)
                    # Converted: drop it and whatever came before it in the body.
                    el.clear()  # the tail too (keep_tail=False)
                    body = el.getparent()
                    while body is not None and el.getprevious() is not None:
                        del body[0]
                    if out.done():
                        return
                if out.done():  # inside one long element as well: the time is checked per piece read
                    return
            parser.close()


def _docx_block(out: _Builder, el: Any, parent: Any) -> None:
    """One of the body's elements; content controls (w:sdt: a cover page, a table of contents) are opened,
    not skipped."""
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    stack: list[Iterator[Any]] = [iter((el,))]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        tag = node.tag if isinstance(node.tag, str) else ""
        if tag == _W_NS + "p":
            _docx_paragraph(out, Paragraph(node, parent))
        elif tag == _W_NS + "tbl":
            _docx_table(out, Table(node, parent))
        elif tag == _W_NS + "sdt":
            content = node.find(_W_NS + "sdtContent")
            if content is not None:
                stack.append(iter(content))


def _docx_paragraph(out: _Builder, p: Any) -> None:
    text = p.text
    if not text.strip():
        return
    try:
        found = p.style
        style = (found.name or "") if found is not None else ""
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


# "<!DOCTYPE html [ <!ENTITY …> ]>": an HTML parser ends the doctype at the internal subset's first ">" and keeps
# the rest ("]>" at least) as the page's first text.  HTML never expands those entities, so the subset goes.
_DOCTYPE_SUBSET = re.compile(rb"<!DOCTYPE([^\[>]*)\[.*?\]\s*>", re.I | re.S)
# Where that doctype is looked for: it comes before the page, and a subset longer than this is no page's.
_DOCTYPE_SCAN_BYTES = 64 * 1024
# The markup is fed to lxml in pieces this long, the time checked between them.
_HTML_FEED_PIECE = 1024 * 1024


@cache
def _html_builder() -> Any:
    """A Beautiful Soup tree builder (lxml's HTML parser) that feeds the page a piece at a time and stops at
    its ``stop_at`` time, or None without lxml.  Parsing a page of tens of megabytes takes minutes on its own;
    this one parses what its share of the time allows, and the tree built so far is converted."""
    from bs4 import XMLParsedAsHTMLWarning

    # An XHTML page or EPUB chapter is parsed as HTML on purpose; bs4's advice to use an XML parser is noise on
    # a load's terminal.  Filtered for the process, once: catch_warnings is not safe across threads.
    warnings.filterwarnings("ignore", category=XMLParsedAsHTMLWarning)
    try:
        from bs4.builder import ParserRejectedMarkup
        from bs4.builder._lxml import LXMLTreeBuilder
        from lxml import etree
    except ImportError:
        return None

    class TimedLXMLTreeBuilder(LXMLTreeBuilder):  # type: ignore[misc, valid-type]
        stop_at = float("inf")
        stopped = False

        def feed(self, markup: Any) -> None:  # bs4's own, fed in pieces
            encoding = self.soup.original_encoding if self.soup is not None else None  # set by BeautifulSoup()
            try:
                self.parser = self.parser_for(encoding)
                for at in range(0, len(markup), _HTML_FEED_PIECE):
                    if at and time.monotonic() > self.stop_at:
                        self.stopped = True
                        break
                    self.parser.feed(markup[at : at + _HTML_FEED_PIECE])
                self.parser.close()
            except (UnicodeDecodeError, LookupError, etree.ParserError) as exc:
                raise ParserRejectedMarkup(exc) from exc

    return TimedLXMLTreeBuilder


def _html_into(data: bytes, out: _Builder) -> None:
    """One HTML page's main text into ``out``, headings continuing the levels already there (an EPUB's spine)."""
    from bs4 import BeautifulSoup

    if m := _DOCTYPE_SUBSET.search(data, 0, _DOCTYPE_SCAN_BYTES):
        data = data[: m.start()] + b"<!DOCTYPE" + m.group(1).rstrip() + b">" + data[m.end() :]
    builder_class = _html_builder()
    if builder_class is None:
        soup = BeautifulSoup(data, "html.parser")
    else:
        builder = builder_class()
        now = time.monotonic()
        builder.stop_at = now + max(out.deadline - now, 0) / 2  # the other half is for the tree's walk
        soup = BeautifulSoup(data, builder=builder)
        if builder.stopped:
            out.cut("cut-time")
    for tag in soup.find_all(_DROP_TAGS):
        tag.decompose()
    for tag in soup.find_all(None, attrs={"role": True}):
        if not tag.decomposed and str(tag.get("role", "")).lower() in _DROP_ROLES:
            tag.decompose()
    # A page-level <header> is the site's banner; one inside an article or section holds that part's title.
    for tag in soup.find_all("header"):
        if not tag.decomposed and tag.find_parent(("article", "main", "section")) is None:
            tag.decompose()
    for tag in soup.select("a.headerlink"):  # Sphinx's "¶" after every heading
        tag.decompose()
    root = soup.find("main") or soup.find(None, attrs={"role": "main"})
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
