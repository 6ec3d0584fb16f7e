"""Connections to PostgreSQL: one per CLI command, a pool per worker/API process.

Every connection is checked for pgvector, migrated once per process and URL,
and has the vector type registered, so callers can pass numpy arrays.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import psycopg
from pgvector.psycopg import register_vector
from psycopg_pool import ConnectionPool

from ..config import Settings, get_settings
from ..errors import ServiceUnavailable
from ..runtime.local_servers import database_url, ensure_pgvector
from .migrations import MIGRATION_LOCK, migrate
from .rows import one

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

log = logging.getLogger("rlm.store")
T = TypeVar("T")

_migrated: set[str] = set()
# re-entrant: connection() creates its pool under the lock and migrates through connect() inside it
_migrate_lock = threading.RLock()
_pools: dict[str, ConnectionPool] = {}
#: connections one process's pool opens at most (the API sizes its admission limit from it: rlm_api/app.py)
POOL_MAX_SIZE = 20
#: how long the pool keeps retrying one new connection before it gives up (the next checkout starts again).
#: psycopg_pool doubles its wait between attempts up to this bound (default 5 min): after a long outage its next
#: attempt could be a minute away, and a request waiting for it timed out with the server long back.  5 s keeps
#: the gap between attempts at 2 s at most.
RECONNECT_SECONDS = 5.0


def _prepare(conn: psycopg.Connection, url: str) -> None:
    if url not in _migrated:
        with _migrate_lock:
            if url not in _migrated:
                prev = conn.autocommit
                conn.autocommit = True
                try:
                    # two first starts at once must not race on CREATE EXTENSION
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                        ensure_pgvector(conn)
                    migrate(conn)
                finally:
                    conn.autocommit = prev
                _migrated.add(url)
    register_vector(conn)


def resolve_url(settings: Settings | None = None) -> str:
    return database_url(settings or get_settings())


def connect(settings: Settings | None = None, *, url: str | None = None) -> psycopg.Connection:
    url = url or resolve_url(settings)
    try:
        conn = psycopg.connect(url, connect_timeout=10)
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ServiceUnavailable(f"cannot connect to PostgreSQL: {first}") from exc
    try:
        _prepare(conn, url)
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


class DrainOnDeadConnection:
    """The pool's checkout check: a connection that fails it is replaced, and the pool is drained with it.

    A dead connection means the server restarted or the network dropped, so every idle one died with it.  Found
    one by one, each after the first costs a checkout the pool's doubling pause (1, 2, 4, 8, 16 s): with six or
    more idle connections the first request after PostgreSQL came back waited out the 30 s checkout and got a
    503.  Draining closes them all at once; the next connection is a fresh one."""

    def __init__(self) -> None:
        self.pool: ConnectionPool | None = None

    def __call__(self, conn: psycopg.Connection) -> None:
        try:
            ConnectionPool.check_connection(conn)
        except Exception:
            if self.pool is not None:
                log.warning("database connection found dead (a restart?): replacing every idle one")
                self.pool.drain()
            raise


@contextlib.contextmanager
def connection(settings: Settings | None = None, *, timeout: float | None = None) -> Iterator[psycopg.Connection]:
    """An autocommit connection from this process's pool (workers, API); use conn.transaction() for atomic steps.

    ``timeout``: seconds to wait for a working connection (the pool's 30 s by default) before
    ``psycopg_pool.PoolTimeout``; while PostgreSQL is down the pool keeps waiting for it to come back.
    """
    url = resolve_url(settings)
    pool = _pools.get(url)
    if pool is None:
        with _migrate_lock:
            pool = _pools.get(url)
            if pool is None:
                # Migrate on a plain connection first: the pool's configure hook must stay cheap.
                connect(url=url).close()
                check = DrainOnDeadConnection()
                pool = ConnectionPool(
                    url,
                    min_size=1,
                    max_size=POOL_MAX_SIZE,
                    open=False,
                    configure=lambda c: _prepare(c, url),
                    check=check,
                    reconnect_timeout=RECONNECT_SECONDS,
                    kwargs={"connect_timeout": 10, "autocommit": True},
                    name="rlm",
                )
                check.pool = pool
                pool.open()
                _pools[url] = pool
    with pool.connection(timeout=timeout) as conn:
        yield conn


def session_lock_key(space: int, name: str) -> int:
    """An advisory lock key: a 32-bit space (one per kind of thing locked) and a hash of the thing's id."""
    return space << 32 | zlib.crc32(name.encode())


def try_session_lock(conn: psycopg.Connection, key: int) -> bool:
    """A session advisory lock, held until ``release_session_lock`` or until the connection closes (a dead
    worker's lock goes with it); False when another session holds it."""
    return bool(one(conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)))[0])


def release_session_lock(conn: psycopg.Connection, key: int) -> None:
    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))


def held_session_locks(conn: psycopg.Connection, space: int) -> set[int]:
    """Keys of ``space``'s session advisory locks some session of this database holds, shared or not.

    A lock goes with its session: a worker killed while it works leaves none, so a key missing here says that
    nobody works on its thing any more, with no lease to wait out (docs/architecture.md#redelivery)."""
    rows = conn.execute(
        """SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
           WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND classid::bigint = %s
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())""",
        (space,),
    ).fetchall()
    return {int(r[0]) for r in rows}


def transaction_lock(conn: psycopg.Connection, key: int) -> None:
    """Wait for an advisory lock held until the caller's transaction ends."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))


def commit(conn: psycopg.Connection) -> None:
    """End the caller's transaction on a plain connection (CLI, tests); pooled ones are autocommit."""
    if not conn.autocommit:
        conn.commit()


def close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


def _outage_errors() -> tuple[type[BaseException], ...]:
    return (psycopg.OperationalError, psycopg.InterfaceError, ServiceUnavailable)


#: PostgreSQL gone (restart, failover, network; a pool checkout that timed out is an OperationalError too):
#: wait and try again rather than fail the job
DB_OUTAGE: tuple[type[BaseException], ...] = _outage_errors()

#: how long a write of something already paid for (LLM output, its usage) waits for PostgreSQL
DURABLE_WRITE_SECONDS = 180.0
#: how long a durable write waits for a pooled connection before it counts as an outage (and says so)
CHECKOUT_SECONDS = 3.0


def durable_write(conn: psycopg.Connection | None, fn: Callable[[psycopg.Connection], T], *, what: str) -> T:
    """Run ``fn(conn)`` (on a pooled connection when ``conn`` is None); while the database is away, retry
    on fresh pooled connections until it is back or ``DURABLE_WRITE_SECONDS`` have passed.

    For writes whose inputs cost money (an LLM answer): retrying the whole task would buy them again.
    """
    # A short checkout wait: a pool quietly waiting out an outage would leave operators no trace of it.
    try:
        if conn is not None:
            return fn(conn)
        with connection(timeout=CHECKOUT_SECONDS) as fresh:
            return fn(fresh)
    except DB_OUTAGE as exc:
        last = exc
    deadline = time.monotonic() + DURABLE_WRITE_SECONDS
    delay = 0.5
    while True:
        log.warning("database unavailable while saving %s (%s); retrying in %.1fs", what, last, delay)
        time.sleep(delay)
        try:
            with connection(timeout=CHECKOUT_SECONDS) as fresh:
                return fn(fresh)
        except DB_OUTAGE as exc:
            last = exc
            if time.monotonic() > deadline:
                raise
            delay = min(10.0, delay * 2)
