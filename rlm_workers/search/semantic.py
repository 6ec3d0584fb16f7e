"""The semantic arm: cosine similarity on pgvector's HNSW index.

Chunks are embedded as several windows; a chunk scores by its best window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..store.migrations import embedding_table

if TYPE_CHECKING:
    import numpy as np

#: windows fetched per wanted chunk: several windows of one chunk may rank together
_WINDOW_FANOUT = 3


def semantic_search(conn, *, buffer_ids: Sequence[int], dim: int, query_vec: np.ndarray, limit: int,  # noqa: ANN001
                    threshold: float | None) -> list[tuple[int, float]]:
    """(chunk_id, cosine similarity) best first, at most ``limit`` chunks, similarity ≥ threshold."""
    table = embedding_table(dim)
    want = max(1, limit) * _WINDOW_FANOUT
    with conn.transaction():
        # ef_search bounds how many rows HNSW can return; iterative scan keeps
        # going when the buffer filter discards neighbours from other buffers.
        conn.execute(f"SET LOCAL hnsw.ef_search = {min(1000, max(40, want))}")
        conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
        rows = conn.execute(
            f"""SELECT chunk_id, 1 - (embedding <=> %(q)s) AS sim FROM {table}
                WHERE buffer_id = ANY(%(b)s) ORDER BY embedding <=> %(q)s LIMIT %(n)s""",
            {"q": query_vec, "b": list(buffer_ids), "n": want},
        ).fetchall()
    best: dict[int, float] = {}
    for cid, sim in rows:
        if sim > best.get(cid, -2.0):
            best[cid] = float(sim)
    ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
    if threshold is not None:
        ranked = [kv for kv in ranked if kv[1] >= threshold]
    return ranked[:limit]
