"""SQL for replays of a batch's Idempotency-Key: a lock per (tenant, key) and the fingerprint of the first
request (``batches.request_fingerprint``).  Query jobs compare their stored query, buffers and options instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg


@contextlib.contextmanager
def key_lock(conn: psycopg.Connection, *, tenant: str, key: str) -> Iterator[None]:
    """Hold (tenant, key) across a submission that commits on its own: a concurrent twin waits, then sees it."""
    args = (f"{tenant}\x1f{key}",)
    conn.execute("SELECT pg_advisory_lock(hashtext('rlm.idempotency'), hashtext(%s))", args)
    try:
        yield
    finally:
        from psycopg import pq

        if conn.info.transaction_status == pq.TransactionStatus.INERROR:  # else the unlock would fail too
            conn.rollback()
        conn.execute("SELECT pg_advisory_unlock(hashtext('rlm.idempotency'), hashtext(%s))", args)


def batch_fingerprint(conn: psycopg.Connection, *, tenant: str, key: str) -> tuple[str, str | None] | None:
    """(batch id, fingerprint of the request that made it) for a used key, or None."""
    row = conn.execute(
        "SELECT id, request_fingerprint FROM batches WHERE tenant = %s AND idempotency_key = %s", (tenant, key)
    ).fetchone()
    return (row[0], row[1]) if row else None


def set_batch_fingerprint(conn: psycopg.Connection, *, batch_id: str, fingerprint: str) -> None:
    conn.execute("UPDATE batches SET request_fingerprint = %s WHERE id = %s", (fingerprint, batch_id))
