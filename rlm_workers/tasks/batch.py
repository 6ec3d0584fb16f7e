"""Overnight batches: many queries × many buffers, one pipeline job per (query, buffer) item.

The batch and its items live in PostgreSQL (``store/batches.py``).  One task
advances a batch, ``rlm.batch.tick(batch_id, token)`` on ``rlm.control``; each
tick, holding the batch row (``FOR UPDATE SKIP LOCKED``, so two ticks never
both schedule):

1. folds finished jobs into their items (result, exact token bill from the
   job's logged LLM calls) and writes clean results to the result cache;
2. gives back items whose job was lost: the broker lost its data (a new
   *broker epoch*, see ``broker_epoch``) or the job has not moved for longer
   than the pipeline's own worst case; the job is cancelled and the item
   resubmitted, at most ``MAX_ATTEMPTS`` times;
3. once the token budget is spent, skips every item not yet scheduled;
4. serves pending items from the result cache (key: tenant, query, buffer
   name and version, options, provider, models, query defaults and prompts);
5. submits up to ``RLM_BATCH_PARALLEL`` items at a time (jobs are created in
   the same transaction, their ``rlm.plan`` sent after it commits, with a
   lower broker priority than interactive queries), and only once ``run_at``
   has passed;
6. re-arms itself after ``RLM_BATCH_TICK_SECONDS`` (or until ``run_at``,
   at most a minute at a time) while the batch is open.

Only the tick holding the batch's current ``tick_token`` re-arms, and it hands
a fresh token to the tick it sends, so a redelivered or duplicated tick never
forks the chain.  When a tick message is lost (Redis restarted without its
data, a worker killed while holding a countdown), ``reconcile_batches`` — run
by the workers' periodic reconciler (``tasks/reconcile.py``) and by
``rlm.batch.reconcile`` — sees ``next_tick_at`` overdue and starts a new chain.

The pipeline needs running workers: a batch waits in PostgreSQL until a
worker serving ``rlm.control`` (``rlm worker`` or ``rlm up``) picks it up.
"""

from __future__ import annotations

import csv
import fnmatch
import hashlib
import io
import json
import logging
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery import shared_task

from ..config import Settings, get_settings
from ..errors import InvalidInput
from ..models import JobStatus
from ..store import batches as store
from ..store import jobs as job_store
from .common import db, survives_outages

log = logging.getLogger("rlm.batch")

#: Redis key holding a random id: a Redis that lost its data (restart without persistence) gets a new one
EPOCH_KEY = "rlm:broker-epoch"
#: an item whose job was lost this many times fails instead of being resubmitted again
MAX_ATTEMPTS = 3
#: the longest single countdown while a batch waits for run_at (long ETAs misbehave on Redis)
MAX_WAIT_SECONDS = 60.0
MAX_ITEMS = 100_000
MAX_QUERIES_FILE_BYTES = 50 * 1024 * 1024
#: pending items looked up in the result cache per round, and rounds per tick
CACHE_WINDOW = 500
MAX_WINDOWS = 20
PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 1, 9, 3
CACHE_VERSION = 1

_UNSET: Any = object()


# --------------------------------------------------------------------------- small pure helpers


def broker_priority(priority: int) -> int:
    """Batch priority 1..9 → the Redis transport's priority steps (0 highest, kept for interactive queries).

    kombu's Redis transport keeps one list per step (0, 3, 6, 9) and pops lower steps first, so 1-3 → 3,
    4-6 → 6, 7-9 → 9: every batch job starts behind every interactive one.
    """
    return 3 * math.ceil(max(PRIORITY_MIN, min(PRIORITY_MAX, int(priority))) / 3)


