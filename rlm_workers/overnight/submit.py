"""Submit, cancel and read overnight batches: what the CLI (`rlm batch …`) and the HTTP API (`/v1/batches`) call.

Nothing here runs an item: submitting stores the batch and sends its first tick
(``scheduler.py``); the workers do the rest.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..config import get_settings
from ..errors import IdempotencyKeyReused, InvalidInput
from ..limits import MAX_RUN_AT_AHEAD_DAYS, MAX_RUN_AT_BEHIND_DAYS
from ..models import JobStatus
from ..search.service import validate_query
from ..store import jobs as job_store
from ..store import overnight as store
from ..store.buffers import list_buffers, require_buffers, validate_buffer_name
from ..store.db import commit
from ..submit import validate_options
from .scheduler import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN, send_tick

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.overnight")

MAX_ITEMS = 100_000
MAX_QUERIES_FILE_BYTES = 50 * 1024 * 1024


def parse_queries(text: str) -> list[str]:
    """A queries file: one query per line, or JSON lines ``{"query": ...}``; blank and ``#`` lines skipped.

    Duplicates are dropped (first occurrence kept): an identical item would only be computed twice.
    """
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


def check_run_at(run_at: datetime, *, now: datetime | None = None, name: str = "run_at") -> datetime:
    """A zone-aware time at most MAX_RUN_AT_AHEAD_DAYS ahead and MAX_RUN_AT_BEHIND_DAYS back.

    Unbounded, ``9999-12-31T23:59:59-23:59`` is year 10000 in UTC: PostgreSQL stores it but it cannot be read
    back into Python, which broke every read of the tenant's batches.
    """
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise InvalidInput(f"{name} needs a time zone offset, e.g. 2026-11-24T02:00:00Z")
    now = now or datetime.now(UTC)
    try:
        delta = run_at - now
    except OverflowError:
        delta = None
    if delta is None or delta > timedelta(days=MAX_RUN_AT_AHEAD_DAYS):
        raise InvalidInput(f"{name} {run_at.isoformat()} is more than {MAX_RUN_AT_AHEAD_DAYS} days ahead")
    if delta < -timedelta(days=MAX_RUN_AT_BEHIND_DAYS):
        raise InvalidInput(f"{name} {run_at.isoformat()} is more than {MAX_RUN_AT_BEHIND_DAYS} days in the past")
    return run_at


def resolve_buffers(conn: psycopg.Connection, *, tenant: str, names: Sequence[str], glob: str | None) -> list[str]:
    out = [validate_buffer_name(n) for n in names]
    if glob:
        matched = [b.name for b in list_buffers(conn, tenant=tenant) if fnmatch.fnmatchcase(b.name, glob)]
        if not matched:
            raise InvalidInput(
                f"no buffer matches {glob!r}; list buffers with `rlm buffers`",
                api_message=f"no buffer matches {glob!r}; list buffers with GET /v1/buffers",
            )
        out += matched
    out = list(dict.fromkeys(out))
    if not out:
        raise InvalidInput(
            "name at least one buffer (--buffer NAME or --buffers-glob PATTERN)",
            api_message="name at least one buffer (buffers or buffers_glob)",
        )
    require_buffers(conn, tenant=tenant, names=out)
    return out


def _numbered(check: Any, n: int, query: str) -> str:
    """``check(query)``, its error naming which query (1-based) of the batch it is."""
    try:
        return check(query)
    except InvalidInput as exc:
        raise InvalidInput(f"query {n}: {exc.message}") from None


@dataclass(frozen=True)
class Stored:
    """A batch ``store_overnight`` wrote (or found under its idempotency key), not yet started."""

    overnight_batch_id: str
    #: written now (False: an earlier submission with the same idempotency key)
    created: bool
    #: the first tick's token (``scheduler.py``)
    tick_token: str


def submit_overnight(conn: psycopg.Connection, **request: Any) -> tuple[str, bool]:
    """Validate and store a batch, commit, then send its first tick.  Returns (batch id, created now).

    Nothing is written when anything is invalid.  A broker that cannot be reached does not fail the
    submission: the batch is durable and the reconciler starts it once a worker runs.
    """
    stored = store_overnight(conn, **request)
    commit(conn)
    start_overnight(stored)
    return stored.overnight_batch_id, stored.created


def start_overnight(stored: Stored) -> None:
    """Send a committed batch's first tick (none for a batch found under its idempotency key: it has one)."""
    if stored.created:
        send_tick(stored.overnight_batch_id, stored.tick_token)


