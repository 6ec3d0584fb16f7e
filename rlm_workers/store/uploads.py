"""Uploads queued for the ingest workers (``POST /v1/buffers?wait=false``).

The files wait in ``upload_files`` until a worker loads them; the load and the
upload's ``done`` commit in one transaction, and the staged bytes go with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pgvector import HalfVector
from psycopg.types.json import Jsonb

from ..constants import UPLOAD_ENDED_CHANNEL
from .buffers import CHUNK_COPY_COLS, CHUNK_COPY_TYPES
from .db import held_session_locks, session_lock_key, try_session_lock
from .rows import one
from .vectors import WindowRow, vector_table

if TYPE_CHECKING:
    import psycopg

_COLS = (
    "id, tenant, buffer, options, status, report, error, files, bytes, attempts, created_at, started_at, finished_at, "
    "groups, groups_done, base_version"
)


@dataclass(frozen=True)
class UploadRow:
    id: str
    tenant: str
    buffer: str
    options: dict[str, Any]
    #: queued | running | done | failed
    status: str
    report: dict[str, Any] | None
    error: dict[str, Any] | None
    files: int
    bytes: int
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    #: file groups it was split into (None: loaded whole by one rlm.ingest) and how many are embedded
    groups: int | None = None
    groups_done: int = 0
    #: the buffer's version the groups compare unchanged files against (0: no buffer yet)
    base_version: int | None = None

    @property
    def terminal(self) -> bool:
        return self.status in ("done", "failed")


def create_upload(
    conn: psycopg.Connection,
    *,
    upload_id: str,
    tenant: str,
    buffer: str,
    options: dict[str, Any],
    files: Sequence[tuple[str, bytes]],
) -> None:
    """The upload row and its files, in one transaction: a worker never sees half an upload."""
    with conn.transaction():
        conn.execute(
            """INSERT INTO uploads (id, tenant, buffer, options, files, bytes)
               VALUES (%s, %s, %s, %s, %s, %s)""",
            (upload_id, tenant, buffer, Jsonb(options), len(files), sum(len(d) for _, d in files)),
        )
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO upload_files (upload_id, path, data) VALUES (%s, %s, %b)",
                [(upload_id, path, data) for path, data in files],
            )


def get_upload(conn: psycopg.Connection, *, upload_id: str, tenant: str | None = None) -> UploadRow | None:
    row = conn.execute(
        f"SELECT {_COLS} FROM uploads WHERE id = %s AND (%s::text IS NULL OR tenant = %s)",
        (upload_id, tenant, tenant),
    ).fetchone()
    return UploadRow(*row) if row else None


_LOCK_SPACE = 0x524C4D49  # "RLMI": keeps these advisory locks apart from the migration lock


def try_lock_upload(conn: psycopg.Connection, *, upload_id: str) -> bool:
    """A session advisory lock on the upload (held until released or the connection closes); False if taken."""
    return try_session_lock(conn, session_lock_key(_LOCK_SPACE, upload_id))


def start_upload(conn: psycopg.Connection, *, upload_id: str) -> UploadRow | None:
    """Mark an open upload running (one more attempt); None when it is gone or already ended."""
    row = conn.execute(
        f"""UPDATE uploads SET status = 'running', attempts = attempts + 1, sent_at = now(),
                   started_at = coalesce(started_at, now())
            WHERE id = %s AND status IN ('queued', 'running') RETURNING {_COLS}""",
        (upload_id,),
    ).fetchone()
    return UploadRow(*row) if row else None


def staged_files(conn: psycopg.Connection, *, upload_id: str) -> list[tuple[str, bytes]]:
    rows = conn.execute(
        "SELECT path, data FROM upload_files WHERE upload_id = %s ORDER BY path", (upload_id,)
    ).fetchall()
    return [(path, bytes(data)) for path, data in rows]


def finish_upload(
    conn: psycopg.Connection,
    *,
    upload_id: str,
    status: str,
    report: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> None:
    """End the upload and drop its staged bytes (in the caller's transaction)."""
    # clock_timestamp(), not now(): the load runs in this same transaction, and now() is when it began.
    conn.execute(
        """UPDATE uploads SET status = %s, report = %s, error = %s, finished_at = clock_timestamp()
                    WHERE id = %s""",
        (status, Jsonb(report) if report else None, Jsonb(error) if error else None, upload_id),
    )
    conn.execute("DELETE FROM upload_files WHERE upload_id = %s", (upload_id,))
    # delivered at commit: a waiting `rlm load --queue --wait` wakes at once instead of at its next poll
    conn.execute("SELECT pg_notify(%s, %s)", (UPLOAD_ENDED_CHANNEL, upload_id))


def listen_upload_ended(conn: psycopg.Connection, *, listen: bool = True) -> None:
    """Start (or stop) hearing ``finish_upload``'s notifications on this connection; takes effect at commit."""
    conn.execute(f"{'LISTEN' if listen else 'UNLISTEN'} {UPLOAD_ENDED_CHANNEL}")


def note_error(conn: psycopg.Connection, *, upload_id: str, error: dict[str, Any]) -> None:
    """The last attempt's error, kept while the upload waits for another attempt."""
    conn.execute(
        "UPDATE uploads SET error = %s WHERE id = %s AND status IN ('queued', 'running')",
        (Jsonb(error), upload_id),
    )


def stale_uploads(conn: psycopg.Connection, *, idle_seconds: float, limit: int = 100) -> list[str]:
    """Open uploads whose task was sent ``idle_seconds`` ago or more: claimed for re-sending, atomically."""
    rows = conn.execute(
        """WITH stale AS (
               SELECT id FROM uploads WHERE status IN ('queued', 'running')
                 AND sent_at < now() - make_interval(secs => %s)
               ORDER BY sent_at LIMIT %s FOR UPDATE SKIP LOCKED)
           UPDATE uploads u SET sent_at = now() FROM stale WHERE u.id = stale.id RETURNING u.id""",
        (idle_seconds, limit),
    ).fetchall()
    return [r[0] for r in rows]


def orphaned_uploads(conn: psycopg.Connection, *, grace_seconds: float, limit: int = 100) -> list[str]:
    """Running uploads, each loaded whole, whose loader's lock is gone (its worker died mid-load) and that nobody
    started or re-sent for ``grace_seconds``: claimed for re-sending, atomically."""
    held = held_session_locks(conn, _LOCK_SPACE)
    rows = conn.execute(
        """SELECT id FROM uploads WHERE status = 'running' AND groups IS NULL
             AND sent_at < now() - make_interval(secs => %s) ORDER BY sent_at LIMIT %s""",
        (grace_seconds, limit),
    ).fetchall()
    lost = [r[0] for r in rows if session_lock_key(_LOCK_SPACE, r[0]) not in held]
    if not lost:
        return []
    # the same conditions again: a delivery that started it since the locks were read bumped sent_at
    return [
        r[0]
        for r in conn.execute(
            """UPDATE uploads SET sent_at = now() WHERE id = ANY(%s) AND status = 'running' AND groups IS NULL
                 AND sent_at < now() - make_interval(secs => %s) RETURNING id""",
            (lost, grace_seconds),
        ).fetchall()
    ]


# ------------------------------------------------------------------ file groups (docs/contract.md#ingest-groups)

_GROUP_COLS = "upload_id, group_no, paths, bytes, status, attempts, report, error"


@dataclass(frozen=True)
class GroupRow:
    upload_id: str
    group_no: int
    paths: list[str]
    bytes: int
    #: queued | running | done | failed
    status: str
    attempts: int
    report: dict[str, Any] | None
    error: dict[str, Any] | None


def staged_sizes(conn: psycopg.Connection, *, upload_id: str) -> list[tuple[str, int]]:
    """(path, bytes) of the upload's files in path order, without reading them."""
    rows = conn.execute(
        "SELECT path, octet_length(data) FROM upload_files WHERE upload_id = %s ORDER BY path", (upload_id,)
    ).fetchall()
    return [(r[0], int(r[1])) for r in rows]


def staged_files_in(conn: psycopg.Connection, *, upload_id: str, paths: Sequence[str]) -> list[tuple[str, bytes]]:
    rows = conn.execute(
        "SELECT path, data FROM upload_files WHERE upload_id = %s AND path = ANY(%s) ORDER BY path",
        (upload_id, list(paths)),
    ).fetchall()
    return [(path, bytes(data)) for path, data in rows]


def ensure_staged_vectors(conn: psycopg.Connection) -> None:
    """The table staged window vectors wait in; made on first use because ``halfvec`` needs pgvector, which a
    migration cannot assume (the server may gain it after the schema is made)."""
    if one(conn.execute("SELECT to_regclass('ingest_staged_vectors')"))[0] is not None:
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_SPACE << 32,))  # two first uses at once
        conn.execute(
            """CREATE TABLE IF NOT EXISTS ingest_staged_vectors (
                   upload_id text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE,
                   group_no  integer NOT NULL,
                   chunk_id  bigint NOT NULL,
                   win       smallint NOT NULL,
                   embedding halfvec NOT NULL,
                   span_start integer,
                   span_end   integer
               )"""
        )
        conn.execute(
            "CREATE INDEX IF NOT EXISTS ingest_staged_vectors_group ON ingest_staged_vectors (upload_id, group_no)"
        )


