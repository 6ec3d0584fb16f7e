"""Overnight batches over HTTP (docs/contract.md#http-batches): submit queries × buffers, follow progress,
stream results as JSONL.

A batch and its items live in PostgreSQL; workers advance it (``rlm.batch.tick``, ``rlm_workers.overnight``).
Other tenants' batches are 404, never 403, so ids do not leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlm_workers.engine import (
    MAX_BIGINT,
    QueryOptions,
    cancel_overnight,
    check_storable_text,
    connection,
    get_overnight,
    iter_csv,
    iter_jsonl,
    list_overnight,
    status_of,
    submit_overnight,
)

from ..deps import ConnDep, ParseOffLoop, TenantDep, found_or_404

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.engine import OvernightRow

router = APIRouter(prefix="/v1/batches", tags=["batches"], route_class=ParseOffLoop)


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(min_length=1, max_length=10_000, description="The questions (duplicates dropped).")
    buffers: list[str] = Field(default_factory=list, max_length=10_000, description="Buffer names.")
    buffers_glob: str | None = Field(None, max_length=200, description="Also every buffer matching this glob.")
    run_at: datetime | None = Field(
        None,
        description="Do not start before this time: ISO 8601 with a zone offset (2026-11-24T02:00:00Z), "
        "at most a year ahead.",
    )
    # Strict like every option: "3", 3.0 or true for a number, "yes" or 1 for a boolean are 422, not coerced.
    priority: int = Field(
        3, strict=True, ge=1, le=9, description="1 soonest … 9 latest; interactive queries always go first."
    )
    token_budget: int | None = Field(
        None, strict=True, ge=1, le=MAX_BIGINT, description="Stop scheduling new items once this many tokens are spent."
    )
    options: QueryOptions = Field(default_factory=QueryOptions, description="Query options, as for POST /v1/queries.")
    llm_batch: bool = Field(
        False,
        strict=True,
        description="Send the analyst calls through the OpenAI Batch API (half price, results within 24 h); "
        "docs/contract.md#llm-batch-api.",
    )

    # Names PostgreSQL cannot store (NUL, a lone surrogate) are a 422 here, not a 500 when a buffer is looked up;
    # the queries get the same rule, numbered, from submit_overnight's validate_query.
    _check_buffers = field_validator("buffers")(
        classmethod(lambda cls, v: [check_storable_text(b, "a buffer name") for b in v])
    )
    _check_glob = field_validator("buffers_glob")(
        classmethod(lambda cls, v: v if v is None else check_storable_text(v, "buffers_glob"))
    )


class BatchCreated(BaseModel):
    batch_id: str
    status_url: str
    results_url: str
    created: bool


class BatchStatus(BaseModel):
    batch_id: str
    status: Literal["scheduled", "running", "done", "cancelled"]
    total: int
    counts: dict[str, int] = Field(description="Items by state: pending, running, done, failed, cancelled, skipped.")
    from_cache: int
    tokens_spent: int
    analyst_tokens_in: int = Field(0, description="Input tokens of the analyst calls, as billed.")
    analyst_tokens_in_unshared: int = Field(
        0, description="What the analysts would have read had every question read its chunks alone."
    )
    analyst_cached_tokens: int = Field(0, description="Of analyst_tokens_in, those served from the prompt cache.")
    token_budget: int | None
    priority: int
    options: dict[str, Any]
    llm_batch: bool = False
    run_at: str | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    last_tick_at: str | None
    eta_seconds: float | None = Field(
        description="Mean item time × remaining rounds (+ wait for run_at); null until an item has finished."
    )


def _urls(batch_id: str) -> tuple[str, str]:
    return f"/v1/batches/{batch_id}", f"/v1/batches/{batch_id}/results"


def _overnight_batch_or_404(conn: psycopg.Connection, tenant: str, batch_id: str) -> OvernightRow:
    return found_or_404(lambda i: get_overnight(conn, overnight_batch_id=i, tenant=tenant), batch_id, "batch")


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=BatchCreated,
    responses={
        200: {"description": "Replay of an Idempotency-Key: the batch made the first time."},
        422: {"description": "invalid body, or an Idempotency-Key already used for a different request"},
    },
)
def create_batch(
    body: BatchIn,
    conn: ConnDep,
    tenant: TenantDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> BatchCreated:
    """Queue every (query, buffer) pair as one item; workers run them, at most RLM_BATCH_PARALLEL at a time."""
    batch_id, created = submit_overnight(
        conn,
        tenant=tenant,
        queries=body.queries,
        buffers=body.buffers,
        buffers_glob=body.buffers_glob,
        options=body.options.stored(),
        run_at=body.run_at,
        priority=body.priority,
        token_budget=body.token_budget,
        idempotency_key=idempotency_key,
        llm_batch=body.llm_batch,
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    status_url, results_url = _urls(batch_id)
    response.headers["Location"] = status_url
    return BatchCreated(batch_id=batch_id, status_url=status_url, results_url=results_url, created=created)


@router.get("", response_model=list[BatchStatus])
def list_batches(
    conn: ConnDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=500)] = 50
) -> list[dict[str, Any]]:
    """The tenant's most recent batches, newest first."""
    return [status_of(conn, b) for b in list_overnight(conn, tenant=tenant, limit=limit)]


@router.get("/{batch_id}", response_model=BatchStatus)
def get_batch(batch_id: str, conn: ConnDep, tenant: TenantDep) -> dict[str, Any]:
    """Counts by state, tokens spent, ETA."""
    return status_of(conn, _overnight_batch_or_404(conn, tenant, batch_id))


# POST …/cancel is the name the contract and `rlm batch cancel` use; the older delete route stays for existing clients.
@router.post("/{batch_id}/cancel", response_model=BatchStatus)
@router.delete("/{batch_id}", response_model=BatchStatus)
def cancel_batch(batch_id: str, conn: ConnDep, tenant: TenantDep) -> dict[str, Any]:
    """Cancel: nothing new starts, running items' jobs are cancelled; finished items keep their results."""
    return status_of(
        conn, found_or_404(lambda i: cancel_overnight(conn, tenant=tenant, overnight_batch_id=i), batch_id, "batch")
    )


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {}, "text/csv": {}},
            "description": 'One line per item: {"batch_id", "query", "buffer", "status", "result", '
            '"item", "from_cache", "tokens", "error"}',
        }
    },
)
def batch_results(
    batch_id: str,
    conn: ConnDep,
    tenant: TenantDep,
    format: Annotated[Literal["jsonl", "csv"], Query()] = "jsonl",
) -> StreamingResponse:
    """Every item in order, finished or not (``status`` tells), streamed from the database."""
    _overnight_batch_or_404(conn, tenant, batch_id)

    def lines() -> Iterator[str]:
        # its own pooled connection: the request's may be returned before streaming ends
        with connection() as c:
            yield from (iter_csv if format == "csv" else iter_jsonl)(c, batch_id)

    media = "text/csv" if format == "csv" else "application/x-ndjson"
    return StreamingResponse(
        lines(),
        media_type=media,
        headers={"Content-Disposition": f'inline; filename="batch-{batch_id}.{format}"'},
    )
