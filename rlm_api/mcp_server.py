"""The MCP server for coding agents (docs/contract.md#mcp): seven tools over stdio or streamable HTTP.

Over stdio the server acts for one tenant, the local user's (``--tenant`` / RLM_TENANT).  Over HTTP every
request carries ``Authorization: Bearer <API key>``; the API's ``KeyFirst`` answers 401 before the SDK sees a request
without a valid key and stores the key's tenant in the request's scope, which the SDK hands each tool call
(``ctx.request_context.request``).  A tool reads its tenant from there and from nowhere else, so one
process serves many tenants without one seeing another's buffers, jobs or chunks.

Tools are async and run every database round trip in a worker thread: the SDK calls tools on its event
loop, which also serves the other sessions.  Tool arguments are data: names and ids are looked up, the
question is stored and analysed, nothing is executed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Annotated, Any, Literal

# Everything a tool needs is imported here, never inside a tool: tools run in worker threads, and the first
# calls of a fresh server, sent together, imported the same modules from several threads at once (an import
# deadlock on psycopg.types.json, or a half-initialised module).  Only `rlm mcp` imports this module.
import anyio
import psycopg
import uvicorn
from mcp.server.fastmcp import Context, FastMCP
from mcp.server.fastmcp.exceptions import ToolError
from mcp.server.stdio import stdio_server
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer
from starlette.concurrency import run_in_threadpool

from rlm_api.deps import OFF_LOOP_JSON_BYTES, UnparsableBody, loads_json
from rlm_api.schemas import JobView, describe_errors
from rlm_workers.config import get_settings
from rlm_workers.engine import (
    MAX_BIGINT,
    QUEUE_ANALYST,
    QUEUE_CONTROL,
    BufferInfo,
    BufferNotFound,
    ChunkView,
    InvalidInput,
    Location,
    QueryResult,
    RLMError,
    SearchHit,
    SearchMode,
    connect,
    connection,
    get_app,
    read_outline,
    read_section,
    require_buffers,
    resolve_url,
    served_queues,
    status_line,
    submit_query,
    validate_options,
    validate_query,
    validate_search_params,
    wait_for_job,
)
from rlm_workers.engine import __version__ as RLM_VERSION
from rlm_workers.engine import get_job as stored_job
from rlm_workers.engine import list_buffers as stored_buffers
from rlm_workers.engine import search as run_search

from .app import KeyFirst
from .views import chunk_views, job_view

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("rlm.mcp")

#: most buffers one search or query may name
MAX_BUFFERS = 20
#: most hits one search returns: an agent's context is the limit, not the index
MAX_TOP_K = 100
#: characters of each hit's text a search returns (get_chunks gives the whole chunk)
HIT_TEXT_CHARS = 1500
#: most chunk ids one get_chunks call takes (the API's GET /v1/chunks bound)
MAX_CHUNK_IDS = 200
#: characters of one get_section result (then a cut marker): a long chapter, still a fraction of an agent's context
SECTION_CHARS = 100_000
#: headings of one get_outline result
MAX_OUTLINE_HEADINGS = 2000
#: the longest a query call waits before it returns the job id to poll
MAX_WAIT_S = 3600.0
DEFAULT_WAIT_S = 300.0
#: an MCP request body over this many bytes is refused (tool arguments are small: a 10 KB question at most)
MAX_BODY_BYTES = 1024 * 1024
#: where the API's KeyFirst leaves the tenant in the ASGI scope
TENANT_KEY = "tenant"

INSTRUCTIONS = (
    "rlm-pipeline answers questions over large text buffers. list_buffers names them; search finds passages "
    "without an LLM; query runs the whole pipeline and returns a markdown report whose citations look like "
    "[chunk 12, path:10-58] or [chunk 12, spec.pdf p. 4 § Transport]; get_chunks shows the cited text; "
    "get_outline lists a document's headings and get_section returns one section's text; get_job follows a "
    "query that is still running."
)

BufferName = Annotated[str, Field(min_length=1, max_length=128)]
Buffers = Annotated[list[BufferName], Field(min_length=1, max_length=MAX_BUFFERS)]
DocPath = Annotated[str, Field(min_length=1, max_length=2000)]


class BufferList(BaseModel):
    buffers: list[BufferInfo]


class Hit(SearchHit):
    """A search hit with ``text`` cut to HIT_TEXT_CHARS characters (``text_truncated``); get_chunks has it all."""

    text_truncated: bool


class SearchResults(BaseModel):
    results: list[Hit]


class QueryAnswer(BaseModel):
    job_id: str
    #: done, or queued/running when the wait ended first (then poll get_job)
    status: str
    stage: str | None = None
    #: the markdown report, when done
    report: str | None = None
    #: the CLI's status lines under a report (scale, chunks, findings, batches, tokens, time; mode, cost)
    status_line: str | None = None
    message: str


class ChunkList(BaseModel):
    chunks: list[ChunkView]
    #: ids asked for that are not this tenant's chunks
    missing: list[int]


class OutlineHeading(BaseModel):
    level: int
    title: str
    #: what get_section takes to return this section ("A › B")
    heading: str
    heading_path: list[str]
    page: int | None = None
    #: lines of the document's converted text; a section's run to the next heading of its level or above
    start_line: int
    end_line: int


class DocumentOutline(BaseModel):
    buffer: str
    path: str
    format: str
    headings: list[OutlineHeading]
    #: why the list is empty, or that it was cut
    message: str | None = None


#: get_section's keys in the order its JSON has always had them (Location's fields come first in the model)
SECTION_KEYS = ("buffer", "path", "heading", "heading_path", "section", "cite", "start_line", "end_line")


# one section's text and where it sits (``section`` is its heading's title); no docstring: that would become a
# description in the tool's output schema
class DocumentSection(Location):
    heading: str
    #: how a report cites it: "spec.pdf p. 4–5 § 2.1 Transport" or "guide.md:10-14 § Install"
    cite: str
    #: the section ran past SECTION_CHARS characters: the text ends with a cut marker
    truncated: bool
    text: str
    message: str | None = None

    @model_serializer(mode="wrap")
    # no return annotation: pydantic would take it for the output's schema in place of the model's
    def _in_published_order(self, handler: SerializerFunctionWrapHandler):
        out = handler(self)
        # the keys named first, then the rest as they come (page_start, page_end, truncated, text, message)
        return {key: out[key] for key in SECTION_KEYS if key in out} | out


# --------------------------------------------------------------------------- tenant and errors


def tenant_of(ctx: Context, local_tenant: str | None) -> str:
    """The tenant a tool call acts for: the HTTP request's key's, or the local user's over stdio."""
    request = ctx.request_context.request
    if request is None:
        if local_tenant is None:  # an HTTP server never falls back to a local tenant
            raise ToolError("unauthorized: no API key came with this call")
        return local_tenant
    tenant = (request.scope.get("state") or {}).get(TENANT_KEY)
    if not tenant:
        raise ToolError("unauthorized: no API key came with this call")
    return tenant


