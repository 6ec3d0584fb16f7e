"""The semantic arm: cosine similarity over each named buffer's HNSW graph.

Chunks are embedded as several windows; a chunk scores by its best window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..store.vectors import Near, nearest_windows

if TYPE_CHECKING:
    import numpy as np
    import psycopg

#: windows fetched per wanted chunk: several windows of one chunk may rank together
_WINDOW_FANOUT = 3
#: HNSW candidate list per buffer graph.  Chosen by bench/search.py on real MiniLM vectors (bench/RESULTS.md,
#: "HNSW recall@10 vs exact search, real vectors"): the smallest of 40/100/200/400 with recall@10 against exact
#: search >= 0.95 for a 105k-window buffer, a 1k-chunk buffer beside a 100k-chunk one, and a query spanning both;
#: 40 fell short on the small buffer (0.93), and hybrid p50 stayed far below 50 ms at 100
EF_SEARCH = 100


def semantic_search(
    conn: psycopg.Connection,
    *,
    buffer_ids: Sequence[int],
    query_vec: np.ndarray,
    limit: int,
    threshold: float | None,
) -> list[Near]:
    """Each chunk's best window, best first: at most ``limit`` chunks, similarity ≥ threshold."""
    rows = nearest_windows(
        conn,
        buffer_ids=buffer_ids,
        query_vec=query_vec,
        limit=max(1, limit) * _WINDOW_FANOUT,
        ef_search=EF_SEARCH,
    )
    best: dict[int, Near] = {}
    for near in rows:
        have = best.get(near.chunk_id)
        if have is None or near.similarity > have.similarity:
            best[near.chunk_id] = near
    ranked = sorted(best.values(), key=lambda n: (-n.similarity, n.chunk_id))
    if threshold is not None:
        ranked = [n for n in ranked if n.similarity >= threshold]
    return ranked[:limit]
