"""Read-only probes and aggregates for the health routes (``/readyz``, ``/metrics``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import psycopg


class StageTotal(NamedTuple):
    stage: str
    seconds: float
    count: int


class CallTotal(NamedTuple):
    model: str
    status: str
    calls: int
    tokens_in: int
    tokens_out: int


def ping(conn: psycopg.Connection) -> None:
    """A round trip: raises if the server does not answer."""
    conn.execute("SELECT 1")


def jobs_by_status(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return [(r[0], r[1]) for r in conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")]


def stage_totals(conn: psycopg.Connection) -> list[StageTotal]:
    """Summed wall time and count per stage over every job's ``timings``."""
    return [
        StageTotal(*r)
        for r in conn.execute(
            """SELECT t.key, sum(t.value::float8), count(*) FROM jobs, jsonb_each_text(jobs.timings) t
           GROUP BY t.key"""
        )
    ]


def call_totals(conn: psycopg.Connection) -> list[CallTotal]:
    """Logged LLM calls and their tokens per (model, status)."""
    return [
        CallTotal(*r)
        for r in conn.execute(
            """SELECT model, status, count(*), coalesce(sum(tokens_in), 0), coalesce(sum(tokens_out), 0)
           FROM llm_calls GROUP BY model, status"""
        )
    ]