def _one_line(exc: BaseException, *, local: bool) -> str:
    """What a tool error says: one line the agent (or its user) can act on; internals stay in the log."""
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        detail = describe_errors(list(errors))
        got = errors[0].get("input") if errors else None
        if got is not None and not isinstance(got, dict | list) and errors[0].get("type") != "missing":
            detail += f" (got {str(got)[:80]!r})"
        return "invalid arguments: " + detail
    if isinstance(exc, BufferNotFound):  # the agent's way to the names is a tool, not a command or a route
        hint = f"did you mean {exc.suggestion!r}? " if exc.suggestion else ""
        return f"no buffer named {exc.name!r}; {hint}the list_buffers tool names them"
    if isinstance(exc, RLMError):
        # The CLI's message names CLI commands: right for the local user, not for an HTTP client.
        return (exc.message if local else exc.api_message).splitlines()[0]
    if isinstance(exc, psycopg.OperationalError):
        log.warning("database unavailable: %s", exc)
        return "database unavailable; try again once it is back"
    log.error("tool failed", exc_info=exc)
    return "internal error; the server log has the details"


class RlmMCP(FastMCP):
    """FastMCP whose tool errors are one clean line (the SDK would prefix its own words and, for bad
    arguments, pydantic's many-line report)."""

    #: serving the local user over stdio (errors may name CLI commands)
    local = False

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        if name == "query" and "question" in arguments and "query" not in arguments:
            # an agent written against the first release, whose argument was `question`: say what it is now
            raise ToolError("invalid arguments: query: the question goes in `query` (it was called `question`)")
        try:
            return await super().call_tool(name, arguments)
        except ToolError as exc:
            cause = exc.__cause__
            if cause is None or isinstance(cause, ToolError):
                raise ToolError(str(cause or exc).splitlines()[0]) from None
            raise ToolError(_one_line(cause, local=self.local)) from None


