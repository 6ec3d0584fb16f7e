"""SQL for overnight batches (tables ``overnight_batches``, ``overnight_batch_items``): the batch row, its
(query, buffer) items and the result cache.

An overnight batch lives entirely in PostgreSQL: Redis only carries the tick
that advances it and the jobs of the items in flight, so a restarted API,
worker or Redis loses nothing (``rlm_workers.overnight.scheduler`` re-arms
what was lost).  Every function takes a connection; the tick calls the
item-level ones inside one transaction that holds the batch row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from .rows import one

if TYPE_CHECKING:
    import psycopg

OPEN = ("scheduled", "running")
ITEM_STATES = ("pending", "running", "done", "failed", "cancelled", "skipped")
ITEM_FINAL = ("done", "failed", "cancelled", "skipped")


@dataclass
class OvernightRow:
    id: str
    tenant: str
    options: dict[str, Any]
    #: None when the stored time cannot be read (see _readable)
    run_at: datetime | None
    priority: int
    token_budget: int | None
    status: str
    idempotency_key: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_tick_at: datetime | None
    tick_token: str | None
    next_tick_at: datetime | None
    #: its analyst calls go through the OpenAI Batch API (docs/contract.md#llm-batch-api)
    llm_batch: bool = False

    @property
    def open(self) -> bool:
        return self.status in OPEN


def _readable(col: str) -> str:
    """A timestamp column, or NULL when Python cannot hold it: PostgreSQL stores years past 9999 (a run_at of
    ``9999-12-31T23:59:59-23:59`` is year 10000 in UTC) that psycopg refuses to load, and one such row must
    not make every read of the tenant's batches fail.  A day's margin covers the session's time zone."""
    return f"CASE WHEN {col} BETWEEN '0001-01-03 00:00+00' AND '9999-12-29 00:00+00' THEN {col} END"


_OVERNIGHT_COLS = ", ".join(
    _readable(c) if c.endswith("_at") else c
    for c in (
        "id tenant options run_at priority token_budget status idempotency_key created_at "
        "started_at finished_at last_tick_at tick_token next_tick_at llm_batch"
    ).split()
)


@dataclass
class ItemRow:
    item_no: int
    query: str
    buffer: str
    status: str
    job_id: str | None
    cache_key: str | None
    from_cache: bool
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    tokens: int
    submitted_at: datetime | None
    finished_at: datetime | None
    attempts: int


_ITEM_COLS = (
    "item_no, query, buffer, status, job_id, cache_key, from_cache, result, error, tokens, submitted_at, "
    "finished_at, attempts"
)


# --------------------------------------------------------------------------- creation and reading


def create_overnight(
    conn: psycopg.Connection,
    *,
    overnight_batch_id: str,
    tenant: str,
    queries: Sequence[str],
    buffers: Sequence[str],
    options: dict[str, Any],
    run_at: datetime | None,
    priority: int,
    token_budget: int | None,
    tick_token: str,
    idempotency_key: str | None = None,
    request_fingerprint: str | None = None,
    llm_batch: bool = False,
) -> tuple[str, bool, str | None]:
    """Insert the batch and its items (queries outer, buffers inner) in one transaction.

    Returns (batch id, created now, fingerprint of the request that made it).  With an idempotency key
    already used by this tenant, nothing is written and the existing batch is returned: a concurrent first
    use of the key waits on the unique index until the other commits, then finds its row.
    """
    with conn.transaction():
        row = conn.execute(
            """INSERT INTO overnight_batches (id, tenant, options, run_at, priority, token_budget, idempotency_key,
                                    request_fingerprint, tick_token, next_tick_at, llm_batch)
               VALUES (%s, %s, %s, coalesce(%s, now()), %s, %s, %s, %s, %s, now(), %s)
               ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
               RETURNING id""",
            (
                overnight_batch_id,
                tenant,
                Jsonb(options),
                run_at,
                priority,
                token_budget,
                idempotency_key,
                request_fingerprint,
                tick_token,
                llm_batch,
            ),
        ).fetchone()
        if row is None:
            existing = one(
                conn.execute(
                    "SELECT id, request_fingerprint FROM overnight_batches WHERE tenant = %s AND idempotency_key = %s",
                    (tenant, idempotency_key),
                )
            )
            return existing[0], False, existing[1]
        with (
            conn.cursor() as cur,
            cur.copy("COPY overnight_batch_items (overnight_batch_id, item_no, query, buffer) FROM STDIN") as cp,
        ):
            n = 0
            for q in queries:
                for b in buffers:
                    cp.write_row((overnight_batch_id, n, q, b))
                    n += 1
    return overnight_batch_id, True, request_fingerprint


