"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import ipaddress

import psycopg
import redis
from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from rlm_workers.config import get_settings
from rlm_workers.engine import broker_url, connection, metrics_text, ping

from ..auth import tenant_for_key

router = APIRouter(tags=["health"])

#: how long /readyz waits for a working pooled connection before it says the database is unreachable
READY_CHECKOUT_SECONDS = 3.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up (no I/O: a slow database must not get the API restarted).

    Async, so it is answered on the event loop: a sync route waits for a worker thread, and under a flood
    every thread may be busy with database work.
    """
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "database or broker unreachable"}})
def readyz() -> JSONResponse:
    """Database and broker both answer within a few seconds."""
    s = get_settings()
    checks: dict[str, str] = {}
    try:
        # Through the pool the routes use, not a connection of its own: ready means a request would get a working
        # connection now (a checkout also replaces the pool's dead ones after a restart).
        with connection(timeout=READY_CHECKOUT_SECONDS) as c:
            ping(c)
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready
        checks["database"] = f"unreachable: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
    try:
        redis.Redis.from_url(broker_url(s), socket_connect_timeout=2, socket_timeout=2).ping()
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"unreachable: {exc}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", **checks}, status_code=200 if ready else 503)


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in ("localhost", "testclient")


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, authorization: str | None = Header(None)) -> PlainTextResponse:
    """Prometheus text format.  Open on loopback; from anywhere else it needs an API key.

    The API binds to 127.0.0.1 unless the operator sets RLM_API_HOST, so by default only local scrapers
    reach it.  uvicorn runs without proxy headers: behind a reverse proxy on the same host every caller
    looks local, so block or authenticate /metrics at the proxy.
    """
    with connection() as conn:
        if not _loopback(request):
            scheme, _, key = (authorization or "").partition(" ")
            if scheme.lower() != "bearer" or tenant_for_key(conn, key.strip()) is None:
                raise HTTPException(401, "metrics off loopback need an API key", headers={"WWW-Authenticate": "Bearer"})
        # the classic text format every Prometheus reads (all our names are legacy-valid)
        return PlainTextResponse(render_metrics(conn), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def render_metrics(conn: psycopg.Connection) -> bytes:
    """O(number of series): in-flight jobs from the partial index, everything else from the Redis counters
    the workers keep (docs/contract.md#metrics)."""
    return metrics_text(conn)