# --------------------------------------------------------------------------- the tools' work (blocking)


def _pooled():
    return connection()


def _list_buffers(tenant: str) -> BufferList:
    with _pooled() as conn:
        return BufferList(buffers=stored_buffers(conn, tenant=tenant))


def _search(tenant: str, query: str, buffers: list[str], mode: str, top_k: int, threshold: float | None):
    query = validate_query(query)
    validate_search_params(mode, top_k, threshold)
    settings = get_settings()
    with _pooled() as conn:
        # the service `rlm search` uses; like it, no similarity cut unless one is asked for
        hits = run_search(
            conn,
            settings=settings,
            url=resolve_url(settings),
            tenant=tenant,
            buffers=list(dict.fromkeys(buffers)),
            query=query,
            mode=mode,
            top_k=top_k,
            threshold=-1.0 if threshold is None else threshold,
        )
    return SearchResults(
        results=[
            Hit(
                **h.model_dump(exclude={"text", "passage"}),
                text=h.text[:HIT_TEXT_CHARS],
                text_truncated=len(h.text) > HIT_TEXT_CHARS,
                passage=h.passage,
            )
            for h in hits
        ]
    )


def _workers_missing() -> list[str]:
    served = served_queues(get_app(), timeout=1.0)
    return [q for q in (QUEUE_CONTROL, QUEUE_ANALYST) if q not in served]


def _submit(tenant: str, question: str, buffers: list[str], mode: str | None, local: bool) -> str:
    validate_query(question)
    options = validate_options({"mode": mode})
    with _pooled() as conn:
        require_buffers(conn, tenant=tenant, names=buffers)  # a wrong name says so before the worker check
    if missing := _workers_missing():
        # A job no worker serves would only sit in the queue: say so instead of submitting it.
        how = "start them with `rlm up` or `rlm worker`" if local else "the server's operator must start them"
        raise InvalidInput(f"no worker serves {', '.join(missing)}, so a query cannot run; {how}")
    with _pooled() as conn:
        job_id, _ = submit_query(conn, tenant=tenant, query=question, buffers=buffers, options=options)
    return job_id


def _wait(job_id: str, timeout: float, stop: threading.Event) -> QueryAnswer:
    class _Stopped(Exception):
        pass

    def progress(_job, _done, _total) -> None:
        if stop.is_set():  # the call was cancelled: stop waiting (the job goes on; get_job follows it)
            raise _Stopped

    # Its own connection, not a pooled one: LISTEN holds it for the whole wait.
    conn = connect()
    try:
        try:
            job = wait_for_job(conn, job_id, timeout=timeout, on_progress=progress)
        except (TimeoutError, _Stopped):
            stored = stored_job(conn, job_id=job_id)
            conn.commit()
            if stored is None:  # submitted just before this wait, and jobs are never deleted
                raise LookupError(f"job {job_id} is not stored") from None
            if not stored.terminal:
                return QueryAnswer(
                    job_id=job_id,
                    status=stored.status,
                    stage=stored.stage,
                    message=f"job {job_id} is still {stored.status} (stage {stored.stage}) after {timeout:g}s; "
                    "the workers go on with it: call get_job with this job_id to follow it",
                )
            job = stored
    finally:
        conn.close()
    return _answer(job)


def _answer(job) -> QueryAnswer:
    result = QueryResult.model_validate(job.result) if job.result else None
    if job.status == "done" and result is not None:
        return QueryAnswer(
            job_id=job.id,
            status=job.status,
            stage=job.stage,
            report=result.response,
            status_line=status_line(result),
            message=f"job {job.id} done",
        )
    message = job.error.message.splitlines()[0] if job.error and job.error.message else f"job ended {job.status}"
    raise ToolError(f"job {job.id} {job.status} ({job.error.type if job.error else 'error'}): {message}")