def get_overnight(
    conn: psycopg.Connection, *, overnight_batch_id: str, tenant: str | None = None
) -> OvernightRow | None:
    sql = f"SELECT {_OVERNIGHT_COLS} FROM overnight_batches WHERE id = %s"
    args: tuple = (overnight_batch_id,)
    if tenant is not None:
        sql += " AND tenant = %s"
        args = (overnight_batch_id, tenant)
    row = conn.execute(sql, args).fetchone()
    return OvernightRow(*row) if row else None


def overnight_batch_ids_starting(conn: psycopg.Connection, *, tenant: str, prefix: str, limit: int = 4) -> list[str]:
    """Ids of the tenant's batches that start with ``prefix`` (an id given short), at most ``limit``."""
    rows = conn.execute(
        "SELECT id FROM overnight_batches WHERE tenant = %s AND starts_with(id, %s) ORDER BY id LIMIT %s",
        (tenant, prefix, limit),
    ).fetchall()
    return [r[0] for r in rows]


def list_overnight(conn: psycopg.Connection, *, tenant: str, limit: int = 50) -> list[OvernightRow]:
    rows = conn.execute(
        f"SELECT {_OVERNIGHT_COLS} FROM overnight_batches WHERE tenant = %s ORDER BY created_at DESC LIMIT %s",
        (tenant, limit),
    ).fetchall()
    return [OvernightRow(*r) for r in rows]


@dataclass
class Progress:
    counts: dict[str, int]
    total: int
    tokens: int
    from_cache: int
    #: mean seconds from submission to finish over items that ran (not served from the cache)
    mean_item_seconds: float | None


def progress(conn: psycopg.Connection, *, overnight_batch_id: str) -> Progress:
    counts = dict.fromkeys(ITEM_STATES, 0)
    for status, n in conn.execute(
        "SELECT status, count(*) FROM overnight_batch_items WHERE overnight_batch_id = %s GROUP BY status",
        (overnight_batch_id,),
    ):
        counts[status] = int(n)
    row = one(
        conn.execute(
            """SELECT coalesce(sum(tokens), 0), count(*) FILTER (WHERE from_cache),
                  avg(extract(epoch FROM finished_at - submitted_at))
                      FILTER (WHERE NOT from_cache AND status IN ('done', 'failed') AND submitted_at IS NOT NULL)
           FROM overnight_batch_items WHERE overnight_batch_id = %s""",
            (overnight_batch_id,),
        )
    )
    return Progress(
        counts=counts,
        total=sum(counts.values()),
        tokens=int(row[0]),
        from_cache=int(row[1]),
        mean_item_seconds=float(row[2]) if row[2] is not None else None,
    )


def iter_items(conn: psycopg.Connection, *, overnight_batch_id: str, page: int = 500) -> Iterator[ItemRow]:
    """Every item in order, read in pages (keyset on item_no) so a big batch never sits in memory."""
    after = -1
    while True:
        rows = conn.execute(
            f"""SELECT {_ITEM_COLS} FROM overnight_batch_items
                WHERE overnight_batch_id = %s AND item_no > %s ORDER BY item_no LIMIT %s""",
            (overnight_batch_id, after, page),
        ).fetchall()
        if not rows:
            return
        for r in rows:
            yield ItemRow(*r)
        after = rows[-1][0]


