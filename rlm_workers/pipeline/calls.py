"""One logical LLM call of a stage, logged on its job (simonw/llm style): model, tokens, latency, outcome.

Every HTTP attempt behind the call (retries included) becomes one ``llm_calls`` row,
so a job's ``total_tokens`` is the exact sum of what was billed.  The log is written
after the call with ``durable_write``: tokens already bought are recorded even if
PostgreSQL blinks meanwhile, and the call is never repeated just to log it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import metrics
from ..errors import BudgetExhausted, LLMError, ParseError
from ..llm import fair
from ..llm.protocol import Completion, CompletionRequest
from ..logs import stage_context
from ..models import LLMCall
from ..resources import provider
from ..store import jobs as job_store
from ..store.db import durable_write

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.llm")


def call_llm(
    conn: psycopg.Connection | None,
    *,
    job_id: str,
    stage: str,
    request: CompletionRequest,
    batch: int | None = None,
    check_open: bool = True,
    parse: Callable[[str], Any] | None = None,
) -> Completion:
    """Call the provider; log every attempt on the job (through ``conn``, or a connection checked out for
    the write when it is None — analysts hold none while the model thinks).

    A job that has ended starts no call (``check_open``: a caller that has just claimed work of an open job
    may skip the round trip).  The tree's budget is checked before every HTTP attempt, retries included
    (``BudgetExhausted``: no call, or no further attempt, starts) and charged after, with the cost priced from
    RLM_PRICES (docs/contract.md#budgets).

    ``parse``: the stage's parser of the reply text.  It runs before the call is logged, so the row says whether
    the reply parsed (``parse_ok``, docs/contract.md#structured-outputs); the completion carries the value
    (``parsed``), or the ``ParseError`` (``parse_error``) for the stage to re-ask or fail as it does.  A parser
    returning None counts as a failure too."""
    from ..config import get_settings
    from ..llm.prices import cost_usd, prices
    from .budget import ledger_for_job

    p = provider()
    table = prices(get_settings())
    if check_open:
        _still_open(conn, job_id)
    if request.tenant is None and not p.local:
        # the slot is the tenant's share of the global limit (docs/contract.md#fair-share); read once per job
        request = replace(request, tenant=fair.tenant_of(job_id))
    ledger = ledger_for_job(job_id)
    if ledger is not None:
        ledger.reserve()
    #: HTTP attempts reserved on the ledger; the charge adds any the provider made without asking
    reserved = 1

    def reserve_retry() -> None:
        nonlocal reserved
        if ledger is not None:
            ledger.reserve()  # a retry is a call: past the limit it is not sent (docs/contract.md#budgets)
            reserved += 1

    t0 = time.perf_counter()

    def attempt(a: dict, status: str, *, model: str = request.model, error: str | None = None) -> LLMCall:
        """One HTTP attempt as a log row (``a`` as the provider reports it: tokens, latency, error)."""
        latency = a.get("latency_ms", int((time.perf_counter() - t0) * 1000))
        tin, tout, cached = a.get("tokens_in", 0), a.get("tokens_out", 0), a.get("cached_tokens", 0)
        return LLMCall(
            stage=stage,
            batch=batch,
            provider=p.name,
            model=model,
            status=status,
            tokens_in=tin,
            tokens_out=tout,
            cached_tokens=cached,
            cost_usd=0.0 if p.local else cost_usd(model, tin, cached, tout, table),
            latency_ms=latency,
            error=a.get("error") or error,
        )

    def charge(calls: list[LLMCall]) -> None:
        if ledger is not None:
            ledger.charge(
                sum(c.tokens_in + c.tokens_out for c in calls),
                sum(c.cost_usd or 0.0 for c in calls),
                extra_calls=len(calls) - reserved,
            )

    try:
        with stage_context(stage):  # the provider's own lines (each attempt) name the stage that called
            completion = p.complete(request, before_retry=reserve_retry)
    except BudgetExhausted as exc:
        # a retry refused: the attempts already made were sent and may have been billed
        calls = [attempt(a, "error", error=exc.message) for a in exc.attempts]
        if calls:
            _log_calls(conn, job_id, calls)
            charge(calls)
            metrics.llm_calls(request.model, calls)
        raise
    except LLMError as exc:
        calls = [attempt(a, "error", error=exc.message) for a in exc.attempts or [{}]]
        _log_calls(conn, job_id, calls)
        charge(calls)
        metrics.llm_calls(request.model, calls)
        raise
    crash: Exception | None = None
    if parse is not None:
        try:
            completion.parsed = parse(completion.text)
            completion.parse_ok = completion.parsed is not None
        except ParseError as exc:
            completion.parse_error, completion.parse_ok = exc, False
        except Exception as exc:  # a parser's bug: the call is paid for and logged all the same, then it surfaces
            crash, completion.parse_ok = exc, False
    calls = [attempt(a, "retried") for a in completion.failed_attempts]
    calls.append(
        attempt(
            {
                "tokens_in": completion.tokens_in,
                "tokens_out": completion.tokens_out,
                "cached_tokens": completion.cached_tokens,
                "latency_ms": completion.latency_ms,
            },
            "ok",
            model=completion.model or request.model,
        ).model_copy(update={"parse_ok": completion.parse_ok})
    )
    _log_calls(conn, job_id, calls)
    charge(calls)
    metrics.llm_calls(request.model, calls)
    log.info(
        "llm %s job=%s batch=%s provider=%s model=%s in=%d out=%d %dms",
        stage,
        job_id,
        batch,
        p.name,
        completion.model or request.model,
        completion.tokens_in,
        completion.tokens_out,
        completion.latency_ms,
    )
    if crash is not None:
        raise crash
    return completion


def _still_open(conn: psycopg.Connection | None, job_id: str) -> None:
    """A job cancelled (or ended) while this stage waited — for a slot, a limiter, a retry — starts no call."""
    from ..errors import JobCancelled
    from ..store.db import connection

    if conn is not None:
        open_ = job_store.is_open(conn, job_id=job_id)
    else:
        with connection() as c:
            open_ = job_store.is_open(c, job_id=job_id)
    if not open_:
        raise JobCancelled(f"job {job_id} has ended (cancelled or finished); no LLM call was started")


def _log_calls(conn: psycopg.Connection | None, job_id: str, calls: list[LLMCall]) -> None:
    def write(c: psycopg.Connection) -> None:
        # all rows or none: a retry after the database dropped half-way must not log (and bill) a call twice
        with c.transaction():
            for call in calls:
                job_store.record_llm_call(c, job_id=job_id, call=call)

    durable_write(conn, write, what=f"llm call log of job {job_id}")
