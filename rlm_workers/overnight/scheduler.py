"""The tick that advances an overnight batch, the broker epoch, and the reconciler's re-arm.

One task advances a batch, ``rlm.batch.tick(batch_id, token)`` on ``rlm.control``;
each tick, holding the batch row locked (a tick that finds it locked skips it,
so two ticks never both schedule):

1. folds finished jobs into their items (result, exact token bill from the
   job's logged LLM calls) and writes clean results to the result cache;
2. gives back items whose job was lost: the broker lost its data (a new
   *broker epoch*, see ``broker_epoch``) or the job has not moved for longer
   than the pipeline's own worst case; the job is cancelled and the item
   resubmitted, at most ``MAX_ATTEMPTS`` times;
3. once the token budget is spent, skips every item not yet scheduled;
4. serves pending items from the result cache (``cache.py``);
5. submits up to ``RLM_BATCH_PARALLEL`` items at a time (jobs are created in
   the same transaction, their ``rlm.plan`` sent after it commits, with a
   lower broker priority than interactive queries), and only once ``run_at``
   has passed;
6. re-arms itself after ``RLM_BATCH_TICK_SECONDS`` (or until ``run_at``,
   at most a minute at a time) while the batch is open.

Only the tick holding the batch's current ``tick_token`` re-arms, and it hands
a fresh token to the tick it sends, so a redelivered or duplicated tick never
forks the chain.  When a tick message is lost (Redis restarted without its
data, a worker killed while holding a countdown), ``reconcile_overnight`` — run
by the workers' periodic reconciler and by ``rlm.batch.reconcile`` — sees
``next_tick_at`` overdue and starts a new chain.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from ..celery_app import get_app
from ..config import Settings, get_settings
from ..errors import BufferNotFound
from ..models import JobStatus
from ..pipeline.flow import Stage, position
from ..pipeline.reads import Launch, launch_group, send_launch
from ..runtime.resources import redis_client
from ..store import jobs as job_store
from ..store import overnight as store
from ..store import reads as read_store
from ..store.db import DB_OUTAGE, commit, connection
from . import llm_batch
from .cache import cache_key, cacheable, fingerprint

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.overnight")

#: Redis key holding a random id: a Redis that lost its data (restart without persistence) gets a new one
EPOCH_KEY = "rlm:broker-epoch"
#: an item whose job was lost this many times fails instead of being resubmitted again
MAX_ATTEMPTS = 3
#: a batch whose tick failed this many times in a row (not a database outage) is closed, its open items failed
MAX_TICK_FAILURES = 5
#: the longest single countdown while a batch waits for run_at (long ETAs misbehave on Redis)
MAX_WAIT_SECONDS = 60.0
#: pending items looked up in the result cache per round, and rounds per tick
CACHE_WINDOW = 500
MAX_WINDOWS = 20
PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 1, 9, 3

_UNSET: Any = object()


def broker_priority(priority: int) -> int:
    """Batch priority 1..9 → the Redis transport's priority steps (0 highest, kept for interactive queries).

    kombu's Redis transport keeps one list per step (0, 3, 6, 9) and pops lower steps first, so 1-3 → 3,
    4-6 → 6, 7-9 → 9: every batch job starts behind every interactive one.
    """
    return 3 * math.ceil(max(PRIORITY_MIN, min(PRIORITY_MAX, int(priority))) / 3)


def broker_epoch() -> str | None:
    """The current broker epoch (created on first use); None when Redis cannot be reached."""
    try:
        client = redis_client()
        value = client.get(EPOCH_KEY)
        if value is None:
            client.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
            value = client.get(EPOCH_KEY)
            log.info("broker epoch %s started (a new or emptied Redis)", value.decode() if value else None)
        return value.decode() if value else None
    except redis.RedisError as exc:
        log.warning("broker epoch unavailable: %s", exc)
        return None


def stall_seconds(settings: Settings) -> float:
    """A job that did nothing for this long is lost: longer than any redelivery plus the job's own watchdog."""
    return float(settings.visibility_timeout + settings.job_timeout)


def reconcile_grace(settings: Settings) -> float:
    """How overdue a batch's next tick may be before the reconciler starts a new chain."""
    return max(5 * settings.batch_tick_seconds, 2.0)