def _job_status(tenant: str, job_id: str) -> QueryAnswer:
    with _pooled() as conn:
        job = stored_job(conn, job_id=job_id, tenant=tenant)
    assert job is not None  # just submitted by this tenant
    return QueryAnswer(
        job_id=job_id,
        status=job.status,
        stage=job.stage,
        message=f"job {job_id} submitted; call get_job with this job_id to follow it",
    )


def _get_job(tenant: str, job_id: str, include_calls: bool) -> JobView:
    with _pooled() as conn:
        # Ids that cannot exist are not looked up (PostgreSQL text refuses a NUL); another tenant's is not found.
        job = stored_job(conn, job_id=job_id, tenant=tenant) if "\x00" not in job_id else None
        if job is None:
            raise ToolError(f"no query job {job_id[:64]!r}")
        view = job_view(conn, job)
    if not include_calls:
        view.calls = []
    return view


def _get_chunks(tenant: str, chunk_ids: list[int]) -> ChunkList:
    with _pooled() as conn:
        found = chunk_views(conn, tenant=tenant, ids=chunk_ids)
    have = {c.chunk_id for c in found}
    return ChunkList(chunks=found, missing=[i for i in dict.fromkeys(chunk_ids) if i not in have])


def _get_outline(tenant: str, buffer: str, path: str) -> DocumentOutline:
    with _pooled() as conn:
        outline = read_outline(conn, tenant=tenant, buffer=buffer, path=path)
    heads = outline.headings
    if not heads:
        message = f"{outline.path} has no headings; search or get_chunks read it"
    elif len(heads) > MAX_OUTLINE_HEADINGS:
        message = f"the first {MAX_OUTLINE_HEADINGS} of {len(heads)} headings"
    else:
        message = None
    return DocumentOutline(
        buffer=outline.buffer,
        path=outline.path,
        format=outline.format,
        headings=[
            OutlineHeading(
                level=h.level,
                title=h.title,
                heading=h.joined,
                heading_path=list(h.path),
                page=h.page,
                start_line=h.start_line,
                end_line=h.end_line,
            )
            for h in heads[:MAX_OUTLINE_HEADINGS]
        ],
        message=message,
    )


def _get_section(tenant: str, buffer: str, path: str, heading: str) -> DocumentSection:
    with _pooled() as conn:
        s = read_section(conn, tenant=tenant, buffer=buffer, path=path, heading=heading, max_chars=SECTION_CHARS)
    same = ", ".join(str(n) for n in s.same_path_at)
    return DocumentSection(
        buffer=s.buffer,
        path=s.path,
        heading=s.heading.joined,
        heading_path=list(s.heading.path),
        section=s.heading.title,
        cite=s.cite,
        start_line=s.start_line,
        end_line=s.end_line,
        page_start=s.page_start,
        page_end=s.page_end,
        truncated=s.truncated,
        text=s.text,
        message=f"other sections with this same heading path start at lines {same}" if same else None,
    )


async def _in_thread(fn, *args, stop: threading.Event | None = None):
    """Run blocking work off the event loop; a cancelled call abandons the thread after telling it to stop."""
    try:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=stop is not None)
    except BaseException:
        if stop is not None:
            stop.set()
        raise


# --------------------------------------------------------------------------- the server