def plan_groups(
    conn: psycopg.Connection, *, upload_id: str, groups: Sequence[tuple[list[str], int]], base_version: int
) -> None:
    """Record the upload's file groups (paths, bytes) in the caller's transaction."""
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO ingest_groups (upload_id, group_no, paths, bytes) VALUES (%s, %s, %s, %s)",
            [(upload_id, n, paths, size) for n, (paths, size) in enumerate(groups)],
        )
    conn.execute(
        "UPDATE uploads SET groups = %s, groups_done = 0, base_version = %s WHERE id = %s",
        (len(groups), base_version, upload_id),
    )


def list_groups(conn: psycopg.Connection, *, upload_id: str) -> list[GroupRow]:
    rows = conn.execute(
        f"SELECT {_GROUP_COLS} FROM ingest_groups WHERE upload_id = %s ORDER BY group_no", (upload_id,)
    ).fetchall()
    return [GroupRow(*r) for r in rows]


def try_lock_group(conn: psycopg.Connection, *, upload_id: str, group_no: int) -> bool:
    return try_session_lock(conn, session_lock_key(_LOCK_SPACE, f"{upload_id}/{group_no}"))


def start_group(conn: psycopg.Connection, *, upload_id: str, group_no: int) -> GroupRow | None:
    """Mark an open group of a running upload running (one more attempt); None when it or its upload ended."""
    row = conn.execute(
        f"""UPDATE ingest_groups g SET status = 'running', attempts = g.attempts + 1, sent_at = now()
            FROM uploads u
            WHERE g.upload_id = %s AND g.group_no = %s AND g.status IN ('queued', 'running')
              AND u.id = g.upload_id AND u.status = 'running'
            RETURNING {", ".join("g." + c.strip() for c in _GROUP_COLS.split(","))}""",
        (upload_id, group_no),
    ).fetchone()
    return GroupRow(*row) if row else None


