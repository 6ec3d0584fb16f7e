"""What a batch shows while it runs and after: its progress, and its results as JSONL or CSV.

Kept apart from ``submit``: reading a batch needs the store only, so `rlm batch status` and `results` do not
load the scheduler, the LLM clients or Celery (docs/architecture.md#overnight).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..config import Settings, get_settings
from ..search.provenance import cite
from ..store import overnight as store
from ..store.reads import read_tokens

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("rlm.overnight")


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def status_of(
    conn: psycopg.Connection, overnight_batch: store.OvernightRow, settings: Settings | None = None
) -> dict[str, Any]:
    """Progress as the API and ``rlm batch status`` show it."""
    settings = settings or get_settings()
    if overnight_batch.run_at is None:
        log.warning(
            "batch %s: its stored run_at is out of range and cannot be read; shown without one", overnight_batch.id
        )
    p = store.progress(conn, overnight_batch_id=overnight_batch.id)
    billed, unshared, cached = read_tokens(conn, overnight_id=overnight_batch.id)
    remaining = p.counts["pending"] + p.counts["running"]
    eta: float | None = None
    if remaining == 0:
        eta = 0.0
    elif overnight_batch.open and p.mean_item_seconds is not None and overnight_batch.run_at is not None:
        wait = max(0.0, (overnight_batch.run_at - store.db_now(conn)).total_seconds())
        rounds = math.ceil(remaining / max(1, settings.batch_parallel))
        eta = round(wait + rounds * p.mean_item_seconds, 1)
    return {
        "batch_id": overnight_batch.id,
        "status": overnight_batch.status,
        "total": p.total,
        "counts": p.counts,
        "from_cache": p.from_cache,
        "tokens_spent": store.tokens_spent(conn, overnight_batch_id=overnight_batch.id),
        # shared reads (docs/contract.md#shared-reads): what the analysts read, and would have read one by one
        "analyst_tokens_in": billed,
        "analyst_tokens_in_unshared": unshared,
        "analyst_cached_tokens": cached,
        "token_budget": overnight_batch.token_budget,
        "priority": overnight_batch.priority,
        "options": overnight_batch.options,
        "llm_batch": overnight_batch.llm_batch,
        "run_at": _iso(overnight_batch.run_at),
        "created_at": _iso(overnight_batch.created_at),
        "started_at": _iso(overnight_batch.started_at),
        "finished_at": _iso(overnight_batch.finished_at),
        "last_tick_at": _iso(overnight_batch.last_tick_at),
        "eta_seconds": eta,
    }


def result_line(overnight_batch_id: str, item: store.ItemRow) -> dict[str, Any]:
    """One JSONL line: the keys of docs/contract.md#batch-results (batch_id, query, buffer, status, result)
    plus item bookkeeping."""
    return {
        "batch_id": overnight_batch_id,
        "query": item.query,
        "buffer": item.buffer,
        "status": item.status,
        "result": item.result,
        "item": item.item_no,
        "from_cache": item.from_cache,
        "tokens": item.tokens,
        "error": item.error,
    }


CSV_COLUMNS = (
    "batch_id",
    "item",
    "query",
    "buffer",
    "status",
    "from_cache",
    "tokens",
    "response",
    "sources",
    "error",
)


def iter_jsonl(conn: psycopg.Connection, overnight_batch_id: str) -> Iterable[str]:
    for item in store.iter_items(conn, overnight_batch_id=overnight_batch_id):
        yield json.dumps(result_line(overnight_batch_id, item), ensure_ascii=False, default=str) + "\n"


def iter_csv(conn: psycopg.Connection, overnight_batch_id: str) -> Iterable[str]:
    buf = io.StringIO()
    writer = csv.writer(buf)

    def flush() -> str:
        out = buf.getvalue()
        buf.seek(0)
        buf.truncate()
        return out

    writer.writerow(CSV_COLUMNS)
    yield flush()
    for item in store.iter_items(conn, overnight_batch_id=overnight_batch_id):
        result = item.result or {}
        sources = "; ".join(
            cite(
                f"{s.get('buffer')}:{s.get('path')}",
                s.get("start_line") or 0,
                s.get("end_line") or 0,
                # a result stored before documents had pages has no such keys: cited by lines, as then
                s.get("page_start"),
                s.get("page_end"),
                s.get("heading_path"),
            )
            for s in result.get("sources") or []
        )
        error = item.error.get("message", "") if item.error else ""
        writer.writerow(
            (
                overnight_batch_id,
                item.item_no,
                item.query,
                item.buffer,
                item.status,
                item.from_cache,
                item.tokens,
                result.get("response", ""),
                sources,
                error,
            )
        )
        yield flush()
