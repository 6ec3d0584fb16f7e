"""``rlm load``: files → chunks → window embeddings → PostgreSQL, in one transaction.

The whole load is a single transaction, so a failure (or Ctrl-C) half-way
leaves the previous version of the buffer exactly as it was.  Unchanged files
(same content hash, same chunking, same model) are skipped without
re-embedding.  Encoding is the slow part, so it runs a group of windows at a
time on its own thread (``EncodeAhead``) while the main thread chunks the next
files, and database writes run on a writer thread that owns the connection:
COPY overlaps with the encoder.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidInput
from ..limits import MAX_DOCUMENT_WINDOWS
from ..search.tokenize import tokenize
from ..store import buffers as store
from ..store import vectors
from .chunkers import Chunk, chunk_document, outline, validate_chunk_params
from .documents import Document, read_document
from .embed import get_embedder
from .files import discover, under
from .vector_memo import VectorMemo
from .writes import IdBlocks, Writer

if TYPE_CHECKING:
    import psycopg

    from .embed import Embedder
    from .onnxenc import OnnxEncoder

log = logging.getLogger("rlm.ingest")

#: encoder batches per group handed to ``encode`` at once (see load_paths): a wider group sorts more windows by
#: length (less padding) and finds more repeated ones; 32 encoded Celery's windows 4 % faster than 8 on 2 cores
#: (bench/RESULTS.md#ingest-2x), for 3 MB of windows and vectors held at a time
ENCODE_GROUP_BATCHES = 32
#: skip reasons worth the file's name in the summary: a document the user will want to look at, not a binary
#: that was never meant to load
NAMED_SKIPS = frozenset({"encrypted", "corrupt", "no-text-layer", "unpack-limit", "convert-limit"})
#: names kept per reason; the count stays exact
MAX_NAMED = 100
#: what to do about each skip reason, for the error of a load that found nothing to load (docs/contract.md#documents).
#: One blanket "only UTF-8 text and documents (PDF, …) are loaded" read, for an encrypted PDF, as if PDFs were not
#: supported at all; a reason not listed here (a new one) is shown by its name alone.  No ";" inside a hint: it
#: separates them.
SKIP_HINTS = {
    "binary": "only UTF-8 text and documents (PDF, DOCX, PPTX, XLSX, HTML, EPUB) are loaded",
    "not-utf8": "text must be UTF-8 (convert it first, e.g. with iconv)",
    "empty": "nothing in the file to load",
    "too-large": "over RLM_MAX_FILE_BYTES (raise it to load such files)",
    "encrypted": "documents that need a password are not opened (decrypt them first)",
    "corrupt": "the file cannot be parsed as its format (truncated or damaged)",
    "no-text-layer": "a PDF of scanned pages holds no text (OCR it first)",
    "unpack-limit": "the document unpacks to more than the limit, as a zip bomb does",
    "convert-limit": "converting the document took more memory or time than allowed",
    "symlink": "symbolic links met while walking are not followed (name the target instead)",
    "special": "not a regular file (a FIFO or a device)",
    "bad-name": "a name with a control character or over 255 bytes cannot be stored",
    "unreadable": "the file could not be read",
    "unreadable-dir": "the directory could not be read",
}


@dataclass
class LoadReport:
    buffer: str
    version: int = 0
    files_seen: int = 0
    files_loaded: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    chunks_written: int = 0
    windows_embedded: int = 0
    bytes_loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    #: names of files refused for size, so the CLI can say which (never read, only stat'ed)
    too_large: list[str] = field(default_factory=list)
    #: documents loaded but shortened, by reason (cut-pages, cut-text, cut-time)
    cut: dict[str, int] = field(default_factory=dict)
    #: the files behind the documents' skip and cut reasons (NAMED_SKIPS, every cut), at most MAX_NAMED each
    named: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    def skip(self, reason: str, n: int = 1, *, path: str | None = None) -> None:
        if n:
            self.skipped[reason] = self.skipped.get(reason, 0) + n
            if path is not None and reason in NAMED_SKIPS:
                self._name(reason, path)

    def cut_short(self, reason: str, path: str) -> None:
        self.cut[reason] = self.cut.get(reason, 0) + 1
        self._name(reason, path)

    def _names(self, reason: str, shown: int = 3) -> str:
        """``": a.pdf, b.pdf"`` for a reason whose files are named (the first few), else nothing."""
        names = self.named.get(reason) or []
        if not names:
            return ""
        more = len(names) - shown
        return ": " + ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")

    def _name(self, reason: str, path: str) -> None:
        names = self.named.setdefault(reason, [])
        if len(names) < MAX_NAMED:
            names.append(path)

    def merge(self, part: dict[str, Any]) -> None:
        """Add one ingest group's report (a LoadReport as the group stored it) to this one."""
        for key in ("files_seen", "files_loaded", "files_unchanged", "chunks_written", "windows_embedded"):
            setattr(self, key, getattr(self, key) + int(part.get(key, 0)))
        self.bytes_loaded += int(part.get("bytes_loaded", 0))
        self.too_large += list(part.get("too_large", []))
        for reason, n in (part.get("skipped") or {}).items():
            self.skip(reason, int(n))
        for reason, n in (part.get("cut") or {}).items():
            self.cut[reason] = self.cut.get(reason, 0) + int(n)
        for reason, names in (part.get("named") or {}).items():
            for path in names:
                self._name(reason, path)
        self.seconds = max(self.seconds, float(part.get("seconds", 0.0)))

    def nothing_to_load(self, buffer: str) -> str:
        """Why a load that found nothing to write changes nothing, as the one-line error says it."""
        skipped = sum(self.skipped.values())
        if not skipped:
            return f"nothing to load: no files found; buffer {buffer!r} was not changed"
        reasons = sorted(self.skipped.items())
        why = ", ".join(f"{n} {reason}{self._names(reason)}" for reason, n in reasons)
        hints = "".join(f"{reason}: {SKIP_HINTS[reason]}; " for reason, _ in reasons if reason in SKIP_HINTS)
        return (
            f"nothing to load: {skipped} file{'s' if skipped != 1 else ''} skipped ({why}); {hints}"
            f"buffer {buffer!r} was not changed"
        )

    def discovered(self, disc: Any) -> None:
        """What ``files.discover`` passed over, counted by reason (the too-large files also by name)."""
        self.skip("too-large", len(disc.skipped_too_large))
        self.too_large = list(disc.skipped_too_large)
        self.skip("symlink", disc.skipped_symlinks)
        self.skip("special", disc.skipped_special)
        self.skip("bad-name", disc.skipped_bad_names)
        self.skip("unreadable-dir", disc.unreadable_dirs)


