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
        from rlm_workers.runtime.local_servers import ensure_pgvector

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

        # the staging table of ingest groups as a release before m020 made it on first use
        conn.execute(
            """CREATE TABLE ingest_staged_vectors (
                   upload_id text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE, group_no integer NOT NULL,
                   chunk_id bigint NOT NULL, win smallint NOT NULL, embedding halfvec NOT NULL)"""
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
        # m020: every window table gains its span columns, NULL for the rows stored before (cut again when shown)
        for table in (f"chunk_vectors_b{ids['a']}", f"chunk_vectors_b{ids['b']}", "ingest_staged_vectors"):
            cols = {
                r[0]
                for r in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0", (table,)
                )
            }
            assert {"span_start", "span_end"} <= cols, table
        assert conn.execute(f"SELECT count(*), count(span_start) FROM chunk_vectors_b{ids['a']}").fetchone() == (4, 0)


def test_overnight_batches_keep_their_rows_under_their_new_names(test_services):
    """m018: a data dir from before keeps its overnight batches, items and the provider batch and read that
    point at them; only the names change, and deleting a batch still cascades."""
    url = test_services.new_database("overnightnames")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        migrations.applied(conn)
        for name, sql in migrations.MIGRATIONS:
            if name == "m018_overnight_batch_names":
                break
            conn.execute(sql)
            conn.execute("INSERT INTO rlm_migrations (name) VALUES (%s)", (name,))
        conn.execute(
            "INSERT INTO batches (id, tenant, status, idempotency_key, llm_batch) "
            "VALUES ('b-old', 'local', 'running', 'k1', true), ('b-done', 'local', 'done', NULL, false)"
        )
        conn.execute(
            "INSERT INTO batch_items (batch_id, item_no, query, buffer, status) "
            "VALUES ('b-old', 0, 'q0', 'alpha', 'done'), ('b-old', 1, 'q1', 'alpha', 'pending'), "
            "('b-done', 0, 'q', 'beta', 'done')"
        )
        conn.execute(
            "INSERT INTO provider_batches (id, tenant, overnight_id, input_file_id, status, requests) "
            "VALUES ('pb-1', 'local', 'b-old', 'file-1', 'in_progress', 1)"
        )
        conn.execute(
            "INSERT INTO reads (tenant, overnight_id, chunk_ids, status, provider_batch_id) "
            "VALUES ('local', 'b-old', '{1}', 'submitted', 'pb-1')"
        )

        names = [name for name, _ in migrations.MIGRATIONS]
        assert migrations.migrate(conn) == names[names.index("m018_overnight_batch_names") :]
        assert migrations.migrate(conn) == []

        assert conn.execute("SELECT to_regclass('batches'), to_regclass('batch_items')").fetchone() == (None, None)
        batches = conn.execute("SELECT id, status, llm_batch FROM overnight_batches ORDER BY id").fetchall()
        assert batches == [("b-done", "done", False), ("b-old", "running", True)]
        items = conn.execute(
            "SELECT overnight_batch_id, item_no, status FROM overnight_batch_items ORDER BY 1, 2"
        ).fetchall()
        assert items == [("b-done", 0, "done"), ("b-old", 0, "done"), ("b-old", 1, "pending")]
        indexes = {
            r[0]
            for r in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename IN ('overnight_batches', 'overnight_batch_items')"
            )
        }
        assert indexes == {
            "overnight_batches_pkey",
            "overnight_batches_tenant_created",
            "overnight_batches_open",
            "overnight_batches_idempotency",
            "overnight_batch_items_pkey",
            "overnight_batch_items_open",
            "overnight_batch_items_job",
        }
        # the idempotency index still answers ON CONFLICT as store/overnight.py writes it
        again = conn.execute(
            "INSERT INTO overnight_batches (id, tenant, idempotency_key) VALUES ('b-new', 'local', 'k1') "
            "ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id"
        ).fetchone()
        assert again is None
        conn.execute("DELETE FROM overnight_batches WHERE id = 'b-old'")
        left = conn.execute(
            "SELECT (SELECT count(*) FROM overnight_batch_items), (SELECT count(*) FROM provider_batches), "
            "(SELECT count(*) FROM reads)"
        ).fetchone()
        assert left == (1, 0, 0)