def build_server(*, local_tenant: str | None, host: str = "127.0.0.1", port: int = 8001) -> FastMCP:
    """The MCP server: ``local_tenant`` for stdio (every call is that tenant's), None over HTTP (the key's)."""
    server = RlmMCP(
        name="rlm-pipeline",
        instructions=INSTRUCTIONS,
        host=host,  # on a loopback host the SDK turns on its DNS-rebinding protection
        port=port,
        streamable_http_path="/mcp",
        # each request stands alone: no session a request with another tenant's key could ride on
        stateless_http=True,
        max_request_body_size=MAX_BODY_BYTES,
        log_level="WARNING",
    )
    server.local = local_tenant is not None
    # What `initialize` reports as serverInfo.version: rlm's, not the SDK's.  FastMCP takes no version, so it is
    # set on the low-level Server it wraps (that class's public `version` attribute, its constructor argument).
    server._mcp_server.version = RLM_VERSION
    read_only = ToolAnnotations(readOnlyHint=True, openWorldHint=False)

    @server.tool(annotations=read_only)
    async def list_buffers(ctx: Context) -> BufferList:
        """The buffers you can search and query: name, version, files, chunks, bytes, embedding model."""
        return await _in_thread(_list_buffers, tenant_of(ctx, local_tenant))

    @server.tool(annotations=read_only)
    async def search(
        query: Annotated[str, Field(min_length=1, max_length=10_000, description="What to look for.")],
        buffers: Annotated[Buffers | BufferName, Field(description="A buffer name, or a list of them.")],
        ctx: Context,
        mode: Annotated[SearchMode, Field(description="bm25, semantic, or hybrid (both, fused by RRF).")] = (
            SearchMode.hybrid
        ),
        top_k: Annotated[int, Field(ge=1, le=MAX_TOP_K, description="How many chunks to return.")] = 10,
        threshold: Annotated[
            float | None, Field(ge=-1.0, le=1.0, description="Minimum cosine similarity of the semantic arm.")
        ] = None,
    ) -> SearchResults:
        """Find chunks without any LLM, best first; each hit's text is cut to 1500 characters (get_chunks
        returns whole chunks)."""
        names = [buffers] if isinstance(buffers, str) else buffers
        tenant = tenant_of(ctx, local_tenant)
        return await _in_thread(_search, tenant, query, names, mode.value, top_k, threshold)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, openWorldHint=False))
    async def query(
        query: Annotated[str, Field(min_length=1, max_length=10_000, description="The question.")],
        buffers: Annotated[Buffers | BufferName, Field(description="A buffer name, or a list of them.")],
        ctx: Context,
        mode: Annotated[
            Literal["instant", "auto", "thinking", "code"] | None,
            Field(
                description="instant: one call; auto (default): routed by size; thinking: follow-up rounds; "
                "code: the model writes programs that read the buffers."
            ),
        ] = None,
        wait: Annotated[bool, Field(description="Wait for the report (true) or return the job id at once.")] = True,
        timeout_s: Annotated[
            float, Field(gt=0, le=MAX_WAIT_S, description="Longest wait; then the job id is returned to poll.")
        ] = DEFAULT_WAIT_S,
    ) -> QueryAnswer:
        """Ask a question over buffers: plan, search, fan out to analysts, synthesize a cited markdown report.
        Returns the report and status lines, or (wait=false, or the wait ran out) the job id for get_job."""
        names = list(dict.fromkeys([buffers] if isinstance(buffers, str) else buffers))
        tenant = tenant_of(ctx, local_tenant)
        job_id = await _in_thread(_submit, tenant, query, names, mode, local_tenant is not None)
        if not wait:
            return await _in_thread(_job_status, tenant, job_id)
        stop = threading.Event()
        return await _in_thread(_wait, job_id, timeout_s, stop, stop=stop)

    @server.tool(annotations=read_only)
    async def get_job(
        job_id: Annotated[str, Field(min_length=1, max_length=64, description="A query's job id.")],
        ctx: Context,
        include_calls: Annotated[bool, Field(description="Also list every LLM call (model, tokens, cost).")] = False,
    ) -> JobView:
        """A query job: status, stage, batch progress, timings, usage, child jobs, and the result once done."""
        return await _in_thread(_get_job, tenant_of(ctx, local_tenant), job_id, include_calls)

    @server.tool(annotations=read_only)
    async def get_chunks(
        chunk_ids: Annotated[
            list[Annotated[int, Field(ge=1, le=MAX_BIGINT)]],
            Field(min_length=1, max_length=MAX_CHUNK_IDS, description="Chunk ids, e.g. from [chunk 12, …]."),
        ],
        ctx: Context,
    ) -> ChunkList:
        """Whole chunks by id (what a citation [chunk 12, path:10-58] points at), in the order asked."""
        return await _in_thread(_get_chunks, tenant_of(ctx, local_tenant), chunk_ids)

    @server.tool(annotations=read_only)
    async def get_outline(
        buffer: Annotated[BufferName, Field(description="The buffer holding the document.")],
        path: Annotated[DocPath, Field(description="The document's path in the buffer (or its unique tail).")],
        ctx: Context,
    ) -> DocumentOutline:
        """A document's headings (PDF, DOCX, Markdown, …): level, title, heading path, page and lines.  A file
        without headings (plain text, code) says so."""
        return await _in_thread(_get_outline, tenant_of(ctx, local_tenant), buffer, path)

    @server.tool(annotations=read_only)
    async def get_section(
        buffer: Annotated[BufferName, Field(description="The buffer holding the document.")],
        path: Annotated[DocPath, Field(description="The document's path in the buffer (or its unique tail).")],
        heading: Annotated[
            str,
            Field(
                min_length=1,
                max_length=2000,
                description='The heading path, "Install › Linux" (or "Install > Linux"), or a title alone.',
            ),
        ],
        ctx: Context,
    ) -> DocumentSection:
        """The text of one section, from its heading to the next heading of its level or above (subsections
        included), with its citation; a heading several sections match gives their paths to choose from."""
        return await _in_thread(_get_section, tenant_of(ctx, local_tenant), buffer, path, heading)

    return server


