"""A large queued upload loaded as file groups by any number of ingest workers (docs/contract.md#ingest-groups).

``rlm.ingest`` splits the upload's files (path order) into groups of about
``RLM_INGEST_GROUP_BYTES`` and sends one ``rlm.ingest.group`` per group.  A
group chunks and embeds its files into staging tables, which no reader looks
at, and counts itself done in the same transaction; the group that makes the
count whole moves every group's rows into the buffer in one transaction that
also bumps the version, so readers see the old version until that commit.  A
group that cannot load (bad input, or out of attempts) fails the upload: the
staged rows go and the buffer keeps its version.

A redelivered group deletes its own staged rows before writing, so it never
duplicates; a commit interrupted half-way is redone by the next delivery of
any group or of ``rlm.ingest`` (the reconciler re-sends both).
"""

from __future__ import annotations

import functools
import logging
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..celery_app import get_app
from ..config import Settings, get_settings
from ..errors import InvalidInput, RLMError, error_record
from ..store import buffers as bstore
from ..store import uploads as store
from ..store import vectors
from ..store.db import DB_OUTAGE, connect, connection
from .chunkers import outline
from .embed import get_embedder
from .failures import final_error, gave_up, internal_error
from .files import discover, under
from .loader import (
    ENCODE_GROUP_BATCHES,
    EncodeAhead,
    LoadReport,
    Owner,
    chunk_fields,
    chunks_to_embed,
    read_counted,
    same_cut,
)
from .staging import write_files
from .writes import IdBlocks, Writer

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.ingest")

#: attempts per group (deliveries that got as far as embedding) before the upload fails for good
MAX_GROUP_ATTEMPTS = 3


def split(sizes: Sequence[tuple[str, int]], group_bytes: int) -> list[tuple[list[str], int]]:
    """Consecutive files (path order) in groups of at most ``group_bytes`` (a larger file is a group alone)."""
    out: list[tuple[list[str], int]] = []
    paths: list[str] = []
    total = 0
    for path, size in sizes:
        if paths and total + size > group_bytes:
            out.append((paths, total))
            paths, total = [], 0
        paths.append(path)
        total += size
    if paths:
        out.append((paths, total))
    return out


def plan(conn: psycopg.Connection, up: store.UploadRow, settings: Settings) -> list[int] | None:
    """Split the upload into groups when it is larger than one; the group numbers to send, or None to load it
    whole.  Commits."""
    if up.groups is not None:
        return []
    if up.bytes <= settings.ingest_group_bytes:
        return None
    store.ensure_staged_vectors(conn)
    groups = split(store.staged_sizes(conn, upload_id=up.id), settings.ingest_group_bytes)
    buf = bstore.get_buffer(conn, tenant=up.tenant, name=up.buffer)
    with conn.transaction():
        store.plan_groups(conn, upload_id=up.id, groups=groups, base_version=buf.version if buf else 0)
    log.info("upload %s: %d files (%d bytes) split into %d groups", up.id, up.files, up.bytes, len(groups))
    # largest first: the last groups taken are the small ones, so the workers run out of work nearly together
    return sorted(range(len(groups)), key=lambda n: -groups[n][1])


def send_groups(upload_id: str, group_nos: Sequence[int]) -> None:
    app = get_app()

    for n in group_nos:
        app.send_task("rlm.ingest.group", (upload_id, n), argsrepr=f"upload={upload_id} group={n}")


