"""SQL for buffers, files and chunks.  Keyword-only functions over a connection."""

from __future__ import annotations

import difflib
import re
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb
from pydantic import ConfigDict

from ..errors import BufferNotFound, InvalidInput
from ..models import BufferInfo, FileInfo, Location
from . import vectors
from .rows import one

if TYPE_CHECKING:
    import psycopg

DEFAULT_TENANT = "local"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_buffer_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise InvalidInput(
            f"invalid buffer name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class BufferRow:
    id: int
    tenant: str
    name: str
    version: int
    chunker: str | None
    chunk_size: int | None
    chunk_overlap: int | None
    embedding_model: str | None
    embedding_dim: int | None
    #: how chunks were cut into embedding windows (``ingest.windows.WindowSpec.label``)
    embedding_windows: str | None = None
    #: what ran the model: ``torch``, ``onnx`` or ``onnx-int8`` (``ingest.embed.RUNTIMES``)
    embedding_runtime: str | None = None

    @property
    def windows_label(self) -> str | None:
        return self.embedding_windows if self.embedding_dim else None

    @property
    def runtime(self) -> str | None:
        return (self.embedding_runtime or "torch") if self.embedding_dim else None


_BUFFER_COLS = (
    "id, tenant, name, version, chunker, chunk_size, chunk_overlap, embedding_model, embedding_dim, embedding_windows, "
    "embedding_runtime"
)


def get_buffer(conn: psycopg.Connection, *, tenant: str, name: str, for_update: bool = False) -> BufferRow | None:
    sql = f"SELECT {_BUFFER_COLS} FROM buffers WHERE tenant = %s AND name = %s"
    row = conn.execute(sql + (" FOR UPDATE" if for_update else ""), (tenant, name)).fetchone()
    return BufferRow(*row) if row else None


def get_buffer_by_id(conn: psycopg.Connection, *, buffer_id: int) -> BufferRow | None:
    row = conn.execute(f"SELECT {_BUFFER_COLS} FROM buffers WHERE id = %s", (buffer_id,)).fetchone()
    return BufferRow(*row) if row else None


def buffer_not_found(conn: psycopg.Connection, *, tenant: str, name: str) -> BufferNotFound:
    """The not-found error for ``name``, suggesting the tenant's closest buffer name when one is near
    (a typo such as ``doc`` for ``docs``); only this tenant's names are ever offered."""
    known = [r[0] for r in conn.execute("SELECT name FROM buffers WHERE tenant = %s", (tenant,)).fetchall()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return BufferNotFound(name, suggestion=close[0] if close else None)


def require_buffers(conn: psycopg.Connection, *, tenant: str, names: Sequence[str]) -> list[BufferRow]:
    out = []
    for name in dict.fromkeys(names):
        row = get_buffer(conn, tenant=tenant, name=name)
        if row is None:
            raise buffer_not_found(conn, tenant=tenant, name=name)
        out.append(row)
    return out


def lock_or_create_buffer(conn: psycopg.Connection, *, tenant: str, name: str) -> BufferRow:
    """Inside a transaction: the buffer row, locked against concurrent loads."""
    conn.execute(
        "INSERT INTO buffers (tenant, name) VALUES (%s, %s) ON CONFLICT (tenant, name) DO NOTHING",
        (tenant, name),
    )
    row = get_buffer(conn, tenant=tenant, name=name, for_update=True)
    assert row is not None
    return row


def update_buffer_meta(
    conn: psycopg.Connection,
    *,
    buffer_id: int,
    # None where the buffer has none yet (BufferRow's columns): a re-embed writes back what it read
    chunker: str | None,
    chunk_size: int | None,
    overlap: int | None,
    embedding_model: str,
    embedding_dim: int,
    embedding_windows: str,
    embedding_runtime: str,
    bump: bool,
) -> int:
    row = one(
        conn.execute(
            """UPDATE buffers SET chunker = %s, chunk_size = %s, chunk_overlap = %s, embedding_model = %s,
               embedding_dim = %s, embedding_windows = %s, embedding_runtime = %s, version = version + %s,
               updated_at = CASE WHEN %s THEN now() ELSE updated_at END
           WHERE id = %s RETURNING version""",
            (
                chunker,
                chunk_size,
                overlap,
                embedding_model,
                embedding_dim,
                embedding_windows,
                embedding_runtime,
                1 if bump else 0,
                bump,
                buffer_id,
            ),
        )
    )
    return int(row[0])


def buffer_info(conn: psycopg.Connection, *, tenant: str, name: str) -> BufferInfo:
    rows = list_buffers(conn, tenant=tenant, name=name)
    if not rows:
        raise buffer_not_found(conn, tenant=tenant, name=name)
    return rows[0]


def list_buffers(conn: psycopg.Connection, *, tenant: str, name: str | None = None) -> list[BufferInfo]:
    rows = conn.execute(
        f"""SELECT b.name, b.id, b.version,
                  (SELECT count(*) FROM files f WHERE f.buffer_id = b.id),
                  (SELECT count(*) FROM chunks c WHERE c.buffer_id = b.id),
                  (SELECT coalesce(sum(size_bytes), 0) FROM files f WHERE f.buffer_id = b.id),
                  b.chunker, b.embedding_model, b.created_at, b.updated_at, b.embedding_windows,
                  b.embedding_runtime
           FROM buffers b WHERE b.tenant = %s {"AND b.name = %s" if name else ""} ORDER BY b.name""",
        (tenant, name) if name else (tenant,),
    ).fetchall()
    return [
        BufferInfo(
            name=r[0],
            id=r[1],
            version=r[2],
            files=r[3],
            chunks=r[4],
            bytes=int(r[5]),
            chunker=r[6],
            embedding_model=r[7],
            created_at=r[8].isoformat(timespec="seconds"),
            updated_at=r[9].isoformat(timespec="seconds"),
            embedding_windows=r[10],
            embedding_runtime=(r[11] or "torch") if r[7] else None,
        )
        for r in rows
    ]


def delete_buffer(conn: psycopg.Connection, *, tenant: str, name: str) -> bool:
    """Delete the buffer and everything it holds: files, chunks, embeddings and the overnight result-cache rows
    answered from it (all ON DELETE CASCADE; the vectors' table is dropped), so a buffer reloaded under the same
    name never serves them."""
    row = conn.execute("DELETE FROM buffers WHERE tenant = %s AND name = %s RETURNING id", (tenant, name)).fetchone()
    if row is None:
        return False
    vectors.drop_table(conn, buffer_id=row[0])
    return True


@dataclass(frozen=True)
class FileRow:
    id: int
    path: str
    content_hash: str
    chunk_count: int


def files_of(conn: psycopg.Connection, *, buffer_id: int) -> dict[str, FileRow]:
    rows = conn.execute(
        "SELECT id, path, content_hash, chunk_count FROM files WHERE buffer_id = %s", (buffer_id,)
    ).fetchall()
    return {r[1]: FileRow(*r) for r in rows}


def list_files(
    conn: psycopg.Connection, *, buffer_id: int, limit: int = 1000, after: str | None = None
) -> list[FileInfo]:
    """The buffer's files in path order, a page at a time (``after``: the last path of the previous page)."""
    rows = conn.execute(
        """SELECT path, size_bytes, chunk_count, loaded_at FROM files
           WHERE buffer_id = %s AND (%s::text IS NULL OR path > %s) ORDER BY path LIMIT %s""",
        (buffer_id, after, after, limit),
    ).fetchall()
    return [FileInfo(path=r[0], bytes=r[1], chunks=r[2], loaded_at=r[3].isoformat() if r[3] else None) for r in rows]


def delete_files(conn: psycopg.Connection, *, buffer_id: int, file_ids: Iterable[int]) -> int:
    """The files, their chunks, and the chunks' vectors."""
    ids = list(file_ids)
    if not ids:
        return 0
    vectors.delete_for_files(conn, buffer_id=buffer_id, file_ids=ids)
    return conn.execute("DELETE FROM files WHERE id = ANY(%s)", (ids,)).rowcount


def insert_file(
    conn: psycopg.Connection,
    *,
    file_id: int,
    buffer_id: int,
    path: str,
    content_hash: str,
    size_bytes: int,
    chunk_count: int,
    doc_format: str = "text",
    outline: list[dict[str, Any]] | None = None,
) -> None:
    conn.execute(
        """INSERT INTO files (id, buffer_id, path, content_hash, size_bytes, chunk_count, format, outline)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s)""",
        (file_id, buffer_id, path, content_hash, size_bytes, chunk_count, doc_format, _jsonb(outline)),
    )


def _jsonb(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


_SEQUENCES = ("files_id_seq", "chunks_id_seq")


def reserve_ids(conn: psycopg.Connection, *, sequence: str, n: int) -> list[int]:
    """Ids for rows written by COPY, which cannot return them."""
    if sequence not in _SEQUENCES:
        raise ValueError(sequence)
    if n <= 0:
        return []
    rows = conn.execute(f"SELECT nextval('{sequence}') FROM generate_series(1, %s)", (n,)).fetchall()
    return [r[0] for r in rows]


CHUNK_COPY_COLS = (
    "id",
    "buffer_id",
    "file_id",
    "ordinal",
    "seq",
    "path",
    "start_line",
    "end_line",
    "start_byte",
    "end_byte",
    "text",
    "token_count",
    "content_hash",
    "terms",
    "page_start",
    "page_end",
    "heading_path",
)
CHUNK_COPY_TYPES = [
    "int8",
    "int8",
    "int8",
    "int4",
    "int4",
    "text",
    "int4",
    "int4",
    "int8",
    "int8",
    "text",
    "int4",
    "text",
    "text",
    "int4",
    "int4",
    "text[]",
]


def copy_chunks(conn: psycopg.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    with (
        conn.cursor() as cur,
        cur.copy(f"COPY chunks ({', '.join(CHUNK_COPY_COLS)}) FROM STDIN WITH (FORMAT BINARY)") as copy,
    ):
        copy.set_types(CHUNK_COPY_TYPES)
        for row in rows:
            copy.write_row(row)


def chunk_texts(conn: psycopg.Connection, *, buffer_id: int, after: int, limit: int) -> list[tuple[int, str]]:
    """(chunk id, text) of the buffer in id order after ``after``: one page of a keyset scan."""
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT id, text FROM chunks WHERE buffer_id = %s AND id > %s ORDER BY id LIMIT %s",
            (buffer_id, after, limit),
        )
    ]


def renumber_ordinals(conn: psycopg.Connection, *, buffer_id: int) -> None:
    """Ordinals follow (path, position in file), so Collect can sort findings in reading order."""
    conn.execute(
        """UPDATE chunks c SET ordinal = o.rn FROM (
               SELECT id, (row_number() OVER (ORDER BY path, seq) - 1)::int AS rn FROM chunks WHERE buffer_id = %s
           ) o WHERE c.id = o.id AND c.ordinal IS DISTINCT FROM o.rn""",
        (buffer_id,),
    )


class ChunkRow(Location):
    """A stored chunk: where it sits, its place in its buffer's reading order (``ordinal``) and its text."""

    model_config = ConfigDict(frozen=True)

    id: int
    ordinal: int
    text: str


#: the provenance columns every displayed chunk carries, read after ``text`` by ``_chunk_row``
_PROVENANCE_COLS = "c.page_start, c.page_end, c.heading_path"


def _chunk_row(r: Sequence[Any]) -> ChunkRow:
    """A ChunkRow from id, buffer, ordinal, path, start, end, text, then the provenance columns."""
    return ChunkRow(
        id=r[0],
        buffer=r[1],
        ordinal=r[2],
        path=r[3],
        start_line=r[4],
        end_line=r[5],
        text=r[6],
        page_start=r[7],
        page_end=r[8],
        heading_path=r[9] or [],
    )


def get_chunks(
    conn: psycopg.Connection, *, tenant: str, chunk_ids: Sequence[int], with_text: bool = True
) -> dict[int, ChunkRow]:
    """Chunks by id, restricted to the tenant's buffers; missing ids are simply absent.  ``with_text=False``
    leaves ``text`` empty: where each chunk lives, for Collect — a 10,000-chunk job's findings would otherwise
    read every chunk's text only to stamp its place."""
    if not chunk_ids:
        return {}
    text = "c.text" if with_text else "''"
    rows = conn.execute(
        f"""SELECT c.id, b.name, c.ordinal, c.path, c.start_line, c.end_line, {text}, {_PROVENANCE_COLS}
            FROM chunks c JOIN buffers b ON b.id = c.buffer_id
            WHERE c.id = ANY(%s) AND b.tenant = %s""",
        (list(chunk_ids), tenant),
    ).fetchall()
    return {r[0]: _chunk_row(r) for r in rows}


@dataclass(frozen=True)
class CountedChunk:
    """A chunk with what an exhaustive count needs of its neighbours in the file (``records.totals.own_lines``)."""

    row: ChunkRow
    prev_end_line: int | None
    #: the file's text right after this chunk's end, taken from the next chunk (empty at the end of the file)
    tail: str
    #: the file's first line (a table's header row, for chunks that do not start the file)
    first_line: str = ""


def chunks_for_counting(conn: psycopg.Connection, *, tenant: str, chunk_ids: Sequence[int]) -> dict[int, CountedChunk]:
    if not chunk_ids:
        return {}
    rows = conn.execute(
        """SELECT c.id, b.name, c.ordinal, c.path, c.start_line, c.end_line, c.text, p.end_line,
                  CASE WHEN n.id IS NULL THEN NULL
                       WHEN n.start_byte <= c.end_byte
                       THEN substring(convert_to(n.text, 'UTF8')
                                      FROM (c.end_byte - n.start_byte + 1)::int FOR 65536)
                       -- the fixed chunker trims the blanks at a cut: inside a line they were spaces or tabs
                       WHEN n.start_line = c.end_line
                       THEN convert_to(repeat(' ', (n.start_byte - c.end_byte)::int) || left(n.text, 65536), 'UTF8')
                  END,
                  left(split_part(h.text, E'\n', 1), 10000), c.page_start, c.page_end, c.heading_path
           FROM chunks c JOIN buffers b ON b.id = c.buffer_id
           LEFT JOIN chunks p ON p.file_id = c.file_id AND p.seq = c.seq - 1
           LEFT JOIN chunks n ON n.file_id = c.file_id AND n.seq = c.seq + 1
           LEFT JOIN chunks h ON h.file_id = c.file_id AND h.seq = 0
           WHERE c.id = ANY(%s) AND b.tenant = %s""",
        (list(chunk_ids), tenant),
    ).fetchall()
    return {
        r[0]: CountedChunk(
            _chunk_row((*r[:7], *r[10:13])),
            r[7],
            bytes(r[8]).decode("utf-8", "ignore") if r[8] is not None else "",
            r[9] or "",
        )
        for r in rows
    }


def chunk_sizes(conn: psycopg.Connection, *, buffer_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(chunk id, characters) of every chunk of the buffers, in document order (buffer as given, then ordinal):
    what an exhaustive job reads, and how big each piece is, without loading any text."""
    order = {bid: k for k, bid in enumerate(buffer_ids)}
    rows = conn.execute(
        "SELECT buffer_id, id, length(text) FROM chunks WHERE buffer_id = ANY(%s) ORDER BY buffer_id, ordinal, id",
        (list(buffer_ids),),
    ).fetchall()
    rows.sort(key=lambda r: order.get(r[0], 0))  # stable: ordinal order kept within a buffer
    return [(r[1], int(r[2])) for r in rows]


def sample_chunks(
    conn: psycopg.Connection, *, buffer_ids: Sequence[int], limit: int, chars: int = 4000
) -> list[tuple[str, str]]:
    """(path, first ``chars`` of text) of at most ``limit`` chunks spread evenly over the buffers' document order:
    enough to tell logs and tables from code or prose without reading every chunk."""
    rows = conn.execute(
        """SELECT path, left(text, %s) FROM (
               SELECT path, text, row_number() OVER (ORDER BY buffer_id, ordinal, id) AS k, count(*) OVER () AS n
               FROM chunks WHERE buffer_id = ANY(%s)) s
           WHERE (k - 1) %% GREATEST(1, n / %s) = 0
           ORDER BY k LIMIT %s""",
        (chars, list(buffer_ids), max(1, limit), max(1, limit)),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def sizes_of(conn: psycopg.Connection, *, tenant: str, chunk_ids: Sequence[int]) -> dict[int, int]:
    """Characters of each of the tenant's chunks among ``chunk_ids`` (absent ids are left out)."""
    if not chunk_ids:
        return {}
    rows = conn.execute(
        """SELECT c.id, length(c.text) FROM chunks c JOIN buffers b ON b.id = c.buffer_id
           WHERE c.id = ANY(%s) AND b.tenant = %s""",
        (list(chunk_ids), tenant),
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def count_chunks(conn: psycopg.Connection, *, buffer_ids: Sequence[int]) -> int:
    row = one(conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = ANY(%s)", (list(buffer_ids),)))
    return int(row[0])


def iter_chunk_texts(
    conn: psycopg.Connection, *, buffer_ids: Sequence[int], page: int = 500
) -> Generator[tuple[int, str, str, int, str], None, None]:
    """(chunk id, buffer name, path, start line, text) in document order, streamed by a server-side cursor.

    Runs inside its own transaction (named cursors need one); stop iterating to stop reading.
    """
    with conn.transaction(), conn.cursor(name="rlm_chunk_texts") as cur:
        cur.itersize = page
        cur.execute(
            """SELECT c.id, b.name, c.path, c.start_line, c.text FROM chunks c
                       JOIN buffers b ON b.id = c.buffer_id
                       WHERE c.buffer_id = ANY(%s) ORDER BY b.name, c.ordinal""",
            (list(buffer_ids),),
        )
        yield from cur


def iter_terms(conn: psycopg.Connection, *, buffer_id: int, batch: int = 5000) -> Iterator[tuple[int, list[str]]]:
    """(chunk_id, terms) of a buffer in id order, streamed: feeds the BM25 index build."""
    # a server-side cursor lives in a transaction; workers' pooled connections are autocommit
    with conn.transaction(), conn.cursor(name="rlm_terms") as cur:
        cur.itersize = batch
        cur.execute("SELECT id, terms FROM chunks WHERE buffer_id = %s ORDER BY id", (buffer_id,))
        for cid, terms in cur:
            yield cid, terms.split()


# --- documents: outlines and sections (the get_outline / get_section tools) ------------------------------


@dataclass(frozen=True)
class FileOutline:
    """A loaded file as the section tools need it: ``outline`` is None for a file without headings."""

    id: int
    path: str
    format: str
    outline: list[dict[str, Any]] | None


def file_outline(conn: psycopg.Connection, *, buffer_id: int, path: str) -> FileOutline | None:
    row = conn.execute(
        "SELECT id, path, format, outline FROM files WHERE buffer_id = %s AND path = %s", (buffer_id, path)
    ).fetchone()
    return FileOutline(*row) if row else None


def paths_ending(conn: psycopg.Connection, *, buffer_id: int, suffix: str, limit: int = 10) -> list[str]:
    """The buffer's file paths that end with ``suffix`` (compared as text, so ``%`` and ``_`` are no wildcards)."""
    rows = conn.execute(
        "SELECT path FROM files WHERE buffer_id = %s AND right(path, %s) = %s ORDER BY path LIMIT %s",
        (buffer_id, len(suffix), suffix, limit),
    ).fetchall()
    return [r[0] for r in rows]


@dataclass(frozen=True)
class SpanChunk:
    """A chunk with where it lies in its file: what stitching a section back together needs."""

    id: int
    seq: int
    start_line: int
    end_line: int
    start_byte: int
    end_byte: int
    page_start: int | None
    page_end: int | None
    text: str


def chunks_in_lines(
    conn: psycopg.Connection, *, buffer_id: int, file_id: int, start_line: int, end_line: int, max_chars: int
) -> list[SpanChunk]:
    """The file's chunks that touch lines ``start_line``..``end_line``, in file order, stopping once the chunks
    already read hold ``max_chars`` characters: a whole book's top-level section is never read to show its start."""
    rows = conn.execute(
        """SELECT id, seq, start_line, end_line, start_byte, end_byte, page_start, page_end, text FROM (
               SELECT id, seq, start_line, end_line, start_byte, end_byte, page_start, page_end, text,
                      sum(length(text)) OVER (ORDER BY seq) - length(text) AS before
               FROM chunks
               WHERE file_id = %s AND buffer_id = %s AND start_line <= %s AND end_line >= %s
           ) s WHERE before < %s ORDER BY seq""",
        (file_id, buffer_id, end_line, start_line, max_chars),
    ).fetchall()
    return [SpanChunk(*r) for r in rows]
