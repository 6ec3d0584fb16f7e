"""Fair share of the global in-flight limit between tenants, at the queue (docs/contract.md#fair-share).

The limiter (``limiter.ConcurrencyLimiter``) gives a free slot to a tenant below its share first.  That
alone does not help a tenant whose tasks wait in the Redis queue behind another tenant's hundreds: every
worker thread would pick the big job's tasks and block on the limiter.  So a task whose tenant already holds
its share while another active tenant waits below its own steps aside: ``defer_seconds`` says for how long,
and ``in_turn`` re-queues the task (``self.retry(countdown=…)``) to the tail, behind the other tenant's tasks.

A fan-out counts its tasks as queued (``note_queued``), so a tenant whose tasks have not reached a thread yet
already counts as waiting; ``defer_seconds`` counts a task that goes ahead as started.  Every function here
works on the provider's own limiter and does nothing for a local provider (nothing is rate-limited there);
a Redis outage never fails or holds a task here: the limiter itself reports it when the call asks for a slot.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any, TypeVar

from celery import current_task

from ..errors import ServiceUnavailable
from ..runtime import metrics
from ..runtime.resources import provider
from ..store import jobs as job_store
from ..store.db import connection
from .limiter import ConcurrencyLimiter

log = logging.getLogger("rlm.fair")

T = TypeVar("T")

#: The broker priority step a job's analyst tasks go at past its first ``RLM_MAX_CONCURRENCY`` (kombu's Redis
#: transport pops 0 before 3 before 6 before 9; an overnight batch's jobs already start at 3 or lower).
TAIL_PRIORITY = 3

#: After this many deferrals a task waits on the limiter like any other: a task re-queued forever is lost work
#: (and each deferral is one of ``DurableTask``'s retries).
MAX_DEFERRALS = 8
#: The first deferral's pause; each next one doubles, up to ``DEFER_CAP`` (a jitter of ±50 % on each spreads
#: the re-queued tasks): a crowd that lasts costs a few re-queues per task, not a busy loop.
DEFER_BASE = 0.1
DEFER_CAP = 5.0


def _limiter() -> ConcurrencyLimiter | None:
    p = provider()
    if p.local:
        return None
    limits = getattr(p, "limits", None)
    concurrency = getattr(limits, "concurrency", limits)
    return concurrency if isinstance(concurrency, ConcurrencyLimiter) else None


#: job id -> tenant, per process; bounded (cleared when full: a miss costs one indexed read)
_TENANTS: dict[str, str] = {}
_TENANTS_MAX = 4096


def tenant_of(job_id: str) -> str | None:
    """The job's tenant, read once per process (a job never changes tenant); None for an unknown job."""
    tenant = _TENANTS.get(job_id)
    if tenant is not None:
        return tenant

    with connection() as conn:
        job = job_store.get_job(conn, job_id=job_id)
    if job is None:
        return None  # not cached: a job stored later must be found
    if len(_TENANTS) >= _TENANTS_MAX:
        _TENANTS.clear()
    _TENANTS[job_id] = job.tenant
    return job.tenant


def note_queued(tenant: str | None, tasks: int) -> None:
    """A fan-out queued ``tasks`` tasks of ``tenant`` that will ask for a slot: until they start, the tenant
    counts as waiting, so other tenants' tasks step aside for them.  Call it right before sending them."""
    limiter = _limiter()
    if limiter is None or tasks <= 0:
        return
    try:
        limiter.queued(tenant, tasks)
    except ServiceUnavailable as exc:
        log.warning("could not count %d queued tasks of tenant %s for the fair share: %s", tasks, tenant, exc)


def header_priorities(n: int, *, own: int | None, head: int) -> list[int]:
    """Broker priorities for a fan-out's ``n`` analyst tasks: the first ``head`` at the job's own priority
    (``own``: 0 for an interactive query, an overnight job's lower step), the rest at ``TAIL_PRIORITY`` or the
    job's own if lower.  A fan-out of hundreds of tasks otherwise fills the queue ahead of every query sent
    after it, and stepping aside (``in_turn``) can only move the big job's tasks one re-queue at a time: with
    its tail a step down, another tenant's small fan-out sent later is popped before it, while the head keeps
    every slot the job may hold busy.  docs/contract.md#fair-share"""
    base = max(0, int(own or 0))
    tail = max(base, TAIL_PRIORITY)
    return [base if k < head else tail for k in range(n)]


def current_priority() -> int:
    """The broker priority of the task running now (0 outside a task, or when it was sent without one)."""
    request = getattr(current_task, "request", None)
    info = getattr(request, "delivery_info", None) or {}
    try:
        return max(0, int(info.get("priority") or 0))
    except (TypeError, ValueError):
        return 0


def defer_seconds(tenant: str | None, deferrals: int = 0) -> float | None:
    """How long a task of ``tenant`` that is about to ask for a slot should step aside (re-queued after that
    many seconds), or None to go ahead: the tenant is within its share, nobody below theirs waits, or the
    task was deferred ``MAX_DEFERRALS`` times already.  Going ahead counts the task as started."""
    limiter = _limiter()
    if limiter is None:
        return None
    try:
        if deferrals >= MAX_DEFERRALS:
            limiter.queued(tenant, -1)
        elif not limiter.start_unless_crowding(tenant):  # one round trip per task, as most tasks go ahead
            metrics.fair_deferred()
            return min(DEFER_CAP, DEFER_BASE * 2**deferrals) * random.uniform(0.5, 1.5)
    except ServiceUnavailable as exc:
        log.warning("fair share unknown (%s); the task goes ahead", exc)
    return None


def in_turn(task: Any, tenant: str | None, deferrals: int, run: Callable[[], T]) -> T:
    """``run()`` now, or re-queue ``task`` (a bound Celery task taking a ``deferrals`` keyword) to the queue's
    tail when ``defer_seconds`` says its tenant should step aside: the task adapter's one line."""
    wait = defer_seconds(tenant, deferrals)
    if wait is not None:
        # a retry keeps the task id, so a chord counts the task once, when it finally runs
        raise task.retry(countdown=wait, kwargs={**(task.request.kwargs or {}), "deferrals": deferrals + 1})
    return run()
