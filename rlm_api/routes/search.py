"""``POST /v1/search``: the search of ``rlm search``, without any LLM, over the caller's buffers.

Same service (rlm_workers.search.service), same hits, same ``{"results": [...]}`` as ``rlm search --format json``
(docs/contract.md#search-json).  Another tenant's buffer is simply not found.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field, field_validator, model_validator

from rlm_workers.config import get_settings
from rlm_workers.engine import SearchHit, SearchMode, Threshold, TopK, database_url
from rlm_workers.engine import search as run_search

from ..deps import ConnDep, ParseOffLoop, TenantDep
from ..schemas import Strict, buffer_name_ok, query_ok

router = APIRouter(prefix="/v1/search", tags=["search"], route_class=ParseOffLoop)

#: most buffers one search may name (as a query's ``buffers``)
MAX_SEARCH_BUFFERS = 50


class SearchRequest(Strict):
    query: str = Field(..., description="What to look for (at most 10 KB).")
    buffers: list[str] | None = Field(
        None, min_length=1, max_length=MAX_SEARCH_BUFFERS, description="Buffers to search (or ``buffer``)."
    )
    buffer: str | None = Field(None, description="One buffer to search (shorthand for ``buffers: [name]``).")
    mode: SearchMode = Field(SearchMode.hybrid, description="hybrid (both arms fused), semantic or bm25.")
    top_k: TopK = Field(10, description="How many hits.")
    threshold: Threshold | None = Field(
        None, description="Minimum cosine similarity for the semantic arm; default: no minimum."
    )

    _check_query = field_validator("query")(classmethod(lambda cls, v: query_ok(v)))

    @field_validator("buffers")
    @classmethod
    def _names(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [buffer_name_ok(n) for n in v]

    @field_validator("buffer")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return None if v is None else buffer_name_ok(v)

    @model_validator(mode="after")
    def _one_way(self) -> SearchRequest:
        if (self.buffers is None) == (self.buffer is None):
            raise ValueError("give either buffers (a list) or buffer (one name)")
        return self

    def names(self) -> list[str]:
        return self.buffers if self.buffers is not None else [self.buffer or ""]


class SearchResults(BaseModel):
    results: list[SearchHit]


@router.post(
    "",
    response_model=SearchResults,
    responses={
        404: {"description": "a named buffer does not exist for this tenant"},
        422: {"description": "invalid body: empty or oversized query, bad mode, top_k or threshold"},
    },
)
def search(body: SearchRequest, conn: ConnDep, tenant: TenantDep) -> SearchResults:
    """Best chunks first; an empty ``results`` when nothing matched (not an error, unlike the CLI's exit 3)."""
    settings = get_settings()
    hits = run_search(
        conn,
        settings=settings,
        url=database_url(settings),
        tenant=tenant,
        buffers=body.names(),
        query=body.query,
        mode=body.mode.value,
        top_k=body.top_k,
        # as `rlm search`: the best k unless the caller asks for a cut
        threshold=-1.0 if body.threshold is None else body.threshold,
    )
    return SearchResults(results=hits)