# --------------------------------------------------------------------------- transports


def ready() -> None:
    """The one-time set-up every tool shares, done once in this thread before any tool can run: the settings
    and the connection pool (which also migrates the database and registers pgvector's types)."""
    get_settings()
    with connection():
        pass


#: JSON-RPC's code for a body that is not JSON, as the SDK answers a syntax error
PARSE_ERROR = -32700


class CheckedBody:
    """A POST body that is not UTF-8 or is nested too deep is a 400 JSON-RPC parse error, as the SDK answers
    any other broken JSON; the SDK would raise on it (UnicodeDecodeError, RecursionError) and answer 500.

    The body is read here (at most ``MAX_BODY_BYTES``, the SDK's own bound: past it a 413) and replayed to
    the SDK, which parses it again.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:
                await _rpc_error(send, 413, -32600, f"request body over {MAX_BODY_BYTES} bytes")
                return
        try:
            if len(body) > OFF_LOOP_JSON_BYTES:
                await run_in_threadpool(loads_json, body)
            else:
                loads_json(body)
        except UnparsableBody as exc:
            await _rpc_error(send, 400, PARSE_ERROR, f"Parse error: {exc}")
            return
        except ValueError:  # plain broken JSON: the SDK's own parse error says where
            pass
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect the SDK waits for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _rpc_error(send: Send, status: int, code: int, message: str) -> None:
    payload = {"jsonrpc": "2.0", "id": "server-error", "error": {"code": code, "message": message}}
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def http_app(*, host: str, port: int) -> ASGIApp:
    """The streamable HTTP app (``POST /mcp``), every request checked for a key, then for a parsable body."""
    sdk_app = build_server(local_tenant=None, host=host, port=port).streamable_http_app()
    return KeyFirst(CheckedBody(sdk_app), prefix=None)


def serve_http(*, host: str, port: int) -> None:
    ready()
    uvicorn.run(http_app(host=host, port=port), host=host, port=port, log_level="warning", proxy_headers=False)


def take_stdout() -> int:
    """Keep stdout for the protocol alone: returns a new descriptor for it, and from here on whatever else would
    write to fd 1 (a print, a library's progress bar, a C extension, a child process) lands on stderr."""
    sys.stdout.flush()
    protocol = os.dup(1)
    os.dup2(2, 1)
    return protocol


def serve_stdio(tenant: str, protocol_fd: int) -> None:
    """Serve one client: requests on stdin, replies on ``protocol_fd`` (``take_stdout()``'s)."""
    server = build_server(local_tenant=tenant)
    ready()

    async def run() -> None:
        out = anyio.wrap_file(io.TextIOWrapper(os.fdopen(protocol_fd, "wb", buffering=0), encoding="utf-8"))
        async with stdio_server(stdout=out) as (read, write):
            lowlevel = server._mcp_server  # FastMCP.run_stdio_async, with our stdout
            await lowlevel.run(read, write, lowlevel.create_initialization_options())

    anyio.run(run)