def run_group(upload_id: str, group_no: int) -> str:
    """Embed one group into the staging tables; the last group commits the load.  Idempotent."""
    settings = get_settings()
    conn = connect(settings)
    conn.autocommit = True
    try:
        if not store.try_lock_group(conn, upload_id=upload_id, group_no=group_no):
            log.info("upload %s group %d is being loaded by another delivery", upload_id, group_no)
            return "busy"
        g = store.start_group(conn, upload_id=upload_id, group_no=group_no)
        if g is None:
            # Done already (a redelivery after the commit of the group), or the upload ended: only the commit
            # may be left to do, if the delivery that made the count whole died before it.
            return commit(conn, upload_id) or "skipped"
        if g.attempts > MAX_GROUP_ATTEMPTS:
            fail(conn, upload_id, group_no, gave_up(MAX_GROUP_ATTEMPTS, g.error))
            return "failed"
        up = store.get_upload(conn, upload_id=upload_id)
        assert up is not None
        conn.autocommit = False
        try:
            counted = _stage(conn, up, g, settings)
        except Exception as exc:
            conn.rollback()
            error = final_error(exc)
            if error is None:  # another attempt may succeed
                if not isinstance(exc, (RLMError, *DB_OUTAGE)):  # those say what they wait for themselves
                    log.warning("upload %s group %d: attempt %d failed: %r", upload_id, group_no, g.attempts, exc)
                    with connection() as sc:
                        store.note_group_error(sc, upload_id=upload_id, group_no=group_no, error=internal_error(exc))
                raise
            conn.autocommit = True
            fail(conn, upload_id, group_no, error)
            return "failed"
        conn.autocommit = True
        if counted is None:
            return "skipped"  # the upload failed meanwhile: this group's rows were rolled back
        done, total = counted
        log.info("upload %s: group %d done (%d of %d)", upload_id, group_no, done, total)
        if done < total:
            return "done"
        return commit(conn, upload_id) or "done"
    finally:
        conn.close()  # also releases the advisory lock


def fail(conn: psycopg.Connection, upload_id: str, group_no: int | None, error: dict[str, Any]) -> None:
    """End the upload as failed with the group's reason; its staged rows go, the buffer is untouched."""
    if group_no is not None:
        first = _first_path(conn, upload_id, group_no)
        where = f"file group {group_no + 1}" + (f" (from {first})" if first else "")
        error = {**error, "message": f"{where}: {error['message']}"}
    with conn.transaction():
        if store.lock_running_upload(conn, upload_id=upload_id) is None:
            return
        if group_no is not None:
            store.fail_group(conn, upload_id=upload_id, group_no=group_no, error=error)
        store.clear_staged(conn, upload_id=upload_id)
        store.finish_upload(conn, upload_id=upload_id, status="failed", error=error)
    log.warning("upload %s failed: %s", upload_id, error["message"])


def _first_path(conn: psycopg.Connection, upload_id: str, group_no: int) -> str | None:
    for g in store.list_groups(conn, upload_id=upload_id):
        if g.group_no == group_no and g.paths:
            return g.paths[0][:200]
    return None


