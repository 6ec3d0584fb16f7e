"""API keys: created once and printed once, stored only as a sha256, each bound to one tenant."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from rlm_workers.errors import InvalidInput

KEY_PREFIX = "rlm_"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    # Keys are 256-bit random tokens, so a plain (unsalted) hash is enough and allows an indexed lookup.
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def validate_tenant(tenant: str) -> str:
    if not _TENANT.match(tenant or ""):
        raise InvalidInput(f"invalid tenant name {tenant!r}: use letters, digits, '_', '.', '-' (max 64)")
    return tenant


@dataclass(frozen=True)
class KeyInfo:
    id: int
    tenant: str
    prefix: str
    name: str
    created_at: str
    revoked: bool


def create_key(conn, *, tenant: str, name: str = "") -> tuple[str, KeyInfo]:  # noqa: ANN001
    """A new key for ``tenant``: returns (the key, shown once; its record)."""
    validate_tenant(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = conn.execute(
        "INSERT INTO api_keys (tenant, key_hash, prefix, name) VALUES (%s, %s, %s, %s) RETURNING id, created_at",
        (tenant, hash_key(key), key[:10], name[:200]),
    ).fetchone()
    return key, KeyInfo(id=row[0], tenant=tenant, prefix=key[:10], name=name, created_at=row[1].isoformat(),
                        revoked=False)


def revoke_key(conn, *, key_or_prefix: str) -> int:  # noqa: ANN001
    """Revoke by the whole key or by its printed prefix; returns how many keys were revoked."""
    if key_or_prefix.startswith(KEY_PREFIX) and len(key_or_prefix) > 20:
        cur = conn.execute("UPDATE api_keys SET revoked_at = now() WHERE key_hash = %s AND revoked_at IS NULL",
                           (hash_key(key_or_prefix),))
    else:
        cur = conn.execute("UPDATE api_keys SET revoked_at = now() WHERE prefix = %s AND revoked_at IS NULL",
                           (key_or_prefix,))
    return cur.rowcount


def list_keys(conn, *, tenant: str | None = None) -> list[KeyInfo]:  # noqa: ANN001
    rows = conn.execute(
        """SELECT id, tenant, prefix, name, created_at, revoked_at IS NOT NULL FROM api_keys
           WHERE %(t)s::text IS NULL OR tenant = %(t)s ORDER BY id""", {"t": tenant}).fetchall()
    return [KeyInfo(id=r[0], tenant=r[1], prefix=r[2], name=r[3], created_at=r[4].isoformat(), revoked=r[5])
            for r in rows]


def tenant_for_key(conn, key: str) -> str | None:  # noqa: ANN001
    if not key or not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    row = conn.execute("SELECT tenant FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL",
                       (hash_key(key),)).fetchone()
    return row[0] if row else None
