"""FastAPI dependencies: a pooled connection and the caller's tenant (from the Bearer key)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, TypeVar

from fastapi import Depends, Header, HTTPException, status


def get_conn() -> Iterator:
    from rlm_workers.store.db import connection

    with connection() as conn:
        yield conn


ConnDep = Annotated[object, Depends(get_conn)]


def get_tenant(conn: ConnDep, authorization: Annotated[str | None, Header()] = None) -> str:
    from .auth import tenant_for_key

    scheme, _, key = (authorization or "").partition(" ")
    tenant = tenant_for_key(conn, key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid API key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]


T = TypeVar("T")


def found_or_404(fetch: Callable[[str], T | None], some_id: str, what: str) -> T:
    """``fetch(some_id)``, or 404 when it finds nothing (another tenant's id included).

    Ids that cannot exist (over 64 characters, or a NUL, which PostgreSQL text refuses) are not looked up.
    """
    row = fetch(some_id) if len(some_id) <= 64 and "\x00" not in some_id else None
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no {what} {some_id[:64]!r}")
    return row
