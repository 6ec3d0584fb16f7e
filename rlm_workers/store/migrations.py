"""Append-only schema migrations, recorded in ``rlm_migrations``.

Each migration is a name and SQL; they are applied in order, once, under a
PostgreSQL advisory lock so two processes starting together cannot race.
Never edit a shipped migration: add ``m00N_…`` instead, so an existing data
directory upgrades by running only what it lacks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .rows import one

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.store")

#: arbitrary constant: the advisory lock key for schema changes
MIGRATION_LOCK = 727_272_001

M001_INITIAL = """
CREATE TABLE buffers (
    id              bigserial PRIMARY KEY,
    tenant          text NOT NULL DEFAULT 'local',
    name            text NOT NULL,
    version         integer NOT NULL DEFAULT 0,
    chunker         text,
    chunk_size      integer,
    chunk_overlap   integer,
    embedding_model text,
    embedding_dim   integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant, name)
);

CREATE TABLE files (
    id            bigserial PRIMARY KEY,
    buffer_id     bigint NOT NULL REFERENCES buffers(id) ON DELETE CASCADE,
    path          text NOT NULL,
    content_hash  text NOT NULL,
    size_bytes    bigint NOT NULL,
    chunk_count   integer NOT NULL,
    loaded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (buffer_id, path)
);

CREATE TABLE chunks (
    id            bigserial PRIMARY KEY,
    buffer_id     bigint NOT NULL REFERENCES buffers(id) ON DELETE CASCADE,
    file_id       bigint NOT NULL REFERENCES files(id) ON DELETE CASCADE,
    ordinal       integer NOT NULL,
    seq           integer NOT NULL,
    path          text NOT NULL,
    start_line    integer NOT NULL,
    end_line      integer NOT NULL,
    start_byte    bigint NOT NULL,
    end_byte      bigint NOT NULL,
    text          text NOT NULL,
    token_count   integer NOT NULL,
    content_hash  text NOT NULL,
    -- BM25 tokens, space separated: rebuilding the index never re-tokenises
    terms         text NOT NULL DEFAULT ''
);
CREATE INDEX chunks_buffer_ordinal ON chunks (buffer_id, ordinal);
CREATE INDEX chunks_file ON chunks (file_id);
"""

M002_JOBS = """
CREATE TABLE jobs (
    id              text PRIMARY KEY,
    tenant          text NOT NULL DEFAULT 'local',
    status          text NOT NULL DEFAULT 'queued',
    stage           text NOT NULL DEFAULT 'queued',
    query           text NOT NULL,
    buffers         text[] NOT NULL,
    options         jsonb NOT NULL DEFAULT '{}',
    plan            jsonb,
    params          jsonb,
    scaling_tier    text,
    chunks_available integer,
    chunk_load_failures integer NOT NULL DEFAULT 0,
    batches_total   integer NOT NULL DEFAULT 0,
    collected       jsonb,
    result          jsonb,
    error           jsonb,
    timings         jsonb NOT NULL DEFAULT '{}',
    task_ids        text[] NOT NULL DEFAULT '{}',
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz
);
CREATE INDEX jobs_tenant_created ON jobs (tenant, created_at DESC);
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_unfinished ON jobs (status) WHERE status IN ('queued', 'running');

CREATE TABLE job_batches (
    job_id      text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    batch_no    integer NOT NULL,
    chunk_ids   bigint[] NOT NULL,
    status      text NOT NULL DEFAULT 'pending',
    error       jsonb,
    attempts    integer NOT NULL DEFAULT 0,
    started_at  timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (job_id, batch_no)
);

CREATE TABLE job_findings (
    job_id     text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    batch_no   integer NOT NULL,
    chunk_id   bigint NOT NULL,
    relevance  text NOT NULL,
    findings   jsonb NOT NULL DEFAULT '[]',
    summary    text NOT NULL DEFAULT '',
    follow_up  jsonb NOT NULL DEFAULT '[]',
    PRIMARY KEY (job_id, batch_no, chunk_id)
);