def _stage(
    conn: psycopg.Connection, up: store.UploadRow, g: store.GroupRow, settings: Settings
) -> tuple[int, int] | None:
    """Chunk and embed the group's files into the staging tables and count the group done, in one transaction
    (the caller commits or rolls back).  Unchanged files (same bytes, same chunking and model as the buffer's
    base version) are recorded, not embedded."""
    t0 = time.perf_counter()
    opts = up.options
    chunker = opts.get("chunker", "semantic")
    chunk_size, overlap = int(opts.get("chunk_size", 3000)), int(opts.get("overlap", 500))
    embedder = get_embedder()
    vectors.check_indexable(embedder.dim)
    buf = bstore.get_buffer(conn, tenant=up.tenant, name=up.buffer)
    _check_base(up, buf)
    same_params = (
        buf is not None
        and buf.embedding_dim == embedder.dim
        and vectors.has_table(conn, buffer_id=buf.id)
        and same_cut(buf, chunker, chunk_size, overlap, embedder)
    )
    existing = bstore.files_of(conn, buffer_id=buf.id) if buf is not None else {}
    report = LoadReport(buffer=up.buffer)
    store.clear_staged(conn, upload_id=up.id, group_no=g.group_no)  # a redelivery starts clean
    with tempfile.TemporaryDirectory(prefix="rlm-upload-") as tmp:
        root = Path(tmp)
        write_files(root, store.staged_files_in(conn, upload_id=up.id, paths=g.paths))
        candidates, disc = discover(sorted(root.iterdir()), max_file_bytes=settings.max_file_bytes)
        report.files_seen = len(candidates)
        report.discovered(disc)
        writer = Writer(conn)
        file_ids, chunk_ids = IdBlocks(writer, "files_id_seq", 256), IdBlocks(writer, "chunks_id_seq", 4096)
        windows: list[str] = []
        owners: list[Owner] = []
        batch = settings.embed_batch_size
        encode_at = batch * ENCODE_GROUP_BATCHES

        def store_rows(rows: list[vectors.WindowRow], n: int) -> None:
            writer.submit(
                lambda: store.copy_staged_vectors(writer.conn, upload_id=up.id, group_no=g.group_no, rows=rows)
            )
            report.windows_embedded += n

        ahead = EncodeAhead(embedder, batch, store_rows)
        try:
            for cand in candidates:
                doc, keep_old, digest = read_counted(cand, report)
                old = existing.get(cand.rel_path)
                if doc is None:
                    if keep_old and old is not None:  # staged as unchanged: the commit keeps the buffer's copy
                        _submit_file(
                            writer, up.id, g.group_no, cand.rel_path, None, old.content_hash, 0, old.chunk_count
                        )
                    continue
                if old is not None and same_params and old.content_hash == digest:
                    report.files_unchanged += 1
                    _submit_file(writer, up.id, g.group_no, cand.rel_path, None, digest, cand.size, old.chunk_count)
                    continue
                doc, chunks = chunks_to_embed(
                    doc,
                    path=cand.rel_path,
                    chunker=chunker,
                    chunk_size=chunk_size,
                    overlap=overlap,
                    embedder=embedder,
                    report=report,
                )
                fid = file_ids.take(1)[0]
                ids = chunk_ids.take(len(chunks))
                rows = [
                    (cid, fid, seq, cand.rel_path, *chunk_fields(cid, ch, spans, windows, owners))
                    for seq, (cid, (ch, spans)) in enumerate(zip(ids, chunks, strict=True))
                ]
                _submit_file(
                    writer,
                    up.id,
                    g.group_no,
                    cand.rel_path,
                    fid,
                    digest,
                    len(doc.text.encode()),
                    len(chunks),
                    doc.format,
                    outline(doc) if doc.headings else None,
                )
                writer.submit(
                    functools.partial(store.copy_staged_chunks, conn, upload_id=up.id, group_no=g.group_no, rows=rows)
                )
                report.files_loaded += 1
                report.bytes_loaded += cand.size
                report.chunks_written += len(chunks)
                while len(windows) >= encode_at:
                    ahead.submit(windows, owners, encode_at)
            ahead.submit(windows, owners, len(windows))
            ahead.wait()
        finally:
            ahead.close()
            writer.close()
    report.seconds = time.perf_counter() - t0
    out = {
        **{k: v for k, v in report.__dict__.items() if k not in ("buffer", "version")},
        "model": [embedder.model_id, embedder.dim, embedder.spec.label, embedder.runtime],
    }
    counted = store.finish_group(conn, upload_id=up.id, group_no=g.group_no, report=out)
    if counted is None:
        conn.rollback()
        return None
    conn.commit()
    return counted


def _check_base(up: store.UploadRow, buf: bstore.BufferRow | None) -> None:
    now = buf.version if buf is not None else 0
    if now != (up.base_version or 0):
        raise InvalidInput(
            f"buffer {up.buffer!r} changed while this upload was loading (version {up.base_version} → {now}); "
            "upload it again"
        )


def _submit_file(
    writer: Writer,
    upload_id: str,
    group_no: int,
    path: str,
    fid: int | None,
    digest: str,
    size: int,
    chunks: int,
    doc_format: str = "text",
    headings: list[dict[str, Any]] | None = None,
) -> None:
    writer.submit(
        lambda: store.stage_file(
            writer.conn,
            upload_id=upload_id,
            group_no=group_no,
            path=path,
            file_id=fid,
            content_hash=digest,
            size_bytes=size,
            chunk_count=chunks,
            doc_format=doc_format,
            outline=headings,
        )
    )


