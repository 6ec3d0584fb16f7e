"""Load one queued upload into its buffer on an ingest worker (chunk, embed, store): the ``rlm.ingest`` task.

An upload larger than ``RLM_INGEST_GROUP_BYTES`` is not loaded here: it is split into file groups that any
ingest workers embed at once (ingest/groups.py); what follows is the path of an upload loaded whole.

The API stages the files in PostgreSQL and sends only the upload id.  The load
runs in one transaction that also marks the upload done, so a worker killed
half-way leaves the previous buffer and the staged files as they were; the
message is redelivered (late ack) or re-sent by the reconciler.  A session
advisory lock keeps two deliveries of one upload from loading it twice at once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from ..config import Settings, get_settings
from ..errors import RLMError
from ..store import uploads as store
from ..store.db import DB_OUTAGE, connect, connection
from . import groups
from .failures import final_error, gave_up, internal_error
from .staging import load_files

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.ingest")

#: attempts (deliveries that got as far as loading) before an upload is failed for good
MAX_ATTEMPTS = 3


def run_ingest(upload_id: str) -> str:
    """Load the upload; returns what happened (done, failed, busy, skipped).  Idempotent."""
    settings = get_settings()
    conn = connect(settings)
    try:
        if not store.try_lock_upload(conn, upload_id=upload_id):
            conn.rollback()
            log.info("upload %s is being loaded by another delivery", upload_id)
            return "busy"
        conn.commit()
        planned = store.get_upload(conn, upload_id=upload_id)
        conn.commit()
        if planned is not None and planned.groups is not None:
            # Split already: its groups carry the load; only their commit may be left (its delivery died).
            conn.autocommit = True
            return groups.commit(conn, upload_id) or "waiting"
        with connection() as status_conn:
            up = store.start_upload(status_conn, upload_id=upload_id)
            if up is None:
                return "skipped"
            if up.attempts > MAX_ATTEMPTS:
                with status_conn.transaction():
                    store.finish_upload(
                        status_conn, upload_id=upload_id, status="failed", error=gave_up(MAX_ATTEMPTS, up.error)
                    )
                log.warning("upload %s failed after %d attempts", upload_id, MAX_ATTEMPTS)
                return "failed"
        to_send = groups.plan(conn, up, settings)
        conn.commit()
        if to_send is not None:
            groups.send_groups(upload_id, to_send)
            return "split"
        log.info(
            "upload %s: loading %d files (%d bytes) into buffer %s (attempt %d)",
            upload_id,
            up.files,
            up.bytes,
            up.buffer,
            up.attempts,
        )
        try:
            report = _load(conn, up, settings)
        except Exception as exc:
            conn.rollback()
            error = final_error(exc)
            if error is None:  # another attempt may succeed
                if not isinstance(exc, (RLMError, *DB_OUTAGE)):  # those say what they wait for themselves
                    log.warning("upload %s: attempt %d failed: %r", upload_id, up.attempts, exc)
                    with connection() as status_conn:
                        store.note_error(status_conn, upload_id=upload_id, error=internal_error(exc))
                raise
            # Bad input stays bad: end the upload now, with its one-line reason.
            store.finish_upload(conn, upload_id=upload_id, status="failed", error=error)
            conn.commit()
            log.warning("upload %s failed: %s (%r)", upload_id, error["message"], exc)
            return "failed"
        log.info(
            "upload %s done: %d files loaded, %d unchanged, %d chunks",
            upload_id,
            report["files_loaded"],
            report["files_unchanged"],
            report["chunks_written"],
        )
        return "done"
    finally:
        conn.close()  # also releases the advisory lock


def _load(conn: psycopg.Connection, up: store.UploadRow, settings: Settings) -> dict[str, Any]:
    opts = up.options
    report = load_files(
        conn,
        tenant=up.tenant,
        buffer=up.buffer,
        files=store.staged_files(conn, upload_id=up.id),
        chunker=opts.get("chunker", "semantic"),
        chunk_size=int(opts.get("chunk_size", 3000)),
        overlap=int(opts.get("overlap", 500)),
        settings=settings,
    )
    out = dataclasses.asdict(report)
    store.finish_upload(conn, upload_id=up.id, status="done", report=out)
    conn.commit()
    return out
