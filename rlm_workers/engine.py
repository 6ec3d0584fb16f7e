"""The engine: every operation a surface needs (the HTTP routes, the CLI, the MCP server, the web view), in one
module.  ``rlm_api`` imports only this module and ``rlm_workers.config``; ``tests/test_engine.py`` keeps it so.

Use it from Python (README.md, "Use it from Python")::

    from rlm_workers import engine

    engine.load(["docs/"], buffer="docs")
    for hit in engine.search_buffers("how is a query answered?", buffers=["docs"]):
        print(f"{hit.score:.3f} {hit.buffer}:{engine.cite_of(hit)}")
    print(engine.ask("How is a query answered?", buffers=["docs"]).response)

Operations by resource (each returns the records below: pydantic models from ``rlm_workers.models`` or the
store's dataclasses such as ``JobRow``, ``UploadRow``, ``OvernightRow``, ``KeyInfo``):

- database: ``connect``, ``connection``, ``resolve_url``, ``ping``
- buffers: ``load``, ``load_paths``, ``load_files``, ``list_buffers``, ``buffer_info``, ``list_files``,
  ``get_buffer``, ``require_buffers``, ``delete_buffer``, ``reembed_buffer``, ``get_chunks``, ``warm_bm25``
- search: ``search_buffers``, ``search``, ``read_outline``, ``read_section``, ``matched_lines``
- queries: ``ask``, ``submit_query``, ``wait_for_job``, ``cancel_query``, ``get_job``, ``list_jobs``,
  ``tree_of``, ``llm_calls_of``, ``code_rounds_of``, ``job_usage``, ``batch_states``, ``status_line``
- sessions: ``create_session``, ``post_message``, ``session_view``, ``cited_sources``
- keys: ``create_key``, ``revoke_key``, ``list_keys``, ``tenant_for_key``
- batches: ``submit_overnight``, ``start_overnight``, ``get_overnight``, ``list_overnight``, ``status_of``,
  ``cancel_overnight``
- uploads: ``create_upload``, ``get_upload``, ``listen_upload_ended``
- health: ``metrics_text``, the ``check_*`` of ``rlm doctor``
- services: the embedded PostgreSQL and Valkey, the local model server, workers (``get_app``, ``ensure_workers``,
  ``worker_abandoned``)

Why names come two ways: the errors, limits, constants and pydantic records are light and imported here; the
rest lives in modules that pull in psycopg, celery, numpy or the encoder, which ``rlm --help`` must not pay
for (rlm_api/cli_types.py).  Those are resolved on first use by ``__getattr__`` from ``_LAZY`` (PEP 562), and
the engine's own functions import them inside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from rlm_workers import __version__
from rlm_workers.constants import ALL_QUEUES, QUEUE_ANALYST, QUEUE_CONTROL, QUEUE_INGEST
from rlm_workers.errors import BufferNotFound, ConfigError, InvalidInput, LLMError, NoChunks, RLMError
from rlm_workers.limits import (
    MAX_BIGINT,
    MAX_CHUNK_SIZE,
    MAX_DOCUMENT_CHARS,
    MAX_DOCUMENT_WINDOWS,
    MAX_INLINE_UPLOAD_BYTES,
    MAX_QUERY_BYTES,
    MAX_RUN_AT_AHEAD_DAYS,
    MIN_CHUNK_SIZE,
)
from rlm_workers.models import (
    ORDER,
    BufferInfo,
    ChunkId,
    ChunkView,
    CodeRound,
    FileInfo,
    JobStatus,
    LLMCall,
    Location,
    Mode,
    QueryOptions,
    QueryResult,
    Scope,
    SearchHit,
    SearchMode,
    Threshold,
    TopK,
    allowed_values,
    check_storable_text,
)
from rlm_workers.search.provenance import cite_of
from rlm_workers.search.provenance import fields as citation_fields
from rlm_workers.store import keys as _keys
from rlm_workers.store.keys import KeyInfo

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.celery_app import app as celery_app
    from rlm_workers.celery_app import get_app
    from rlm_workers.config import Settings
    from rlm_workers.ingest.chunkers import validate_chunk_params
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.files import discover, path_problem
    from rlm_workers.ingest.loader import LoadReport, load_paths
    from rlm_workers.ingest.reembed import reembed_buffer
    from rlm_workers.ingest.staging import check_names, load_files
    from rlm_workers.overnight.submit import (
        MAX_QUERIES_FILE_BYTES,
        cancel_overnight,
        check_run_at,
        parse_queries,
        start_overnight,
        store_overnight,
        submit_overnight,
    )
    from rlm_workers.overnight.views import iter_csv, iter_jsonl, status_of
    from rlm_workers.pipeline.flow import BROKER_OUTAGE
    from rlm_workers.pipeline.report import status_line
    from rlm_workers.pipeline.sessions import cited_sources, create_session, post_message, session_view
    from rlm_workers.runtime.doctor import (
        Check,
        check_broker,
        check_database,
        check_encoder,
        check_llm,
        check_workers,
    )
    from rlm_workers.runtime.ephemeral import ensure_workers, served_queues
    from rlm_workers.runtime.local_llm import (
        ServerState,
        build_server,
        endpoint,
        fetch_model,
        is_ready,
        model_file,
        server_status,
        stop_server,
    )
    from rlm_workers.runtime.local_llm import status_line as llm_status_line
    from rlm_workers.runtime.local_models import DEFAULT_STAGE_MODELS, resolve_model, wheel_problem
    from rlm_workers.runtime.local_servers import (
        broker_url,
        database_url,
        embedded_clients,
        postgres_status,
        running_broker_url,
        running_database_url,
        status_lines,
        stop_embedded,
        stop_embedded_postgres,
        stop_embedded_valkey,
        valkey_status,
        write_private,
    )
    from rlm_workers.search.preview import matched_lines, shorten
    from rlm_workers.search.sections import read_outline, read_section
    from rlm_workers.search.service import search, validate_query, validate_search_params
    from rlm_workers.store.buffers import (
        buffer_info,
        buffer_not_found,
        delete_buffer,
        get_buffer,
        get_chunks,
        list_buffers,
        list_files,
        require_buffers,
        validate_buffer_name,
    )
    from rlm_workers.store.code import rounds_of as code_rounds_of
    from rlm_workers.store.db import POOL_MAX_SIZE, connect, connection, resolve_url
    from rlm_workers.store.jobs import (
        JobRow,
        TreeUsage,
        batch_states,
        get_job,
        job_ids_starting,
        job_usage,
        list_jobs,
        llm_calls_of,
        tree_of,
    )
    from rlm_workers.store.metrics import jobs_in_flight, ping
    from rlm_workers.store.overnight import OvernightRow, get_overnight, list_overnight, overnight_batch_ids_starting
    from rlm_workers.store.uploads import UploadRow, create_upload, get_upload, listen_upload_ended
    from rlm_workers.submit import cancel_query, submit_query, validate_options, wait_for_job

#: name → "module:attribute" of what the engine re-exports from a module too heavy to import with it
_LAZY = {
    # database
    "connect": "rlm_workers.store.db:connect",
    "connection": "rlm_workers.store.db:connection",
    "resolve_url": "rlm_workers.store.db:resolve_url",
    "POOL_MAX_SIZE": "rlm_workers.store.db:POOL_MAX_SIZE",
    "ping": "rlm_workers.store.metrics:ping",
    "jobs_in_flight": "rlm_workers.store.metrics:jobs_in_flight",
    # buffers
    "LoadReport": "rlm_workers.ingest.loader:LoadReport",
    "load_paths": "rlm_workers.ingest.loader:load_paths",
    "load_files": "rlm_workers.ingest.staging:load_files",
    "check_names": "rlm_workers.ingest.staging:check_names",
    "discover": "rlm_workers.ingest.files:discover",
    "path_problem": "rlm_workers.ingest.files:path_problem",
    "validate_chunk_params": "rlm_workers.ingest.chunkers:validate_chunk_params",
    "get_embedder": "rlm_workers.ingest.embed:get_embedder",
    "reembed_buffer": "rlm_workers.ingest.reembed:reembed_buffer",
    "buffer_info": "rlm_workers.store.buffers:buffer_info",
    "buffer_not_found": "rlm_workers.store.buffers:buffer_not_found",
    "delete_buffer": "rlm_workers.store.buffers:delete_buffer",
    "get_buffer": "rlm_workers.store.buffers:get_buffer",
    "get_chunks": "rlm_workers.store.buffers:get_chunks",
    "list_buffers": "rlm_workers.store.buffers:list_buffers",
    "list_files": "rlm_workers.store.buffers:list_files",
    "require_buffers": "rlm_workers.store.buffers:require_buffers",
    "validate_buffer_name": "rlm_workers.store.buffers:validate_buffer_name",
    # search
    "search": "rlm_workers.search.service:search",
    "validate_query": "rlm_workers.search.service:validate_query",
    "validate_search_params": "rlm_workers.search.service:validate_search_params",
    "matched_lines": "rlm_workers.search.preview:matched_lines",
    "shorten": "rlm_workers.search.preview:shorten",
    "read_outline": "rlm_workers.search.sections:read_outline",
    "read_section": "rlm_workers.search.sections:read_section",
    # queries
    "submit_query": "rlm_workers.submit:submit_query",
    "validate_options": "rlm_workers.submit:validate_options",
    "wait_for_job": "rlm_workers.submit:wait_for_job",
    "cancel_query": "rlm_workers.submit:cancel_query",
    "JobRow": "rlm_workers.store.jobs:JobRow",
    "TreeUsage": "rlm_workers.store.jobs:TreeUsage",
    "batch_states": "rlm_workers.store.jobs:batch_states",
    "get_job": "rlm_workers.store.jobs:get_job",
    "job_ids_starting": "rlm_workers.store.jobs:job_ids_starting",
    "job_usage": "rlm_workers.store.jobs:job_usage",
    "list_jobs": "rlm_workers.store.jobs:list_jobs",
    "llm_calls_of": "rlm_workers.store.jobs:llm_calls_of",
    "code_rounds_of": "rlm_workers.store.code:rounds_of",
    "tree_of": "rlm_workers.store.jobs:tree_of",
    "BROKER_OUTAGE": "rlm_workers.pipeline.flow:BROKER_OUTAGE",
    "status_line": "rlm_workers.pipeline.report:status_line",
    # sessions
    "create_session": "rlm_workers.pipeline.sessions:create_session",
    "post_message": "rlm_workers.pipeline.sessions:post_message",
    "session_view": "rlm_workers.pipeline.sessions:session_view",
    "cited_sources": "rlm_workers.pipeline.sessions:cited_sources",
    # batches
    "OvernightRow": "rlm_workers.store.overnight:OvernightRow",
    "get_overnight": "rlm_workers.store.overnight:get_overnight",
    "list_overnight": "rlm_workers.store.overnight:list_overnight",
    "overnight_batch_ids_starting": "rlm_workers.store.overnight:overnight_batch_ids_starting",
    "MAX_QUERIES_FILE_BYTES": "rlm_workers.overnight.submit:MAX_QUERIES_FILE_BYTES",
    "cancel_overnight": "rlm_workers.overnight.submit:cancel_overnight",
    "check_run_at": "rlm_workers.overnight.submit:check_run_at",
    "iter_csv": "rlm_workers.overnight.views:iter_csv",
    "iter_jsonl": "rlm_workers.overnight.views:iter_jsonl",
    "parse_queries": "rlm_workers.overnight.submit:parse_queries",
    "start_overnight": "rlm_workers.overnight.submit:start_overnight",
    "status_of": "rlm_workers.overnight.views:status_of",
    "store_overnight": "rlm_workers.overnight.submit:store_overnight",
    "submit_overnight": "rlm_workers.overnight.submit:submit_overnight",
    # uploads
    "UploadRow": "rlm_workers.store.uploads:UploadRow",
    "create_upload": "rlm_workers.store.uploads:create_upload",
    "get_upload": "rlm_workers.store.uploads:get_upload",
    "listen_upload_ended": "rlm_workers.store.uploads:listen_upload_ended",
    # health and doctor
    "Check": "rlm_workers.runtime.doctor:Check",
    "check_broker": "rlm_workers.runtime.doctor:check_broker",
    "check_database": "rlm_workers.runtime.doctor:check_database",
    "check_encoder": "rlm_workers.runtime.doctor:check_encoder",
    "check_llm": "rlm_workers.runtime.doctor:check_llm",
    "check_workers": "rlm_workers.runtime.doctor:check_workers",
    # services: workers, embedded servers, the local model server
    "celery_app": "rlm_workers.celery_app:app",
    "get_app": "rlm_workers.celery_app:get_app",
    "ensure_workers": "rlm_workers.runtime.ephemeral:ensure_workers",
    "served_queues": "rlm_workers.runtime.ephemeral:served_queues",
    "broker_url": "rlm_workers.runtime.local_servers:broker_url",
    "database_url": "rlm_workers.runtime.local_servers:database_url",
    "embedded_clients": "rlm_workers.runtime.local_servers:embedded_clients",
    "postgres_status": "rlm_workers.runtime.local_servers:postgres_status",
    "running_broker_url": "rlm_workers.runtime.local_servers:running_broker_url",
    "running_database_url": "rlm_workers.runtime.local_servers:running_database_url",
    "status_lines": "rlm_workers.runtime.local_servers:status_lines",
    "stop_embedded": "rlm_workers.runtime.local_servers:stop_embedded",
    "stop_embedded_postgres": "rlm_workers.runtime.local_servers:stop_embedded_postgres",
    "stop_embedded_valkey": "rlm_workers.runtime.local_servers:stop_embedded_valkey",
    "valkey_status": "rlm_workers.runtime.local_servers:valkey_status",
    "write_private": "rlm_workers.runtime.local_servers:write_private",
    "ServerState": "rlm_workers.runtime.local_llm:ServerState",
    "build_server": "rlm_workers.runtime.local_llm:build_server",
    "endpoint": "rlm_workers.runtime.local_llm:endpoint",
    "fetch_model": "rlm_workers.runtime.local_llm:fetch_model",
    "is_ready": "rlm_workers.runtime.local_llm:is_ready",
    "llm_status_line": "rlm_workers.runtime.local_llm:status_line",
    "model_file": "rlm_workers.runtime.local_llm:model_file",
    "server_status": "rlm_workers.runtime.local_llm:server_status",
    "stop_server": "rlm_workers.runtime.local_llm:stop_server",
    "DEFAULT_STAGE_MODELS": "rlm_workers.runtime.local_models:DEFAULT_STAGE_MODELS",
    "resolve_model": "rlm_workers.runtime.local_models:resolve_model",
    "wheel_problem": "rlm_workers.runtime.local_models:wheel_problem",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# --- the short way: one call per step, with the configured settings and tenant ------------------------


def _settings(settings: Settings | None) -> Settings:
    from rlm_workers.config import get_settings

    return settings or get_settings()


def load(
    paths: Sequence[Path | str],
    *,
    buffer: str,
    chunker: str = "semantic",
    chunk_size: int = 3000,
    overlap: int = 500,
    tenant: str | None = None,
    settings: Settings | None = None,
) -> LoadReport:
    """Load files and directories into ``buffer`` (created if new) in one transaction, as ``rlm load`` does
    without ``--queue``: unchanged files are skipped, changed ones replaced.  Needs no worker."""
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.db import connect, resolve_url

    s = _settings(settings)
    tenant = tenant or s.tenant
    url = resolve_url(s)
    conn = connect(s, url=url)
    try:
        report = load_paths(
            conn,
            buffer=buffer,
            paths=[Path(p) for p in paths],
            chunker=chunker,
            chunk_size=chunk_size,
            overlap=overlap,
            tenant=tenant,
            embedder=get_embedder(s.embedding_model),
            embed_batch_size=s.embed_batch_size,
            max_file_bytes=s.max_file_bytes,
        )
        conn.commit()
        warm_bm25(conn, s, url, buffer, tenant)
    finally:
        conn.close()
    return report


def search_buffers(
    query: str,
    *,
    buffers: Sequence[str],
    mode: str = "hybrid",
    top_k: int = 10,
    threshold: float | None = None,
    tenant: str | None = None,
    settings: Settings | None = None,
) -> list[SearchHit]:
    """The ``top_k`` best chunks of ``buffers`` for ``query``, no LLM involved (``rlm search``)."""
    from rlm_workers.search.service import search
    from rlm_workers.store.db import connect, resolve_url

    s = _settings(settings)
    url = resolve_url(s)
    conn = connect(s, url=url)
    try:
        return search(
            conn,
            settings=s,
            url=url,
            tenant=tenant or s.tenant,
            buffers=buffers,
            query=query,
            mode=mode,
            top_k=top_k,
            threshold=-1.0 if threshold is None else threshold,
        )
    finally:
        conn.close()


def ask(
    question: str,
    *,
    buffers: Sequence[str],
    options: dict[str, Any] | None = None,
    timeout: float = 600.0,
    tenant: str | None = None,
    settings: Settings | None = None,
) -> QueryResult:
    """Answer ``question`` from ``buffers`` and wait for the result (``rlm query``).  Where no worker serves
    the query queues, one runs in this process for the query's length, as ``rlm query`` does.

    Raises ``RLMError`` when the job fails or is cancelled, ``TimeoutError`` (after cancelling it) when it
    runs past ``timeout`` seconds.
    """
    from rlm_workers.celery_app import get_app
    from rlm_workers.runtime.ephemeral import ensure_workers
    from rlm_workers.search.service import validate_query
    from rlm_workers.store.buffers import require_buffers
    from rlm_workers.store.db import connect
    from rlm_workers.submit import cancel_query, submit_query, validate_options, wait_for_job

    s = _settings(settings)
    tenant = tenant or s.tenant
    question = validate_query(question)
    opts = validate_options(options or {})
    conn = connect(s)
    try:
        require_buffers(conn, tenant=tenant, names=list(buffers))
        with ensure_workers(get_app()):
            job_id, _ = submit_query(conn, tenant=tenant, query=question, buffers=list(buffers), options=opts)
            conn.commit()
            try:
                job = wait_for_job(conn, job_id, timeout=timeout)
            except TimeoutError:
                cancel_query(conn, job_id=job_id, tenant=tenant)
                raise
    finally:
        conn.close()
    if job.status != "done" or not job.result:
        failure = dict(job.error or {})  # the stored error record, as a dict or as its typed model
        message = failure.get("message") or f"job ended {job.status}"
        raise RLMError(f"job {job_id} {job.status} ({failure.get('type', 'error')}): {message}")
    return QueryResult.model_validate(job.result)


# --- buffers ------------------------------------------------------------------------------------------


def warm_bm25(conn: psycopg.Connection, settings: Settings, url: str, buffer: str, tenant: str) -> None:
    """Build ``buffer``'s BM25 cache now, so the first search after a load is fast."""
    from rlm_workers.search import bm25_cache
    from rlm_workers.store.buffers import require_buffers

    (row,) = require_buffers(conn, tenant=tenant, names=[buffer])
    bm25_cache.index_for(conn, row, cache_dir=settings.data_dir / "cache", dbk=bm25_cache.db_key(url))
    conn.commit()


