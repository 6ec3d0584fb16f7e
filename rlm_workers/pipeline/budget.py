"""The budget of a job tree, as the pipeline sees it: which ledger a job's calls are charged to.

Limits are the root's options (--max-llm-calls, --max-tokens, --max-cost, --deadline); every job of the tree
charges the root's ledger in Redis (``llm/budget.py``), checked before each call by ``calls.call_llm``.  A job's
root and limits never change, so they are looked up once per process.  Should Redis lose the ledger, it is
seeded again from the calls logged in PostgreSQL.  See docs/contract.md#budgets.
"""

from __future__ import annotations

import functools
from typing import Any

from ..llm.budget import BudgetLedger, BudgetLimits
from ..models import BudgetReport
from ..runtime.resources import redis_client
from ..store import jobs as job_store
from ..store.db import connection


@functools.lru_cache(maxsize=4096)
def _root_and_limits(job_id: str) -> tuple[str, BudgetLimits] | None:
    with connection() as conn:
        found = job_store.root_options(conn, job_id=job_id)
    if found is None:
        return None
    root_id, options, created = found
    return root_id, BudgetLimits.from_options(options, created)


def _seed(root_id: str) -> tuple[int, int, float]:
    with connection() as conn:
        usage = job_store.tree_usage(conn, root_id=root_id)
    return usage.calls, usage.tokens_in + usage.tokens_out, usage.cost_usd


def ledger_for_job(job_id: str | None) -> BudgetLedger | None:
    """The ledger that ``job_id``'s calls are charged to; None when its tree has no limits."""
    if job_id is None:
        return None
    found = _root_and_limits(job_id)
    if found is None:
        return None
    root_id, limits = found
    return _ledger(root_id, limits)


def _ledger(root_id: str, limits: BudgetLimits) -> BudgetLedger | None:
    if not limits.any:
        return None
    return BudgetLedger(redis_client(), root_id, limits, seed=functools.partial(_seed, root_id))


def report(root_id: str, options: dict[str, Any], used: tuple[int, int, float], exhausted_hint: str | None):
    """The result's ``budget``: the limits as asked, what the tree used (exact, from the call log) and the limit
    that stopped it."""
    ledger = ledger_for_job(root_id)
    exhausted = None
    if ledger is not None:
        exhausted = ledger.state().get("exhausted")
    calls, tokens, cost = used
    return BudgetReport(
        max_llm_calls=options.get("max_llm_calls"),
        max_tokens=options.get("max_tokens"),
        max_cost=options.get("max_cost"),
        deadline=options.get("deadline"),
        used_llm_calls=calls,
        used_tokens=tokens,
        used_cost_usd=round(cost, 6),
        exhausted=exhausted or exhausted_hint,
    )