def parse_queries(text: str) -> list[str]:
    """A queries file: one query per line, or JSON lines ``{"query": ...}``; blank and ``#`` lines skipped.

    Duplicates are dropped (first occurrence kept): an identical item would only be computed twice.
    """
    from ..search.service import validate_query

    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"queries line {n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("query"), str):
                raise InvalidInput(f'queries line {n}: a JSON line needs a "query" string')
            s = obj["query"]
        try:
            out.append(validate_query(s))
        except InvalidInput as exc:
            raise InvalidInput(f"queries line {n}: {exc.message}") from None
    if not out:
        raise InvalidInput("the queries file holds no query (blank lines and # comments are skipped)")
    return list(dict.fromkeys(out))


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def fingerprint(settings: Settings) -> str:
    """Everything besides the item itself that changes an answer: provider, models, defaults, prompts."""
    from ..stages.prompting import PROMPT_NAMES, load_prompt
    from .common import provider_name

    prompts = {}
    for name in PROMPT_NAMES:
        try:
            prompts[name] = hashlib.sha256(load_prompt(name, prompt_dir=settings.prompt_dir).encode()).hexdigest()
        except (OSError, FileNotFoundError):
            prompts[name] = None
    online = not settings.offline
    return _sha({
        "v": CACHE_VERSION,
        "provider": provider_name(settings),
        "base_url": settings.base_url if online else None,
        "models": [settings.primary_model, settings.subcall_model, settings.synthesizer_model] if online else [],
        "defaults": {"batch_size": settings.batch_size, "top_k": settings.search_top_k,
                     "threshold": settings.threshold, "finding_threshold": settings.finding_threshold},
        "embedding_model": settings.embedding_model,
        "prompts": prompts,
    })


def cache_key(*, tenant: str, query: str, buffer: str, version: int, options: dict[str, Any], fp: str) -> str:
    return _sha({"tenant": tenant, "query": query, "buffer": buffer, "version": int(version),
                 "options": options, "fp": fp})


def broker_epoch() -> str | None:
    """The current broker epoch (created on first use); None when Redis cannot be reached."""
    import redis

    from .common import redis_client

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


def _commit(conn) -> None:  # noqa: ANN001
    if not conn.autocommit:
        conn.commit()


def _send(name: str, args: tuple, *, countdown: float | None = None, priority: int | None = None,
          argsrepr: str) -> None:
    """Send by name through our app (shared tasks bind to Celery's default app outside workers)."""
    from ..celery_app import app

    opts: dict[str, Any] = {"argsrepr": argsrepr,
                            "retry_policy": {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5}}
    if countdown:
        opts["countdown"] = countdown
    if priority is not None:
        opts["priority"] = priority
    app.send_task(name, args, **opts)


def send_tick(batch_id: str, token: str | None, countdown: float | None = None) -> bool:
    try:
        _send("rlm.batch.tick", (batch_id, token), countdown=countdown, argsrepr=f"batch={batch_id}")
        return True
    except Exception as exc:  # noqa: BLE001 - the reconciler re-arms a batch whose tick never left
        log.warning("could not send the tick of batch %s (%s); the reconciler will re-arm it", batch_id, exc)
        return False


# --------------------------------------------------------------------------- submit, cancel, read


def resolve_buffers(conn, *, tenant: str, names: Sequence[str], glob: str | None) -> list[str]:  # noqa: ANN001
    from ..store.buffers import list_buffers, require_buffers, validate_buffer_name

    out = [validate_buffer_name(n) for n in names]
    if glob:
        matched = [b.name for b in list_buffers(conn, tenant=tenant) if fnmatch.fnmatchcase(b.name, glob)]
        if not matched:
            raise InvalidInput(f"no buffer matches {glob!r}; list buffers with `rlm buffers`")
        out += matched
    out = list(dict.fromkeys(out))
    if not out:
        raise InvalidInput("name at least one buffer (--buffer NAME or --buffers-glob PATTERN)")
    require_buffers(conn, tenant=tenant, names=out)
    return out