def items(conn: psycopg.Connection, *, overnight_batch_id: str) -> list[ItemRow]:
    return list(iter_items(conn, overnight_batch_id=overnight_batch_id))


# --------------------------------------------------------------------------- the tick (inside one transaction)


def lock_overnight(conn: psycopg.Connection, *, overnight_batch_id: str) -> OvernightRow | None:
    """The batch row locked for this transaction; None if missing or another tick holds it (SKIP LOCKED)."""
    row = conn.execute(
        f"SELECT {_OVERNIGHT_COLS} FROM overnight_batches WHERE id = %s FOR UPDATE SKIP LOCKED", (overnight_batch_id,)
    ).fetchone()
    return OvernightRow(*row) if row else None


def overnight_exists(conn: psycopg.Connection, *, overnight_batch_id: str) -> bool:
    return conn.execute("SELECT 1 FROM overnight_batches WHERE id = %s", (overnight_batch_id,)).fetchone() is not None


def db_now(conn: psycopg.Connection) -> datetime:
    return one(conn.execute("SELECT now()"))[0]


def mark_started(conn: psycopg.Connection, *, overnight_batch_id: str) -> None:
    conn.execute(
        """UPDATE overnight_batches SET status = 'running', started_at = coalesce(started_at, now())
                    WHERE id = %s AND status = 'scheduled'""",
        (overnight_batch_id,),
    )


def mark_ticked(
    conn: psycopg.Connection, *, overnight_batch_id: str, next_in: float | None = None, token: str | None = None
) -> None:
    """Record this tick (a tick that got this far did not fail); with ``token`` also hand the chain to the
    tick about to be sent."""
    if token is None:
        conn.execute(
            "UPDATE overnight_batches SET last_tick_at = now(), tick_failures = 0 WHERE id = %s", (overnight_batch_id,)
        )
    else:
        conn.execute(
            """UPDATE overnight_batches SET last_tick_at = now(), tick_failures = 0, tick_token = %s,
                   next_tick_at = now() + make_interval(secs => %s) WHERE id = %s""",
            (token, float(next_in or 0), overnight_batch_id),
        )


def count_tick_failure(conn: psycopg.Connection, *, overnight_batch_id: str) -> int:
    """One more tick failed in a row; returns how many (0 if the batch is gone or closed)."""
    row = conn.execute(
        """UPDATE overnight_batches SET tick_failures = tick_failures + 1
           WHERE id = %s AND status IN ('scheduled', 'running') RETURNING tick_failures""",
        (overnight_batch_id,),
    ).fetchone()
    return int(row[0]) if row else 0


def fail_open(conn: psycopg.Connection, *, overnight_batch_id: str, error: dict[str, Any]) -> list[str]:
    """Inside a transaction: close a batch that cannot be advanced; its pending and running items fail with
    ``error``.  Returns the job ids that were in flight (the caller cancels the jobs)."""
    jobs = [j for _, j in running_job_ids(conn, overnight_batch_id=overnight_batch_id) if j]
    conn.execute(
        """UPDATE overnight_batch_items SET status = 'failed', error = %s, finished_at = now()
           WHERE overnight_batch_id = %s AND status IN ('pending', 'running')""",
        (Jsonb(error), overnight_batch_id),
    )
    finish_overnight(conn, overnight_batch_id=overnight_batch_id)
    return jobs


def finish_overnight(conn: psycopg.Connection, *, overnight_batch_id: str, status: str = "done") -> None:
    conn.execute(
        """UPDATE overnight_batches SET status = %s, finished_at = now(), last_tick_at = now(), tick_token = NULL,
                        next_tick_at = NULL WHERE id = %s AND status IN ('scheduled', 'running')""",
        (status, overnight_batch_id),
    )


@dataclass
class FinishedJob:
    item_no: int
    job_id: str
    job_status: str
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    tokens: int
    cache_key: str | None
    buffer: str


