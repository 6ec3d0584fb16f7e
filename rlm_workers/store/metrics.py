"""Read-only probes for the health routes (``/readyz``, ``/metrics``).

Everything else ``/metrics`` shows is counted in Redis as the work happens (``rlm_workers/runtime/metrics.py``):
nothing here may aggregate a whole table per scrape."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg


def ping(conn: psycopg.Connection) -> None:
    """A round trip: raises if the server does not answer."""
    conn.execute("SELECT 1")


def jobs_in_flight(conn: psycopg.Connection) -> dict[str, int]:
    """Queued and running jobs by status, read from the partial index ``jobs_unfinished`` (its size is the work
    in flight, not the history)."""
    rows = conn.execute(
        "SELECT status, count(*) FROM jobs WHERE status IN ('queued', 'running') GROUP BY status"
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}