def submit_batch(conn, *, tenant: str, queries: Sequence[str], buffers: Sequence[str] = (),  # noqa: ANN001
                 buffers_glob: str | None = None, options: dict[str, Any] | None = None,
                 run_at: datetime | None = None, priority: int = PRIORITY_DEFAULT, token_budget: int | None = None,
                 idempotency_key: str | None = None) -> tuple[str, bool]:
    """Validate and store a batch, then send its first tick.  Returns (batch id, created now).

    Nothing is written when anything is invalid.  A broker that cannot be reached does not fail the
    submission: the batch is durable and the reconciler starts it once a worker runs.
    """
    from ..search.service import validate_query
    from ..submit import validate_options

    clean_queries = list(dict.fromkeys(validate_query(q) for q in queries))
    if not clean_queries:
        raise InvalidInput("give at least one query")
    names = resolve_buffers(conn, tenant=tenant, names=buffers, glob=buffers_glob)
    clean = validate_options(dict(options or {}))
    n_items = len(clean_queries) * len(names)
    if n_items > MAX_ITEMS:
        raise InvalidInput(f"{len(clean_queries)} queries × {len(names)} buffers = {n_items} items; "
                           f"the limit is {MAX_ITEMS} per batch")
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidInput(f"invalid priority {priority!r}: use {PRIORITY_MIN} (soonest) to {PRIORITY_MAX}")
    if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                     or token_budget < 1):
        raise InvalidInput(f"invalid token budget {token_budget!r}: a positive number of tokens")
    if run_at is not None and run_at.tzinfo is None:
        raise InvalidInput("run_at needs a time zone (e.g. 2030-01-01T02:00:00+00:00)")
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
        raise InvalidInput("an idempotency key is 1-200 characters")
    token = uuid.uuid4().hex
    batch_id, created = store.create_batch(
        conn, batch_id=uuid.uuid4().hex, tenant=tenant, queries=clean_queries, buffers=names, options=clean,
        run_at=run_at, priority=priority, token_budget=token_budget, tick_token=token,
        idempotency_key=idempotency_key)
    _commit(conn)
    if created:
        log.info("batch %s: %d queries × %d buffers = %d items, run_at=%s, priority=%d, budget=%s", batch_id,
                 len(clean_queries), len(names), n_items, run_at, priority, token_budget)
        send_tick(batch_id, token)
    return batch_id, created


def cancel_batch(conn, *, tenant: str, batch_id: str) -> store.BatchRow | None:  # noqa: ANN001
    """Close the batch: pending and running items are cancelled, their jobs too.  None if unknown."""
    with conn.transaction():
        row = conn.execute("SELECT id, status FROM batches WHERE id = %s AND tenant = %s FOR UPDATE",
                           (batch_id, tenant)).fetchone()
        if row is None:
            return None
        if row[1] in store.OPEN:
            for job_id in store.cancel_batch(conn, batch_id=batch_id):
                job_store.finish_job(conn, job_id=job_id, status=JobStatus.cancelled,
                                     error={"type": "cancelled", "message": f"batch {batch_id} was cancelled"})
            log.info("batch %s cancelled", batch_id)
    _commit(conn)
    return store.get_batch(conn, batch_id=batch_id, tenant=tenant)


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def status_of(conn, batch: store.BatchRow, settings: Settings | None = None) -> dict[str, Any]:  # noqa: ANN001
    """Progress as the API and ``rlm batch status`` show it."""
    settings = settings or get_settings()
    p = store.progress(conn, batch_id=batch.id)
    remaining = p.counts["pending"] + p.counts["running"]
    eta: float | None = None
    if remaining == 0:
        eta = 0.0
    elif batch.open and p.mean_item_seconds is not None:
        wait = max(0.0, (batch.run_at - store.db_now(conn)).total_seconds())
        rounds = math.ceil(remaining / max(1, settings.batch_parallel))
        eta = round(wait + rounds * p.mean_item_seconds, 1)
    return {
        "batch_id": batch.id, "status": batch.status, "total": p.total, "counts": p.counts,
        "from_cache": p.from_cache, "tokens_spent": store.tokens_spent(conn, batch_id=batch.id),
        "token_budget": batch.token_budget, "priority": batch.priority, "options": batch.options,
        "run_at": _iso(batch.run_at), "created_at": _iso(batch.created_at), "started_at": _iso(batch.started_at),
        "finished_at": _iso(batch.finished_at), "last_tick_at": _iso(batch.last_tick_at),
        "eta_seconds": eta,
    }