def load_upload(
    *,
    tenant: str,
    buffer: str,
    files: Sequence[tuple[str, bytes | BinaryIO]],
    chunker: str,
    chunk_size: int,
    overlap: int,
    settings: Settings | None = None,
) -> tuple[LoadReport, BufferInfo]:
    """Load uploaded ``(relative path, bytes or file)`` pairs into ``buffer`` in one transaction (a failed
    upload leaves the previous buffer intact); returns the loader's report and the buffer's info after it."""
    from rlm_workers.ingest.staging import check_names, load_files
    from rlm_workers.store.buffers import buffer_info
    from rlm_workers.store.db import connect

    check_names(name for name, _ in files)  # a bad name is refused before anything else is tried
    s = _settings(settings)
    conn = connect(s)
    try:
        report = load_files(
            conn,
            tenant=tenant,
            buffer=buffer,
            files=files,
            chunker=chunker,
            chunk_size=chunk_size,
            overlap=overlap,
            settings=s,
        )
        conn.commit()
        info = buffer_info(conn, tenant=tenant, name=buffer)
    finally:
        conn.close()
    return report, info


# --- services -----------------------------------------------------------------------------------------


def worker_abandoned() -> bool:
    """Whether an in-process worker (``ensure_workers``) was stopped with tasks still running: the process
    should then end without joining their threads (``rlm_api.cli.entry``)."""
    # looked up, not imported: only the commands that may start such a worker load its module
    ephemeral = sys.modules.get("rlm_workers.runtime.ephemeral")
    return ephemeral is not None and ephemeral.abandoned()


