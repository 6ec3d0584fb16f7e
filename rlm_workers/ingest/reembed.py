"""Re-embed a stored buffer with the configured model (`rlm buffer reembed`, the ``rlm.embed`` task).

Chunks stay as they are; only their vectors are replaced, in one transaction:
a failure leaves the old vectors (and the buffer's recorded model) untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BufferNotFound
from ..store import buffers as store
from ..store.migrations import embedding_table, ensure_embedding_table

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


def reembed_buffer(conn, *, tenant: str, name: str, embedder=None, embed_batch_size: int = 64,  # noqa: ANN001
                   force: bool = False, on_chunks: Callable[[int, int], None] | None = None) -> ReembedReport:
    """Replace every vector of the buffer with ``embedder``'s (the configured model by default).

    ``on_chunks(done, total)`` is told the progress.  The version is bumped: cached results keyed by the
    old version are not served for the new vectors.
    """
    t0 = time.perf_counter()
    if embedder is None:
        from .embed import get_embedder

        embedder = get_embedder()
    with conn.transaction():
        buf = store.get_buffer(conn, tenant=tenant, name=name, for_update=True)
        if buf is None:
            raise BufferNotFound(name)
        report = ReembedReport(buffer=name, model=embedder.model_id, previous_model=buf.embedding_model,
                               version=buf.version)
        if buf.embedding_model == embedder.model_id and not force:
            report.unchanged = True
            return report
        total = int(conn.execute("SELECT count(*) FROM chunks WHERE buffer_id = %s", (buf.id,)).fetchone()[0])
        if buf.embedding_dim:
            old = embedding_table(buf.embedding_dim)
            if conn.execute("SELECT to_regclass(%s)", (old,)).fetchone()[0] is not None:
                conn.execute(f"DELETE FROM {old} WHERE buffer_id = %s", (buf.id,))
        table = ensure_embedding_table(conn, embedder.dim)
        conn.execute(f"DELETE FROM {table} WHERE buffer_id = %s", (buf.id,))
        last = 0
        while True:
            rows = conn.execute("SELECT id, text FROM chunks WHERE buffer_id = %s AND id > %s ORDER BY id LIMIT %s",
                                (buf.id, last, PAGE)).fetchall()
            if not rows:
                break
            last = rows[-1][0]
            windows: list[str] = []
            owners: list[tuple[int, int]] = []
            for chunk_id, text in rows:
                for win, piece in enumerate(embedder.window_texts(text)):
                    windows.append(piece)
                    owners.append((chunk_id, win))
            vecs = embedder.encode(windows, batch_size=embed_batch_size)
            store.copy_embeddings(conn, table=table,
                                  rows=[(cid, buf.id, win, vecs[i]) for i, (cid, win) in enumerate(owners)])
            report.chunks += len(rows)
            report.windows_embedded += len(windows)
            if on_chunks:
                on_chunks(report.chunks, total)
        report.version = store.update_buffer_meta(
            conn, buffer_id=buf.id, chunker=buf.chunker, chunk_size=buf.chunk_size, overlap=buf.chunk_overlap,
            embedding_model=embedder.model_id, embedding_dim=embedder.dim, bump=True)
    report.seconds = time.perf_counter() - t0
    return report