def note_group_error(conn: psycopg.Connection, *, upload_id: str, group_no: int, error: dict[str, Any]) -> None:
    conn.execute(
        """UPDATE ingest_groups SET error = %s
           WHERE upload_id = %s AND group_no = %s AND status IN ('queued', 'running')""",
        (Jsonb(error), upload_id, group_no),
    )


def clear_staged(conn: psycopg.Connection, *, upload_id: str, group_no: int | None = None) -> None:
    """Staged rows of one group (a re-run starts clean, so a redelivery never duplicates) or of the whole upload."""
    tables = ["ingest_staged_files", "ingest_staged_chunks"]
    if one(conn.execute("SELECT to_regclass('ingest_staged_vectors')"))[0] is not None:
        tables.append("ingest_staged_vectors")
    for table in tables:
        conn.execute(
            f"DELETE FROM {table} WHERE upload_id = %s AND (%s::int IS NULL OR group_no = %s)",
            (upload_id, group_no, group_no),
        )


def stage_file(
    conn: psycopg.Connection,
    *,
    upload_id: str,
    group_no: int,
    path: str,
    file_id: int | None,
    content_hash: str,
    size_bytes: int,
    chunk_count: int,
    doc_format: str = "text",
    outline: list[dict[str, Any]] | None = None,
) -> None:
    conn.execute(
        """INSERT INTO ingest_staged_files
               (upload_id, group_no, path, file_id, content_hash, size_bytes, chunk_count, format, outline)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)""",
        (
            upload_id,
            group_no,
            path,
            file_id,
            content_hash,
            size_bytes,
            chunk_count,
            doc_format,
            None if outline is None else Jsonb(outline),
        ),
    )