class Progress(Protocol):
    """What the loader tells a progress bar.  A protocol: the CLI's bar (rich, or log lines) matches it without
    importing the loader, which ``rlm --help`` must not pay for."""

    def files_total(self, n: int) -> None: ...
    def file_done(self, path: str) -> None: ...
    def windows_added(self, n: int) -> None: ...
    def windows_embedded(self, n: int) -> None: ...


class _Unshown:
    """The progress of a load no one watches."""

    def files_total(self, n: int) -> None:
        pass

    def file_done(self, path: str) -> None:
        pass

    def windows_added(self, n: int) -> None:
        pass

    def windows_embedded(self, n: int) -> None:
        pass


def read_counted(cand: Any, report: LoadReport) -> tuple[Document | None, bool, str]:
    """The candidate converted (its skip or cuts counted in ``report``), whether a skipped file is a document that
    keeps its earlier version (it did not convert this time: bad input loses nothing already stored), and the
    sha256 of its bytes."""
    doc, reason, digest = read_document(cand.abs_path, cand.rel_path)
    if doc is None:
        report.skip(reason or "unreadable", path=cand.rel_path)
        return None, reason in NAMED_SKIPS, digest
    for cut in doc.cuts:
        report.cut_short(cut, cand.rel_path)
    return doc, False, digest


def _roots(paths: Sequence[Path | str]) -> list[tuple[str, bool]]:
    """Stored-path prefixes covered by this load, for removing files that disappeared."""
    out = []
    for p in paths:
        p = Path(p).resolve()
        out.append((p.name + "/", True) if p.is_dir() else (p.name, False))
    return out


