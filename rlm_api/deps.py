"""FastAPI dependencies: a pooled connection and the caller's tenant (from the Bearer key)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

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
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="missing or invalid API key",
                            headers={"WWW-Authenticate": "Bearer"})
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]
