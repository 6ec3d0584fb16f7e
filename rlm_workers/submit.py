"""Submitting and following query jobs: used by the CLI and the API alike."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .constants import SEARCH_MODES
from .errors import InvalidInput
from .search.service import validate_query
from .store import jobs as job_store
from .store.buffers import require_buffers

#: the options a query accepts (CLI flags / API fields), with their checks
OPTION_CHECKS: dict[str, Callable[[Any], bool]] = {
    "search_mode": lambda v: v in SEARCH_MODES,
    "threshold": lambda v: isinstance(v, int | float) and -1.0 <= v <= 1.0,
    "top_k": lambda v: isinstance(v, int) and 1 <= v <= 10_000,
    "max_chunks": lambda v: isinstance(v, int) and 1 <= v <= 100_000,
    "batch_size": lambda v: isinstance(v, int) and 1 <= v <= 1000,
    "num_agents": lambda v: isinstance(v, int) and 1 <= v <= 10_000,
    "skip_plan": lambda v: isinstance(v, bool),
    "finding_threshold": lambda v: v in ("high", "medium", "low", "none"),
}


def validate_options(options: dict[str, Any]) -> dict[str, Any]:
    clean = {k: v for k, v in options.items() if v is not None}
    for key, value in clean.items():
        check = OPTION_CHECKS.get(key)
        if check is None:
            raise InvalidInput(f"unknown query option {key!r}")
        if isinstance(value, bool) and key != "skip_plan" or not check(value):
            raise InvalidInput(f"invalid value for {key.replace('_', '-')}: {value!r}")
    if "batch_size" in clean and "num_agents" in clean:
        raise InvalidInput("--batch-size and --num-agents exclude each other: give one")
    return clean


def submit_query(conn, *, tenant: str, query: str, buffers: Sequence[str], options: dict[str, Any],  # noqa: ANN001
                 idempotency_key: str | None = None) -> tuple[str, bool]:
    """Validate, store the job, enqueue rlm.plan.  Returns (job id, created now)."""
    # Sent by name through our app: shared tasks would bind to Celery's default app in a process
    # (CLI, API, tests) that never made ours current.
    from .celery_app import app

    query = validate_query(query)
    if not buffers:
        raise InvalidInput("name at least one --buffer to query")
    require_buffers(conn, tenant=tenant, names=buffers)
    clean = validate_options(options)
    job_id, created = job_store.create_job(conn, job_id=uuid.uuid4().hex, tenant=tenant, query=query,
                                           buffers=list(dict.fromkeys(buffers)), options=clean,
                                           idempotency_key=idempotency_key)
    conn.commit() if not conn.autocommit else None
    if created:
        app.send_task("rlm.plan", (job_id,), argsrepr=f"job={job_id}")
    return job_id, created


def wait_for_job(conn, job_id: str, *, timeout: float | None = None,  # noqa: ANN001
                 on_progress: Callable[[job_store.JobRow, int, int], None] | None = None,
                 poll: float = 0.25) -> job_store.JobRow:
    """Block until the job ends: woken by the NOTIFY of ``finish_job``, re-checked every ``poll`` seconds
    (progress for ``on_progress``, and a safety net should a notification be missed)."""
    from .constants import JOB_ENDED_CHANNEL

    deadline = None if timeout is None else time.monotonic() + timeout
    conn.execute(f"LISTEN {JOB_ENDED_CHANNEL}")
    if not conn.autocommit:
        conn.commit()  # LISTEN takes effect at commit
    try:
        while True:
            job = job_store.get_job(conn, job_id=job_id)
            if job is None:
                raise InvalidInput(f"no job {job_id}")
            if not conn.autocommit:
                conn.commit()  # end the snapshot so the next look sees new rows
            if job.terminal:
                return job
            if on_progress is not None:
                done, total = job_store.batch_progress(conn, job_id=job_id)
                if not conn.autocommit:
                    conn.commit()
                on_progress(job, done, total)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} ({job.stage}) after {timeout:.0f}s")
            for note in conn.notifies(timeout=poll):
                if note.payload == job_id:
                    break
    finally:
        try:
            conn.execute(f"UNLISTEN {JOB_ENDED_CHANNEL}")
            if not conn.autocommit:
                conn.commit()
        except Exception:  # noqa: BLE001 - the connection may be gone with the server; nothing to undo then
            pass
