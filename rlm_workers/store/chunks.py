"""Reads over a job's chunks that the pipeline needs besides lookups by id (``buffers.get_chunks``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg


def count_chunks(conn: psycopg.Connection, *, buffer_ids: Sequence[int]) -> int:
    row = conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = ANY(%s)", (list(buffer_ids),)).fetchone()
    return int(row[0])


def iter_chunk_texts(
    conn: psycopg.Connection, *, buffer_ids: Sequence[int], page: int = 500
) -> Iterator[tuple[int, str, str, int, str]]:
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
