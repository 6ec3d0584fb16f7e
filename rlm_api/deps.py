"""FastAPI dependencies: a pooled connection and the caller's tenant (from the Bearer key)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any, TypeVar

import psycopg
from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from starlette.concurrency import run_in_threadpool

from rlm_workers.engine import connection

from .auth import tenant_for_key


def get_conn() -> Iterator[psycopg.Connection]:
    with connection() as conn:
        yield conn


ConnDep = Annotated[psycopg.Connection, Depends(get_conn)]


UNAUTHORIZED = "missing or invalid API key: send Authorization: Bearer <key>"


def tenant_from_header(authorization: str | None) -> str | None:
    """The tenant of ``Authorization: Bearer <key>``, or None (blocking: one pooled connection)."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    with connection() as conn:
        return tenant_for_key(conn, key.strip())


#: declares the scheme in the OpenAPI spec (Swagger UI's "Authorize"); the key itself is checked below
_bearer = HTTPBearer(auto_error=False, description="An API key from `rlm keys create --tenant NAME`.")


def get_tenant(request: Request, _scheme: Annotated[object, Depends(_bearer)] = None) -> str:
    # Checked by the KeyFirst middleware before the body was read; looked up here only without it.
    tenant = getattr(request.state, "tenant", None) or tenant_from_header(request.headers.get("authorization"))
    if tenant is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
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


#: JSON bodies over this many bytes are parsed in the thread pool (see ParseOffLoop)
OFF_LOOP_JSON_BYTES = 64 * 1024


class UnparsableBody(Exception):
    """A JSON body that is not UTF-8 or is nested too deep (the message says which)."""


def loads_json(body: bytes) -> Any:
    """``json.loads(body)``, with the two failures FastAPI and the MCP SDK do not catch as ``UnparsableBody``.

    Both catch only ``JSONDecodeError``: bytes that are not UTF-8 raise ``UnicodeDecodeError`` (FastAPI's 400
    "There was an error parsing the body", the SDK's 500) and arrays or objects nested a thousand deep raise
    ``RecursionError`` (a 500 for both).  A plain syntax error is still ``JSONDecodeError``.
    """
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise UnparsableBody(f"not UTF-8 text (byte 0x{body[exc.start]:02x} at offset {exc.start})") from None
    except RecursionError:
        raise UnparsableBody("arrays or objects nested too deep") from None


class ParseOffLoop(APIRoute):
    """A route whose JSON body is parsed here: in the thread pool when large, and a body that is not UTF-8
    or nested too deep is a 422 ``invalid_input`` like any other broken JSON.

    FastAPI parses a body parameter with ``await request.json()`` on the loop: seconds for tens of
    megabytes, during which no other request (``/healthz`` included) is served.  Starlette's ``Request.json``
    keeps what it parsed in ``_json``; filling it first leaves FastAPI nothing to parse.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_first(request: Request) -> Response:
            body = await request.body()
            if body and "json" in request.headers.get("content-type", ""):
                try:
                    if len(body) > OFF_LOOP_JSON_BYTES:
                        request._json = await run_in_threadpool(loads_json, body)
                    else:
                        request._json = loads_json(body)
                except UnparsableBody as exc:
                    error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {}}
                    raise RequestValidationError([{**error, "ctx": {"error": str(exc)}}]) from None
                except ValueError:  # FastAPI parses it again and says where it is broken
                    pass
            return await handler(request)

        return parse_first
