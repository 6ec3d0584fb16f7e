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


def test_vectors_of_a_shared_table_move_to_one_table_per_buffer(test_services):
    """m011: a data dir from before keeps every vector, now in its buffer's own indexed table."""
    url = test_services.new_database("vecmove")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        migrations.applied(conn)
        for name, sql in migrations.MIGRATIONS:
            if name == "m011_vectors_per_buffer":
                break
            conn.execute(sql)
            conn.execute("INSERT INTO rlm_migrations (name) VALUES (%s)", (name,))
        # the shared table as the release before created it, holding two buffers' windows
        conn.execute(
            """CREATE TABLE chunk_embeddings_d3 (
                   chunk_id bigint NOT NULL REFERENCES chunks(id) ON DELETE CASCADE, buffer_id bigint NOT NULL,
                   win smallint NOT NULL, embedding vector(3) NOT NULL, PRIMARY KEY (chunk_id, win));
               CREATE INDEX chunk_embeddings_d3_hnsw ON chunk_embeddings_d3 USING hnsw (embedding vector_cosine_ops)"""
        )
        ids = {}
        for name in ("a", "b", "empty"):
            ids[name] = conn.execute(
                "INSERT INTO buffers (name, embedding_model, embedding_dim) VALUES (%s, 'm', %s) RETURNING id",
                (name, None if name == "empty" else 3),
            ).fetchone()[0]
        (file_id,) = conn.execute(
            "INSERT INTO files (buffer_id, path, content_hash, size_bytes, chunk_count) "
            "VALUES (%s, 'f', 'h', 1, 1) RETURNING id",
            (ids["a"],),
        ).fetchone()
        for n, buf in enumerate(("a", "a", "b")):
            (cid,) = conn.execute(
                "INSERT INTO chunks (buffer_id, file_id, ordinal, seq, path, start_line, end_line, start_byte, "
                "end_byte, text, token_count, content_hash, terms) "
                "VALUES (%s, %s, %s, %s, 'f', 1, 1, 0, 1, 't', 1, 'h', 't') RETURNING id",
                (ids[buf], file_id, n, n),
            ).fetchone()
            conn.execute(
                "INSERT INTO chunk_embeddings_d3 VALUES (%s, %s, 0, %s), (%s, %s, 1, %s)",
                (cid, ids[buf], f"[1,{n},0]", cid, ids[buf], f"[0,1,{n}]"),
            )

        names = [name for name, _ in migrations.MIGRATIONS]
        # every migration from m011 on (later ones included, so a new migration does not break this test)
        assert migrations.migrate(conn) == names[names.index("m011_vectors_per_buffer") :]

        def count(buf: str) -> int:
            return conn.execute(f"SELECT count(*) FROM chunk_vectors_b{ids[buf]}").fetchone()[0]

        assert (count("a"), count("b")) == (4, 2)
        assert conn.execute("SELECT to_regclass('chunk_embeddings_d3')").fetchone()[0] is None
        assert conn.execute(f"SELECT to_regclass('chunk_vectors_b{ids['empty']}')").fetchone()[0] is None
        indexed = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE indexname = ANY(%s) AND indexdef LIKE '%%hnsw%%'",
            ([f"chunk_vectors_b{ids[b]}_hnsw" for b in ("a", "b")],),
        ).fetchone()[0]
        assert indexed == 2
        labels = dict(conn.execute("SELECT name, embedding_windows FROM buffers").fetchall())
        assert labels == {"a": "tokens:254/32", "b": "tokens:254/32", "empty": None}
        # m012: everything embedded before runtimes were recorded was embedded by PyTorch
        runtimes = dict(conn.execute("SELECT name, embedding_runtime FROM buffers").fetchall())
        assert runtimes == {"a": "torch", "b": "torch", "empty": None}
