"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

if TYPE_CHECKING:
    import psycopg

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (no I/O: a slow database must not get the API restarted)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "database or broker unreachable"}})
def readyz() -> JSONResponse:
    """Database and broker both answer within a few seconds."""
    import psycopg
    import redis

    from rlm_workers.config import get_settings
    from rlm_workers.local_servers import broker_url, database_url
    from rlm_workers.store.metrics import ping

    s = get_settings()
    checks: dict[str, str] = {}
    try:
        with psycopg.connect(database_url(s), connect_timeout=3) as c:
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
    from rlm_workers.store.db import connection

    with connection() as conn:
        if not _loopback(request):
            from ..auth import tenant_for_key

            scheme, _, key = (authorization or "").partition(" ")
            if scheme.lower() != "bearer" or tenant_for_key(conn, key.strip()) is None:
                raise HTTPException(401, "metrics off loopback need an API key", headers={"WWW-Authenticate": "Bearer"})
        return PlainTextResponse(render_metrics(conn), media_type="text/plain; version=0.0.4")


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _queue_depths(queues: Sequence[str]) -> list[tuple[dict[str, object], float]]:
    """LLEN of each queue's Redis lists: kombu keeps one list per priority step (``name\\x06\\x16<p>``)
    and batch work is sent at a lower priority, so the plain list alone would miss it."""
    try:
        import redis
        from kombu.transport.redis import PRIORITY_STEPS, Channel

        from rlm_workers.config import get_settings
        from rlm_workers.local_servers import broker_url

        client = redis.Redis.from_url(broker_url(get_settings()), socket_connect_timeout=2, socket_timeout=2)
        pipe = client.pipeline(transaction=False)
        for q in queues:
            for step in PRIORITY_STEPS:
                pipe.llen(f"{q}{Channel.sep}{step}" if step else q)
        counts = pipe.execute()
    except Exception:  # the other metrics still render without the broker
        return []
    n = len(PRIORITY_STEPS)
    return [({"queue": q}, sum(counts[i * n : (i + 1) * n])) for i, q in enumerate(queues)]


def render_metrics(conn: psycopg.Connection) -> str:
    from rlm_workers.constants import ALL_QUEUES
    from rlm_workers.store import metrics

    lines: list[str] = []

    def family(
        name: str,
        kind: str,
        help_: str,
        rows: list[tuple[dict[str, object], float]],
        samples: list[tuple[str, dict[str, object], float]] = (),
    ) -> None:
        """One metric family; ``samples`` are (suffix, labels, value) for summaries' _sum/_count lines."""
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in [("", lab, v) for lab, v in rows] + list(samples):
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            lines.append(f"{name}{suffix}{{{lab}}} {value}" if lab else f"{name}{suffix} {value}")

    jobs = metrics.jobs_by_status(conn)
    family("rlm_jobs", "gauge", "Jobs by status.", [({"status": s}, n) for s, n in jobs])
    stages = metrics.stage_totals(conn)
    # A summary without quantiles: rate(_sum)/rate(_count) is the mean stage time over any window.
    family(
        "rlm_stage_seconds",
        "summary",
        "Wall time per pipeline stage, from jobs.timings.",
        [],
        [("_sum", {"stage": k}, round(v, 4)) for k, v, _ in stages]
        + [("_count", {"stage": k}, n) for k, _, n in stages],
    )
    calls = metrics.call_totals(conn)
    family(
        "rlm_llm_calls_total",
        "counter",
        "LLM calls by model and status (ok, retried, error).",
        [({"model": m, "status": st}, n) for m, st, n, _, _ in calls],
    )
    # One series per label set: a model seen with several statuses is summed, never listed twice.
    tokens: dict[tuple[str, str], int] = {}
    errors: dict[str, int] = {}
    for model, st, n, t_in, t_out in calls:
        tokens[(model, "in")] = tokens.get((model, "in"), 0) + t_in
        tokens[(model, "out")] = tokens.get((model, "out"), 0) + t_out
        if st != "ok":
            errors[model] = errors.get(model, 0) + n
    family(
        "rlm_llm_tokens_total",
        "counter",
        "LLM tokens (as reported by the provider) by model and direction.",
        [({"model": m, "direction": d}, n) for (m, d), n in sorted(tokens.items())],
    )
    family(
        "rlm_llm_errors_total",
        "counter",
        "Failed LLM calls (retried or final) by model.",
        [({"model": m}, n) for m, n in sorted(errors.items())],
    )
    family(
        "rlm_queue_depth",
        "gauge",
        "Messages waiting per Celery queue (all priority levels).",
        _queue_depths(ALL_QUEUES),
    )
    return "\n".join(lines) + "\n"
