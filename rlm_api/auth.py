"""API keys: created once and printed once, stored only as a sha256, each bound to one tenant."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
from typing import TYPE_CHECKING

from rlm_workers.errors import InvalidInput
from rlm_workers.store import keys as store
from rlm_workers.store.keys import KeyInfo

if TYPE_CHECKING:
    import psycopg

KEY_PREFIX = "rlm_"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    # Keys are 256-bit random tokens, so a plain (unsalted) hash is enough and allows an indexed lookup.
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def validate_tenant(tenant: str) -> str:
    if not _TENANT.match(tenant or ""):
        raise InvalidInput(f"invalid tenant name {tenant!r}: use letters, digits, '_', '.', '-' (max 64)")
    return tenant


def create_key(conn: psycopg.Connection, *, tenant: str, name: str = "") -> tuple[str, KeyInfo]:
    """A new key for ``tenant``: returns (the key, shown once; its record)."""
    validate_tenant(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    info = store.insert_key(conn, tenant=tenant, key_hash=hash_key(key), prefix=key[:10], name=name[:200])
    return key, dataclasses.replace(info, name=name)


def revoke_key(conn: psycopg.Connection, *, key_or_prefix: str) -> int:
    """Revoke by the whole key or by its printed prefix; returns how many keys were revoked."""
    if key_or_prefix.startswith(KEY_PREFIX) and len(key_or_prefix) > 20:
        return store.revoke_by_hash(conn, key_hash=hash_key(key_or_prefix))
    return store.revoke_by_prefix(conn, prefix=key_or_prefix)


def list_keys(conn: psycopg.Connection, *, tenant: str | None = None) -> list[KeyInfo]:
    return store.list_keys(conn, tenant=tenant)


def tenant_for_key(conn: psycopg.Connection, key: str) -> str | None:
    if not key or not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    return store.tenant_of(conn, key_hash=hash_key(key))