# --- health -------------------------------------------------------------------------------------------


def metrics_text(conn: psycopg.Connection) -> bytes:
    """The Prometheus text: in-flight jobs from the partial index, everything else from the Redis counters
    the workers keep (docs/contract.md#metrics)."""
    from rlm_workers.runtime.metrics_render import render
    from rlm_workers.store.metrics import jobs_in_flight

    return render(jobs_in_flight(conn), ALL_QUEUES)


# --- keys: created once and printed once, stored only as a sha256, each bound to one tenant ---------------

KEY_PREFIX = "rlm_"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    """The stored form of a key."""
    # Keys are 256-bit random tokens, so a plain (unsalted) hash is enough and allows an indexed lookup.
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def validate_tenant(tenant: str) -> str:
    """``tenant`` when it is a valid tenant name, else ``InvalidInput``."""
    if not _TENANT.match(tenant or ""):
        raise InvalidInput(f"invalid tenant name {tenant!r}: use letters, digits, '_', '.', '-' (max 64)")
    return tenant


def create_key(conn: psycopg.Connection, *, tenant: str, name: str = "") -> tuple[str, KeyInfo]:
    """A new key for ``tenant``: returns (the key, shown once; its record)."""
    validate_tenant(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    info = _keys.insert_key(conn, tenant=tenant, key_hash=hash_key(key), prefix=key[:10], name=name[:200])
    return key, dataclasses.replace(info, name=name)


def revoke_key(conn: psycopg.Connection, *, key_or_prefix: str) -> int:
    """Revoke by the whole key or by its printed prefix; returns how many keys were revoked."""
    if key_or_prefix.startswith(KEY_PREFIX) and len(key_or_prefix) > 20:
        return _keys.revoke_by_hash(conn, key_hash=hash_key(key_or_prefix))
    return _keys.revoke_by_prefix(conn, prefix=key_or_prefix)


def list_keys(conn: psycopg.Connection, *, tenant: str | None = None) -> list[KeyInfo]:
    """The keys (revoked ones included) of ``tenant``, or of every tenant."""
    return _keys.list_keys(conn, tenant=tenant)


def tenant_for_key(conn: psycopg.Connection, key: str) -> str | None:
    """The tenant a live key is bound to, or None."""
    if not key or not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    return _keys.tenant_of(conn, key_hash=hash_key(key))


__all__ = [
    # errors
    "BufferNotFound",
    "ConfigError",
    "InvalidInput",
    "LLMError",
    "NoChunks",
    "RLMError",
    # limits and constants
    "ALL_QUEUES",
    "KEY_PREFIX",
    "MAX_BIGINT",
    "MAX_CHUNK_SIZE",
    "MAX_DOCUMENT_CHARS",
    "MAX_DOCUMENT_WINDOWS",
    "MAX_INLINE_UPLOAD_BYTES",
    "MAX_QUERY_BYTES",
    "MAX_RUN_AT_AHEAD_DAYS",
    "MIN_CHUNK_SIZE",
    "QUEUE_ANALYST",
    "QUEUE_CONTROL",
    "QUEUE_INGEST",
    "__version__",
    # records
    "BufferInfo",
    "ChunkId",
    "ChunkView",
    "FileInfo",
    "JobStatus",
    "KeyInfo",
    "LLMCall",
    "CodeRound",
    "Location",
    "Mode",
    "QueryOptions",
    "QueryResult",
    "Scope",
    "SearchHit",
    "SearchMode",
    "Threshold",
    "TopK",
    "allowed_values",
    "check_storable_text",
    "cite_of",
    "citation_fields",
    # the engine's own operations
    "ask",
    "create_key",
    "hash_key",
    "list_keys",
    "load",
    "load_upload",
    "metrics_text",
    "revoke_key",
    "search_buffers",
    "tenant_for_key",
    "validate_tenant",
    "warm_bm25",
    "worker_abandoned",
    # re-exported on first use (_LAZY), by resource
    # database
    "connect",
    "connection",
    "resolve_url",
    "POOL_MAX_SIZE",
    "ping",
    "jobs_in_flight",
    # buffers
    "LoadReport",
    "load_paths",
    "load_files",
    "check_names",
    "discover",
    "path_problem",
    "validate_chunk_params",
    "get_embedder",
    "reembed_buffer",
    "buffer_info",
    "buffer_not_found",
    "delete_buffer",
    "get_buffer",
    "get_chunks",
    "list_buffers",
    "list_files",
    "require_buffers",
    "validate_buffer_name",
    # search
    "search",
    "validate_query",
    "validate_search_params",
    "matched_lines",
    "shorten",
    "read_outline",
    "read_section",
    # queries
    "submit_query",
    "validate_options",
    "wait_for_job",
    "cancel_query",
    "JobRow",
    "TreeUsage",
    "batch_states",
    "get_job",
    "job_ids_starting",
    "job_usage",
    "list_jobs",
    "llm_calls_of",
    "code_rounds_of",
    "tree_of",
    "BROKER_OUTAGE",
    "ORDER",
    "status_line",
    # sessions
    "create_session",
    "post_message",
    "session_view",
    "cited_sources",
    # batches
    "OvernightRow",
    "get_overnight",
    "list_overnight",
    "overnight_batch_ids_starting",
    "MAX_QUERIES_FILE_BYTES",
    "cancel_overnight",
    "check_run_at",
    "iter_csv",
    "iter_jsonl",
    "parse_queries",
    "start_overnight",
    "status_of",
    "store_overnight",
    "submit_overnight",
    # uploads
    "UploadRow",
    "create_upload",
    "get_upload",
    "listen_upload_ended",
    # health and doctor
    "Check",
    "check_broker",
    "check_database",
    "check_encoder",
    "check_llm",
    "check_workers",
    # services: workers, embedded servers, the local model server
    "celery_app",
    "get_app",
    "ensure_workers",
    "served_queues",
    "broker_url",
    "database_url",
    "embedded_clients",
    "postgres_status",
    "running_broker_url",
    "running_database_url",
    "status_lines",
    "stop_embedded",
    "stop_embedded_postgres",
    "stop_embedded_valkey",
    "valkey_status",
    "write_private",
    "ServerState",
    "build_server",
    "endpoint",
    "fetch_model",
    "is_ready",
    "llm_status_line",
    "model_file",
    "server_status",
    "stop_server",
    "DEFAULT_STAGE_MODELS",
    "resolve_model",
    "wheel_problem",
]
