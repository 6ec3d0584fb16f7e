"""`rlm buffers` and `rlm buffer show|rm|reembed`: the tenant's buffers.

Registered in cli.py as the ``buffers`` command and the ``buffer`` group.
"""

from __future__ import annotations

from typing import Annotated

import typer

from rlm_workers.engine import warm_bm25

from .cli_output import human, one_transaction_interrupt, plural, print_json
from .cli_types import Fmt, TenantOpt, new_typer, open_db, resolve_tenant

buffer_app = new_typer(help="Inspect or remove one buffer.")


def buffers_cmd(fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text, tenant: TenantOpt = None) -> None:
    """List buffers."""
    from rlm_workers.engine import list_buffers

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        rows = list_buffers(conn, tenant=tenant)
    if fmt == Fmt.json:
        print_json({"buffers": [r.model_dump() for r in rows]})
        return
    if not rows:
        typer.echo("no buffers yet: load some with `rlm load PATH --buffer NAME`")
        return
    for r in rows:
        typer.echo(
            f"{r.name:<24} v{r.version:<4} {r.files:>6} {plural(r.files, 'file'):<5} "
            f"{r.chunks:>8} {plural(r.chunks, 'chunk'):<6} {human(r.bytes):>10}"
        )


@buffer_app.command("show")
def buffer_show(
    name: str,
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    files: Annotated[
        int, typer.Option("--files", min=0, max=100_000, help="List at most this many files (0: none).")
    ] = 50,
    tenant: TenantOpt = None,
) -> None:
    """Show one buffer's size, chunking and model, and its files (path, bytes, chunks)."""
    from rlm_workers.engine import buffer_info, list_files

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        info = buffer_info(conn, tenant=tenant, name=name)
        # one row past the cap tells whether "… and N more" is needed without counting twice
        listed = list_files(conn, buffer_id=info.id, limit=files + 1) if files else []
    shown = listed[:files]
    if fmt == Fmt.json:
        print_json({**info.model_dump(), "file_list": [f.model_dump() for f in shown]})
        return
    fields = info.model_dump()
    width = max(map(len, fields))  # a fixed width cut "embedding_windows" one column out of line
    for key, value in fields.items():
        typer.echo(f"{key:>{width}}: {value}")
    if shown:
        typer.echo("")
        # columns as wide as their longest cell: path to the left, numbers to the right
        sizes = [human(f.bytes) for f in shown]
        path_w, size_w = max(len(f.path) for f in shown), max(map(len, sizes))
        chunks_w = max(len(str(f.chunks)) for f in shown)
        for f, size in zip(shown, sizes, strict=True):
            typer.echo(f"  {f.path:<{path_w}}  {size:>{size_w}}  {f.chunks:>{chunks_w}} {plural(f.chunks, 'chunk')}")
    if info.files > len(shown):
        typer.echo(f"  … and {info.files - len(shown)} more (--files N to list more)")


@buffer_app.command("rm")
def buffer_rm(name: str, tenant: TenantOpt = None) -> None:
    """Delete a buffer with its chunks and embeddings."""
    from rlm_workers.engine import buffer_not_found, delete_buffer

    tenant = resolve_tenant(tenant)
    with open_db() as (_s, _u, conn):
        if not delete_buffer(conn, tenant=tenant, name=name):
            raise buffer_not_found(conn, tenant=tenant, name=name)
        conn.commit()
    typer.echo(f"removed buffer {name}")


@buffer_app.command("reembed")
def buffer_reembed(
    name: str,
    queue: Annotated[
        bool, typer.Option("--queue", help="Send it to the ingest workers (rlm.embed) and return.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Re-embed even if the buffer is on this model.")] = False,
    fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text,
    tenant: TenantOpt = None,
) -> None:
    """Replace a buffer's vectors with RLM_EMBEDDING_MODEL's (after changing models); chunks stay as they are."""
    # celery, rich and the embedder load with the command, not for `rlm --help` (cli_types)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlm_workers.engine import get_app, reembed_buffer, require_buffers

    tenant = resolve_tenant(tenant)
    with open_db() as (settings, url, conn):
        (row,) = require_buffers(conn, tenant=tenant, names=[name])
        if queue:
            celery = get_app()

            celery.send_task("rlm.embed", (row.id,), argsrepr=f"buffer={row.id}")
            typer.echo(
                f"queued rlm.embed for buffer {name}: an ingest worker (rlm worker -Q rlm.ingest) "
                "re-embeds it; `rlm buffer show` tells the model when it is done"
            )
            return
        console = Console(stderr=True)
        with (
            one_transaction_interrupt(name),
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                # a bar on a stderr that is no terminal draws nothing but an empty line as it stops
                disable=fmt == Fmt.json or not console.is_terminal,
            ) as progress,
        ):
            bar = progress.add_task("chunks", total=None)
            report = reembed_buffer(
                conn,
                tenant=tenant,
                name=name,
                force=force,
                embed_batch_size=settings.embed_batch_size,
                on_chunks=lambda done, total: progress.update(bar, completed=done, total=total),
            )
        if not report.unchanged:
            warm_bm25(conn, settings, url, name, tenant)
    if fmt == Fmt.json:
        print_json(report.__dict__)
    elif report.unchanged:
        typer.echo(f"buffer {name} is already embedded with {report.model}: nothing to do (--force to redo it)")
    else:
        typer.echo(
            f"buffer {name} v{report.version}: {report.chunks} chunks, {report.windows_embedded} windows "
            f"re-embedded with {report.model} (was {report.previous_model}) ({report.seconds:.1f}s)"
        )
