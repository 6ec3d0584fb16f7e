"""SQL for replays of a batch's Idempotency-Key: a lock per (tenant, key) and the fingerprint of the first
request (``batches.request_fingerprint``).  Query jobs compare their stored query, buffers and options instead."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .db import session_lock, session_lock_key

if TYPE_CHECKING:
    import psycopg


_KEY_SPACE = 0x524C4D4B  # "RLMK": a (tenant, Idempotency-Key), apart from the other advisory locks


def key_lock(conn: psycopg.Connection, *, tenant: str, key: str) -> contextlib.AbstractContextManager[None]:
    """Hold (tenant, key) across a submission that commits on its own: a concurrent twin waits, then sees it."""
    return session_lock(conn, session_lock_key(_KEY_SPACE, f"{tenant}\x1f{key}"))


def batch_fingerprint(conn: psycopg.Connection, *, tenant: str, key: str) -> tuple[str, str | None] | None:
    """(batch id, fingerprint of the request that made it) for a used key, or None."""
    row = conn.execute(
        "SELECT id, request_fingerprint FROM batches WHERE tenant = %s AND idempotency_key = %s", (tenant, key)
    ).fetchone()
    return (row[0], row[1]) if row else None


def set_batch_fingerprint(conn: psycopg.Connection, *, batch_id: str, fingerprint: str) -> None:
    conn.execute("UPDATE batches SET request_fingerprint = %s WHERE id = %s", (fingerprint, batch_id))