#: a staged chunk has the columns of ``chunks`` (``buffers.CHUNK_COPY_COLS``) but the buffer's and the ordinal,
#: given at the commit: (id, file_id, seq, path, start_line, end_line, start_byte, end_byte, text, token_count,
#: content_hash, terms, page_start, page_end, heading_path)
_GIVEN_AT_COMMIT = ("buffer_id", "ordinal")
STAGED_CHUNK_COLS = tuple(c for c in CHUNK_COPY_COLS if c not in _GIVEN_AT_COMMIT)
#: upload id and group number first, then the chunk's own columns as ``chunks`` types them
_STAGED_CHUNK_TYPES = ["text", "int4"] + [
    t for c, t in zip(CHUNK_COPY_COLS, CHUNK_COPY_TYPES, strict=True) if c not in _GIVEN_AT_COMMIT
]


def copy_staged_chunks(
    conn: psycopg.Connection, *, upload_id: str, group_no: int, rows: Sequence[tuple[Any, ...]]
) -> None:
    cols = ", ".join(("upload_id", "group_no", *STAGED_CHUNK_COLS))
    with conn.cursor() as cur, cur.copy(f"COPY ingest_staged_chunks ({cols}) FROM STDIN WITH (FORMAT BINARY)") as cp:
        cp.set_types(_STAGED_CHUNK_TYPES)
        for row in rows:
            cp.write_row((upload_id, group_no, *row))


def copy_staged_vectors(conn: psycopg.Connection, *, upload_id: str, group_no: int, rows: Sequence[WindowRow]) -> None:
    """rows as ``vectors.copy`` takes them, stored as halfvec like the buffer's own table."""
    with (
        conn.cursor() as cur,
        cur.copy(
            "COPY ingest_staged_vectors (upload_id, group_no, chunk_id, win, embedding, span_start, span_end)"
            " FROM STDIN WITH (FORMAT BINARY)"
        ) as cp,
    ):
        cp.set_types(["text", "int4", "int8", "int2", "halfvec", "int4", "int4"])
        for cid, win, vec, start, end in rows:
            cp.write_row((upload_id, group_no, cid, win, HalfVector(vec), start, end))


def finish_group(
    conn: psycopg.Connection, *, upload_id: str, group_no: int, report: dict[str, Any]
) -> tuple[int, int] | None:
    """In the group's transaction: the group done and counted; (groups done, groups), or None when the upload
    is no longer running (failed meanwhile: the caller rolls its rows back).  The upload's row lock orders
    the groups' counts, so exactly one group sees the last one."""
    # NO KEY UPDATE, not UPDATE: the group's staged rows hold KEY SHARE on this row (their foreign key), and
    # two groups each holding it while asking for UPDATE would deadlock.
    up = conn.execute("SELECT status FROM uploads WHERE id = %s FOR NO KEY UPDATE", (upload_id,)).fetchone()
    if up is None or up[0] != "running":
        return None
    hit = conn.execute(
        """UPDATE ingest_groups SET status = 'done', report = %s, error = NULL, finished_at = clock_timestamp()
           WHERE upload_id = %s AND group_no = %s AND status <> 'done'""",
        (Jsonb(report), upload_id, group_no),
    ).rowcount
    row = one(
        conn.execute(
            "UPDATE uploads SET groups_done = groups_done + %s WHERE id = %s RETURNING groups_done, groups",
            (hit, upload_id),
        )
    )
    return int(row[0]), int(row[1])


def lock_running_upload(conn: psycopg.Connection, *, upload_id: str) -> UploadRow | None:
    """Inside a transaction: the upload, locked against the groups' counts (not against their staged rows'
    foreign keys: a running group's transaction must not hold the commit or a failure up), if still running."""
    row = conn.execute(
        f"SELECT {_COLS} FROM uploads WHERE id = %s AND status = 'running' FOR NO KEY UPDATE", (upload_id,)
    ).fetchone()
    return UploadRow(*row) if row else None


