"""`rlm search`: the search of a query, without any LLM (the same service as ``POST /v1/search``).

Registered in cli.py as the ``search`` command.
"""

from __future__ import annotations

import textwrap
from typing import Annotated

import typer

from rlm_workers.engine import NoChunks, SearchMode, cite_of

from .cli_output import print_json
from .cli_types import Fmt, TenantOpt, open_db, resolve_tenant

#: characters of a hit's preview line
PREVIEW_WIDTH = 110


def search(
    query: Annotated[str, typer.Argument(help="What to look for.")],
    buffer: Annotated[list[str], typer.Option("--buffer", "-b", help="Buffer(s) to search; repeatable.")],
    mode: Annotated[SearchMode, typer.Option("--mode")] = SearchMode.hybrid,
    top_k: Annotated[int, typer.Option("--top-k")] = 10,
    threshold: Annotated[
        float | None,
        typer.Option("--threshold", help="Minimum cosine similarity (semantic arm); default: no minimum."),
    ] = None,
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """Search buffers without any LLM: bm25, semantic, or hybrid (both arms fused)."""
    # the search service reads the settings and the embedder: loaded with the command (cli_types)
    from rlm_workers.engine import matched_lines, shorten, validate_query, validate_search_params
    from rlm_workers.engine import search as run_search

    tenant = resolve_tenant(tenant)
    validate_query(query)
    validate_search_params(mode.value, top_k, threshold)
    with open_db() as (settings, url, conn):
        hits = run_search(
            conn,
            settings=settings,
            url=url,
            tenant=tenant,
            buffers=buffer,
            query=query,
            mode=mode.value,
            top_k=top_k,
            # a person searching wants the best k, not an empty list: the cut is theirs to ask for
            threshold=-1.0 if threshold is None else threshold,
        )
    if fmt == Fmt.json:
        print_json({"results": [h.model_dump() for h in hits]})
        if not hits:
            raise NoChunks("no chunks matched the query", mode_flag="--mode")
        return
    if not hits:
        raise NoChunks("no chunks matched the query", mode_flag="--mode")
    for i, h in enumerate(hits, 1):
        typer.echo(f"{i:>3}. {h.score:.4f}  {h.buffer}:{cite_of(h)}  (chunk {h.chunk_id})")
        # the lines where the query's words are, numbered; when they hold only a stray word of it (a
        # paraphrased question), the sentences the semantic arm matched; failing both, the chunk's first lines
        pv = matched_lines(h.text, query, start_line=h.start_line)
        shown = " ".join(h.passage.split()) if h.passage and not pv.literal else None
        if shown:
            # three lines of it at most, wrapped and cut between words, the cut marked
            for line in textwrap.wrap(shown, PREVIEW_WIDTH, break_long_words=False, max_lines=3, placeholder=" …"):
                typer.echo(f"       {line}")
            continue
        for n, ln in pv.lines:
            typer.echo(f"  {n:>6}: {shorten(ln.strip(), PREVIEW_WIDTH)}")