def finished_jobs(conn: psycopg.Connection, *, overnight_batch_id: str) -> list[FinishedJob]:
    """Running items whose job has ended, with the job's exact token bill (every logged call)."""
    rows = conn.execute(
        """SELECT i.item_no, i.job_id, j.status, j.result, j.error,
                  coalesce((SELECT sum(c.tokens_in + c.tokens_out) FROM llm_calls c WHERE c.job_id = j.id), 0),
                  i.cache_key, i.buffer
           FROM overnight_batch_items i JOIN jobs j ON j.id = i.job_id
           WHERE i.overnight_batch_id = %s AND i.status = 'running' AND j.status IN ('done', 'failed', 'cancelled')
           ORDER BY i.item_no""",
        (overnight_batch_id,),
    ).fetchall()
    return [FinishedJob(r[0], r[1], r[2], r[3], r[4], int(r[5]), r[6], r[7]) for r in rows]


def finish_item(
    conn: psycopg.Connection,
    *,
    overnight_batch_id: str,
    item_no: int,
    status: str,
    result: dict[str, Any] | None,
    error: dict[str, Any] | None,
    tokens: int = 0,
    from_cache: bool = False,
    cache_key: str | None = None,
) -> None:
    conn.execute(
        """UPDATE overnight_batch_items SET status = %s, result = %s, error = %s, tokens = tokens + %s, from_cache = %s,
               cache_key = coalesce(%s, cache_key), finished_at = now()
           WHERE overnight_batch_id = %s AND item_no = %s""",
        (
            status,
            Jsonb(result) if result is not None else None,
            Jsonb(error) if error is not None else None,
            tokens,
            from_cache,
            cache_key,
            overnight_batch_id,
            item_no,
        ),
    )


@dataclass
class InFlight:
    item_no: int
    job_id: str | None
    job_status: str | None
    broker_epoch: str | None
    attempts: int
    #: seconds since anything last happened to the job (created, a stage started, a batch or LLM call ended)
    idle_seconds: float | None
    tokens: int


def in_flight(conn: psycopg.Connection, *, overnight_batch_id: str) -> list[InFlight]:
    """Running items whose job has not ended (or vanished), with how long the job has been idle (``stage_at``
    counts: a job whose reads wait in an OpenAI batch is touched by overnight/llm_batch.py)."""
    rows = conn.execute(
        """SELECT i.item_no, i.job_id, j.status, i.broker_epoch, i.attempts,
                  extract(epoch FROM now() - greatest(
                      j.created_at, j.started_at, j.stage_at,
                      (SELECT max(greatest(b.started_at, b.finished_at)) FROM job_batches b WHERE b.job_id = j.id),
                      (SELECT max(c.created_at) FROM llm_calls c WHERE c.job_id = j.id))),
                  coalesce((SELECT sum(c.tokens_in + c.tokens_out) FROM llm_calls c WHERE c.job_id = j.id), 0)
           FROM overnight_batch_items i LEFT JOIN jobs j ON j.id = i.job_id
           WHERE i.overnight_batch_id = %s AND i.status = 'running'
             AND (j.id IS NULL OR j.status IN ('queued', 'running'))
           ORDER BY i.item_no""",
        (overnight_batch_id,),
    ).fetchall()
    return [
        InFlight(r[0], r[1], r[2], r[3], int(r[4]), float(r[5]) if r[5] is not None else None, int(r[6])) for r in rows
    ]


def requeue_item(conn: psycopg.Connection, *, overnight_batch_id: str, item_no: int, tokens: int) -> None:
    """A lost item goes back to pending; the abandoned job's tokens stay on its bill."""
    conn.execute(
        """UPDATE overnight_batch_items SET status = 'pending', job_id = NULL, broker_epoch = NULL, submitted_at = NULL,
               attempts = attempts + 1, tokens = tokens + %s WHERE overnight_batch_id = %s AND item_no = %s""",
        (tokens, overnight_batch_id, item_no),
    )


