"""SQL for API keys (table ``api_keys``): only a key's sha256 and its printed prefix are stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .rows import one

if TYPE_CHECKING:
    import psycopg


@dataclass(frozen=True)
class KeyInfo:
    id: int
    tenant: str
    prefix: str
    name: str
    created_at: str
    revoked: bool


def insert_key(conn: psycopg.Connection, *, tenant: str, key_hash: str, prefix: str, name: str) -> KeyInfo:
    row = one(
        conn.execute(
            "INSERT INTO api_keys (tenant, key_hash, prefix, name) VALUES (%s, %s, %s, %s) RETURNING id, created_at",
            (tenant, key_hash, prefix, name),
        )
    )
    return KeyInfo(id=row[0], tenant=tenant, prefix=prefix, name=name, created_at=row[1].isoformat(), revoked=False)


def revoke_by_hash(conn: psycopg.Connection, *, key_hash: str) -> int:
    return conn.execute(
        "UPDATE api_keys SET revoked_at = now() WHERE key_hash = %s AND revoked_at IS NULL", (key_hash,)
    ).rowcount


def revoke_by_prefix(conn: psycopg.Connection, *, prefix: str) -> int:
    return conn.execute(
        "UPDATE api_keys SET revoked_at = now() WHERE prefix = %s AND revoked_at IS NULL", (prefix,)
    ).rowcount


def list_keys(conn: psycopg.Connection, *, tenant: str | None = None) -> list[KeyInfo]:
    rows = conn.execute(
        """SELECT id, tenant, prefix, name, created_at, revoked_at IS NOT NULL FROM api_keys
           WHERE %(t)s::text IS NULL OR tenant = %(t)s ORDER BY id""",
        {"t": tenant},
    ).fetchall()
    return [
        KeyInfo(id=r[0], tenant=r[1], prefix=r[2], name=r[3], created_at=r[4].isoformat(), revoked=r[5]) for r in rows
    ]


def tenant_of(conn: psycopg.Connection, *, key_hash: str) -> str | None:
    """The tenant of an unrevoked key, or None."""
    row = conn.execute("SELECT tenant FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL", (key_hash,)).fetchone()
    return row[0] if row else None