def result_line(batch_id: str, item: store.ItemRow) -> dict[str, Any]:
    """One JSONL line: DESIGN §8's keys (batch_id, query, buffer, status, result) plus item bookkeeping."""
    return {"batch_id": batch_id, "query": item.query, "buffer": item.buffer, "status": item.status,
            "result": item.result, "item": item.item_no, "from_cache": item.from_cache, "tokens": item.tokens,
            "error": item.error}


CSV_COLUMNS = ("batch_id", "item", "query", "buffer", "status", "from_cache", "tokens", "response", "sources",
               "error")


def iter_jsonl(conn, batch_id: str) -> Iterable[str]:  # noqa: ANN001
    for item in store.iter_items(conn, batch_id=batch_id):
        yield json.dumps(result_line(batch_id, item), ensure_ascii=False, default=str) + "\n"


def iter_csv(conn, batch_id: str) -> Iterable[str]:  # noqa: ANN001
    buf = io.StringIO()
    writer = csv.writer(buf)

    def flush() -> str:
        out = buf.getvalue()
        buf.seek(0)
        buf.truncate()
        return out

    writer.writerow(CSV_COLUMNS)
    yield flush()
    for item in store.iter_items(conn, batch_id=batch_id):
        result = item.result or {}
        sources = "; ".join(f"{s.get('buffer')}:{s.get('path')}:{s.get('start_line')}-{s.get('end_line')}"
                            for s in result.get("sources") or [])
        error = (item.error or {}).get("message", "") if item.error else ""
        writer.writerow((batch_id, item.item_no, item.query, item.buffer, item.status, item.from_cache,
                         item.tokens, result.get("response", ""), sources, error))
        yield flush()


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


def tick_batch(conn, batch_id: str, token: str | None = None, *, settings: Settings | None = None,  # noqa: ANN001
               epoch: str | None = _UNSET) -> TickResult:
    """One step of a batch, in one transaction holding its row.  Sends nothing (see ``run_tick``)."""
    settings = settings or get_settings()
    if epoch is _UNSET:
        epoch = broker_epoch()
    try:
        with conn.transaction():
            result = _tick_locked(conn, batch_id, token, settings, epoch)
    finally:
        _commit(conn)
    return result


def _tick_locked(conn, batch_id: str, token: str | None, settings: Settings, epoch: str | None) -> TickResult:  # noqa: ANN001
    b = store.lock_batch(conn, batch_id=batch_id)
    if b is None:
        exists = conn.execute("SELECT 1 FROM batches WHERE id = %s", (batch_id,)).fetchone()
        return TickResult("busy" if exists else "missing")
    if not b.open:
        return TickResult(b.status)
    owner = token is not None and token == b.tick_token
    now = store.db_now(conn)
    if b.run_at > now:
        wait = min((b.run_at - now).total_seconds(), MAX_WAIT_SECONDS)
        return _rearm(conn, b, owner, wait, TickResult("waiting", priority=b.priority))
    store.mark_started(conn, batch_id=b.id)
    res = TickResult("running", priority=b.priority)
    _fold(conn, b, res)
    _recover(conn, b, settings, epoch, res)
    spent = store.tokens_spent(conn, batch_id=b.id)
    within_budget = b.token_budget is None or spent < b.token_budget
    # cache hits cost nothing: they are served even once the budget is spent
    _schedule(conn, b, settings, epoch, res, submit=within_budget)
    if not within_budget:
        n = store.close_pending(conn, batch_id=b.id, status="skipped", error={
            "type": "token_budget",
            "message": f"the batch's token budget ({b.token_budget}) was spent ({spent} tokens) before this item ran"})
        if n:
            res.actions.append(f"token budget {b.token_budget} spent ({spent}): {n} items skipped")
            log.info("batch %s: token budget %s spent (%d): %d items skipped", b.id, b.token_budget, spent, n)
    if store.count_status(conn, batch_id=b.id, status="pending") == 0 and \
            store.count_status(conn, batch_id=b.id, status="running") == 0:
        store.finish_batch(conn, batch_id=b.id)
        log.info("batch %s done", b.id)
        res.status = "done"
        return res
    return _rearm(conn, b, owner, settings.batch_tick_seconds, res)