CREATE TABLE llm_calls (
    id          bigserial PRIMARY KEY,
    job_id      text REFERENCES jobs(id) ON DELETE CASCADE,
    stage       text NOT NULL,
    batch_no    integer,
    provider    text NOT NULL,
    model       text NOT NULL,
    tokens_in   integer NOT NULL DEFAULT 0,
    tokens_out  integer NOT NULL DEFAULT 0,
    latency_ms  integer NOT NULL DEFAULT 0,
    status      text NOT NULL,
    error       text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX llm_calls_job ON llm_calls (job_id);
"""

M003_API = """
CREATE TABLE api_keys (
    id          bigserial PRIMARY KEY,
    tenant      text NOT NULL,
    -- sha256 of the whole key; the key itself is shown once and never stored
    key_hash    text NOT NULL UNIQUE,
    -- the first characters, so an operator can tell keys apart in `rlm keys list`
    prefix      text NOT NULL,
    name        text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant);

CREATE TABLE batches (
    id              text PRIMARY KEY,
    tenant          text NOT NULL,
    options         jsonb NOT NULL DEFAULT '{}',
    run_at          timestamptz NOT NULL DEFAULT now(),
    priority        integer NOT NULL DEFAULT 3,
    token_budget    bigint,
    status          text NOT NULL DEFAULT 'scheduled',
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz,
    last_tick_at    timestamptz
);
CREATE INDEX batches_tenant_created ON batches (tenant, created_at DESC);
CREATE INDEX batches_open ON batches (status) WHERE status IN ('scheduled', 'running');
CREATE UNIQUE INDEX batches_idempotency ON batches (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;

CREATE TABLE batch_items (
    batch_id    text NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    item_no     integer NOT NULL,
    query       text NOT NULL,
    buffer      text NOT NULL,
    -- pending (not submitted) | running (job submitted) | done | failed | cancelled | skipped (budget)
    status      text NOT NULL DEFAULT 'pending',
    job_id      text REFERENCES jobs(id) ON DELETE SET NULL,
    cache_key   text,
    from_cache  boolean NOT NULL DEFAULT false,
    result      jsonb,
    error       jsonb,
    tokens      bigint NOT NULL DEFAULT 0,
    submitted_at timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (batch_id, item_no)
);
CREATE INDEX batch_items_open ON batch_items (batch_id, status);

-- Finished answers keyed by (query, buffer version, parameters, models): an identical item is served
-- from here with no LLM call.
CREATE TABLE result_cache (
    cache_key   text PRIMARY KEY,
    tenant      text NOT NULL,
    result      jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"""

M004_JOB_STAGE_TIME = """
-- when the job last changed stage (or showed progress): the reconciler's measure of "stuck"
ALTER TABLE jobs ADD COLUMN stage_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX jobs_open_stage_at ON jobs (stage_at) WHERE status IN ('queued', 'running');
"""

M005_BATCH_RECOVERY = """
-- The tick chain of a batch: only the tick holding the current token re-arms itself; the reconciler
-- starts a new chain (new token) when next_tick_at is long past (the tick message was lost).
ALTER TABLE batches ADD COLUMN tick_token text;
ALTER TABLE batches ADD COLUMN next_tick_at timestamptz;
-- The broker epoch an item's job was enqueued under: a Redis that lost its data gets a new epoch,
-- so the job's messages are known lost.  attempts counts resubmissions after a loss.
ALTER TABLE batch_items ADD COLUMN broker_epoch text;
ALTER TABLE batch_items ADD COLUMN attempts integer NOT NULL DEFAULT 0;
CREATE INDEX batch_items_job ON batch_items (job_id) WHERE job_id IS NOT NULL;
"""

M006_UPLOADS = """
-- Uploads queued for the ingest workers: the files wait here until one loads them, then go.
CREATE TABLE uploads (
    id          text PRIMARY KEY,
    tenant      text NOT NULL,
    buffer      text NOT NULL,
    options     jsonb NOT NULL,
    status      text NOT NULL DEFAULT 'queued' CHECK (status IN ('queued', 'running', 'done', 'failed')),
    report      jsonb,
    error       jsonb,
    files       integer NOT NULL,
    bytes       bigint NOT NULL,
    attempts    integer NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- when its rlm.ingest was last sent: the reconciler re-sends an open upload that sat too long
    sent_at     timestamptz NOT NULL DEFAULT now(),
    started_at  timestamptz,
    finished_at timestamptz
);
CREATE INDEX uploads_open ON uploads (sent_at) WHERE status IN ('queued', 'running');
CREATE TABLE upload_files (
    upload_id text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE,
    path      text NOT NULL,
    data      bytea NOT NULL,
    PRIMARY KEY (upload_id, path)
);
"""

M007_SYNTHESIS_LEASE = """
-- The synthesizing worker's lease on its job: renewed by its heartbeat, it lapses only when that worker
-- is gone, and until then no salvage writes a second report (docs/architecture.md "Locks").
ALTER TABLE jobs ADD COLUMN lease_owner text;
ALTER TABLE jobs ADD COLUMN lease_until timestamptz;
"""

M008_BATCH_TICKS_AND_CACHE = """
-- A tick that keeps failing (not a database outage) is counted; past a few in a row the batch is closed
-- with its open items failed, instead of being re-armed by the reconciler forever.
ALTER TABLE batches ADD COLUMN tick_failures integer NOT NULL DEFAULT 0;
-- A cached answer belongs to the buffer whose content produced it and goes with it. Rows from before were
-- keyed on the buffer's name and version, which restart when a buffer is deleted and recreated: they may
-- answer for deleted content, so they are dropped (a cache only costs a recomputation).
DELETE FROM result_cache;
ALTER TABLE result_cache ADD COLUMN buffer_id bigint NOT NULL REFERENCES buffers(id) ON DELETE CASCADE;
CREATE INDEX result_cache_buffer ON result_cache (buffer_id);
"""

# A batch's Idempotency-Key remembers a fingerprint of the request that made it: a replay with another body is
# refused (422) instead of answered with a batch of other questions.  NULL for batches made before.
M009_BATCH_REQUEST_FINGERPRINT = """
ALTER TABLE batches ADD COLUMN request_fingerprint text;
"""

M010_BATCH_LEASE_AND_UNANSWERED = """
-- A claimed batch's lease: its analyst renews heartbeat_at while it waits on the limiter or the model, so a
-- redelivered message finds the batch taken (and does not pay for it twice) and the watchdog sees progress.
ALTER TABLE job_batches ADD COLUMN heartbeat_at timestamptz;
-- Chunks of a finished batch the analyst never answered for, even when asked again (a cut-off reply).
ALTER TABLE job_batches ADD COLUMN unanswered bigint[] NOT NULL DEFAULT '{}';
"""

# Vectors move from one table per width, shared by every buffer and filtered by buffer_id, to one table and
# HNSW graph per buffer, stored as 16-bit halfvec (why: store/vectors.py).  Each buffer records how its
# chunks were cut into windows; buffers embedded before this used 254-word-piece windows overlapping by 32,
# cut anywhere.  The DDL of the
# new tables is written out here as it was on the day (store/vectors.py may change later).
M011_VECTORS_PER_BUFFER = """
ALTER TABLE buffers ADD COLUMN embedding_windows text;
UPDATE buffers SET embedding_windows = 'tokens:254/32' WHERE embedding_dim IS NOT NULL;
DO $$
DECLARE
    t record;
    b record;
    target text;
BEGIN
    FOR t IN
        SELECT c.relname AS name, substring(c.relname FROM '^chunk_embeddings_d([0-9]+)$')::int AS dim
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.relkind = 'r' AND n.nspname = current_schema() AND c.relname ~ '^chunk_embeddings_d[0-9]+$'
    LOOP
        FOR b IN EXECUTE format('SELECT DISTINCT buffer_id FROM %I', t.name) LOOP
            target := 'chunk_vectors_b' || b.buffer_id;
            EXECUTE format(
                'CREATE TABLE %I (chunk_id bigint NOT NULL, win smallint NOT NULL, embedding halfvec(%s) NOT NULL, '
                'PRIMARY KEY (chunk_id, win))', target, t.dim);
            EXECUTE format('INSERT INTO %I SELECT chunk_id, win, embedding::halfvec FROM %I WHERE buffer_id = %s',
                           target, t.name, b.buffer_id);
            EXECUTE format('CREATE INDEX %I ON %I USING hnsw (embedding halfvec_cosine_ops)',
                           target || '_hnsw', target);
        END LOOP;
        EXECUTE format('DROP TABLE %I', t.name);
    END LOOP;
END
$$;
"""

# Each buffer records what ran its embedding model (torch, onnx, onnx-int8: docs/architecture.md#encoder-runtimes);
# vectors from two runtimes differ slightly, so a search embeds the query with the buffers' runtime and never
# ranks two runtimes together.  Every buffer embedded before this was embedded by PyTorch.
M012_EMBEDDING_RUNTIME = """
ALTER TABLE buffers ADD COLUMN embedding_runtime text;
UPDATE buffers SET embedding_runtime = 'torch' WHERE embedding_dim IS NOT NULL;
"""

#: issue #11: a query is a tree of jobs (thinking follow-ups, query_subset) sharing a root's budget; a job records
#: how it was routed and what its completeness check said; analysts' typed records; cached tokens and cost per call
M013_JOB_TREES = """
ALTER TABLE jobs ADD COLUMN parent_id text;
ALTER TABLE jobs ADD COLUMN root_id text;
ALTER TABLE jobs ADD COLUMN depth integer NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN route text;
ALTER TABLE jobs ADD COLUMN route_reason text;
ALTER TABLE jobs ADD COLUMN spec jsonb;
ALTER TABLE jobs ADD COLUMN checks jsonb NOT NULL DEFAULT '[]'::jsonb;
ALTER TABLE jobs ADD COLUMN synth_state jsonb;
CREATE INDEX jobs_parent ON jobs (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX jobs_root ON jobs (root_id) WHERE root_id IS NOT NULL;
ALTER TABLE job_findings ADD COLUMN records jsonb NOT NULL DEFAULT '[]'::jsonb;
ALTER TABLE llm_calls ADD COLUMN cached_tokens integer NOT NULL DEFAULT 0;
ALTER TABLE llm_calls ADD COLUMN cost_usd double precision;
"""

#: issue #13: chat sessions (docs/contract.md#sessions): a session names its buffers and options once; each turn is
#: one question and the query job that answered it (the answer, citations and status are read from that job)
M014_SESSIONS = """
CREATE TABLE sessions (
    id          text PRIMARY KEY,
    tenant      text NOT NULL,
    buffers     text[] NOT NULL,
    options     jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sessions_tenant ON sessions (tenant, created_at DESC);
CREATE TABLE session_turns (
    session_id  text NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn        integer NOT NULL,
    content     text NOT NULL,
    job_id      text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, turn)
);
CREATE INDEX session_turns_job ON session_turns (job_id) WHERE job_id IS NOT NULL;
"""

#: overnight at a fraction of the cost (docs/contract.md#shared-reads, #llm-batch-api): a call shared by several
#: questions is logged on each of their jobs with its share (``shared`` questions, ``solo_tokens_in`` what that
#: job alone would have read), Batch API calls are marked ``via``; a "read" is one analyst call over one chunk
#: batch for one or more (job, batch) members; provider_batches are the OpenAI Batch API jobs in flight.
M015_OVERNIGHT_READS = """
ALTER TABLE llm_calls ADD COLUMN shared integer NOT NULL DEFAULT 1;
ALTER TABLE llm_calls ADD COLUMN solo_tokens_in integer;
ALTER TABLE llm_calls ADD COLUMN via text NOT NULL DEFAULT 'sync';
ALTER TABLE batches ADD COLUMN llm_batch boolean NOT NULL DEFAULT false;

CREATE TABLE provider_batches (
    id              text PRIMARY KEY,
    tenant          text NOT NULL,
    overnight_id    text REFERENCES batches(id) ON DELETE CASCADE,
    input_file_id   text NOT NULL,
    output_file_id  text,
    error_file_id   text,
    -- as the provider says: validating | in_progress | finalizing | completed | failed | expired | cancelling
    -- | cancelled; 'routed' once every line went back to its read
    status          text NOT NULL,
    requests        integer NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    checked_at      timestamptz,
    finished_at     timestamptz,
    error           jsonb
);
CREATE INDEX provider_batches_open ON provider_batches (overnight_id) WHERE finished_at IS NULL;

CREATE TABLE reads (
    id                bigserial PRIMARY KEY,
    tenant            text NOT NULL,
    overnight_id      text REFERENCES batches(id) ON DELETE CASCADE,
    chunk_ids         bigint[] NOT NULL,
    -- pending (task sent) | queued (waits for a provider batch) | submitted (in one) | done | failed
    status            text NOT NULL DEFAULT 'pending',
    llm_batch         boolean NOT NULL DEFAULT false,
    provider_batch_id text REFERENCES provider_batches(id) ON DELETE SET NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    error             jsonb
);
CREATE INDEX reads_queued ON reads (overnight_id) WHERE status = 'queued';
CREATE INDEX reads_provider_batch ON reads (provider_batch_id) WHERE provider_batch_id IS NOT NULL;

CREATE TABLE read_members (
    read_id     bigint NOT NULL REFERENCES reads(id) ON DELETE CASCADE,
    job_id      text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    batch_no    integer NOT NULL,
    -- 1-based number of the member's question in the read's prompt
    question_no integer NOT NULL,
    PRIMARY KEY (read_id, job_id, batch_no)
);
CREATE INDEX read_members_job ON read_members (job_id);
"""

M016_INGEST_GROUPS = """
-- A large upload is loaded as file groups, each embedded by any ingest worker (docs/contract.md#ingest-groups).
-- groups: how many (NULL: loaded whole by one rlm.ingest); base_version: the buffer's version the groups
-- compare unchanged files against, so a load that another load overtook fails instead of mixing the two.
ALTER TABLE uploads ADD COLUMN groups integer, ADD COLUMN groups_done integer NOT NULL DEFAULT 0,
    ADD COLUMN base_version integer;
CREATE TABLE ingest_groups (
    upload_id   text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE,
    group_no    integer NOT NULL,
    paths       text[] NOT NULL,
    bytes       bigint NOT NULL,
    -- queued | running | done | failed
    status      text NOT NULL DEFAULT 'queued',
    attempts    integer NOT NULL DEFAULT 0,
    -- when its rlm.ingest.group was last sent: the reconciler re-sends a group that sat too long
    sent_at     timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    report      jsonb,
    error       jsonb,
    PRIMARY KEY (upload_id, group_no)
);
CREATE INDEX ingest_groups_open ON ingest_groups (sent_at) WHERE status IN ('queued', 'running');
-- What the groups made, invisible to readers until the last group moves it into the buffer in one transaction.
-- file_id NULL: the file is unchanged and the buffer's copy is kept.
CREATE TABLE ingest_staged_files (
    upload_id    text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE,
    group_no     integer NOT NULL,
    path         text NOT NULL,
    file_id      bigint,
    content_hash text NOT NULL,
    size_bytes   bigint NOT NULL,
    chunk_count  integer NOT NULL,
    PRIMARY KEY (upload_id, path)
);
CREATE INDEX ingest_staged_files_group ON ingest_staged_files (upload_id, group_no);
CREATE TABLE ingest_staged_chunks (
    upload_id    text NOT NULL REFERENCES uploads(id) ON DELETE CASCADE,
    group_no     integer NOT NULL,
    id           bigint NOT NULL,
    file_id      bigint NOT NULL,
    seq          integer NOT NULL,
    path         text NOT NULL,
    start_line   integer NOT NULL,
    end_line     integer NOT NULL,
    start_byte   bigint NOT NULL,
    end_byte     bigint NOT NULL,
    text         text NOT NULL,
    token_count  integer NOT NULL,
    content_hash text NOT NULL,
    terms        text NOT NULL
);
CREATE INDEX ingest_staged_chunks_group ON ingest_staged_chunks (upload_id, group_no);
"""

# Whether a stage could use the reply as it came (docs/contract.md#structured-outputs); NULL: nothing parsed.
M017_LLM_CALL_PARSE_OK = """
ALTER TABLE llm_calls ADD COLUMN parse_ok boolean;
"""

# "batch" meant four things (docs/architecture.md#glossary); the overnight one's tables say so.  The rows, their
# keys and the foreign keys onto them (provider_batches, reads) are kept: a rename touches no data.  The tables had
# no sequence (their keys are text ids), so only indexes and constraints are renamed with them.
M018_OVERNIGHT_BATCH_NAMES = """
ALTER TABLE batches RENAME TO overnight_batches;
ALTER INDEX batches_pkey RENAME TO overnight_batches_pkey;
ALTER INDEX batches_tenant_created RENAME TO overnight_batches_tenant_created;
ALTER INDEX batches_open RENAME TO overnight_batches_open;
ALTER INDEX batches_idempotency RENAME TO overnight_batches_idempotency;
ALTER TABLE batch_items RENAME TO overnight_batch_items;
ALTER TABLE overnight_batch_items RENAME COLUMN batch_id TO overnight_batch_id;
ALTER INDEX batch_items_pkey RENAME TO overnight_batch_items_pkey;
ALTER INDEX batch_items_open RENAME TO overnight_batch_items_open;
ALTER INDEX batch_items_job RENAME TO overnight_batch_items_job;
ALTER TABLE overnight_batch_items
    RENAME CONSTRAINT batch_items_batch_id_fkey TO overnight_batch_items_overnight_batch_id_fkey;
ALTER TABLE overnight_batch_items RENAME CONSTRAINT batch_items_job_id_fkey TO overnight_batch_items_job_id_fkey;
"""

# Documents (docs/contract.md#documents): where a chunk sits in its document (pages or slides, the heading path of
# the section holding most of it) and each file's format and outline, for citations and get_section.  NULL for
# plain text and code, whose chunks stay as they were.
M019_DOCUMENT_PROVENANCE = """
ALTER TABLE chunks ADD COLUMN page_start integer, ADD COLUMN page_end integer, ADD COLUMN heading_path text[];
ALTER TABLE ingest_staged_chunks ADD COLUMN page_start integer, ADD COLUMN page_end integer,
    ADD COLUMN heading_path text[];
ALTER TABLE files ADD COLUMN format text NOT NULL DEFAULT 'text', ADD COLUMN outline jsonb;
ALTER TABLE ingest_staged_files ADD COLUMN format text NOT NULL DEFAULT 'text', ADD COLUMN outline jsonb;
"""

# Each window vector keeps its character span in the chunk, so a hit's passage is a slice, not a re-tokenising
# (why: store/vectors.py).  Rows already stored keep NULL spans and are cut again when shown; adding a nullable
# column rewrites no table.  The staging table of ingest groups is made on first use and may not exist yet.
M020_WINDOW_SPANS = """
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT c.relname AS name
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.relkind = 'r' AND n.nspname = current_schema()
          AND (c.relname ~ '^chunk_vectors_b[0-9]+(_next)?$' OR c.relname = 'ingest_staged_vectors')
    LOOP
        EXECUTE format('ALTER TABLE %I ADD COLUMN IF NOT EXISTS span_start integer, '
                       'ADD COLUMN IF NOT EXISTS span_end integer', t.name);
    END LOOP;
END
$$;
"""

#: code mode's rounds (docs/contract.md#code-mode): each program and what it did, written as the round ends
M021_CODE_ROUNDS = """
CREATE TABLE code_rounds (
    job_id        text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    round         integer NOT NULL,
    code          text NOT NULL,
    output        text NOT NULL DEFAULT '',
    output_chars  bigint NOT NULL DEFAULT 0,
    error         text,
    calls         integer NOT NULL DEFAULT 0,
    sub_calls     integer NOT NULL DEFAULT 0,
    seconds       double precision NOT NULL DEFAULT 0,
    ended         boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, round)
);
"""

MIGRATIONS: list[tuple[str, str]] = [
    ("m001_initial", M001_INITIAL),
    ("m002_jobs", M002_JOBS),
    ("m003_api", M003_API),
    ("m004_job_stage_time", M004_JOB_STAGE_TIME),
    ("m005_batch_recovery", M005_BATCH_RECOVERY),
    ("m006_uploads", M006_UPLOADS),
    ("m007_synthesis_lease", M007_SYNTHESIS_LEASE),
    ("m008_batch_ticks_and_cache", M008_BATCH_TICKS_AND_CACHE),
    ("m009_batch_request_fingerprint", M009_BATCH_REQUEST_FINGERPRINT),
    ("m010_batch_lease_and_unanswered", M010_BATCH_LEASE_AND_UNANSWERED),
    ("m011_vectors_per_buffer", M011_VECTORS_PER_BUFFER),
    ("m012_embedding_runtime", M012_EMBEDDING_RUNTIME),
    ("m013_job_trees", M013_JOB_TREES),
    ("m014_sessions", M014_SESSIONS),
    ("m015_overnight_reads", M015_OVERNIGHT_READS),
    ("m016_ingest_groups", M016_INGEST_GROUPS),
    ("m017_llm_call_parse_ok", M017_LLM_CALL_PARSE_OK),
    ("m018_overnight_batch_names", M018_OVERNIGHT_BATCH_NAMES),
    ("m019_document_provenance", M019_DOCUMENT_PROVENANCE),
    ("m020_window_spans", M020_WINDOW_SPANS),
    ("m021_code_rounds", M021_CODE_ROUNDS),
]


def applied(conn: psycopg.Connection) -> list[str]:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS rlm_migrations "
        "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    return [r[0] for r in conn.execute("SELECT name FROM rlm_migrations ORDER BY name")]


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply missing migrations; returns the names applied now."""
    done_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        have = set(applied(conn))
        for name, sql in MIGRATIONS:
            if name in have:
                continue
            log.info("applying migration %s", name)
            conn.execute(sql)
            conn.execute("INSERT INTO rlm_migrations (name) VALUES (%s)", (name,))
            done_now.append(name)
    return done_now


def schema_version(conn: psycopg.Connection) -> str | None:
    names = applied(conn)
    return names[-1] if names else None


# --------------------------------------------------------------------------- read-only checks (rlm doctor) and pgvector


def server_version(conn: psycopg.Connection) -> str:
    return str(one(conn.execute("SHOW server_version"))[0])


def vector_installed(conn: psycopg.Connection) -> str | None:
    """The pgvector version created in this database, or None."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    return row[0] if row else None


def vector_available(conn: psycopg.Connection) -> bool:
    """The server offers pgvector (created or not)."""
    return conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone() is not None


def create_vector_extension(conn: psycopg.Connection) -> None:
    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")


def applied_if_any(conn: psycopg.Connection) -> list[str]:
    """The applied migrations, [] on an empty database; unlike ``applied`` it creates nothing."""
    if one(conn.execute("SELECT to_regclass('rlm_migrations')"))[0] is None:
        return []
    return [r[0] for r in conn.execute("SELECT name FROM rlm_migrations ORDER BY name")]
