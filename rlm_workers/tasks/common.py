"""What every stage task shares: the pool, the provider, logging LLM calls, ending jobs."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..config import Settings, get_settings
from ..errors import LLMError, RLMError, ServiceUnavailable
from ..llm.protocol import Completion, CompletionRequest, LLMProvider
from ..models import JobStatus, LLMCall
from ..store import jobs as job_store
from ..store.db import connection

log = logging.getLogger("rlm.tasks")

db = connection


@functools.cache
def redis_client():  # noqa: ANN201
    import redis

    from ..services import broker_url

    return redis.Redis.from_url(broker_url(get_settings()), socket_timeout=10, health_check_interval=30)


@functools.cache
def provider() -> LLMProvider:
    """One provider per process: extractive with no API key, else the OpenAI-compatible client."""
    settings = get_settings()
    if settings.offline:
        from ..llm.extractive import ExtractiveProvider

        return ExtractiveProvider()
    from ..llm.limiter import Limits
    from ..llm.openai_provider import OpenAIProvider

    return OpenAIProvider(settings, limiter=Limits.from_settings(settings, redis_client()))


def provider_name(settings: Settings | None = None) -> str:
    return "extractive" if (settings or get_settings()).offline else "openai"


#: PostgreSQL gone (restart, failover, network): wait and try the stage again rather than fail the job
DB_OUTAGE = (psycopg.OperationalError, psycopg.InterfaceError, ServiceUnavailable)
OUTAGE_MAX_RETRIES = 30


def call_llm(conn, *, job_id: str, stage: str, request: CompletionRequest, batch: int | None = None) -> Completion:  # noqa: ANN001
    """One logical call; every HTTP attempt (retries included) is logged on the job (through ``conn``,
    or a connection checked out for the write when it is None).

    The log is written after the call with ``durable_write``: tokens already bought are recorded
    even if PostgreSQL blinks meanwhile, and the call is never repeated just to log it.
    """
    p = provider()
    t0 = time.perf_counter()
    try:
        completion = p.complete(request)
    except LLMError as exc:
        attempts = getattr(exc, "attempts", None) or [{}]
        calls = [LLMCall(stage=stage, batch=batch, provider=p.name, model=request.model, status="error",
                         tokens_in=a.get("tokens_in", 0), tokens_out=a.get("tokens_out", 0),
                         latency_ms=a.get("latency_ms", int((time.perf_counter() - t0) * 1000)),
                         error=a.get("error") or exc.message) for a in attempts]
        durable_write(conn, lambda c: [job_store.record_llm_call(c, job_id=job_id, call=x) for x in calls],
                      what=f"llm call log of job {job_id}")
        raise
    calls = [LLMCall(stage=stage, batch=batch, provider=p.name, model=request.model, status="retried",
                     tokens_in=a.get("tokens_in", 0), tokens_out=a.get("tokens_out", 0),
                     latency_ms=a.get("latency_ms", 0), error=a.get("error")) for a in completion.failed_attempts]
    calls.append(LLMCall(stage=stage, batch=batch, provider=p.name, model=completion.model or request.model,
                         status="ok", tokens_in=completion.tokens_in, tokens_out=completion.tokens_out,
                         latency_ms=completion.latency_ms))
    durable_write(conn, lambda c: [job_store.record_llm_call(c, job_id=job_id, call=x) for x in calls],
                  what=f"llm call log of job {job_id}")
    log.info("llm %s job=%s batch=%s model=%s in=%d out=%d %dms", stage, job_id, batch, request.model,
             completion.tokens_in, completion.tokens_out, completion.latency_ms)
    return completion


#: how long a write of something already paid for (LLM output, its usage) waits for PostgreSQL
DURABLE_WRITE_SECONDS = 180.0
#: how long a durable write waits for a pooled connection before it counts as an outage (and says so)
CHECKOUT_SECONDS = 3.0


def durable_write(conn, fn: Callable[[Any], Any], *, what: str) -> Any:  # noqa: ANN001
    """Run ``fn(conn)`` (a pooled connection when ``conn`` is None); if the database is away, retry on
    fresh pooled connections until it is back.

    For writes whose inputs cost money (an LLM answer): retrying the whole task would buy it again.
    """
    # A short checkout wait: a pool quietly waiting out an outage would leave operators no trace of it
    # (its PoolTimeout is an OperationalError, so it counts as an outage below).
    try:
        if conn is not None:
            return fn(conn)
        with db(timeout=CHECKOUT_SECONDS) as fresh:
            return fn(fresh)
    except DB_OUTAGE as exc:
        first = exc
    deadline = time.monotonic() + DURABLE_WRITE_SECONDS
    delay = 0.5
    while True:
        log.warning("database unavailable while saving %s (%s); retrying in %.1fs", what, first, delay)
        time.sleep(delay)
        try:
            with db(timeout=CHECKOUT_SECONDS) as fresh:
                return fn(fresh)
        except DB_OUTAGE as exc:
            first = exc
            if time.monotonic() > deadline:
                raise
            delay = min(10.0, delay * 2)


def error_dict(exc: BaseException, prefix: str | None = None) -> dict[str, Any]:
    if isinstance(exc, RLMError):
        err = exc.to_dict()
    else:
        err = {"type": type(exc).__name__, "message": str(exc)[:2000] or type(exc).__name__}
    if prefix:
        err["message"] = f"{prefix}: {err['message']}"
    return err


def fail_job(conn, *, job_id: str, exc: BaseException, result: dict[str, Any] | None = None,  # noqa: ANN001
             prefix: str | None = None) -> None:
    log.warning("job %s failed: %s", job_id, exc)
    job_store.finish_job(conn, job_id=job_id, status=JobStatus.failed, error=error_dict(exc, prefix), result=result)


class StageTimer:
    """Adds the stage's wall time to the job's timings when the block ends."""

    def __init__(self, conn, job_id: str, stage: str) -> None:  # noqa: ANN001
        self.conn, self.job_id, self.stage = conn, job_id, stage

    def __enter__(self) -> StageTimer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            job_store.add_timing(self.conn, job_id=self.job_id, stage=self.stage, seconds=time.perf_counter() - self.t0)
        except Exception:  # noqa: BLE001 - timings never hide the stage's own outcome
            log.exception("could not record timing for job %s", self.job_id)




def outage_countdown(retries: int) -> float:
    return min(30.0, 1.0 * 2 ** retries)


def survives_outages(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Retry the (idempotent) stage task with backoff while the database is unreachable."""

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN001
        try:
            return fn(self, *args, **kwargs)
        except DB_OUTAGE as exc:
            log.warning("%s %s: database unavailable (%s); retrying", self.name, args, exc)
            raise self.retry(exc=exc, countdown=outage_countdown(self.request.retries),
                             max_retries=OUTAGE_MAX_RETRIES) from None

    return wrapper
