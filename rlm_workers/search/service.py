"""Search over one or several buffers: bm25, semantic, or hybrid (both arms fused: ``fusion.py``).

Used by ``rlm search``, the pipeline's Search stage and the synthesizer's
``search`` tool alike.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from ..config import Settings
from ..errors import InvalidInput
from ..ingest.embed import get_query_encoder, model_id_for, ranked_as, resolve_runtime
from ..ingest.windows import DEFAULT_WINDOWS, WindowSpec
from ..limits import MAX_QUERY_BYTES
from ..models import SearchHit, SearchMode, Threshold, TopK, check_storable_text
from ..store.buffers import BufferRow, get_chunks, require_buffers
from ..store.vectors import Near
from . import bm25_cache
from .fusion import fused_top
from .provenance import fields
from .semantic import semantic_search
from .tokenize import tokenize

if TYPE_CHECKING:
    import numpy as np
    import psycopg

    from .bm25 import BM25Index, BM25Union


@dataclass(frozen=True)
class Ranked:
    chunk_id: int
    score: float
    #: the chunk's window nearest the query, when the semantic arm saw the chunk
    near: Near | None = None


def validate_query(query: str) -> str:
    if not query or not query.strip():
        raise InvalidInput("the query is empty: say what to look for")
    try:
        check_storable_text(query, "the query")
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if len(query.encode()) > MAX_QUERY_BYTES:
        raise InvalidInput(f"the query is {len(query.encode())} bytes; the limit is {MAX_QUERY_BYTES} (10 KB)")
    return query.strip()


def validate_search_params(mode: str, top_k: int, threshold: float | None) -> None:
    """The bounds of ``QueryOptions`` (one place), said as a person at the command line would fix them."""
    modes = [m.value for m in SearchMode]
    if mode not in modes:
        raise InvalidInput(f"unknown search mode {mode!r}: use one of {', '.join(modes)}")
    # (the Annotated type the value must satisfy, the value, the message): Annotated forms are not classes
    checks: list[tuple[Any, float, str]] = [(TopK, top_k, "--top-k must be between 1 and 10000, got {}")]
    if threshold is not None:
        checks.append((Threshold, threshold, "--threshold must be between -1 and 1 (cosine similarity), got {}"))
    for kind, value, message in checks:
        try:
            TypeAdapter(kind).validate_python(value)
        except ValidationError:
            raise InvalidInput(message.format(value)) from None


def _bm25_index(
    conn: psycopg.Connection, rows: Sequence[BufferRow], settings: Settings, url: str
) -> BM25Index | BM25Union:
    """The buffers' BM25 as one index: each buffer's mapped file, scored with the statistics of them all."""
    dbk = bm25_cache.db_key(url)
    parts = [bm25_cache.index_for(conn, r, cache_dir=settings.data_dir / "cache", dbk=dbk) for r in rows]
    if len(parts) == 1:
        return parts[0]
    return bm25_cache.union_of(dbk, rows, parts)


def _semantic_rows(rows: Sequence[BufferRow], settings: Settings) -> list[BufferRow]:
    """Buffers that have vectors, checked to share the configured model, one window setting and one runtime.

    Scores from different window sizes are not comparable (a shorter window scores a matching
    sentence higher), nor are vectors of two runtimes (the query is embedded by one of them).
    """
    want = model_id_for(settings.embedding_model)
    have = [r for r in rows if r.embedding_dim]
    for r in have:
        if r.embedding_model != want:
            mismatch = (
                f"buffer {r.name!r} was embedded with {r.embedding_model}, but RLM_EMBEDDING_MODEL selects {want}"
            )
            raise InvalidInput(
                f"{mismatch}: set RLM_EMBEDDING_MODEL={r.embedding_model}, or run `rlm buffer reembed {r.name}`",
                api_message=f"{mismatch}: the server's operator sets RLM_EMBEDDING_MODEL={r.embedding_model} or "
                "re-embeds the buffer; meanwhile options.search_mode=bm25 needs no vectors",
            )
    _refuse_mixed(
        have,
        # a GPU's half-precision vectors are ranked with the float32 reference's (embed.COMPARABLE_COSINE)
        lambda r: ranked_as(r.runtime),
        "by different encoder runtimes",
        lambda: ranked_as(resolve_runtime(settings.embedding_model)),
        "RLM_EMBEDDING_RUNTIME",
    )
    _refuse_mixed(have, lambda r: r.windows_label, "with different window settings", lambda: DEFAULT_WINDOWS.label, "")
    return have


def _refuse_mixed(have: list[BufferRow], kind_of, what: str, target, setting: str) -> None:
    """Buffers whose vectors were made differently (``kind_of``) are not ranked together: their scores differ.

    ``target()`` names the setting a re-embed brings them to; only the refusal asks (resolving ``auto`` reads
    the model's files, which every search would otherwise pay).
    """
    if len({kind_of(r) for r in have}) <= 1:
        return
    current = target()
    odd = sorted(r.name for r in have if kind_of(r) != current) or [have[0].name]
    listing = ", ".join(f"{r.name!r} ({kind_of(r)})" for r in have)
    head = f"these buffers were embedded {what} and cannot be ranked together: {listing}"
    raise InvalidInput(
        f"{head}; run `rlm buffer reembed {odd[0]}` to bring it to {current}{f' ({setting})' if setting else ''}",
        api_message=f"{head}; the server's operator re-embeds the odd one out, or search them one at a time",
    )


@functools.lru_cache(maxsize=256)
def query_vector(model: str | None, query: str, runtime: str = "torch") -> np.ndarray:
    """The query's embedding by ``runtime`` (the buffers'), memoised per process (a job's plan stage computes
    it ahead of its search)."""
    vec = get_query_encoder(model, runtime).encode_query(query)
    vec.setflags(write=False)  # shared between callers
    return vec


def rank(
    conn: psycopg.Connection,
    *,
    settings: Settings,
    url: str,
    rows: Sequence[BufferRow],
    query: str,
    mode: str,
    top_k: int,
    threshold: float | None,
) -> list[Ranked]:
    """Chunk ids best first; hybrid fetches 2×top_k from each arm and fuses them (``fusion.fused_top``)."""
    depth = top_k * 2 if mode == "hybrid" else top_k
    lexical: list[tuple[int, float]] = []
    dense: list[Near] = []
    if mode in ("bm25", "hybrid"):
        lexical = _bm25_index(conn, rows, settings, url).top_k(tokenize(query), depth)
    if mode in ("semantic", "hybrid"):
        vec_rows = _semantic_rows(rows, settings)
        if vec_rows:
            vec = query_vector(settings.embedding_model, query, vec_rows[0].runtime)
            dense = semantic_search(
                conn,
                buffer_ids=[r.id for r in vec_rows],
                query_vec=vec,
                limit=depth,
                threshold=threshold,
            )
    if mode == "bm25":
        return [Ranked(c, s) for c, s in lexical[:top_k]]
    if mode == "semantic":
        return [Ranked(n.chunk_id, n.similarity, n) for n in dense[:top_k]]

    fused = fused_top(lexical, [(n.chunk_id, n.similarity) for n in dense], top_k)
    near = {n.chunk_id: n for n in dense}
    return [Ranked(c, s, near.get(c)) for c, s in fused]


def search(
    conn: psycopg.Connection,
    *,
    settings: Settings,
    url: str,
    tenant: str,
    buffers: Sequence[str],
    query: str,
    mode: str = "hybrid",
    top_k: int = 10,
    threshold: float | None = None,
) -> list[SearchHit]:
    query = validate_query(query)
    validate_search_params(mode, top_k, threshold)
    if not buffers:
        raise InvalidInput("name at least one --buffer to search")
    rows = require_buffers(conn, tenant=tenant, names=buffers)
    ranked = rank(
        conn,
        settings=settings,
        url=url,
        rows=rows,
        query=query,
        mode=mode,
        top_k=top_k,
        threshold=settings.threshold if threshold is None else threshold,
    )
    chunks = get_chunks(conn, tenant=tenant, chunk_ids=[r.chunk_id for r in ranked])
    cuts = {r.name: (r.windows_label, r.runtime) for r in rows}
    return [
        SearchHit(
            chunk_id=r.chunk_id,
            buffer=c.buffer,
            path=c.path,
            start_line=c.start_line,
            end_line=c.end_line,
            score=round(r.score, 6),
            text=c.text,
            passage=_passage(settings, c.text, *cuts.get(c.buffer, (None, None)), r),
            **fields(c.page_start, c.page_end, c.heading_path),
        )
        for r in ranked
        if (c := chunks.get(r.chunk_id)) is not None
    ]


def _passage(settings: Settings, text: str, label: str | None, runtime: str | None, hit: Ranked) -> str | None:
    """The text of the chunk's window nearest the query: the sentence(s) the semantic arm matched."""
    near = hit.near
    if near is None:
        return None
    if near.span is not None:
        a, b = near.span
        return text[a:b] if 0 <= a < b <= len(text) else None
    if label is None or runtime is None:
        return None
    # vectors stored before their spans were: cut the chunk again
    try:
        spec = WindowSpec.from_label(label)
    except ValueError:
        return None
    # the encoder that embedded the query: every encoder cuts alike (same tokenizer.json, same cutter)
    spans = get_query_encoder(settings.embedding_model, runtime).window_spans(text, spec)
    if not 0 <= near.win < len(spans):
        return None  # a chunk re-cut since: no passage rather than a wrong one
    a, b = spans[near.win]
    return text[a:b]
