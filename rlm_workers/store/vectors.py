"""SQL for window vectors: one table and one HNSW graph per buffer (docs/architecture.md#vectors).

Why per buffer, not one table per width with a ``buffer_id`` filter: a search
names its buffers, and an HNSW graph shared by every buffer is walked through
all of them.  A 1,000-chunk buffer beside a 100,000-chunk one found its own
neighbours only by scanning past the big one's (recall fell, latency grew);
at a million chunks in a hundred buffers a one-buffer query would walk a graph
100 times larger than its buffer.  Per-buffer graphs make a query's cost
depend on the buffers it names only (bench/RESULTS.md#search-latency).

Vectors are stored as ``halfvec`` (16-bit floats): a chunk has tens of short
windows, so the vectors outweigh the text many times over; half the bytes is
half the table, half the graph and half the memory a search touches, and the
rounding (about 1e-3 of a cosine) does not change which chunks rank first
(bench/RESULTS.md#search-latency measures recall against exact search).

Each window row keeps its character span in the chunk (``span_start``, ``span_end``): a hit's ``passage`` is
then a slice of the chunk text, not a re-tokenising of it at query time (that cost more than the rest of a
warm hybrid search together).  Rows written before the spans were stored have NULLs there, and a search cuts
their windows again as before.

There is no foreign key to ``chunks``: with one table per buffer, every chunk
deleted anywhere would probe every buffer's table.  The functions here that
delete chunks' owners delete their vectors first, and a search drops an id
whose chunk is gone (``store.buffers.get_chunks`` returns only live chunks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pgvector import HalfVector

from ..errors import ConfigError
from ..limits import MAX_INDEXED_EMBEDDING_DIM
from .rows import one

if TYPE_CHECKING:
    import numpy as np
    import psycopg

#: most memory for building one buffer's graph in one pass (a 100k-window graph of 384-d vectors needs ~200 MB);
#: a larger build spills to disk and runs slower, never fails
BUILD_MEMORY = "512MB"
#: a build asks for this many times its table's size, at least BUILD_MEMORY_MIN_MB, at most BUILD_MEMORY: a
#: parallel build reserves all of maintenance_work_mem as shared memory up front, and 512 MB of it cost 0.15 s
#: (2,000 windows: 0.35 s at 512 MB, 0.20 s at 64 MB; 20,000 windows: 2.9 s vs 2.6 s).  The graph takes about
#: 2.5 times the table for 384-d halfvec (more for narrower vectors, less for wider).
BUILD_MEMORY_PER_TABLE_BYTE = 3
BUILD_MEMORY_MIN_MB = 64
#: a table from this size up gets a parallel graph build (PostgreSQL's own gate, min_parallel_table_scan_size,
#: is 8 MB, sized for scans: a graph costs far more per page, so a 1 MB table, ~1,200 384-d windows, already
#: builds faster with a helper; measured 1.36 s alone vs 1.06 s with one on 6,000 windows)
PARALLEL_BUILD_FROM = "1MB"
#: what the writers hand ``copy``: (chunk id, window number, float32 vector, span start, span end), the span in
#: characters of the chunk text
WindowRow = tuple[int, int, Any, int, int]

#: pgvector's ceiling on hnsw.ef_search
MAX_EF_SEARCH = 1000


def vector_table(buffer_id: int, *, staging: bool = False) -> str:
    """The buffer's table; ``staging`` names the one a re-embed fills while searches still read the old."""
    return f"chunk_vectors_b{int(buffer_id)}" + ("_next" if staging else "")


def check_indexable(dim: int) -> int:
    if not (0 < int(dim) <= MAX_INDEXED_EMBEDDING_DIM):
        raise ConfigError(
            f"embedding dimension {dim} cannot be indexed: pgvector's HNSW index holds at most "
            f"{MAX_INDEXED_EMBEDDING_DIM} dimensions; choose an RLM_EMBEDDING_MODEL with {MAX_INDEXED_EMBEDDING_DIM} "
            "or fewer"
        )
    return int(dim)


def ensure_table(conn: psycopg.Connection, *, buffer_id: int, dim: int, staging: bool = False) -> bool:
    """Inside the load's transaction: the buffer's vector table of width ``dim``; True when created now.

    A new table gets its graph from ``ensure_index`` once the load has written its rows: one
    bulk build is several times faster than growing the graph row by row.  A table of another width
    (the buffer is being re-embedded with another model) is replaced.
    """
    check_indexable(dim)
    table = vector_table(buffer_id, staging=staging)
    have = conn.execute(
        """SELECT a.atttypmod, format_type(a.atttypid, NULL) FROM pg_attribute a
           WHERE a.attrelid = to_regclass(%s) AND a.attname = 'embedding' AND NOT a.attisdropped""",
        (table,),
    ).fetchone()
    if have is not None and (int(have[0]), have[1]) == (int(dim), "halfvec"):
        return False
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(
        f"""CREATE TABLE {table} (
                chunk_id  bigint NOT NULL,
                win       smallint NOT NULL,
                embedding halfvec({int(dim)}) NOT NULL,
                span_start integer,
                span_end   integer,
                PRIMARY KEY (chunk_id, win)
            )"""
    )
    return True