def store_overnight(
    conn: psycopg.Connection,
    *,
    tenant: str,
    queries: Sequence[str],
    buffers: Sequence[str] = (),
    buffers_glob: str | None = None,
    options: dict[str, Any] | None = None,
    run_at: datetime | None = None,
    priority: int = PRIORITY_DEFAULT,
    token_budget: int | None = None,
    idempotency_key: str | None = None,
    llm_batch: bool = False,
) -> Stored:
    """Validate a batch and write it and its items in the caller's transaction; nothing is sent.

    The caller commits, then calls ``start_overnight``: the CLI does so itself, so that Ctrl-C before its
    commit keeps nothing and one after it can name the batch (``submit_overnight`` does all three).
    """
    clean_queries = list(dict.fromkeys(_numbered(validate_query, n, q) for n, q in enumerate(queries, 1)))
    if not clean_queries:
        raise InvalidInput("give at least one query")
    settings = get_settings()
    if llm_batch and not (settings.resolved_provider == "openai" and settings.api_key):
        # the Batch API is OpenAI's: a keyless OpenAI-compatible server, a local model or the extractive
        # provider has nothing to batch against
        raise InvalidInput(
            "--llm-batch needs an OpenAI API key (OPENAI_API_KEY or RLM_API_KEY): the "
            f"{settings.resolved_provider} provider has no Batch API",
            api_message="llm_batch needs an OpenAI API key on the server: the "
            f"{settings.resolved_provider} provider has no Batch API",
        )
    names = resolve_buffers(conn, tenant=tenant, names=buffers, glob=buffers_glob)
    clean = validate_options(dict(options or {}))
    n_items = len(clean_queries) * len(names)
    if n_items > MAX_ITEMS:
        raise InvalidInput(
            f"{len(clean_queries)} queries × {len(names)} buffers = {n_items} items; the limit is {MAX_ITEMS} per batch"
        )
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidInput(f"invalid priority {priority!r}: use {PRIORITY_MIN} (soonest) to {PRIORITY_MAX}")
    if token_budget is not None and (
        isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1
    ):
        raise InvalidInput(f"invalid token budget {token_budget!r}: a positive number of tokens")
    if run_at is not None:
        check_run_at(run_at)
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
        raise InvalidInput("an idempotency key is 1-200 characters")
    # The request as the client gave it (buffers and glob, not what the glob matches today), so a replay is
    # recognised, and a different request under a used key refused (422, as the IETF draft says).
    request = {
        "queries": clean_queries,
        "buffers": list(buffers),
        "buffers_glob": buffers_glob,
        "options": clean,
        "run_at": run_at.timestamp() if run_at else None,  # one instant, whatever its zone
        "priority": priority,
        "token_budget": token_budget,
    }
    if llm_batch:  # only when set: a replay of a request stored before the field existed keeps its fingerprint
        request["llm_batch"] = True
    fingerprint = hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()
    token = uuid.uuid4().hex
    overnight_batch_id, created, first = store.create_overnight(
        conn,
        overnight_batch_id=uuid.uuid4().hex,
        tenant=tenant,
        queries=clean_queries,
        buffers=names,
        options=clean,
        run_at=run_at,
        priority=priority,
        token_budget=token_budget,
        tick_token=token,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint if idempotency_key else None,
        llm_batch=bool(llm_batch),
    )
    # an existing batch is found only by a key; None: a batch made before fingerprints
    if not created and idempotency_key and first is not None and first != fingerprint:
        raise IdempotencyKeyReused(
            f"idempotency key {idempotency_key[:80]!r} was used for a different request (batch {overnight_batch_id}); "
            "use a new key for a new request"
        )
    if created:
        log.info(
            "batch %s: %d queries × %d buffers = %d items, run_at=%s, priority=%d, budget=%s",
            overnight_batch_id,
            len(clean_queries),
            len(names),
            n_items,
            run_at,
            priority,
            token_budget,
        )
    return Stored(overnight_batch_id=overnight_batch_id, created=created, tick_token=token)


def cancel_overnight(conn: psycopg.Connection, *, tenant: str, overnight_batch_id: str) -> store.OvernightRow | None:
    """Close the batch: pending and running items are cancelled, their jobs too.  None if unknown."""
    with conn.transaction():
        status = store.lock_for_cancel(conn, overnight_batch_id=overnight_batch_id, tenant=tenant)
        if status is None:
            return None
        if status in store.OPEN:
            for job_id in store.mark_cancelled(conn, overnight_batch_id=overnight_batch_id):
                job_store.finish_job(
                    conn,
                    job_id=job_id,
                    status=JobStatus.cancelled,
                    error={"type": "cancelled", "message": f"batch {overnight_batch_id} was cancelled"},
                )
            log.info("batch %s cancelled", overnight_batch_id)
    commit(conn)
    row = store.get_overnight(conn, overnight_batch_id=overnight_batch_id, tenant=tenant)
    if row is not None and row.llm_batch and status in store.OPEN:
        send_tick(overnight_batch_id, None)  # its provider batches are cancelled by the tick (llm_batch.cancel_open)
    return row
