"""Schema upgrades: an older data dir gains new migrations and keeps its data."""

from __future__ import annotations

import psycopg

from rlm_workers.store import migrations


def test_old_schema_is_upgraded_in_place(test_services):
    url = test_services.new_database("mig")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        # a data dir created by the first release: only m001 applied
        migrations.applied(conn)
        first_name, first_sql = migrations.MIGRATIONS[0]
        conn.execute(first_sql)
        conn.execute("INSERT INTO rlm_migrations (name) VALUES (%s)", (first_name,))
        conn.execute("INSERT INTO buffers (name, version) VALUES ('old', 7)")
        assert migrations.schema_version(conn) == first_name

        applied_now = migrations.migrate(conn)
        assert applied_now == [name for name, _ in migrations.MIGRATIONS[1:]]
        assert migrations.schema_version(conn) == migrations.MIGRATIONS[-1][0]
        assert conn.execute("SELECT version FROM buffers WHERE name = 'old'").fetchone() == (7,)
        assert migrations.migrate(conn) == []


def test_migration_names_are_ordered_and_unique():
    names = [name for name, _ in migrations.MIGRATIONS]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(name.startswith(f"m{i + 1:03d}_") for i, name in enumerate(names))


def test_concurrent_first_start_applies_each_migration_once(test_services):
    import threading

    url = test_services.new_database("race")
    results: list[list[str]] = []

    def start():
        from rlm_workers.local_servers import ensure_pgvector

        with psycopg.connect(url, autocommit=True) as conn:
            with conn.transaction():  # what store.db does on a first start: the extension under the lock
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (migrations.MIGRATION_LOCK,))
                ensure_pgvector(conn)
            results.append(migrations.migrate(conn))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(threads)  # no thread died on the way
    flat = [name for r in results for name in r]
    assert sorted(flat) == sorted(name for name, _ in migrations.MIGRATIONS)