def _rearm(conn, b: store.BatchRow, owner: bool, wait: float, res: TickResult) -> TickResult:  # noqa: ANN001
    if owner:
        res.next_token, res.next_in = uuid.uuid4().hex, max(0.0, wait)
        store.mark_ticked(conn, batch_id=b.id, next_in=res.next_in, token=res.next_token)
    else:
        store.mark_ticked(conn, batch_id=b.id)
    return res


def _cacheable(result: dict[str, Any] | None) -> bool:
    """Only clean answers are reused: a result with failed analyst batches would be a degraded answer forever."""
    return bool(result) and not result.get("batches_failed") and not result.get("chunk_load_failures")


def _fold(conn, b: store.BatchRow, res: TickResult) -> None:  # noqa: ANN001
    for f in store.finished_jobs(conn, batch_id=b.id):
        if f.job_status == JobStatus.done.value:
            store.finish_item(conn, batch_id=b.id, item_no=f.item_no, status="done", result=f.result, error=None,
                              tokens=f.tokens)
            if f.cache_key and _cacheable(f.result):
                store.cache_put(conn, tenant=b.tenant, key=f.cache_key, result=f.result)
        else:
            status = "failed" if f.job_status == JobStatus.failed.value else "cancelled"
            error = f.error or {"type": status, "message": f"the job ended {f.job_status}"}
            store.finish_item(conn, batch_id=b.id, item_no=f.item_no, status=status, result=f.result, error=error,
                              tokens=f.tokens)


def _recover(conn, b: store.BatchRow, settings: Settings, epoch: str | None, res: TickResult) -> None:  # noqa: ANN001
    stall = stall_seconds(settings)
    for f in store.in_flight(conn, batch_id=b.id):
        if f.job_id is None or f.job_status is None:
            reason = "its job row is gone"
        elif epoch and f.broker_epoch and f.broker_epoch != epoch:
            reason = "the broker lost its data (new broker epoch) while the job was queued or running"
        elif f.idle_seconds is not None and f.idle_seconds > stall:
            reason = f"no progress for {f.idle_seconds:.0f}s"
        else:
            continue
        if f.job_id and f.job_status:
            job_store.finish_job(conn, job_id=f.job_id, status=JobStatus.cancelled,
                                 error={"type": "lost", "message": f"abandoned by batch {b.id}: {reason}"})
        if f.attempts + 1 >= MAX_ATTEMPTS:
            store.finish_item(conn, batch_id=b.id, item_no=f.item_no, status="failed", result=None, tokens=f.tokens,
                              error={"type": "lost", "message": f"job lost {f.attempts + 1} times; last: {reason}"})
            line = f"batch {b.id} item {f.item_no}: job {f.job_id} lost ({reason}); failed after {f.attempts + 1} attempts"
        else:
            store.requeue_item(conn, batch_id=b.id, item_no=f.item_no, tokens=f.tokens)
            line = f"batch {b.id} item {f.item_no}: job {f.job_id} lost ({reason}); resubmitting"
        log.warning("reconcile: %s", line)
        res.actions.append(line)


def _schedule(conn, b: store.BatchRow, settings: Settings, epoch: str | None, res: TickResult, *,  # noqa: ANN001
              submit: bool) -> None:
    """Serve pending items from the cache; submit up to the free slots (when ``submit``)."""
    from ..errors import BufferNotFound

    slots = settings.batch_parallel - store.count_status(conn, batch_id=b.id, status="running") if submit else 0
    fp: str | None = None
    versions: dict[str, int] = {}
    after = -1
    for _ in range(MAX_WINDOWS):
        window = store.pending_items(conn, batch_id=b.id, after=after, limit=CACHE_WINDOW)
        if not window:
            return
        after = window[-1][0]
        fp = fp or fingerprint(settings)
        unknown = {buf for _, _, buf in window} - versions.keys()
        if unknown:
            versions.update(store.buffer_versions(conn, tenant=b.tenant, names=sorted(unknown)))
        keys = {no: cache_key(tenant=b.tenant, query=q, buffer=buf, version=versions[buf], options=b.options, fp=fp)
                for no, q, buf in window if buf in versions}
        hits = store.cache_get(conn, tenant=b.tenant, keys=list(keys.values()))
        for no, q, buf in window:
            key = keys.get(no)
            if key is None:
                store.finish_item(conn, batch_id=b.id, item_no=no, status="failed", result=None,
                                  error=BufferNotFound(buf).to_dict())
            elif key in hits:
                store.finish_item(conn, batch_id=b.id, item_no=no, status="done", result=hits[key], error=None,
                                  from_cache=True, cache_key=key)
            elif slots > 0:
                job_id = uuid.uuid4().hex
                job_store.create_job(conn, job_id=job_id, tenant=b.tenant, query=q, buffers=[buf], options=b.options)
                store.mark_submitted(conn, batch_id=b.id, item_no=no, job_id=job_id, cache_key=key,
                                     broker_epoch=epoch)
                res.to_send.append((job_id, no))
                slots -= 1
        if slots <= 0 and not hits:
            return  # nothing more this tick: the rest waits for a free slot