def load_paths(
    conn: psycopg.Connection,  # not in autocommit
    *,
    buffer: str,
    paths: Sequence[Path | str],
    chunker: str = "semantic",
    chunk_size: int = 3000,
    overlap: int = 500,
    tenant: str = store.DEFAULT_TENANT,
    embedder: Embedder | OnnxEncoder | None = None,  # injected by tests
    embed_batch_size: int = 64,
    max_file_bytes: int = 50 * 1024 * 1024,
    progress: Progress | None = None,
) -> LoadReport:
    t0 = time.perf_counter()
    progress = progress or _Unshown()
    store.validate_buffer_name(buffer)
    try:
        validate_chunk_params(chunker, chunk_size, overlap)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if not paths:
        raise InvalidInput("give at least one file or directory to load")
    try:
        candidates, disc = discover([Path(p) for p in paths], max_file_bytes=max_file_bytes)
    except FileNotFoundError as exc:
        raise InvalidInput(str(exc).strip() or "path not found") from None

    report = LoadReport(buffer=buffer, files_seen=len(candidates))
    report.discovered(disc)
    if not candidates:  # before the embedder is loaded: there is nothing to encode
        raise InvalidInput(report.nothing_to_load(buffer))
    if embedder is None:
        embedder = get_embedder()
    progress.files_total(len(candidates))

    with conn.transaction():
        buf = store.lock_or_create_buffer(conn, tenant=tenant, name=buffer)
        new_table = vectors.ensure_table(conn, buffer_id=buf.id, dim=embedder.dim)
        same_params = not new_table and same_cut(buf, chunker, chunk_size, overlap, embedder)
        existing = store.files_of(conn, buffer_id=buf.id)
        seen: set[str] = set()
        changed = False
        writer = Writer(conn)
        file_ids, chunk_ids = IdBlocks(writer, "files_id_seq", 256), IdBlocks(writer, "chunks_id_seq", 4096)
        windows: list[str] = []
        owners: list[Owner] = []
        # Windows are encoded in groups of several batches: sorted by length within the group (less padding),
        # and the ONNX runtimes encode a group's batches on all cores at once.
        group = embed_batch_size * ENCODE_GROUP_BATCHES

        def store_rows(rows: list[vectors.WindowRow], n: int) -> None:
            writer.submit(lambda: vectors.copy(writer.conn, buffer_id=buf.id, rows=rows))
            report.windows_embedded += n
            progress.windows_embedded(n)

        ahead = EncodeAhead(embedder, embed_batch_size, store_rows)
        try:
            for cand in candidates:
                doc, keep_old, digest = read_counted(cand, report)
                if doc is None:
                    if keep_old and cand.rel_path in existing:
                        seen.add(cand.rel_path)
                    progress.file_done(cand.rel_path)
                    continue
                seen.add(cand.rel_path)
                old = existing.get(cand.rel_path)
                if old is not None and same_params and old.content_hash == digest:
                    report.files_unchanged += 1
                    progress.file_done(cand.rel_path)
                    continue
                changed = True
                queued_before = len(windows)
                doc, chunks = chunks_to_embed(
                    doc,
                    path=cand.rel_path,
                    chunker=chunker,
                    chunk_size=chunk_size,
                    overlap=overlap,
                    embedder=embedder,
                    report=report,
                )
                n = _queue_file(
                    conn, writer, file_ids, chunk_ids, windows, owners, buf.id, old, cand.rel_path, doc, digest, chunks
                )
                report.files_loaded += 1
                report.bytes_loaded += cand.size
                report.chunks_written += n
                progress.windows_added(len(windows) - queued_before)
                while len(windows) >= group:
                    ahead.submit(windows, owners, group)
                progress.file_done(cand.rel_path)
            if not seen:
                # Every file was skipped: an empty new buffer, or an old one emptied by a directory of images,
                # is never what the user meant.  Raising here rolls the whole load back.
                raise InvalidInput(report.nothing_to_load(buffer))
            ahead.submit(windows, owners, len(windows))
            ahead.wait()
            gone = [f.id for path, f in existing.items() if path not in seen and under(path, _roots(paths))]
            if gone:
                changed = True
                report.files_removed = len(gone)
                writer.submit(lambda: store.delete_files(conn, buffer_id=buf.id, file_ids=gone))
        finally:
            ahead.close()
            writer.close()
        if changed:
            store.renumber_ordinals(conn, buffer_id=buf.id)
        vectors.ensure_index(conn, buffer_id=buf.id)
        report.version = store.update_buffer_meta(
            conn,
            buffer_id=buf.id,
            chunker=chunker,
            chunk_size=chunk_size,
            overlap=overlap,
            embedding_model=embedder.model_id,
            embedding_dim=embedder.dim,
            embedding_windows=embedder.spec.label,
            embedding_runtime=embedder.runtime,
            bump=changed or buf.version == 0,
        )
    report.seconds = time.perf_counter() - t0
    return report


