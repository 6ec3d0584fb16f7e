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
from ..errors import RLMError, error_record
from ..store import uploads as store
from ..store.db import DB_OUTAGE, connect, connection
from . import groups

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
                last = (up.error or {}).get("message", "no error recorded")
                with status_conn.transaction():
                    store.finish_upload(
                        status_conn,
                        upload_id=upload_id,
                        status="failed",
                        error={
                            "type": "gave_up",
                            "message": f"not loaded after {MAX_ATTEMPTS} attempts; last: {last}",
                        },
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
        except RLMError as exc:
            conn.rollback()
            if exc.retryable:
                raise
            # Bad input stays bad: end the upload with the loader's one-line reason.
            store.finish_upload(conn, upload_id=upload_id, status="failed", error=error_record(exc))
            conn.commit()
            log.warning("upload %s failed: %s", upload_id, exc)
            return "failed"
        except DB_OUTAGE:
            conn.rollback()
            raise
        except Exception as exc:
            conn.rollback()
            if _bad_data(exc):  # the same bytes fail the same way on every attempt: end it now
                store.finish_upload(conn, upload_id=upload_id, status="failed", error=_BAD_DATA)
                conn.commit()
                log.warning("upload %s failed: data the database refuses: %s", upload_id, exc)
                return "failed"
            # The client sees the upload's error: never the exception text, which can carry SQL, the data
            # and the server's temporary paths.  The full error goes to the worker log.
            log.warning("upload %s: attempt %d failed: %r", upload_id, up.attempts, exc)
            with connection() as status_conn:
                store.note_error(status_conn, upload_id=upload_id, error=_internal_error(exc))
            raise
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


_BAD_DATA = {
    "type": "invalid_input",
    "message": "the upload holds text the database cannot store (such as a NUL character); "
    "fix the file and upload it again",
}


def _bad_data(exc: BaseException) -> bool:
    import psycopg

    # SQLSTATE class 22 (data exception): the values themselves are refused, whatever the server's state.
    return isinstance(exc, psycopg.errors.DataError)


def _internal_error(exc: BaseException) -> dict[str, str]:
    return {
        "type": "internal_error",
        "message": f"the ingest worker could not load the upload ({type(exc).__name__}); its log has the details",
    }


def _load(conn: psycopg.Connection, up: store.UploadRow, settings: Settings) -> dict[str, Any]:
    from .staging import load_files

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
