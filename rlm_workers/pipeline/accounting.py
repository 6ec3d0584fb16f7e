"""The one path every model call is paid through: its HTTP attempts as ``llm_calls`` rows, priced, written
durably, charged to the tree's budget and counted in the metrics (docs/contract.md#llm-accounting).

Every attempt behind a call (retries included) becomes one row, so a job's ``total_tokens`` is the exact sum
of what was billed.  Two kinds of call pay here:

* a stage's own call (``calls.call_llm``): its rows on its job, charged to its tree's ledger, on which
  ``call_llm`` reserved each attempt before it was sent (``record``);
* a shared read (``reads.py``): one call answering several jobs' questions, sent directly or as a line of a
  Batch API file (priced at ``prices.BATCH_API_DISCOUNT``).  Each attempt is one row per member job holding
  that job's share, charged to each member's ledger, and never checked before: one job's budget cannot refuse
  a call that answers the others too (``record_shared``).

The rows of one call are written all or none, in one transaction with ``durable_write``: tokens already
bought are recorded even if PostgreSQL blinks meanwhile, and a write retried after the database dropped half-way
never bills a call twice.  The call is never repeated just to log it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from ..config import get_settings
from ..errors import BudgetExhausted, LLMError, ServiceUnavailable
from ..llm.prices import Price, cost_usd, prices
from ..llm.protocol import Attempt, Completion, LLMProvider
from ..models import LLMCall
from ..runtime import metrics
from ..store import jobs as job_store
from ..store.db import durable_write
from .budget import ledger_for_job

if TYPE_CHECKING:
    import psycopg

    from ..llm.budget import BudgetLedger

log = logging.getLogger("rlm.llm")

Via = Literal["sync", "batch_api"]


# --------------------------------------------------------------------------- attempts


def answered(completion: Completion, *, parse_ok: bool | None) -> list[Attempt]:
    """The attempts behind a completion: those that failed first (``retried``), then the one that answered
    (``ok``, with whether the stage could use its reply)."""
    return [
        *(replace(a, status="retried") for a in completion.failed_attempts),
        Attempt(
            status="ok",
            tokens_in=completion.tokens_in,
            tokens_out=completion.tokens_out,
            cached_tokens=completion.cached_tokens,
            latency_ms=completion.latency_ms,
            model=completion.model or None,
            parse_ok=parse_ok,
        ),
    ]


def failed(exc: LLMError | BudgetExhausted) -> list[Attempt]:
    """The attempts behind a call that failed, each an ``error`` carrying the call's message where it has none of
    its own.  An ``LLMError`` with no attempt reported is still one failed call; a ``BudgetExhausted`` without
    any refused the first attempt, so nothing was sent."""
    attempts = exc.attempts
    if not attempts and isinstance(exc, LLMError):
        attempts = [Attempt(status="error")]
    return [replace(a, status="error", error=a.error or exc.message) for a in attempts]


# --------------------------------------------------------------------------- rows


def priced(
    attempts: Sequence[Attempt],
    *,
    stage: str,
    provider: LLMProvider,
    model: str,
    batch: int | None = None,
    via: Via = "sync",
    latency_ms: int = 0,
    table: dict[str, Price] | None = None,
) -> list[LLMCall]:
    """Each attempt as one ``LLMCall`` row, priced from RLM_PRICES (``table``: the caller's, read before the
    call; else read now) at the model that answered (``model`` where the attempt names none); a local provider's
    calls cost nothing.  ``latency_ms``: for an attempt nothing timed."""
    table = prices(get_settings().prices) if table is None else table
    rows = []
    for a in attempts:
        name = a.model or model
        cost = (
            0.0
            if provider.local
            else cost_usd(name, a.tokens_in, a.cached_tokens, a.tokens_out, table, batch_api=via == "batch_api")
        )
        rows.append(
            LLMCall(
                stage=stage,
                batch=batch,
                provider=provider.name,
                model=name,
                status=a.status,
                tokens_in=a.tokens_in,
                tokens_out=a.tokens_out,
                cached_tokens=a.cached_tokens,
                cost_usd=cost,
                latency_ms=latency_ms if a.latency_ms is None else a.latency_ms,
                error=a.error,
                via=via,
                parse_ok=a.parse_ok,
            )
        )
    return rows


@dataclass(frozen=True)
class Share:
    """One member of a shared call: the job (and its analyst batch) the call answered a question for."""

    job_id: str
    batch: int
    #: estimated input tokens the job's own call would have sent, as a fraction of the shared call's
    solo: float


def split(total: int, shares: int) -> list[int]:
    """``total`` in ``shares`` whole parts that sum to it exactly, the first ones a token larger."""
    base, extra = divmod(max(0, int(total)), shares)
    return [base + (1 if i < extra else 0) for i in range(shares)]


def shared_rows(calls: Sequence[LLMCall], shares: Sequence[Share]) -> list[tuple[str, LLMCall]]:
    """Each row of a shared call as one row per member job, holding that job's share of the tokens and cost (and
    what it alone would have sent): the sum over the members is the exact bill."""
    n = len(shares)
    rows: list[tuple[str, LLMCall]] = []
    for whole in calls:
        parts = zip(
            shares, split(whole.tokens_in, n), split(whole.tokens_out, n), split(whole.cached_tokens, n), strict=True
        )
        for share, tin, tout, cached in parts:
            part = whole.model_copy(
                update={
                    "batch": share.batch,
                    "tokens_in": tin,
                    "tokens_out": tout,
                    "cached_tokens": cached,
                    "cost_usd": None if whole.cost_usd is None else whole.cost_usd / n,
                    "shared": n,
                    "solo_tokens_in": round(whole.tokens_in * share.solo) if n > 1 else None,
                }
            )
            rows.append((share.job_id, part))
    return rows


def write(conn: psycopg.Connection | None, rows: Sequence[tuple[str, LLMCall]], *, what: str) -> None:
    """The rows, each on its job, through ``conn`` (or a pooled connection when None): all or none."""

    # all rows or none (one statement): a retry after the database dropped half-way must not log (and bill) a call
    # twice
    durable_write(conn, lambda c: job_store.record_llm_calls(c, rows=rows), what=what)


# --------------------------------------------------------------------------- a call, paid


def record(
    conn: psycopg.Connection | None,
    job_id: str,
    calls: Sequence[LLMCall],
    *,
    ledger: BudgetLedger | None,
    reserved: int,
    model: str,
) -> None:
    """A job's own call: its rows on the job, its tokens and cost on the tree's ``ledger`` (the attempts beyond
    the ``reserved`` ones counted as calls too), and the metrics under ``model``, the configured model asked
    for."""
    write(conn, [(job_id, c) for c in calls], what=f"llm call log of job {job_id}")
    if ledger is not None:
        ledger.charge(
            sum(c.tokens_in + c.tokens_out for c in calls),
            sum(c.cost_usd or 0.0 for c in calls),
            extra_calls=len(calls) - reserved,
        )
    metrics.llm_calls(model, calls)


def record_shared(read_id: int, shares: Sequence[Share], calls: Sequence[LLMCall], *, model: str) -> None:
    """A shared read's call: each row as one per member job (its share), each member's share charged to its
    tree's ledger, and the metrics under ``model`` for the call as a whole."""
    rows = shared_rows(calls, shares)
    write(None, rows, what=f"llm call log of read {read_id}")
    _charge_shares(rows, calls=len(calls))
    metrics.llm_calls(model, calls)


def _charge_shares(rows: Sequence[tuple[str, LLMCall]], *, calls: int) -> None:
    """Each member job's share on its tree's budget (``--max-tokens``, ``--max-cost``; docs/contract.md#budgets),
    so the job's next call is refused once the share spent it; nothing was reserved, so every attempt counts."""
    spent: dict[str, list[float]] = {}
    for job_id, call in rows:
        t = spent.setdefault(job_id, [0, 0.0])
        t[0] += call.tokens_in + call.tokens_out
        t[1] += call.cost_usd or 0.0
    for job_id, (tokens, cost) in spent.items():
        try:
            ledger = ledger_for_job(job_id)
            if ledger is not None:
                ledger.charge(int(tokens), cost, extra_calls=calls)
        except ServiceUnavailable as exc:  # the calls are logged: a ledger seeded again from the log has them
            log.warning("read: could not charge job %s's budget (%s)", job_id, exc)