def staged_file_list(conn: psycopg.Connection, *, upload_id: str) -> list[tuple[str, int | None]]:
    """(path, staged file id or None when unchanged) of every file the groups saw, in path order."""
    rows = conn.execute(
        "SELECT path, file_id FROM ingest_staged_files WHERE upload_id = %s ORDER BY path", (upload_id,)
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def move_staged(conn: psycopg.Connection, *, upload_id: str, buffer_id: int) -> int:
    """The groups' files, chunks and vectors into the buffer (the caller deleted the files they replace);
    returns the chunks moved.  In the commit's transaction: readers see all of it or none."""
    conn.execute(
        """INSERT INTO files (id, buffer_id, path, content_hash, size_bytes, chunk_count, format, outline)
           SELECT file_id, %s, path, content_hash, size_bytes, chunk_count, format, outline FROM ingest_staged_files
           WHERE upload_id = %s AND file_id IS NOT NULL ORDER BY path""",
        (buffer_id, upload_id),
    )
    cols = ", ".join(STAGED_CHUNK_COLS)
    moved = conn.execute(
        f"""INSERT INTO chunks (buffer_id, ordinal, {cols})
            SELECT %s, 0, {cols} FROM ingest_staged_chunks WHERE upload_id = %s ORDER BY path, seq""",
        (buffer_id, upload_id),
    ).rowcount
    conn.execute(
        f"""INSERT INTO {vector_table(buffer_id)} (chunk_id, win, embedding, span_start, span_end)
            SELECT chunk_id, win, embedding, span_start, span_end FROM ingest_staged_vectors WHERE upload_id = %s""",
        (upload_id,),
    )
    return moved


def group_reports(conn: psycopg.Connection, *, upload_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT report FROM ingest_groups WHERE upload_id = %s ORDER BY group_no", (upload_id,)
    ).fetchall()
    return [r[0] or {} for r in rows]


def fail_group(conn: psycopg.Connection, *, upload_id: str, group_no: int, error: dict[str, Any]) -> None:
    """The failing group marked failed with its error (the others stay as they are, for the record)."""
    conn.execute(
        """UPDATE ingest_groups SET status = 'failed', error = %s, finished_at = clock_timestamp()
           WHERE upload_id = %s AND group_no = %s""",
        (Jsonb(error), upload_id, group_no),
    )


def stale_groups(conn: psycopg.Connection, *, idle_seconds: float, limit: int = 100) -> list[tuple[str, int]]:
    """Open groups of running uploads whose task was sent ``idle_seconds`` ago or more: claimed for re-sending."""
    rows = conn.execute(
        """WITH stale AS (
               SELECT g.upload_id, g.group_no FROM ingest_groups g JOIN uploads u ON u.id = g.upload_id
               WHERE g.status IN ('queued', 'running') AND u.status = 'running'
                 AND g.sent_at < now() - make_interval(secs => %s)
               ORDER BY g.sent_at LIMIT %s FOR UPDATE OF g SKIP LOCKED)
           UPDATE ingest_groups g SET sent_at = now() FROM stale
           WHERE g.upload_id = stale.upload_id AND g.group_no = stale.group_no
           RETURNING g.upload_id, g.group_no""",
        (idle_seconds, limit),
    ).fetchall()
    return [(r[0], int(r[1])) for r in rows]


def orphaned_groups(conn: psycopg.Connection, *, grace_seconds: float, limit: int = 100) -> list[tuple[str, int]]:
    """Running groups whose worker's lock is gone (it died mid-group) and that nobody started or re-sent for
    ``grace_seconds``: claimed for re-sending, atomically."""
    held = held_session_locks(conn, _LOCK_SPACE)
    rows = conn.execute(
        """SELECT g.upload_id, g.group_no FROM ingest_groups g JOIN uploads u ON u.id = g.upload_id
           WHERE g.status = 'running' AND u.status = 'running' AND g.sent_at < now() - make_interval(secs => %s)
           ORDER BY g.sent_at LIMIT %s""",
        (grace_seconds, limit),
    ).fetchall()
    lost = [(r[0], int(r[1])) for r in rows if session_lock_key(_LOCK_SPACE, f"{r[0]}/{r[1]}") not in held]
    claimed = []
    for upload_id, group_no in lost:
        row = conn.execute(
            """UPDATE ingest_groups SET sent_at = now() WHERE upload_id = %s AND group_no = %s AND status = 'running'
                 AND sent_at < now() - make_interval(secs => %s) RETURNING group_no""",
            (upload_id, group_no, grace_seconds),
        ).fetchone()
        if row is not None:
            claimed.append((upload_id, group_no))
    return claimed