def _queue_file(
    conn: psycopg.Connection,
    writer: Writer,
    file_ids: IdBlocks,
    chunk_ids: IdBlocks,
    windows: list[str],
    owners: list[Owner],
    buffer_id: int,
    old: store.FileRow | None,
    path: str,
    doc: Document,
    digest: str,
    chunks: list[tuple[Chunk, list[tuple[int, int]]]],
) -> int:
    """Send one file's rows to the writer and queue its chunks' windows for encoding."""
    file_id = file_ids.take(1)[0]
    ids = chunk_ids.take(len(chunks))
    rows = [
        (cid, buffer_id, file_id, 0, seq, path, *chunk_fields(cid, ch, spans, windows, owners))
        for seq, (cid, (ch, spans)) in enumerate(zip(ids, chunks, strict=True))
    ]
    size = len(doc.text.encode())
    headings = outline(doc) if doc.headings else None

    def write() -> None:
        if old is not None:
            store.delete_files(conn, buffer_id=buffer_id, file_ids=[old.id])
        store.insert_file(
            conn,
            file_id=file_id,
            buffer_id=buffer_id,
            path=path,
            content_hash=digest,
            size_bytes=size,
            chunk_count=len(chunks),
            doc_format=doc.format,
            outline=headings,
        )
        store.copy_chunks(conn, rows)

    writer.submit(write)
    return len(chunks)


def same_cut(buf: Any, chunker: str, chunk_size: int, overlap: int, embedder: Any) -> bool:
    """Was the buffer cut and embedded as this load would?  A file whose text is unchanged is still re-embedded
    if it was cut or embedded differently."""
    return (
        buf.chunker,
        buf.chunk_size,
        buf.chunk_overlap,
        buf.embedding_model,
        buf.embedding_windows,
        buf.runtime,
    ) == (chunker, chunk_size, overlap, embedder.model_id, embedder.spec.label, embedder.runtime)


#: a queued window's owner: (chunk id, window number, span start, span end in the chunk text)
Owner = tuple[int, int, int, int]


def chunks_to_embed(
    doc: Document,
    *,
    path: str,
    chunker: str,
    chunk_size: int,
    overlap: int,
    embedder: Any,
    report: LoadReport,
) -> tuple[Document, list[tuple[Chunk, list[tuple[int, int]]]]]:
    """A file's chunks, each with its windows' spans.  A converted document whose windows would pass
    ``MAX_DOCUMENT_WINDOWS`` is cut before the chunk that passes it (counted as ``cut-text``), and the document
    returned is the text kept, so the file's size and outline match its chunks."""
    out: list[tuple[Chunk, list[tuple[int, int]]]] = []
    total = 0
    for ch in chunk_document(doc, path=path, chunker=chunker, chunk_size=chunk_size, overlap=overlap):
        spans = embedder.window_spans(ch.text, embedder.spec)
        total += len(spans)
        if doc.converted and total > MAX_DOCUMENT_WINDOWS and out:
            if "cut-text" not in doc.cuts:
                report.cut_short("cut-text", path)
            end = len(doc.text.encode()[: out[-1][0].end_byte].decode("utf-8", "ignore"))
            return doc.cut_at(end, "cut-text"), out
        out.append((ch, spans))
    return doc, out


def chunk_fields(cid: int, ch: Any, spans: list[tuple[int, int]], windows: list[str], owners: list[Owner]) -> tuple:
    """A chunk's stored columns from its start line on (lines, bytes, text, term count, digest, terms, pages,
    heading path), and its windows (``spans`` of its text) queued for encoding under ``cid``."""
    terms = tokenize(ch.text)
    queue_windows(cid, ch.text, spans, windows, owners)
    return (
        ch.start_line,
        ch.end_line,
        ch.start_byte,
        ch.end_byte,
        ch.text,
        len(terms),
        hashlib.sha256(ch.text.encode()).hexdigest(),
        " ".join(terms),
        ch.page_start,
        ch.page_end,
        list(ch.heading_path) or None,
    )


def queue_windows(cid: int, text: str, spans: list[tuple[int, int]], windows: list[str], owners: list[Owner]) -> None:
    """Queue a chunk's windows (``spans`` of its ``text``) for encoding under ``cid``, each with its span."""
    for w, (a, b) in enumerate(spans):
        windows.append(text[a:b])
        owners.append((cid, w, a, b))


