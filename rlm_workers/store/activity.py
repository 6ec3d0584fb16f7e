"""Who is connected to the PostgreSQL server: the embedded server's watcher and `rlm up` ask before stopping it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .rows import one

if TYPE_CHECKING:
    import psycopg


def client_connections(conn: psycopg.Connection, *, ignore_application: str) -> int:
    """Client connections other than this one and those named ``ignore_application`` (the watcher's own).

    Background processes (autovacuum, walwriter, ...) are not clients: only ``client backend`` counts.
    """
    row = one(
        conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid() AND coalesce(application_name, '') <> %s",
            (ignore_application,),
        )
    )
    return int(row[0])