def release_item(conn: psycopg.Connection, *, overnight_batch_id: str, item_no: int, job_id: str) -> None:
    """An item whose job never reached the broker goes back to pending (no attempt counted)."""
    conn.execute(
        """UPDATE overnight_batch_items SET status = 'pending', job_id = NULL, broker_epoch = NULL, submitted_at = NULL
           WHERE overnight_batch_id = %s AND item_no = %s AND job_id = %s""",
        (overnight_batch_id, item_no, job_id),
    )


def pending_items(
    conn: psycopg.Connection, *, overnight_batch_id: str, after: int = -1, limit: int = 500
) -> list[tuple[int, str, str]]:
    return [
        (r[0], r[1], r[2])
        for r in conn.execute(
            """SELECT item_no, query, buffer FROM overnight_batch_items
               WHERE overnight_batch_id = %s AND status = 'pending' AND item_no > %s
           ORDER BY item_no LIMIT %s""",
            (overnight_batch_id, after, limit),
        )
    ]


def count_status(conn: psycopg.Connection, *, overnight_batch_id: str, status: str) -> int:
    return int(
        one(
            conn.execute(
                "SELECT count(*) FROM overnight_batch_items WHERE overnight_batch_id = %s AND status = %s",
                (overnight_batch_id, status),
            )
        )[0]
    )


def tokens_spent(conn: psycopg.Connection, *, overnight_batch_id: str) -> int:
    """Tokens of every finished item plus those already logged by the jobs in flight."""
    row = one(
        conn.execute(
            """SELECT (SELECT coalesce(sum(tokens), 0) FROM overnight_batch_items WHERE overnight_batch_id = %(b)s)
                + (SELECT coalesce(sum(c.tokens_in + c.tokens_out), 0) FROM llm_calls c
                   JOIN overnight_batch_items r ON r.job_id = c.job_id
                   WHERE r.overnight_batch_id = %(b)s AND r.status = 'running')""",
            {"b": overnight_batch_id},
        )
    )
    return int(row[0])


def mark_submitted(
    conn: psycopg.Connection,
    *,
    overnight_batch_id: str,
    item_no: int,
    job_id: str,
    cache_key: str,
    broker_epoch: str | None,
) -> None:
    conn.execute(
        """UPDATE overnight_batch_items SET status = 'running', job_id = %s, cache_key = %s, broker_epoch = %s,
               submitted_at = now(), error = NULL WHERE overnight_batch_id = %s AND item_no = %s""",
        (job_id, cache_key, broker_epoch, overnight_batch_id, item_no),
    )


def close_pending(conn: psycopg.Connection, *, overnight_batch_id: str, status: str, error: dict[str, Any]) -> int:
    """Every pending item → ``status`` (skipped by the budget, cancelled with the batch)."""
    return conn.execute(
        """UPDATE overnight_batch_items SET status = %s, error = %s, finished_at = now()
           WHERE overnight_batch_id = %s AND status = 'pending'""",
        (status, Jsonb(error), overnight_batch_id),
    ).rowcount


def running_job_ids(conn: psycopg.Connection, *, overnight_batch_id: str) -> list[tuple[int, str | None]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            """SELECT item_no, job_id FROM overnight_batch_items
               WHERE overnight_batch_id = %s AND status = 'running' ORDER BY item_no""",
            (overnight_batch_id,),
        )
    ]


