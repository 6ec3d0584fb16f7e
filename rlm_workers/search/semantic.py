"""The semantic arm: cosine similarity on pgvector's HNSW index.

Chunks are embedded as several windows; a chunk scores by its best window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..store.buffers import nearest_windows
from ..store.migrations import embedding_table

if TYPE_CHECKING:
    import numpy as np
    import psycopg

#: windows fetched per wanted chunk: several windows of one chunk may rank together
_WINDOW_FANOUT = 3


def semantic_search(
    conn: psycopg.Connection,
    *,
    buffer_ids: Sequence[int],
    dim: int,
    query_vec: np.ndarray,
    limit: int,
    threshold: float | None,
) -> list[tuple[int, float]]:
    """(chunk_id, cosine similarity) best first, at most ``limit`` chunks, similarity ≥ threshold."""
    rows = nearest_windows(
        conn,
        table=embedding_table(dim),
        buffer_ids=buffer_ids,
        query_vec=query_vec,
        limit=max(1, limit) * _WINDOW_FANOUT,
    )
    best: dict[int, float] = {}
    for cid, sim in rows:
        if sim > best.get(cid, -2.0):
            best[cid] = float(sim)
    ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
    if threshold is not None:
        ranked = [kv for kv in ranked if kv[1] >= threshold]
    return ranked[:limit]