def ensure_index(conn: psycopg.Connection, *, buffer_id: int, staging: bool = False) -> None:
    """The buffer's HNSW graph (cosine), built now if the table has none."""
    table = vector_table(buffer_id, staging=staging)
    if one(conn.execute("SELECT to_regclass(%s)", (f"{table}_hnsw",)))[0] is not None:
        return
    conn.execute(
        "SELECT set_config('maintenance_work_mem', least(greatest(%s * pg_relation_size(%s::regclass) / 1048576, %s),"
        " pg_size_bytes(%s) / 1048576)::bigint || 'MB', true)",
        (BUILD_MEMORY_PER_TABLE_BYTE, table, BUILD_MEMORY_MIN_MB, BUILD_MEMORY),
    )
    # pgvector builds the graph with max_parallel_maintenance_workers helpers; the server's setting caps them
    conn.execute(f"SET LOCAL min_parallel_table_scan_size = '{PARALLEL_BUILD_FROM}'")
    conn.execute(f"CREATE INDEX {table}_hnsw ON {table} USING hnsw (embedding halfvec_cosine_ops)")
    # the rest of the caller's transaction plans its queries as the server would
    conn.execute("SET LOCAL min_parallel_table_scan_size TO DEFAULT")


def drop_table(conn: psycopg.Connection, *, buffer_id: int) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {vector_table(buffer_id)}")


def promote(conn: psycopg.Connection, *, buffer_id: int) -> None:
    """The staging table (filled and indexed) replaces the buffer's table, at the end of the re-embed's
    transaction: searches of the buffer wait only for this, not for the whole re-embed."""
    table, staging = vector_table(buffer_id), vector_table(buffer_id, staging=True)
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(f"ALTER TABLE {staging} RENAME TO {table}")
    conn.execute(f"ALTER INDEX IF EXISTS {staging}_hnsw RENAME TO {table}_hnsw")
    conn.execute(f"ALTER INDEX IF EXISTS {staging}_pkey RENAME TO {table}_pkey")


def has_table(conn: psycopg.Connection, *, buffer_id: int) -> bool:
    return one(conn.execute("SELECT to_regclass(%s)", (vector_table(buffer_id),)))[0] is not None


def delete_for_files(conn: psycopg.Connection, *, buffer_id: int, file_ids: Sequence[int]) -> None:
    """The vectors of these files' chunks; called before the files (and so their chunks) are deleted."""
    if file_ids and has_table(conn, buffer_id=buffer_id):
        conn.execute(
            f"DELETE FROM {vector_table(buffer_id)} WHERE chunk_id IN (SELECT id FROM chunks WHERE file_id = ANY(%s))",
            (list(file_ids),),
        )


def copy(conn: psycopg.Connection, *, buffer_id: int, rows: Iterable[WindowRow], staging: bool = False) -> None:
    """rows: (chunk_id, window, float32 vector, span start, span end)."""
    table = vector_table(buffer_id, staging=staging)
    with (
        conn.cursor() as cur,
        cur.copy(
            f"COPY {table} (chunk_id, win, embedding, span_start, span_end) FROM STDIN WITH (FORMAT BINARY)"
        ) as cp,
    ):
        cp.set_types(["int8", "int2", "halfvec", "int4", "int4"])
        for cid, win, vec, start, end in rows:
            cp.write_row((cid, win, HalfVector(vec), start, end))


def count(conn: psycopg.Connection, *, buffer_id: int) -> int:
    if not has_table(conn, buffer_id=buffer_id):
        return 0
    return int(one(conn.execute(f"SELECT count(*) FROM {vector_table(buffer_id)}"))[0])


@dataclass(frozen=True, slots=True)
class Near:
    """A window near the query: its chunk, its number in the chunk, its cosine similarity, and its character
    span in the chunk text (None where the row predates stored spans)."""

    chunk_id: int
    win: int
    similarity: float
    span: tuple[int, int] | None


def nearest_windows(
    conn: psycopg.Connection, *, buffer_ids: Sequence[int], query_vec: np.ndarray, limit: int, ef_search: int
) -> list[Near]:
    """The ``limit`` windows nearest the query in each buffer's graph.

    One statement: a UNION ALL of one index scan per buffer, each cut to ``limit``; the caller
    merges.  A buffer whose table is missing (embedded by nothing yet) adds nothing.
    """
    present = [
        int(b)
        for (b,) in conn.execute(
            "SELECT b FROM unnest(%s::bigint[]) AS b WHERE to_regclass('chunk_vectors_b' || b) IS NOT NULL",
            (list(buffer_ids),),
        )
    ]
    if not present:
        return []

    arms = " UNION ALL ".join(
        f"(SELECT chunk_id, win, span_start, span_end, embedding <=> %(q)s AS d FROM {vector_table(b)}"
        " ORDER BY d LIMIT %(n)s)"
        for b in present
    )
    with conn.transaction():
        # ef_search is the candidate list HNSW keeps: it bounds recall, and how many rows one scan returns
        # unless the scan may go on (iterative scan) when a deep search wants more than pgvector's ceiling
        conn.execute(f"SET LOCAL hnsw.ef_search = {min(MAX_EF_SEARCH, max(ef_search, limit))}")
        if limit > MAX_EF_SEARCH:
            conn.execute("SET LOCAL hnsw.iterative_scan = strict_order")
            conn.execute(f"SET LOCAL hnsw.max_scan_tuples = {max(20_000, 4 * int(limit))}")
        rows = conn.execute(
            f"SELECT chunk_id, win, 1 - d, span_start, span_end FROM ({arms}) AS arms",
            {"q": HalfVector(query_vec), "n": limit},
        ).fetchall()
    return [Near(r[0], r[1], float(r[2]), None if r[3] is None else (r[3], r[4])) for r in rows]
