"""Real services for tests: the machine's when URLs are given, else embedded ones.

``RLM_TEST_DATABASE_URL`` (PostgreSQL with pgvector) and ``RLM_TEST_BROKER_URL``
(Redis) point the suite at existing servers; otherwise one embedded PostgreSQL
and one embedded Valkey are started under a temporary data dir for the whole
session, and stopped and removed at the end.  They never stop for being idle
(a module may spend longer than any idle time without touching them); a killed
run's servers are stopped by their watchers once the temp dir is removed.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


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


def start_services(data_dir: Path) -> TestServices:
    from rlm_workers.runtime import local_servers as services

    pg = os.environ.get("RLM_TEST_DATABASE_URL")
    redis_url = os.environ.get("RLM_TEST_BROKER_URL")
    admin = pg or services.embedded_postgres_url(data_dir, idle_seconds=0)
    broker = redis_url or services.embedded_valkey_url(data_dir, idle_seconds=0)
    return TestServices(
        data_dir=data_dir,
        admin_url=admin,
        broker_url=broker,
        embedded_pg=pg is None,
        embedded_valkey=redis_url is None,
    )