def commit(conn: psycopg.Connection, upload_id: str) -> str | None:
    """Move every group's rows into the buffer as its new version, if every group is done and the upload is
    still running; "done" or "failed" when this call ended the upload, None when there was nothing to do."""
    try:
        with conn.transaction():
            up = store.lock_running_upload(conn, upload_id=upload_id)
            if up is None or up.groups is None or up.groups_done < up.groups:
                return None
            report = _commit(conn, up)
            store.clear_staged(conn, upload_id=upload_id)
            store.finish_upload(conn, upload_id=upload_id, status="done", report=report)
    except RLMError as exc:
        if exc.retryable:
            raise
        fail(conn, upload_id, None, error_record(exc))
        return "failed"
    log.info(
        "upload %s done: %d groups, %d files loaded, %d unchanged, %d chunks (v%d)",
        upload_id,
        up.groups,
        report["files_loaded"],
        report["files_unchanged"],
        report["chunks_written"],
        report["version"],
    )
    return "done"


def _commit(conn: psycopg.Connection, up: store.UploadRow) -> dict[str, Any]:
    t0 = time.perf_counter()
    parts = store.group_reports(conn, upload_id=up.id)
    models = {tuple(p.get("model") or ()) for p in parts}
    if len(models) != 1:
        raise InvalidInput(
            "the ingest workers that embedded this upload use different embedding models or runtimes; give them "
            "one RLM_EMBEDDING_MODEL and RLM_EMBEDDING_RUNTIME and upload again"
        )
    model_id, dim, windows_label, runtime = next(iter(models))
    merged = LoadReport(buffer=up.buffer)
    for p in parts:
        merged.merge(p)
    staged = store.staged_file_list(conn, upload_id=up.id)
    if not staged:
        raise InvalidInput(merged.nothing_to_load(up.buffer))
    opts = up.options
    buf = bstore.lock_or_create_buffer(conn, tenant=up.tenant, name=up.buffer)
    _check_base(up, buf)
    vectors.ensure_table(conn, buffer_id=buf.id, dim=int(dim))
    existing = bstore.files_of(conn, buffer_id=buf.id)
    seen = {path for path, _ in staged}
    roots = _roots(name for name, _ in store.staged_sizes(conn, upload_id=up.id))
    replaced = [existing[path].id for path, fid in staged if fid is not None and path in existing]
    gone = [f.id for path, f in existing.items() if path not in seen and under(path, roots)]
    merged.files_removed = len(gone)
    bstore.delete_files(conn, buffer_id=buf.id, file_ids=replaced + gone)
    store.move_staged(conn, upload_id=up.id, buffer_id=buf.id)
    changed = bool(replaced or gone or merged.files_loaded)
    if changed:
        bstore.renumber_ordinals(conn, buffer_id=buf.id)
    t_graph = time.perf_counter()
    vectors.ensure_index(conn, buffer_id=buf.id)
    graph_seconds = time.perf_counter() - t_graph
    merged.version = bstore.update_buffer_meta(
        conn,
        buffer_id=buf.id,
        chunker=opts.get("chunker", "semantic"),
        chunk_size=int(opts.get("chunk_size", 3000)),
        overlap=int(opts.get("overlap", 500)),
        embedding_model=model_id,
        embedding_dim=int(dim),
        embedding_windows=windows_label,
        embedding_runtime=runtime,
        bump=changed or buf.version == 0,
    )
    out = dict(merged.__dict__)
    if up.started_at is not None:  # the load's wall time, split to commit (the groups' own seconds overlap)
        out["seconds"] = round(max(0.0, (datetime.now(UTC) - up.started_at).total_seconds()), 3)
    out["groups"] = up.groups
    out["commit_seconds"] = round(time.perf_counter() - t0, 3)
    # the share of the commit that built the buffer's HNSW graph in bulk (a new table's): nearly all of it, as
    # measured for bench/RESULTS.md; a buffer that has a graph already grows it while the rows move
    out["graph_seconds"] = round(graph_seconds, 3)
    return out


def _roots(names: Any) -> list[tuple[str, bool]]:
    """The stored-path prefixes the upload covers (its top-level files and directories), as `rlm load DIR`
    removes a file that disappeared from a directory it loads."""
    out: set[tuple[str, bool]] = set()
    for name in names:
        head, sep, _ = name.partition("/")
        out.add((head + "/", True) if sep else (head, False))
    return sorted(out)
