"""What every stage task shares: the pool, the provider, logging LLM calls, ending jobs."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from ..config import Settings, get_settings
from ..errors import LLMError, RLMError
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


def call_llm(conn, *, job_id: str, stage: str, request: CompletionRequest, batch: int | None = None) -> Completion:  # noqa: ANN001
    """One logical call; every HTTP attempt (retries included) is logged on the job."""
    p = provider()
    t0 = time.perf_counter()
    try:
        completion = p.complete(request)
    except LLMError as exc:
        attempts = getattr(exc, "attempts", None) or [{}]
        for a in attempts:
            job_store.record_llm_call(conn, job_id=job_id, call=LLMCall(
                stage=stage, batch=batch, provider=p.name, model=request.model, status="error",
                tokens_in=a.get("tokens_in", 0), tokens_out=a.get("tokens_out", 0),
                latency_ms=a.get("latency_ms", int((time.perf_counter() - t0) * 1000)),
                error=a.get("error") or exc.message))
        raise
    for a in completion.failed_attempts:
        job_store.record_llm_call(conn, job_id=job_id, call=LLMCall(
            stage=stage, batch=batch, provider=p.name, model=request.model, status="retried",
            tokens_in=a.get("tokens_in", 0), tokens_out=a.get("tokens_out", 0),
            latency_ms=a.get("latency_ms", 0), error=a.get("error")))
    job_store.record_llm_call(conn, job_id=job_id, call=LLMCall(
        stage=stage, batch=batch, provider=p.name, model=completion.model or request.model, status="ok",
        tokens_in=completion.tokens_in, tokens_out=completion.tokens_out, latency_ms=completion.latency_ms))
    log.info("llm %s job=%s batch=%s model=%s in=%d out=%d %dms", stage, job_id, batch, request.model,
             completion.tokens_in, completion.tokens_out, completion.latency_ms)
    return completion


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
