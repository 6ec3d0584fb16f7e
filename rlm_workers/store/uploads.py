"""Uploads queued for the ingest workers (``POST /v1/buffers?wait=false``).

The files wait in ``upload_files`` until a worker loads them; the load and the
upload's ``done`` commit in one transaction, and the staged bytes go with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from .db import session_lock_key, try_session_lock

if TYPE_CHECKING:
    import psycopg

_COLS = (
    "id, tenant, buffer, options, status, report, error, files, bytes, attempts, created_at, started_at, finished_at"
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