def encode_queued(
    windows: list[str], owners: list[Owner], n: int, batch_size: int, embedder: Any
) -> list[vectors.WindowRow]:
    """Encode the first ``n`` queued windows (taken off the queue) as the vector store's rows."""
    return encode_rows(*_take(windows, owners, n), batch_size, embedder)


def _take(windows: list[str], owners: list[Owner], n: int) -> tuple[list[str], list[Owner]]:
    """The first ``n`` queued windows and their owners, removed from the queue."""
    batch, who = windows[:n], owners[:n]
    del windows[:n], owners[:n]
    return batch, who


#: window vectors kept per encoder object in a process (ingest/vector_memo.py), the 20,000 last used (30 MB at 384
#: dimensions): a long-lived process that loads a text again (a folder uploaded anew, a file reloaded after an edit,
#: one document in two buffers) encodes only the windows it has not seen.  Per object, not per model: an encoder
#: wrapped to fail or to count its calls must see every call the loader makes of it.
WINDOW_MEMO_SIZE = 20_000
_window_memos: weakref.WeakKeyDictionary[Any, VectorMemo] = weakref.WeakKeyDictionary()
_window_memos_lock = threading.Lock()


def _memo_of(embedder: Any) -> VectorMemo | None:
    """The encoder's window memo; None for one that cannot be weakly referenced (it is then never memoised)."""
    with _window_memos_lock:
        try:
            memo = _window_memos.get(embedder)
            if memo is None:
                memo = _window_memos[embedder] = VectorMemo(WINDOW_MEMO_SIZE)
        except TypeError:
            return None
        return memo


def encode_rows(batch: list[str], who: list[Owner], batch_size: int, embedder: Any) -> list[vectors.WindowRow]:
    """The vector store's rows of these windows.

    A text that repeats within them is encoded once and its vector stored for each: mostly a window of the
    overlap two neighbouring chunks share, also a repeated line (``def __init__(self, *args, **kwargs):``); about
    7 % of the windows of a Python package (bench/RESULTS.md#ingest-2x).  Identical windows then also get
    identical vectors, which the int8 runtime's per-batch scales did not quite give them."""
    unique = list(dict.fromkeys(batch))
    if (memo := _memo_of(embedder)) is None:
        vecs = embedder.encode(unique, batch_size=batch_size)
    else:
        # one memo per encoder object: no other encoder's vectors are in it to tell apart by name
        vecs = memo.encode("", unique, lambda texts: embedder.encode(texts, batch_size=batch_size))
    at = {text: i for i, text in enumerate(unique)}
    return [(cid, w, vecs[at[text]], a, b) for text, (cid, w, a, b) in zip(batch, who, strict=True)]


class EncodeAhead:
    """Encodes one group of queued windows on a background thread while the caller chunks the next files.

    Chunking, window cuts and BM25 terms run on the caller's thread (1.3 s of a 43 s load of Celery's source);
    encoding in line left the encoder's threads idle meanwhile (bench/RESULTS.md#ingest-2x).  One group in
    flight at a time: ``submit`` first waits for the previous one, so at most two groups are held.
    ``on_rows(rows, n)`` runs on the caller's thread, in submission order.
    """

    def __init__(self, embedder: Any, batch_size: int, on_rows: Callable[[list[vectors.WindowRow], int], None]) -> None:
        self._embedder, self._batch_size, self._on_rows = embedder, batch_size, on_rows
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rlm-encode-ahead")
        self._pending: tuple[Future[list[vectors.WindowRow]], int] | None = None

    def submit(self, windows: list[str], owners: list[Owner], n: int) -> None:
        """Take the first ``n`` queued windows off the queue and start encoding them."""
        if n <= 0:
            return
        batch, who = _take(windows, owners, n)
        self.wait()
        self._pending = (self._pool.submit(encode_rows, batch, who, self._batch_size, self._embedder), n)

    def wait(self) -> None:
        """Hand the group in flight, once encoded, to ``on_rows``; an encoder error is raised here."""
        if self._pending is None:
            return
        fut, n = self._pending
        self._pending = None
        self._on_rows(fut.result(), n)

    def close(self) -> None:
        """Stop the thread.  A group still in flight (the load failed) is dropped once its encode returns."""
        self._pool.shutdown(wait=True, cancel_futures=True)
