"""`rlm load`: files into a buffer, here (embedded by this process) or with ``--queue`` by the ingest workers.

Registered in cli.py as the ``load`` command.
"""

from __future__ import annotations

import uuid
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rlm_workers.engine import MAX_DOCUMENT_CHARS, MAX_DOCUMENT_WINDOWS, InvalidInput, RLMError, warm_bm25

from .cli_output import Ticker, human, one_transaction_interrupt, plural, print_json
from .cli_types import Fmt, TenantOpt, open_db, resolve_tenant

if TYPE_CHECKING:
    from rich.progress import Progress


class Chunker(str, Enum):
    semantic = "semantic"
    fixed = "fixed"
    code = "code"


def _settings_max_file_bytes() -> int:
    from rlm_workers.config import get_settings

    return get_settings().max_file_bytes


class _RichProgress:
    def __init__(self, progress: Progress) -> None:
        self.p = progress
        self.files = progress.add_task("files", total=None)
        self.wins = progress.add_task("embedding", total=0)

    def files_total(self, n: int) -> None:
        self.p.update(self.files, total=n)

    def file_done(self, path: str) -> None:
        self.p.update(self.files, advance=1, description=f"files [dim]{path[-40:]}[/]")

    def windows_added(self, n: int) -> None:
        task = self.p.tasks[self.wins]
        self.p.update(self.wins, total=(task.total or 0) + n)

    def windows_embedded(self, n: int) -> None:
        self.p.update(self.wins, advance=n)


class _LogProgress:
    """The loader's progress (rlm_workers.ingest.loader.Progress) as log lines: every ~10% of the files or
    every few seconds, e.g. ``loading: 120/900 files, 3400 windows embedded, 45 s``."""

    def __init__(self) -> None:
        self.tick = Ticker(after=2.0, every=5.0)
        self.total = 0
        self.done = 0
        self.windows = 0
        self.step = 0

    def _line(self, force: bool = False) -> None:
        of = f"/{self.total}" if self.total else ""
        self.tick.maybe(
            lambda s: f"loading: {self.done}{of} files, {self.windows} windows embedded, {s:.0f} s", force=force
        )

    def files_total(self, n: int) -> None:
        self.total = n

    def file_done(self, path: str) -> None:
        self.done += 1
        step = self.done * 10 // self.total if self.total else 0
        self._line(force=step > self.step)
        self.step = max(step, self.step)

    def windows_added(self, n: int) -> None:
        pass

    def windows_embedded(self, n: int) -> None:
        self.windows += n
        self._line()


def load(
    paths: Annotated[list[Path], typer.Argument(help="Files or directories (recursive).")],
    buffer: Annotated[str, typer.Option("--buffer", "-b", help="Buffer to create or update.")],
    chunker: Annotated[Chunker, typer.Option(help="How to cut files into chunks.")] = Chunker.semantic,
    chunk_size: Annotated[int, typer.Option(help="Maximum characters per chunk.")] = 3000,
    overlap: Annotated[int, typer.Option(help="Characters shared by consecutive chunks.")] = 500,
    fmt: Annotated[Fmt, typer.Option("--format", help="Output format.")] = Fmt.text,
    queue: Annotated[
        bool,
        typer.Option(
            "--queue",
            help="Stage the files in PostgreSQL and let the ingest workers load them (split into file groups "
            "embedded at once when larger than RLM_INGEST_GROUP_BYTES); prints the upload id and returns.",
        ),
    ] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="With --queue: follow the upload (groups done) until it ends.")
    ] = False,
    tenant: TenantOpt = None,
) -> None:
    """Load files into a buffer: unchanged files are skipped, changed ones replaced, in one transaction."""
    # rich and the loader load with the command, not for `rlm --help` (cli_types)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlm_workers.engine import get_embedder, load_paths, validate_buffer_name, validate_chunk_params

    tenant = resolve_tenant(tenant)
    validate_buffer_name(buffer)
    try:
        validate_chunk_params(chunker.value, chunk_size, overlap)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    for p in paths:
        if not p.exists():
            raise InvalidInput(f"path not found: {p}")
    if queue:
        opts = {"chunker": chunker.value, "chunk_size": chunk_size, "overlap": overlap}
        _load_queued(paths, buffer, opts, tenant, fmt, wait)
        return
    if wait:
        raise InvalidInput("--wait follows a queued load: give --queue too")
    with open_db() as (settings, _url, conn):
        embedder = get_embedder(settings.embedding_model)
        console = Console(stderr=True)
        with (
            one_transaction_interrupt(buffer),
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                # where stderr is no terminal the log lines report progress (_LogProgress), and a bar there
                # would only print an empty line as it stops, before the summary or the error
                disable=fmt == Fmt.json or not console.is_terminal,
            ) as progress,
        ):
            report = load_paths(
                conn,
                buffer=buffer,
                paths=paths,
                chunker=chunker.value,
                chunk_size=chunk_size,
                overlap=overlap,
                tenant=tenant,
                embedder=embedder,
                embed_batch_size=settings.embed_batch_size,
                max_file_bytes=settings.max_file_bytes,
                progress=_RichProgress(progress) if console.is_terminal else _LogProgress(),
            )
        warm_bm25(conn, settings, _url, buffer, tenant)
    if fmt == Fmt.json:
        print_json(report.__dict__)
        return
    for name in report.too_large[:5]:
        typer.echo(
            f"warning: skipped {name}: larger than RLM_MAX_FILE_BYTES ({_settings_max_file_bytes()} bytes); not read",
            err=True,
        )
    if len(report.too_large) > 5:
        typer.echo(f"warning: … and {len(report.too_large) - 5} more files over the size limit", err=True)
    _warn_documents(report.named, report.skipped, report.cut)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(report.skipped.items())) or "none"
    cut = "".join(f", {n} {why}" for why, n in sorted(report.cut.items()))
    typer.echo(
        f"{_loaded_line(report.buffer, report.version, report.__dict__)}; skipped: {skipped}{cut} "
        f"({report.seconds:.1f}s)"
    )