def run_tick(conn, batch_id: str, token: str | None = None, *, settings: Settings | None = None) -> TickResult:  # noqa: ANN001
    """``tick_batch`` and then what it decided: send the new jobs, re-arm the chain."""
    res = tick_batch(conn, batch_id, token, settings=settings)
    unsent: list[tuple[str, int]] = []
    for i, (job_id, item_no) in enumerate(res.to_send):
        try:
            _send("rlm.plan", (job_id,), priority=broker_priority(res.priority),
                  argsrepr=f"job={job_id} batch={batch_id} item={item_no}")
        except Exception as exc:  # noqa: BLE001 - broker gone: give the items back, the next tick retries
            log.warning("batch %s: could not enqueue %d jobs (%s); they go back to pending", batch_id,
                        len(res.to_send) - i, exc)
            unsent = res.to_send[i:]
            break
    if unsent:
        _release(conn, batch_id, unsent)
    if res.next_token is not None:
        send_tick(batch_id, res.next_token, countdown=res.next_in)
    return res


def _release(conn, batch_id: str, unsent: Sequence[tuple[str, int]]) -> None:  # noqa: ANN001
    with conn.transaction():
        for job_id, item_no in unsent:
            job_store.finish_job(conn, job_id=job_id, status=JobStatus.cancelled,
                                 error={"type": "lost", "message": "could not be enqueued (broker unavailable)"})
            conn.execute(
                """UPDATE batch_items SET status = 'pending', job_id = NULL, broker_epoch = NULL, submitted_at = NULL
                   WHERE batch_id = %s AND item_no = %s AND job_id = %s""", (batch_id, item_no, job_id))
    _commit(conn)


# --------------------------------------------------------------------------- reconciler


def reconcile_batches(conn, *, settings: Settings | None = None) -> list[str]:  # noqa: ANN001
    """Re-arm open batches whose next tick is overdue (its message was lost); one line per action, logged."""
    settings = settings or get_settings()
    with conn.transaction():
        claimed = store.claim_stale(conn, grace_seconds=reconcile_grace(settings))
    _commit(conn)
    actions = []
    for batch_id, token in claimed:
        sent = send_tick(batch_id, token)
        line = f"batch {batch_id}: tick overdue by more than {reconcile_grace(settings):.0f}s; " + \
               ("re-armed" if sent else "re-arm failed (broker unavailable), will retry")
        log.warning("reconcile: %s", line)
        actions.append(line)
    return actions


# --------------------------------------------------------------------------- tasks (thin adapters)


@shared_task(name="rlm.batch.tick", bind=True, acks_late=True, ignore_result=True)
@survives_outages  # a retried tick keeps its token, so it still owns the chain
def tick(self, batch_id: str, token: str | None = None) -> str:  # noqa: ANN001
    with db() as conn:
        res = run_tick(conn, batch_id, token)
    return res.status


@shared_task(name="rlm.batch.reconcile", bind=True, acks_late=True, ignore_result=True)
def reconcile(self) -> int:  # noqa: ANN001
    """For celery beat users: the same sweep the workers' reconciler thread runs."""
    with db() as conn:
        return len(reconcile_batches(conn))
