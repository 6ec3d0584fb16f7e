"""rlm.embed: re-embed one buffer with the configured model, on an ingest worker."""

from __future__ import annotations

from celery import shared_task

from ..config import get_settings
from .common import log, survives_outages


@shared_task(name="rlm.embed", bind=True, acks_late=True, reject_on_worker_lost=True)
@survives_outages
def embed(self, buffer_id: int) -> str:  # noqa: ANN001
    return run_embed(buffer_id)


def run_embed(buffer_id: int) -> str:
    """done, unchanged (already on this model) or missing; one transaction, so a redelivery simply redoes it."""
    from ..ingest.reembed import reembed_buffer
    from ..store.db import connect

    settings = get_settings()
    conn = connect(settings)
    try:
        row = conn.execute("SELECT tenant, name FROM buffers WHERE id = %s", (buffer_id,)).fetchone()
        if row is None:
            log.info("rlm.embed: buffer %s is gone", buffer_id)
            return "missing"
        report = reembed_buffer(conn, tenant=row[0], name=row[1], embed_batch_size=settings.embed_batch_size)
        conn.commit()
    finally:
        conn.close()
    if report.unchanged:
        return "unchanged"
    log.info("buffer %s (%s) re-embedded with %s (was %s): %d chunks, %d windows, %.1fs", row[1], buffer_id,
             report.model, report.previous_model, report.chunks, report.windows_embedded, report.seconds)
    return "done"
