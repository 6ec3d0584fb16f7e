"""Re-embed a stored buffer with the configured model (`rlm buffer reembed`, the ``rlm.embed`` task).

Chunks stay as they are; only their vectors are replaced, in one transaction:
a failure leaves the old vectors (and the buffer's recorded model) untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import get_settings
from ..errors import BufferNotFound
from ..store import buffers as store
from ..store import vectors
from ..store.db import connect
from .embed import get_embedder, model_id_for, resolve_runtime
from .loader import Owner, encode_queued, queue_windows
from .windows import DEFAULT_WINDOWS

if TYPE_CHECKING:
    import psycopg

    from .embed import Embedder
    from .onnxenc import OnnxEncoder

log = logging.getLogger("rlm.ingest")

#: chunks read and encoded per round (keeps memory flat on a buffer of 100,000 chunks)
PAGE = 512


@dataclass
class ReembedReport:
    buffer: str
    model: str
    previous_model: str | None
    version: int = 0
    chunks: int = 0
    windows_embedded: int = 0
    #: the buffer was already embedded by this model: nothing was done
    unchanged: bool = False
    seconds: float = 0.0


def reembed_buffer(
    conn: psycopg.Connection,
    *,
    tenant: str,
    name: str,
    embedder: Embedder | OnnxEncoder | None = None,
    embed_batch_size: int = 64,
    force: bool = False,
    on_chunks: Callable[[int, int], None] | None = None,
) -> ReembedReport:
    """Replace every vector of the buffer with ``embedder``'s (the configured model by default).

    ``on_chunks(done, total)`` is told the progress.  The version is bumped: cached results keyed by the
    old version are not served for the new vectors.
    """
    t0 = time.perf_counter()
    if embedder is None:
        model = get_settings().embedding_model
        want, want_runtime = model_id_for(model), resolve_runtime(model)
    else:
        want, want_runtime = embedder.model_id, embedder.runtime
    with conn.transaction():
        buf = store.get_buffer(conn, tenant=tenant, name=name, for_update=True)
        if buf is None:
            raise BufferNotFound(name)
        report = ReembedReport(buffer=name, model=want, previous_model=buf.embedding_model, version=buf.version)

        current = (buf.embedding_model, buf.embedding_windows, buf.runtime)
        if current == (want, DEFAULT_WINDOWS.label, want_runtime) and not force:
            report.unchanged = True  # decided before loading a model: nothing to do costs no torch import
            return report
        embedder = embedder or get_embedder()
        total = store.count_chunks(conn, buffer_ids=[buf.id])
        # new vectors go to a staging table that replaces the old one at the end: searches read the old until then
        vectors.ensure_table(conn, buffer_id=buf.id, dim=embedder.dim, staging=True)
        last = 0
        while True:
            rows = store.chunk_texts(conn, buffer_id=buf.id, after=last, limit=PAGE)
            if not rows:
                break
            last = rows[-1][0]
            windows: list[str] = []
            owners: list[Owner] = []
            for chunk_id, text in rows:
                queue_windows(chunk_id, text, embedder.window_spans(text, embedder.spec), windows, owners)
            queued = len(windows)
            encoded = encode_queued(windows, owners, queued, embed_batch_size, embedder)
            vectors.copy(conn, buffer_id=buf.id, rows=encoded, staging=True)
            report.chunks += len(rows)
            report.windows_embedded += queued
            if on_chunks:
                on_chunks(report.chunks, total)
        vectors.ensure_index(conn, buffer_id=buf.id, staging=True)
        vectors.promote(conn, buffer_id=buf.id)
        report.version = store.update_buffer_meta(
            conn,
            buffer_id=buf.id,
            chunker=buf.chunker,
            chunk_size=buf.chunk_size,
            overlap=buf.chunk_overlap,
            embedding_model=embedder.model_id,
            embedding_dim=embedder.dim,
            embedding_windows=embedder.spec.label,
            embedding_runtime=embedder.runtime,
            bump=True,
        )
    report.seconds = time.perf_counter() - t0
    return report


def run_embed(buffer_id: int) -> str:
    """The ``rlm.embed`` task: done, unchanged (already on this model) or missing.

    One transaction, so a redelivery simply redoes it.
    """
    settings = get_settings()
    conn = connect(settings)
    try:
        buf = store.get_buffer_by_id(conn, buffer_id=buffer_id)
        if buf is None:
            log.info("rlm.embed: buffer %s is gone", buffer_id)
            return "missing"
        report = reembed_buffer(conn, tenant=buf.tenant, name=buf.name, embed_batch_size=settings.embed_batch_size)
        conn.commit()
    finally:
        conn.close()
    if report.unchanged:
        return "unchanged"
    log.info(
        "buffer %s (%s) re-embedded with %s (was %s): %d chunks, %d windows, %.1fs",
        buf.name,
        buffer_id,
        report.model,
        report.previous_model,
        report.chunks,
        report.windows_embedded,
        report.seconds,
    )
    return "done"
