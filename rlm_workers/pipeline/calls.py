"""One logical LLM call of a stage, logged on its job (simonw/llm style): model, tokens, latency, outcome.

Every HTTP attempt behind the call (retries included) is reserved on the tree's budget before it is sent, then
paid through ``accounting.record``: one ``llm_calls`` row each, written after the call with ``durable_write``,
so tokens already bought are recorded even if PostgreSQL blinks meanwhile, and the call is never repeated just
to log it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..config import get_settings
from ..errors import BudgetExhausted, JobCancelled, LLMError, ParseError
from ..llm import fair
from ..llm.prices import prices
from ..llm.protocol import Attempt, Completion, CompletionRequest
from ..runtime.logs import stage_context
from ..runtime.resources import provider
from ..store import jobs as job_store
from ..store.db import connection
from . import accounting
from .budget import ledger_for_job

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
    p = provider()
    table = prices(get_settings().prices)
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

    def pay(attempts: list[Attempt]) -> None:
        # an attempt nothing timed (an error before any was sent) took what the call has taken so far
        calls = accounting.priced(
            attempts,
            stage=stage,
            provider=p,
            model=request.model,
            batch=batch,
            latency_ms=int((time.perf_counter() - t0) * 1000),
            table=table,
        )
        accounting.record(conn, job_id, calls, ledger=ledger, reserved=reserved, model=request.model)

    try:
        with stage_context(stage):  # the provider's own lines (each attempt) name the stage that called
            completion = p.complete(request, before_retry=reserve_retry)
    except (BudgetExhausted, LLMError) as exc:
        # the attempts made were sent and may have been billed; a budget that refused the first one left none
        if attempts := accounting.failed(exc):
            pay(attempts)
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
    pay(accounting.answered(completion, parse_ok=completion.parse_ok))
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
    if conn is not None:
        open_ = job_store.is_open(conn, job_id=job_id)
    else:
        with connection() as c:
            open_ = job_store.is_open(c, job_id=job_id)
    if not open_:
        raise JobCancelled(f"job {job_id} has ended (cancelled or finished); no LLM call was started")
