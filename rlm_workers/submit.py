"""Submitting and following query jobs: used by the CLI and the API alike."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from .celery_app import get_app
from .config import get_settings
from .errors import IdempotencyKeyReused, InvalidInput, TooManyJobs
from .llm.prices import price_for, prices
from .models import QueryOptions, allowed_values
from .pipeline.params import check_job_caps
from .search.service import validate_query
from .store import jobs as job_store
from .store.buffers import require_buffers
from .store.db import commit

if TYPE_CHECKING:
    import psycopg


def validate_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as given (CLI flags, API fields, a batch's options) → the clean dict stored on a job.

    One pydantic model (``QueryOptions``) holds every bound; its first complaint becomes a one-line error.
    """
    given = {k: v for k, v in options.items() if v is not None}
    try:
        opts = QueryOptions.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err.get("loc") else ""
        if err.get("type") == "extra_forbidden":
            raise InvalidInput(f"unknown query option {key!r}") from None
        if not key:  # a model-level rule
            raise InvalidInput(str(err.get("msg", "invalid options")).removeprefix("Value error, ")) from None
        allowed = allowed_values(key)
        raise InvalidInput(
            f"invalid value for {key.replace('_', '-')}: {given.get(key)!r}" + (f" ({allowed})" if allowed else "")
        ) from None
    check_job_caps(opts, get_settings())  # the per-job caps are the operator's: checked here, not in the type
    if opts.max_cost is not None:
        check_priced(get_settings())
    return opts.stored()


def check_priced(settings) -> None:
    """--max-cost needs a price for every model the tree may call; a missing one would make the limit a lie."""
    if settings.offline:
        return  # the offline provider costs nothing
    table = prices(settings.prices)
    models = {settings.primary_model, settings.subcall_model, settings.synthesizer_model, settings.resolved_check_model}
    if missing := sorted(m for m in models if price_for(m, table) is None):
        raise InvalidInput(
            f"--max-cost needs a price for model {missing[0]!r}: add it to RLM_PRICES "
            '(e.g. {"' + missing[0] + '": {"input": 1.25, "cached_input": 0.125, "output": 10}})',
            api_message=f"max_cost needs a price for model {missing[0]!r}: the operator must add it to RLM_PRICES",
        )


def submit_query(
    conn: psycopg.Connection,
    *,
    tenant: str,
    query: str,
    buffers: Sequence[str],
    options: dict[str, Any],
    idempotency_key: str | None = None,
    on_created: Callable[[psycopg.Connection, str], None] | None = None,
) -> tuple[str, bool]:
    """Validate, store the job, enqueue rlm.plan.  Returns (job id, created now).

    ``on_created(conn, job_id)`` runs in the transaction that stores a new job, before its first task is sent:
    a chat turn attaches its session context there (docs/contract.md#sessions); raising in it stores nothing."""
    # Sent by name through our app: shared tasks would bind to Celery's default app in a process
    # (CLI, API, tests) that never made ours current.
    app = get_app()

    query = validate_query(query)
    if not buffers:
        raise InvalidInput("name at least one --buffer to query", api_message="name at least one buffer to query")
    clean = validate_options(options)
    names = list(dict.fromkeys(buffers))
    # One transaction (pooled connections are autocommit): the tenant's lock holds until the job is written,
    # so the key lookup and the in-flight count are still true when it is.
    with conn.transaction():
        job_store.lock_submissions(conn, tenant=tenant)
        first = job_store.job_for_idempotency_key(conn, tenant=tenant, key=idempotency_key) if idempotency_key else None
        if idempotency_key and first is not None:  # a first job is found only by a key
            # A replay answers with the first job, even if its buffer has gone since; a different request under
            # the same key must not get an answer to a question it did not ask.
            if (first.query, first.buffers, first.options.stored()) != (query, names, clean):
                raise IdempotencyKeyReused(
                    f"idempotency key {idempotency_key[:80]!r} was used for a different request (job {first.id}); "
                    "use a new key for a new request"
                )
            job_id, created = first.id, False
        else:
            require_buffers(conn, tenant=tenant, names=names)
            cap = get_settings().max_jobs_in_flight_per_tenant
            if job_store.jobs_in_flight(conn, tenant=tenant) >= cap:
                raise TooManyJobs(
                    f"{cap} queries are already queued or running for this tenant "
                    "(RLM_MAX_JOBS_IN_FLIGHT_PER_TENANT); submit again once some have finished"
                )
            job_id, created = job_store.create_job(
                conn,
                job_id=uuid.uuid4().hex,
                tenant=tenant,
                query=query,
                buffers=names,
                options=clean,
                idempotency_key=idempotency_key,
            )
            if created and on_created is not None:
                on_created(conn, job_id)
    commit(conn)
    if created:
        app.send_task("rlm.plan", (job_id,), argsrepr=f"job={job_id}")
    return job_id, created


def wait_for_job(
    conn: psycopg.Connection,
    job_id: str,
    *,
    timeout: float | None = None,
    on_progress: Callable[[job_store.JobRow, int, int], None] | None = None,
    poll: float = 0.25,
) -> job_store.JobRow:
    """Block until the job ends: woken by the NOTIFY of ``finish_job``, re-checked every ``poll`` seconds
    (progress for ``on_progress``, and a safety net should a notification be missed)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    job_store.listen_job_ended(conn)
    commit(conn)  # LISTEN takes effect at commit
    try:
        while True:
            job = job_store.get_job(conn, job_id=job_id)
            if job is None:
                raise InvalidInput(f"no job {job_id}")
            commit(conn)  # end the snapshot so the next look sees new rows
            if job.terminal:
                return job
            if on_progress is not None:
                done, total = job_store.batch_progress(conn, job_id=job_id)
                commit(conn)
                on_progress(job, done, total)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} ({job.stage}) after {timeout:.0f}s")
            for note in conn.notifies(timeout=poll):
                if note.payload == job_id:
                    break
    finally:
        try:
            job_store.listen_job_ended(conn, listen=False)
            commit(conn)
        except Exception:  # the connection may be gone with the server; nothing to undo then
            pass


def cancel_query(
    conn: psycopg.Connection, *, job_id: str, tenant: str, reason: str = "cancelled by the user"
) -> job_store.JobRow | None:
    """Cancel a job the way the API's cancel route (an HTTP delete of ``/v1/queries/{id}``) does: mark it
    cancelled (its tasks see that and stop before doing more work), then revoke its queued tasks.

    None when the tenant has no such job."""
    job = job_store.get_job(conn, job_id=job_id, tenant=tenant)
    if job is None or job.terminal:
        return job
    below = job_store.descendants(conn, job_id=job_id)
    job = job_store.cancel_job(conn, job_id=job_id, tenant=tenant, reason=reason) or job
    commit(conn)  # cancelled first: a revoke that misses a task still leaves it nothing to do
    task_ids = job_store.task_ids_of(conn, job_ids=[job_id, *below])
    commit(conn)
    if task_ids:
        revoke_tasks(task_ids)
    return job


def revoke_tasks(task_ids: Sequence[str]) -> None:
    """Best effort: tasks check the job's status before doing work, so a missed revoke only costs a dequeue."""
    app = get_app()

    try:
        # kombu retries a broadcast forever while the broker is down: connect once with a bound, then publish.
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=3)
            app.control.revoke(list(task_ids), connection=connection)
    except Exception as exc:
        logging.getLogger("rlm.submit").warning("could not revoke %d task(s): %s", len(task_ids), exc)
