"""Real services for tests: the machine's when URLs are given, else embedded ones.

``RLM_TEST_DATABASE_URL`` (PostgreSQL with pgvector) and ``RLM_TEST_BROKER_URL``
(Redis) point the suite at existing servers; otherwise one embedded PostgreSQL
and one embedded Valkey are started under a temporary data dir for the whole
session (per pytest process: each xdist worker has its own; given URLs are shared, each worker on its own
Redis database), and stopped and removed at the end.  They never stop for being idle
(a module may spend longer than any idle time without touching them); a killed
run's servers are stopped by their watchers once the temp dir is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rlm_workers.runtime.local_servers import start_lock


@dataclass
class TestServices:
    data_dir: Path
    admin_url: str
    broker_url: str
    embedded_pg: bool
    embedded_valkey: bool

    def new_database(self, prefix: str = "t") -> str:
        """A fresh database on the same server: tests never see each other's buffers."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return with_database(self.admin_url, name)

    def stop(self) -> None:
        from rlm_workers.runtime import local_servers as services

        if self.embedded_valkey:
            services.stop_embedded_valkey(self.data_dir)
        if self.embedded_pg:
            services.stop_embedded_postgres(self.data_dir)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def worker_database(url: str, worker: str | None) -> str:
    """The broker URL for one xdist worker (``gw0``, ``gw1``, ...): the given database number plus the worker's,
    so a module's ``flushdb`` and the global queue names never reach another worker's modules."""
    if not worker or not worker.startswith("gw"):
        return url
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit((parts.scheme, parts.netloc, f"/{base + int(worker[2:])}", parts.query, parts.fragment))


@contextlib.contextmanager
def embedded_start_lock() -> Iterator[None]:
    """One embedded start at a time on this machine: run as root, pgserver creates its system user on first use,
    and two pytest processes (xdist workers) that both find it missing race ``useradd`` (one of them fails)."""
    with start_lock(Path(tempfile.gettempdir()) / "rlm-test-embedded-start.lock"):
        yield


def run_data_dir(prefix: str) -> Path:
    """A new data dir for a test process's embedded servers, under the run's directory (tests/conftest.py makes
    it and removes it at the end, which stops the servers of a process that never reached its teardown)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("RLM_TEST_RUN_DIR")))


def start_services(data_dir: Path) -> TestServices:
    from rlm_workers.runtime import local_servers as services

    pg = os.environ.get("RLM_TEST_DATABASE_URL")
    redis_url = os.environ.get("RLM_TEST_BROKER_URL")
    with embedded_start_lock():
        admin = pg or services.embedded_postgres_url(data_dir, idle_seconds=0)
        broker = redis_url or services.embedded_valkey_url(data_dir, idle_seconds=0)
    if redis_url:
        broker = worker_database(redis_url, os.environ.get("PYTEST_XDIST_WORKER"))
    return TestServices(
        data_dir=data_dir,
        admin_url=admin,
        broker_url=broker,
        embedded_pg=pg is None,
        embedded_valkey=redis_url is None,
    )