def buffer_contents(conn: psycopg.Connection, *, tenant: str, names: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Buffer name → (id, content digest) for the result cache's key.

    The digest covers the version, the chunking and embedding settings and every file's path and content
    hash (which the loader stores): a buffer deleted and reloaded under the same name has a new id, and any
    reload that changes what a query can find changes the digest.
    """
    return {
        r[0]: (int(r[1]), r[2])
        for r in conn.execute(
            r"""SELECT b.name, b.id,
                      encode(sha256(convert_to(concat_ws(E'\n', b.version, b.chunker, b.chunk_size, b.chunk_overlap,
                          b.embedding_model, b.embedding_dim,
                          (SELECT string_agg(f.path || E'\t' || f.content_hash, E'\n' ORDER BY f.path)
                           FROM files f WHERE f.buffer_id = b.id)), 'UTF8')), 'hex')
               FROM buffers b WHERE b.tenant = %s AND b.name = ANY(%s)""",
            (tenant, list(set(names))),
        )
    }


# --------------------------------------------------------------------------- reconciler


def claim_stale(conn: psycopg.Connection, *, grace_seconds: float, limit: int = 100) -> list[tuple[str, str]]:
    """Open batches whose next tick is overdue by ``grace_seconds``: each gets a new tick token, atomically.

    Returns (batch id, new token) for the caller to send; two reconcilers never claim the same batch twice.
    """
    rows = conn.execute(
        """WITH stale AS (
               SELECT id FROM overnight_batches
               WHERE status IN ('scheduled', 'running')
                 AND coalesce(next_tick_at, created_at) < now() - make_interval(secs => %s)
               ORDER BY coalesce(next_tick_at, created_at) LIMIT %s
               FOR UPDATE SKIP LOCKED)
           UPDATE overnight_batches b SET tick_token = md5(random()::text || clock_timestamp()::text),
                  next_tick_at = now()
           FROM stale WHERE b.id = stale.id
           RETURNING b.id, b.tick_token""",
        (grace_seconds, limit),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


# --------------------------------------------------------------------------- result cache


def cache_get(conn: psycopg.Connection, *, tenant: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    if not keys:
        return {}
    return {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT cache_key, result FROM result_cache WHERE tenant = %s AND cache_key = ANY(%s)",
            (tenant, list(set(keys))),
        )
    }


def cache_put(conn: psycopg.Connection, *, tenant: str, key: str, buffer: str, result: dict[str, Any]) -> None:
    """Cache under the buffer's row, so deleting the buffer deletes its answers (ON DELETE CASCADE).

    Nothing is cached when the buffer is gone; the key names the buffer id it was computed for, so a row
    attached to a buffer recreated meanwhile is never served for it.
    """
    conn.execute(
        """INSERT INTO result_cache (cache_key, tenant, result, buffer_id)
           SELECT %s, %s, %s, id FROM buffers WHERE tenant = %s AND name = %s
           ON CONFLICT (cache_key) DO UPDATE SET result = EXCLUDED.result, buffer_id = EXCLUDED.buffer_id,
               created_at = now()""",
        (key, tenant, Jsonb(result), tenant, buffer),
    )


# --------------------------------------------------------------------------- cancel


def lock_for_cancel(conn: psycopg.Connection, *, overnight_batch_id: str, tenant: str) -> str | None:
    """Inside a transaction: the tenant's batch row locked (waiting for a tick holding it); its status, or None."""
    row = conn.execute(
        "SELECT status FROM overnight_batches WHERE id = %s AND tenant = %s FOR UPDATE", (overnight_batch_id, tenant)
    ).fetchone()
    return row[0] if row else None


def mark_cancelled(conn: psycopg.Connection, *, overnight_batch_id: str) -> list[str]:
    """Inside a transaction holding the row: close the batch, its pending and running items.

    Returns the job ids that were in flight (the caller cancels the jobs).
    """
    jobs = [j for _, j in running_job_ids(conn, overnight_batch_id=overnight_batch_id) if j]
    cancelled = {"type": "cancelled", "message": "the batch was cancelled"}
    conn.execute(
        """UPDATE overnight_batch_items SET status = 'cancelled', error = %s, finished_at = now()
           WHERE overnight_batch_id = %s AND status IN ('pending', 'running')""",
        (Jsonb(cancelled), overnight_batch_id),
    )
    finish_overnight(conn, overnight_batch_id=overnight_batch_id, status="cancelled")
    return jobs