def _loaded_line(buffer: str, version: int, counts: dict[str, Any]) -> str:
    """What a load wrote, as both the direct and the queued load end their summary."""
    return (
        f"buffer {buffer} v{version}: {counts['files_loaded']} {plural(counts['files_loaded'], 'file')} loaded, "
        f"{counts['files_unchanged']} unchanged, {counts['files_removed']} removed; {counts['chunks_written']} "
        f"{plural(counts['chunks_written'], 'chunk')}, {counts['windows_embedded']} "
        f"{plural(counts['windows_embedded'], 'window')} embedded"
    )


#: what each document skip or cut means, for the warning that names the files (docs/contract.md#documents)
_DOCUMENT_REASONS = {
    "encrypted": "skipped: encrypted (no password is tried but the empty one)",
    "corrupt": "skipped: corrupt (the file cannot be parsed as its format)",
    "no-text-layer": "skipped: no text layer (a scanned PDF; OCR it first)",
    "unpack-limit": "skipped: unpacks to more than the limit (a zip bomb?)",
    "convert-limit": "skipped: converting it took more memory or time than allowed",
    "cut-pages": "loaded in part: over the page limit, the rest is not loaded",
    "cut-text": (
        f"loaded in part: the converted text is over the limit ({MAX_DOCUMENT_CHARS:,} characters or "
        f"{MAX_DOCUMENT_WINDOWS:,} embedding windows), the rest is not loaded"
    ),
    "cut-time": "loaded in part: conversion ran over the time limit",
}


def _warn_documents(named: dict[str, list[str]], skipped: dict[str, int], cut: dict[str, int]) -> None:
    """One warning line per document skip or cut reason, naming the files (the first five)."""
    for reason, names in sorted(named.items()):
        n = skipped.get(reason) or cut.get(reason) or len(names)
        more = f" and {n - 5} more" if n > 5 else ""
        typer.echo(
            f"warning: {n} document{'s' if n != 1 else ''} {_DOCUMENT_REASONS.get(reason, reason)}: "
            f"{', '.join(names[:5])}{more}",
            err=True,
        )


def _load_queued(paths: list[Path], buffer: str, opts: dict[str, Any], tenant: str, fmt: Fmt, wait: bool) -> None:
    """Stage the files as an upload (what a large POST /v1/buffers does) and send it to the ingest workers."""
    from rlm_workers.engine import check_names, create_upload, discover, get_app, get_upload, listen_upload_ended

    with open_db() as (settings, _url, conn):
        try:
            candidates, _ = discover(paths, max_file_bytes=settings.max_file_bytes)
        except FileNotFoundError as exc:
            raise InvalidInput(str(exc).strip() or "path not found") from None
        if not candidates:
            raise InvalidInput(f"nothing to load: no files found; buffer {buffer!r} was not changed")
        check_names(c.rel_path for c in candidates)
        files = [(c.rel_path, c.abs_path.read_bytes()) for c in candidates]
        upload_id = uuid.uuid4().hex
        create_upload(conn, upload_id=upload_id, tenant=tenant, buffer=buffer, options=opts, files=files)
        conn.commit()
        celery = get_app()

        try:
            celery.send_task("rlm.ingest", (upload_id,), argsrepr=f"upload={upload_id}")
        except Exception as exc:  # stored: the reconciler sends it once the broker is back
            typer.echo(f"warning: upload stored but not sent ({type(exc).__name__}); the reconciler sends it", err=True)
        size = sum(len(d) for _, d in files)
        if not wait:
            if fmt == Fmt.json:
                print_json({"upload_id": upload_id, "buffer": buffer, "files": len(files), "bytes": size})
            else:
                typer.echo(
                    f"queued upload {upload_id}: {len(files)} files ({human(size)}) into buffer {buffer}; the ingest "
                    f"workers (rlm worker -Q rlm.ingest) load it; follow it with GET /v1/uploads/{upload_id} or "
                    "`rlm load --queue --wait`"
                )
            return
        shown = None
        listen_upload_ended(conn)
        conn.commit()  # LISTEN takes effect at commit
        while True:
            up = get_upload(conn, upload_id=upload_id)
            conn.commit()
            assert up is not None
            line = f"upload {upload_id}: {up.status}" + (
                f", groups {up.groups_done}/{up.groups}" if up.groups is not None else ""
            )
            if line != shown and fmt != Fmt.json:
                typer.echo(line, err=True)
                shown = line
            if up.terminal:
                break
            # woken by the upload's end at once (a poll alone left the load's end unseen for 0.25 s on average);
            # the timeout keeps the group count moving and is the safety net should a notification be missed
            for note in conn.notifies(timeout=0.5):
                if note.payload == upload_id:
                    break
    if fmt == Fmt.json:
        print_json({"upload_id": upload_id, "status": up.status, "report": up.report, "error": up.error})
    elif up.status == "done" and up.report:
        r = up.report
        _warn_documents(r.get("named") or {}, r.get("skipped") or {}, r.get("cut") or {})
        typer.echo(_loaded_line(buffer, r["version"], r))
    if up.status != "done":
        why = up.error.get("message", "no reason recorded") if up.error else "no reason recorded"
        raise RLMError(f"upload {upload_id} failed: {why}")
