"""Shared reads (docs/contract.md#shared-reads): one analyst call over one chunk batch for several (job, batch).

A read's members are the (job, batch) pairs it answers; each member's question is numbered in the read's
message (``question_no``).  The read's status says where its call is: ``pending`` (a ``rlm.read`` task was
sent), ``queued`` (waiting to go out in an OpenAI Batch API file), ``submitted`` (in one), ``done``, ``failed``.
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
class ReadRow:
    id: int
    tenant: str
    overnight_id: str | None
    chunk_ids: list[int]
    status: str
    llm_batch: bool


@dataclass(frozen=True)
class Member:
    job_id: str
    batch_no: int
    question_no: int


@dataclass(frozen=True)
class ParkedJob:
    """A job of an overnight batch's read group, as the tick sees it when deciding to launch the group."""

    job_id: str
    group: str
    stage: str
    status: str
    launched: bool


def create_read(
    conn: psycopg.Connection,
    *,
    tenant: str,
    overnight_id: str | None,
    chunk_ids: Sequence[int],
    members: Sequence[tuple[str, int]],
    llm_batch: bool,
) -> int:
    """A read and its members (question numbers in the order given)."""
    read_id = one(
        conn.execute(
            """INSERT INTO reads (tenant, overnight_id, chunk_ids, status, llm_batch)
           VALUES (%s, %s, %s, %s, %s) RETURNING id""",
            (tenant, overnight_id, list(chunk_ids), "queued" if llm_batch else "pending", llm_batch),
        )
    )[0]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO read_members (read_id, job_id, batch_no, question_no) VALUES (%s, %s, %s, %s)",
            [(read_id, job_id, batch_no, n) for n, (job_id, batch_no) in enumerate(members, 1)],
        )
    return int(read_id)


def get_read(conn: psycopg.Connection, *, read_id: int) -> ReadRow | None:
    row = conn.execute(
        "SELECT id, tenant, overnight_id, chunk_ids, status, llm_batch FROM reads WHERE id = %s", (read_id,)
    ).fetchone()
    return ReadRow(row[0], row[1], row[2], list(row[3]), row[4], row[5]) if row else None


def members_of(conn: psycopg.Connection, *, read_id: int) -> list[Member]:
    return [
        Member(r[0], r[1], r[2])
        for r in conn.execute(
            "SELECT job_id, batch_no, question_no FROM read_members WHERE read_id = %s ORDER BY question_no",
            (read_id,),
        )
    ]


def pending_members(conn: psycopg.Connection, *, read_id: int) -> list[Member]:
    """The members whose batch is still pending (not answered, failed or salvaged since the read was made)."""
    return [
        Member(r[0], r[1], r[2])
        for r in conn.execute(
            """SELECT m.job_id, m.batch_no, m.question_no FROM read_members m
               JOIN job_batches b ON b.job_id = m.job_id AND b.batch_no = m.batch_no
               WHERE m.read_id = %s AND b.status = 'pending' ORDER BY m.question_no""",
            (read_id,),
        )
    ]


def set_status(conn: psycopg.Connection, *, read_id: int, status: str, error: dict[str, Any] | None = None) -> None:
    final = status in ("done", "failed")
    conn.execute(
        """UPDATE reads SET status = %s, error = coalesce(%s, error),
                            finished_at = CASE WHEN %s THEN now() ELSE finished_at END
           WHERE id = %s""",
        (status, Jsonb(error) if error else None, final, read_id),
    )


def queued_reads(conn: psycopg.Connection, *, overnight_id: str, limit: int) -> list[int]:
    """Reads waiting for a provider batch, oldest first, locked for the caller's transaction (a concurrent
    caller skips them, so no read goes out twice)."""
    return [
        r[0]
        for r in conn.execute(
            """SELECT id FROM reads WHERE overnight_id = %s AND status = 'queued'
               ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED""",
            (overnight_id, limit),
        )
    ]


def mark_submitted(conn: psycopg.Connection, *, read_ids: Sequence[int], provider_batch_id: str) -> None:
    conn.execute(
        "UPDATE reads SET status = 'submitted', provider_batch_id = %s WHERE id = ANY(%s)",
        (provider_batch_id, list(read_ids)),
    )


def reads_of_provider_batch(conn: psycopg.Connection, *, provider_batch_id: str) -> list[tuple[int, str]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT id, status FROM reads WHERE provider_batch_id = %s ORDER BY id", (provider_batch_id,)
        )
    ]


def job_ids_of_reads(conn: psycopg.Connection, *, read_ids: Sequence[int]) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT job_id FROM read_members WHERE read_id = ANY(%s) ORDER BY job_id", (list(read_ids),)
        )
    ]


def open_reads_of_overnight(conn: psycopg.Connection, *, overnight_id: str) -> int:
    """Reads of the batch still waiting for a provider batch (queued or submitted)."""
    return int(
        one(
            conn.execute(
                "SELECT count(*) FROM reads WHERE overnight_id = %s AND status IN ('queued', 'submitted')",
                (overnight_id,),
            )
        )[0]
    )


# --------------------------------------------------------------------------- groups (the overnight tick)


def parked_jobs(conn: psycopg.Connection, *, overnight_id: str) -> list[ParkedJob]:
    """The jobs of the batch's running items that belong to a read group."""
    return [
        ParkedJob(r[0], r[1], r[2], r[3], bool(r[4]))
        for r in conn.execute(
            """SELECT j.id, j.spec->>'read_group', j.stage, j.status, cardinality(j.task_ids) > 0
               FROM overnight_batch_items i JOIN jobs j ON j.id = i.job_id
               WHERE i.overnight_batch_id = %s AND i.status = 'running' AND j.spec ? 'read_group'""",
            (overnight_id,),
        )
    ]


def batches_of_jobs(conn: psycopg.Connection, *, job_ids: Sequence[str]) -> list[tuple[str, int, list[int]]]:
    """(job, batch no, chunk ids) of the jobs' pending analyst batches."""
    return [
        (r[0], r[1], list(r[2]))
        for r in conn.execute(
            """SELECT job_id, batch_no, chunk_ids FROM job_batches
               WHERE job_id = ANY(%s) AND status = 'pending' ORDER BY job_id, batch_no""",
            (list(job_ids),),
        )
    ]


def flip_to_collect(conn: psycopg.Connection, *, job_id: str) -> bool:
    """Move a job waiting on its reads on to collect once none of its batches is pending; True for the one
    caller that moved it (so exactly one ``rlm.collect`` is sent)."""
    return (
        conn.execute(
            """UPDATE jobs SET stage = 'collect', stage_at = now()
               WHERE id = %s AND stage = 'fan_out' AND status IN ('queued', 'running')
                 AND NOT EXISTS (SELECT 1 FROM job_batches WHERE job_id = %s AND status = 'pending')""",
            (job_id, job_id),
        ).rowcount
        > 0
    )


def read_tokens(conn: psycopg.Connection, *, overnight_id: str) -> tuple[int, int, int]:
    """The batch's analyst input tokens as billed, as they would have been without shared reads, and of them
    those served from the provider's prompt cache (the items' current jobs)."""
    row = one(
        conn.execute(
            """SELECT coalesce(sum(c.tokens_in), 0), coalesce(sum(coalesce(c.solo_tokens_in, c.tokens_in)), 0),
                  coalesce(sum(c.cached_tokens), 0)
           FROM overnight_batch_items i JOIN llm_calls c ON c.job_id = i.job_id
           WHERE i.overnight_batch_id = %s AND c.stage = 'analyst'""",
            (overnight_id,),
        )
    )
    return int(row[0]), int(row[1]), int(row[2])