def _send(
    name: str, args: tuple, *, countdown: float | None = None, priority: int | None = None, argsrepr: str
) -> None:
    """Send by name through our app (shared tasks bind to Celery's default app outside workers)."""
    app = get_app()

    opts: dict[str, Any] = {
        "argsrepr": argsrepr,
        "retry_policy": {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
    }
    if countdown:
        opts["countdown"] = countdown
    if priority is not None:
        opts["priority"] = priority
    app.send_task(name, args, **opts)


def send_tick(overnight_batch_id: str, token: str | None, countdown: float | None = None) -> bool:
    try:
        _send(
            "rlm.batch.tick", (overnight_batch_id, token), countdown=countdown, argsrepr=f"batch={overnight_batch_id}"
        )
        return True
    except Exception as exc:  # the reconciler re-arms a batch whose tick never left
        log.warning("could not send the tick of batch %s (%s); the reconciler will re-arm it", overnight_batch_id, exc)
        return False


# --------------------------------------------------------------------------- the tick


@dataclass
class TickResult:
    #: missing | busy | done | cancelled | waiting | running
    status: str
    #: (job id, item no) whose rlm.plan is sent once the transaction committed
    to_send: list[tuple[str, int]] = field(default_factory=list)
    next_token: str | None = None
    next_in: float | None = None
    priority: int = PRIORITY_DEFAULT
    actions: list[str] = field(default_factory=list)
    #: shared reads created this tick (``pipeline/reads.py``), sent once the transaction committed
    launches: list[Launch] = field(default_factory=list)
    #: the batch sends its analyst calls through the OpenAI Batch API (``llm_batch.advance`` runs after the tick)
    llm_batch: bool = False


def tick_overnight(
    conn: psycopg.Connection,
    overnight_batch_id: str,
    token: str | None = None,
    *,
    settings: Settings | None = None,
    epoch: str | None = _UNSET,
) -> TickResult:
    """One step of a batch, in one transaction holding its row.  Sends nothing (see ``run_tick``)."""
    settings = settings or get_settings()
    if epoch is _UNSET:
        epoch = broker_epoch()
    try:
        with conn.transaction():
            result = _tick_locked(conn, overnight_batch_id, token, settings, epoch)
    finally:
        commit(conn)
    return result


def _tick_locked(
    conn: psycopg.Connection, overnight_batch_id: str, token: str | None, settings: Settings, epoch: str | None
) -> TickResult:
    b = store.lock_overnight(conn, overnight_batch_id=overnight_batch_id)
    if b is None:
        return TickResult("busy" if store.overnight_exists(conn, overnight_batch_id=overnight_batch_id) else "missing")
    if not b.open:
        return TickResult(b.status, llm_batch=b.llm_batch)
    owner = token is not None and token == b.tick_token
    if b.run_at is None:
        # stored before run_at was bounded (docs/contract.md#http-batches): it can never come, say so and close
        _fail_overnight_batch(
            conn,
            b.id,
            "the batch's run_at is out of range and cannot be read; submit it again with a run_at at most a year ahead",
        )
        return TickResult("done")
    now = store.db_now(conn)
    if b.run_at > now:
        wait = min((b.run_at - now).total_seconds(), MAX_WAIT_SECONDS)
        return _rearm(conn, b, owner, wait, TickResult("waiting", priority=b.priority))
    store.mark_started(conn, overnight_batch_id=b.id)
    res = TickResult("running", priority=b.priority, llm_batch=b.llm_batch)
    _fold(conn, b, res)
    _recover(conn, b, settings, epoch, res)
    _launch_reads(conn, b, settings, res)
    spent = store.tokens_spent(conn, overnight_batch_id=b.id)
    within_budget = b.token_budget is None or spent < b.token_budget
    # cache hits cost nothing: they are served even once the budget is spent
    _schedule(conn, b, settings, epoch, res, submit=within_budget)
    if not within_budget:
        n = store.close_pending(
            conn,
            overnight_batch_id=b.id,
            status="skipped",
            error={
                "type": "token_budget",
                "message": f"the batch's token budget ({b.token_budget}) was spent ({spent} tokens) "
                "before this item ran",
            },
        )
        if n:
            res.actions.append(f"token budget {b.token_budget} spent ({spent}): {n} items skipped")
            log.info("batch %s: token budget %s spent (%d): %d items skipped", b.id, b.token_budget, spent, n)
    if (
        store.count_status(conn, overnight_batch_id=b.id, status="pending") == 0
        and store.count_status(conn, overnight_batch_id=b.id, status="running") == 0
    ):
        store.finish_overnight(conn, overnight_batch_id=b.id)
        log.info("batch %s done", b.id)
        res.status = "done"
        return res
    return _rearm(conn, b, owner, settings.batch_tick_seconds, res)


def _fail_overnight_batch(conn: psycopg.Connection, overnight_batch_id: str, message: str) -> None:
    """Close a batch that cannot be advanced: open items fail with ``message``, their jobs are cancelled."""
    error = {"type": "batch_failed", "message": message}
    for job_id in store.fail_open(conn, overnight_batch_id=overnight_batch_id, error=error):
        job_store.finish_job(conn, job_id=job_id, status=JobStatus.cancelled, error=error)
    log.error("batch %s closed, its open items failed: %s", overnight_batch_id, message)


def _rearm(conn: psycopg.Connection, b: store.OvernightRow, owner: bool, wait: float, res: TickResult) -> TickResult:
    if owner:
        res.next_token, res.next_in = uuid.uuid4().hex, max(0.0, wait)
        store.mark_ticked(conn, overnight_batch_id=b.id, next_in=res.next_in, token=res.next_token)
    else:
        store.mark_ticked(conn, overnight_batch_id=b.id)
    return res


def _fold(conn: psycopg.Connection, b: store.OvernightRow, res: TickResult) -> None:
    for f in store.finished_jobs(conn, overnight_batch_id=b.id):
        if f.job_status == JobStatus.done.value:
            store.finish_item(
                conn,
                overnight_batch_id=b.id,
                item_no=f.item_no,
                status="done",
                result=f.result,
                error=None,
                tokens=f.tokens,
            )
            if f.cache_key and cacheable(f.result):
                store.cache_put(conn, tenant=b.tenant, key=f.cache_key, buffer=f.buffer, result=f.result)
        else:
            status = "failed" if f.job_status == JobStatus.failed.value else "cancelled"
            error = f.error or {"type": status, "message": f"the job ended {f.job_status}"}
            store.finish_item(
                conn,
                overnight_batch_id=b.id,
                item_no=f.item_no,
                status=status,
                result=f.result,
                error=error,
                tokens=f.tokens,
            )


def _recover(
    conn: psycopg.Connection, b: store.OvernightRow, settings: Settings, epoch: str | None, res: TickResult
) -> None:
    stall = stall_seconds(settings)
    for f in store.in_flight(conn, overnight_batch_id=b.id):
        if f.job_id is None or f.job_status is None:
            reason = "its job row is gone"
        elif epoch and f.broker_epoch and f.broker_epoch != epoch:
            reason = "the broker lost its data (new broker epoch) while the job was queued or running"
        elif f.idle_seconds is not None and f.idle_seconds > stall:
            reason = f"no progress for {f.idle_seconds:.0f}s"
        else:
            continue
        if f.job_id and f.job_status:
            job_store.finish_job(
                conn,
                job_id=f.job_id,
                status=JobStatus.cancelled,
                error={"type": "lost", "message": f"abandoned by batch {b.id}: {reason}"},
            )
        if f.attempts + 1 >= MAX_ATTEMPTS:
            store.finish_item(
                conn,
                overnight_batch_id=b.id,
                item_no=f.item_no,
                status="failed",
                result=None,
                tokens=f.tokens,
                error={"type": "lost", "message": f"job lost {f.attempts + 1} times; last: {reason}"},
            )
            line = (
                f"batch {b.id} item {f.item_no}: job {f.job_id} lost ({reason}); failed after {f.attempts + 1} attempts"
            )
        else:
            store.requeue_item(conn, overnight_batch_id=b.id, item_no=f.item_no, tokens=f.tokens)
            line = f"batch {b.id} item {f.item_no}: job {f.job_id} lost ({reason}); resubmitting"
        log.warning("reconcile: %s", line)
        res.actions.append(line)


def _launch_reads(conn: psycopg.Connection, b: store.OvernightRow, settings: Settings, res: TickResult) -> None:
    """Launch the shared reads of every read group whose jobs have all searched (docs/contract.md#shared-reads);
    a group still waiting for one of its jobs keeps its parked jobs fresh, so no sweep takes them for stuck."""
    groups: dict[str, list[read_store.ParkedJob]] = {}
    for p in read_store.parked_jobs(conn, overnight_id=b.id):
        groups.setdefault(p.group, []).append(p)
    for key, members in groups.items():
        parked = [p for p in members if p.stage == Stage.fan_out and not p.launched and p.status == "running"]
        if not parked:
            continue
        searching = [
            p for p in members if p.status in ("queued", "running") and position(p.stage) < position(Stage.answer)
        ]
        if searching:
            for p in parked:
                job_store.touch_job(conn, job_id=p.job_id)
            continue
        jobs = [j for p in parked if (j := job_store.get_job(conn, job_id=p.job_id)) is not None]
        launch = launch_group(
            conn, tenant=b.tenant, overnight_id=b.id, jobs=jobs, llm_batch=b.llm_batch, settings=settings
        )
        res.launches.append(launch)
        line = f"batch {b.id} group {key}: {len(jobs)} questions share {len(launch.reads) or 'their'} reads"
        log.info(line)
        res.actions.append(line)


def _groups(
    candidates: list[tuple[int, str, str, str]], size: int, llm_batch: bool
) -> list[list[tuple[int, str, str, str]]]:
    """Pending items (no, query, buffer, cache key) as submission groups: up to ``size`` questions over one
    buffer read together; alone (no group) when sharing is off and the batch does not use the Batch API."""
    if size <= 1 and not llm_batch:
        return [[c] for c in candidates]
    by_buffer: dict[str, list[list[tuple[int, str, str, str]]]] = {}
    out: list[list[tuple[int, str, str, str]]] = []
    for c in candidates:
        groups = by_buffer.setdefault(c[2], [])
        if not groups or len(groups[-1]) >= max(1, size):
            groups.append([])
            out.append(groups[-1])
        groups[-1].append(c)
    return out


def _schedule(
    conn: psycopg.Connection,
    b: store.OvernightRow,
    settings: Settings,
    epoch: str | None,
    res: TickResult,
    *,
    submit: bool,
) -> None:
    """Serve pending items from the cache; submit up to the free slots (when ``submit``)."""
    slots = (
        settings.batch_parallel - store.count_status(conn, overnight_batch_id=b.id, status="running") if submit else 0
    )
    fp: str | None = None
    contents: dict[str, tuple[int, str]] = {}
    after = -1
    for _ in range(MAX_WINDOWS):
        window = store.pending_items(conn, overnight_batch_id=b.id, after=after, limit=CACHE_WINDOW)
        if not window:
            return
        after = window[-1][0]
        fp = fp or fingerprint(settings)
        unknown = {buf for _, _, buf in window} - contents.keys()
        if unknown:
            contents.update(store.buffer_contents(conn, tenant=b.tenant, names=sorted(unknown)))
        keys = {
            no: cache_key(
                tenant=b.tenant,
                query=q,
                buffer_id=contents[buf][0],
                content=contents[buf][1],
                options=b.options,
                fp=fp,
            )
            for no, q, buf in window
            if buf in contents
        }
        hits = store.cache_get(conn, tenant=b.tenant, keys=list(keys.values()))
        candidates: list[tuple[int, str, str, str]] = []
        for no, q, buf in window:
            key = keys.get(no)
            if key is None:
                store.finish_item(
                    conn,
                    overnight_batch_id=b.id,
                    item_no=no,
                    status="failed",
                    result=None,
                    error=BufferNotFound(buf).to_dict(),
                )
            elif key in hits:
                store.finish_item(
                    conn,
                    overnight_batch_id=b.id,
                    item_no=no,
                    status="done",
                    result=hits[key],
                    error=None,
                    from_cache=True,
                    cache_key=key,
                )
            elif slots > 0:
                candidates.append((no, q, buf, key))
        # questions over one buffer go together, so their reads can be shared; a group starts whole, once the
        # slots left hold it (it is never larger than RLM_BATCH_PARALLEL)
        size = min(settings.shared_read_questions, settings.batch_parallel)
        for group in _groups(candidates, size, b.llm_batch):
            if len(group) > slots:
                slots = 0
                break
            spec = (
                {"kind": "overnight", "read_group": f"{b.id}:{group[0][0]}"} if len(group) > 1 or b.llm_batch else None
            )
            for no, q, buf, key in group:
                job_id = uuid.uuid4().hex
                job_store.create_job(
                    conn, job_id=job_id, tenant=b.tenant, query=q, buffers=[buf], options=b.options, spec=spec
                )
                store.mark_submitted(
                    conn, overnight_batch_id=b.id, item_no=no, job_id=job_id, cache_key=key, broker_epoch=epoch
                )
                res.to_send.append((job_id, no))
            slots -= len(group)
        if slots <= 0 and not hits:
            return  # nothing more this tick: the rest waits for a free slot


def run_tick(
    conn: psycopg.Connection, overnight_batch_id: str, token: str | None = None, *, settings: Settings | None = None
) -> TickResult:
    """``tick_overnight`` and then what it decided: send the new jobs, re-arm the chain."""
    res = tick_overnight(conn, overnight_batch_id, token, settings=settings)
    unsent: list[tuple[str, int]] = []
    for i, (job_id, item_no) in enumerate(res.to_send):
        try:
            _send(
                "rlm.plan",
                (job_id,),
                priority=broker_priority(res.priority),
                argsrepr=f"job={job_id} batch={overnight_batch_id} item={item_no}",
            )
        except Exception as exc:  # broker gone: give the items back, the next tick retries
            log.warning(
                "batch %s: could not enqueue %d jobs (%s); they go back to pending",
                overnight_batch_id,
                len(res.to_send) - i,
                exc,
            )
            unsent = res.to_send[i:]
            break
    if unsent:
        _release(conn, overnight_batch_id, unsent)
    for launch in res.launches:
        try:
            send_launch(launch, priority=broker_priority(res.priority))
        except Exception as exc:  # the reads are stored: their jobs' watchdog or the reconciler salvages them
            log.warning("batch %s: could not send its shared reads (%s)", overnight_batch_id, exc)
    if res.next_token is not None:
        send_tick(overnight_batch_id, res.next_token, countdown=res.next_in)
    if res.llm_batch and res.status == "running":
        # after the re-arm: a failure here must not break the tick chain; the next tick tries again

        res.actions += llm_batch.advance(overnight_batch_id, settings)
    elif res.llm_batch and res.status == "cancelled":
        # a cancelled batch's provider batches would otherwise run (and bill) to the end: docs/contract.md#llm-batch-api

        cancelled = llm_batch.cancel_open(overnight_batch_id, settings)
        if cancelled is None:
            # an advance begun before the cancel still holds the batch (and may submit one more provider batch):
            # this closed batch has no tick chain left, so come back once it has let go
            wait = (settings or get_settings()).batch_tick_seconds
            send_tick(overnight_batch_id, None, countdown=wait)
            res.actions.append(
                f"batch {overnight_batch_id}: held by an advance; cancelling its provider batches in {wait} s"
            )
        else:
            res.actions += cancelled
    return res


def _release(conn: psycopg.Connection, overnight_batch_id: str, unsent: Sequence[tuple[str, int]]) -> None:
    with conn.transaction():
        for job_id, item_no in unsent:
            job_store.finish_job(
                conn,
                job_id=job_id,
                status=JobStatus.cancelled,
                error={"type": "lost", "message": "could not be enqueued (broker unavailable)"},
            )
            store.release_item(conn, overnight_batch_id=overnight_batch_id, item_no=item_no, job_id=job_id)
    commit(conn)


# --------------------------------------------------------------------------- reconciler


def reconcile_overnight(conn: psycopg.Connection, *, settings: Settings) -> list[str]:
    """Re-arm open batches whose next tick is overdue (its message was lost); one line per action, logged."""
    with conn.transaction():
        claimed = store.claim_stale(conn, grace_seconds=reconcile_grace(settings))
    commit(conn)
    actions = []
    for overnight_batch_id, token in claimed:
        sent = send_tick(overnight_batch_id, token)
        line = f"batch {overnight_batch_id}: tick overdue by more than {reconcile_grace(settings):.0f}s; " + (
            "re-armed" if sent else "re-arm failed (broker unavailable), will retry"
        )
        log.warning("reconcile: %s", line)
        actions.append(line)
    return actions


def advance(overnight_batch_id: str, token: str | None = None) -> str:
    """What the ``rlm.batch.tick`` task does: one tick on a pooled connection; returns its status.

    A database outage is raised (``DurableTask`` retries it).  Any other failure is logged and counted on the
    batch and the tick ends: the reconciler re-arms the chain, and after ``MAX_TICK_FAILURES`` failures in a
    row the batch is closed with its open items failed, so one broken batch cannot fail forever.
    """
    with connection() as conn:
        try:
            return run_tick(conn, overnight_batch_id, token).status
        except DB_OUTAGE:
            raise
        except Exception as exc:
            log.error("batch %s: tick failed: %s", overnight_batch_id, exc, exc_info=True)
            conn.rollback()
            return record_tick_failure(conn, overnight_batch_id, exc)


def record_tick_failure(conn: psycopg.Connection, overnight_batch_id: str, exc: BaseException) -> str:
    """Count a failed tick; the ``MAX_TICK_FAILURES``-th in a row closes the batch.  Returns the tick's status."""
    with conn.transaction():
        n = store.count_tick_failure(conn, overnight_batch_id=overnight_batch_id)
        if n >= MAX_TICK_FAILURES:
            _fail_overnight_batch(
                conn,
                overnight_batch_id,
                f"the batch could not be advanced: its tick failed {n} times in a row "
                f"(last: {type(exc).__name__}); see the worker log",
            )
    commit(conn)
    return "done" if n >= MAX_TICK_FAILURES else "failed"


def sweep() -> int:
    """What the ``rlm.batch.reconcile`` task does (for celery beat users); returns how many chains restarted."""
    with connection() as conn:
        return len(reconcile_overnight(conn, settings=get_settings()))
