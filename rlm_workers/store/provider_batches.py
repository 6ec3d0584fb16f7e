"""SQL for OpenAI Batch API jobs in flight (table ``provider_batches``, docs/contract.md#llm-batch-api).

A row is written only once the provider accepted the batch, in the same transaction that marks its reads
``submitted`` (``store.reads.mark_submitted``); ``finished_at`` is set once every line went back to its read
(status ``routed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from .rows import one

if TYPE_CHECKING:
    import psycopg


@dataclass(frozen=True)
class ProviderBatch:
    id: str
    status: str
    requests: int


def overnight_of(conn: psycopg.Connection, *, overnight_id: str) -> tuple[str, bool, str] | None:
    """(tenant, llm_batch, status) of an overnight batch; None when it is gone."""
    row = conn.execute(
        "SELECT tenant, llm_batch, status FROM overnight_batches WHERE id = %s", (overnight_id,)
    ).fetchone()
    return (row[0], bool(row[1]), row[2]) if row else None


def insert(
    conn: psycopg.Connection,
    *,
    provider_batch_id: str,
    tenant: str,
    overnight_id: str,
    input_file_id: str,
    status: str,
    requests: int,
) -> None:
    conn.execute(
        """INSERT INTO provider_batches (id, tenant, overnight_id, input_file_id, status, requests)
           VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING""",
        (provider_batch_id, tenant, overnight_id, input_file_id, status, requests),
    )


def known(conn: psycopg.Connection, *, ids: Sequence[str]) -> set[str]:
    """Which of these provider batch ids we recorded."""
    if not ids:
        return set()
    return {r[0] for r in conn.execute("SELECT id FROM provider_batches WHERE id = ANY(%s)", (list(ids),))}


def claim_due(conn: psycopg.Connection, *, overnight_id: str, poll_seconds: float) -> list[ProviderBatch]:
    """Open provider batches of an overnight batch not checked for ``poll_seconds``, stamped checked now (so a
    second advance running at the same moment does not poll them too)."""
    rows = conn.execute(
        """UPDATE provider_batches SET checked_at = now()
           WHERE overnight_id = %s AND finished_at IS NULL
             AND (checked_at IS NULL OR checked_at <= now() - make_interval(secs => %s))
           RETURNING id, status, requests""",
        (overnight_id, poll_seconds),
    ).fetchall()
    return [ProviderBatch(r[0], r[1], int(r[2])) for r in sorted(rows)]


def mark_checked(
    conn: psycopg.Connection,
    *,
    provider_batch_id: str,
    status: str,
    output_file_id: str | None,
    error_file_id: str | None,
) -> None:
    conn.execute(
        """UPDATE provider_batches SET status = %s, output_file_id = coalesce(%s, output_file_id),
               error_file_id = coalesce(%s, error_file_id), checked_at = now()
           WHERE id = %s AND finished_at IS NULL""",
        (status, output_file_id, error_file_id, provider_batch_id),
    )


def mark_routed(conn: psycopg.Connection, *, provider_batch_id: str, error: dict[str, Any] | None) -> None:
    """Every line of the batch went back to its read (or the read fell back to an ordinary call)."""
    conn.execute(
        """UPDATE provider_batches SET status = 'routed', finished_at = now(), checked_at = now(), error = %s
           WHERE id = %s AND finished_at IS NULL""",
        (Jsonb(error) if error else None, provider_batch_id),
    )


def open_ids(conn: psycopg.Connection, *, overnight_id: str) -> list[str]:
    """Provider batches of an overnight batch not routed yet."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT id FROM provider_batches WHERE overnight_id = %s AND finished_at IS NULL ORDER BY id",
            (overnight_id,),
        )
    ]


def close_cancelled(conn: psycopg.Connection, *, provider_batch_id: str, status: str, error: dict[str, Any]) -> int:
    """An overnight batch was cancelled: its provider batch is finished with ``status`` and every read still
    waiting on it is closed failed (their jobs were cancelled with the batch).  The reads closed."""
    n = conn.execute(
        """UPDATE reads SET status = 'failed', finished_at = now(), error = %s
           WHERE provider_batch_id = %s AND status IN ('queued', 'submitted')""",
        (Jsonb(error), provider_batch_id),
    ).rowcount
    conn.execute(
        """UPDATE provider_batches SET status = %s, finished_at = now(), checked_at = now(), error = %s
           WHERE id = %s AND finished_at IS NULL""",
        (status, Jsonb(error), provider_batch_id),
    )
    return n


def close_queued_reads(conn: psycopg.Connection, *, overnight_id: str, error: dict[str, Any]) -> int:
    """Reads of a cancelled overnight batch never sent to the provider: closed failed, never sent."""
    return conn.execute(
        """UPDATE reads SET status = 'failed', finished_at = now(), error = %s
           WHERE overnight_id = %s AND status = 'queued'""",
        (Jsonb(error), overnight_id),
    ).rowcount


def open_count(conn: psycopg.Connection, *, overnight_id: str) -> int:
    return int(
        one(
            conn.execute(
                "SELECT count(*) FROM provider_batches WHERE overnight_id = %s AND finished_at IS NULL", (overnight_id,)
            )
        )[0]
    )


def still_queued(conn: psycopg.Connection, *, read_ids: Sequence[int]) -> list[int]:
    if not read_ids:
        return []
    return [
        r[0]
        for r in conn.execute(
            "SELECT id FROM reads WHERE id = ANY(%s) AND status = 'queued' ORDER BY id", (list(read_ids),)
        )
    ]


def close_reads(conn: psycopg.Connection, *, read_ids: Sequence[int]) -> int:
    """Queued reads with nothing left to ask (every member job ended): done without a call."""
    if not read_ids:
        return 0
    return conn.execute(
        "UPDATE reads SET status = 'done', finished_at = now() WHERE id = ANY(%s) AND status = 'queued'",
        (list(read_ids),),
    ).rowcount


def touch_waiting_jobs(conn: psycopg.Connection, *, overnight_id: str) -> int:
    """Mark the open jobs whose reads wait for a provider batch as alive: a batch may take hours, and neither the
    reconciler nor the overnight tick may take them for lost meanwhile."""
    return conn.execute(
        """UPDATE jobs SET stage_at = now()
           WHERE id IN (SELECT m.job_id FROM reads r JOIN read_members m ON m.read_id = r.id
                        WHERE r.overnight_id = %s AND r.status IN ('queued', 'submitted'))
             AND status IN ('queued', 'running')""",
        (overnight_id,),
    ).rowcount
