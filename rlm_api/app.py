"""The thin HTTP API (docs/contract.md#http-api): routes by resource, one error shape, bounded request bodies.

``create_app()`` builds the app without touching the database or the broker;
connections are opened per request from the process pool.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlm_workers.config import get_settings
from rlm_workers.engine import POOL_MAX_SIZE, RLMError

from .deps import UNAUTHORIZED, tenant_from_header
from .routes import batches, buffers, chunks, health, queries, search, sessions, uploads
from .schemas import ErrorBody, ErrorResponse, describe_errors
from .ui import routes as ui_routes

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: RLMError.type → HTTP status; anything else a user can fix is 422, infrastructure is 503
STATUS_BY_TYPE = {
    "invalid_input": 422,
    "buffer_not_found": 404,
    "no_chunks": 422,
    "idempotency_key_reused": 422,
    "too_many_jobs": 429,
    "session_busy": 409,
    "service_unavailable": 503,
    "missing_extension": 503,
    "config_error": 500,
}

#: status → error type for HTTPExceptions raised by FastAPI, Starlette or our dependencies
HTTP_ERROR_TYPES = {
    400: "invalid_input",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    422: "invalid_input",
    429: "too_many_jobs",
}


class BodyLimit:
    """Refuse bodies over ``limit`` bytes with 413, by Content-Length or while streaming (chunked uploads)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(send, self.limit)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # An HTTPException, not our own: FastAPI turns any other error raised while it reads a
                    # body parameter into a 400 "error parsing the body"; this one it lets through as 413.
                    raise StarletteHTTPException(413, detail=f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counted_receive, send)


def _status_of(exc: RLMError) -> int:
    return STATUS_BY_TYPE.get(exc.type, 503 if exc.retryable else 500)


async def _too_large(send: Send, limit: int) -> None:
    await _send_error(send, 413, "too_large", f"request body over {limit} bytes")


async def _send_error(send: Send, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
    """An error in the API's one shape, sent by a middleware (no route, no exception handler involved)."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


#: paths whose requests use the database (the key lookup included) and so pass the admission limit
ADMITTED_PREFIXES = ("/v1", "/metrics")
#: how long a request may wait for a database slot before it is answered 429
ADMISSION_WAIT_SECONDS = 10.0


class Admission:
    """At most ``slots`` requests to /v1 and /metrics at a time, ``queue`` more waiting; the rest answer 429
    ``overloaded`` with ``Retry-After`` at once, and so does one that waited ``wait`` seconds.

    A sync route takes its pooled connection in one worker thread (the ``get_conn`` dependency) and runs in
    another, so with more requests than connections every thread could end up waiting for a connection held
    by a request that waits for a thread: a deadlock that only the pool's 30 s timeout broke, as a 503.  With
    ``slots`` at half the pool (a request may hold two connections: the key lookup's or a streamed result's
    beside its own) and well under the 40 threads, a request let in always finds both.  /healthz, /readyz,
    the docs and the web view's pages never wait here.
    """

    def __init__(self, app: ASGIApp, *, slots: int, queue: int, wait: float = ADMISSION_WAIT_SECONDS) -> None:
        self.app, self.slots, self.queue, self.wait = app, slots, queue, wait
        self._sem: anyio.Semaphore | None = None  # made on first use, inside the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else None
        if path is None or not any(path == p or path.startswith(p + "/") for p in ADMITTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self._sem is None:
            self._sem = anyio.Semaphore(self.slots)
        sem = self._sem
        if sem.value == 0 and sem.statistics().tasks_waiting >= self.queue:
            await self._refuse(send, "the API is at capacity")
            return
        with anyio.move_on_after(self.wait) as waited:
            await sem.acquire()
        if waited.cancelled_caught:
            await self._refuse(send, f"no database slot came free within {self.wait:g} s")
            return
        try:
            await self.app(scope, receive, send)
        finally:
            sem.release()

    async def _refuse(self, send: Send, why: str) -> None:
        await _send_error(send, 429, "overloaded", f"{why}: retry after 1 s", {"Retry-After": "1"})


class KeyFirst:
    """Check the bearer key of every request under ``prefix`` before anything reads its body.

    FastAPI reads and parses a body before it solves dependencies, so a check made only by ``get_tenant``
    would let anyone without a key make the API read (and parse, on the event loop) up to
    RLM_MAX_REQUEST_BYTES.  Here a request without a valid key is answered 401 with its body unread; a
    valid one goes on with its tenant in ``scope["state"]["tenant"]`` for ``get_tenant`` (and the MCP tools,
    whose HTTP app checks every path: ``prefix=None``).
    """

    def __init__(self, app: ASGIApp, prefix: str | None = "/v1") -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else None
        if path is None or (self.prefix and not (path == self.prefix or path.startswith(self.prefix + "/"))):
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        try:
            tenant = await run_in_threadpool(tenant_from_header, authorization)
        except RLMError as exc:  # no route, so no exception handler: answered here in the same shape
            await _send_error(send, _status_of(exc), exc.type, exc.api_message)
            return
        except psycopg.OperationalError as exc:  # the database is down or the pool is full: the operator's 503
            logging.getLogger("rlm.api").warning("cannot check an API key: database unavailable: %s", exc)
            await _send_error(send, 503, "service_unavailable", "database unavailable")
            return
        if tenant is None:
            await _send_error(send, 401, "unauthorized", UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class CatchAll:
    """An exception no handler took becomes a JSON 500 naming a request id (the log has the traceback).

    Starlette's own last resort answers and then re-raises, and the server drops the keep-alive connection
    of a request that raised; answering here ends the request normally.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # half a response is out: nothing left to answer with
                raise
            request_id = uuid.uuid4().hex[:16]
            if isinstance(exc, psycopg.OperationalError):
                # A database that is down or a full connection pool is the operator's 503, not a bug.
                logging.getLogger("rlm.api").warning("request %s: database unavailable: %s", request_id, exc)
                await _send_error(
                    send, 503, "service_unavailable", "database unavailable", {"X-Request-Id": request_id}
                )
                return
            logging.getLogger("rlm.api").error(
                "request %s: %s %s failed", request_id, scope.get("method"), scope.get("path"), exc_info=exc
            )
            message = f"internal error (request id {request_id}); the server log has the details"
            await _send_error(send, 500, "internal", message, {"X-Request-Id": request_id})


def _document_errors(spec: dict) -> None:
    """Make the spec say what the handlers above send: ``{"error": {"type", "message"}}`` for every error
    status (FastAPI would advertise its own 422 ``detail`` list), 401 on /v1, 413 on bodies."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema()
    schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas["ErrorResponse"].pop("$defs", None)
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            if path.startswith("/v1"):
                responses.setdefault("401", {"description": "missing, unknown or revoked API key"})
            if method in ("post", "put", "patch"):
                responses.setdefault("413", {"description": "body over RLM_MAX_REQUEST_BYTES"})
            for code, resp in responses.items():
                if code[0] in "45" and path != "/readyz":  # readyz's 503 is its own {status, database, broker}
                    resp["content"] = body
                    if resp.get("description") == "Validation Error":
                        resp["description"] = "invalid request: the message names the field"
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)


#: where the Swagger UI / ReDoc files are served from (never a CDN: /docs must work offline)
DOCS_ASSETS = "/docs-assets"


def _docs_assets_dir() -> str | None:
    """The Swagger UI and ReDoc files shipped by the ``fastapi-offline`` package, or None without it."""
    spec = importlib.util.find_spec("fastapi_offline")  # only its static files are used: no import
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / "static"
    return str(static) if (static / "swagger-ui-bundle.js").is_file() else None


def _serve_docs(app: FastAPI, assets: str) -> None:
    """/docs and /redoc from local files (FastAPI's own pages load them from a CDN: blank when offline)."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")
    spec_url = app.openapi_url or "/openapi.json"  # FastAPI's default: this app never turns its spec off

    def root(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/")

    @app.get("/docs", include_in_schema=False)
    def swagger(request: Request) -> HTMLResponse:
        base = root(request)
        return get_swagger_ui_html(
            openapi_url=base + spec_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=base + "/docs/oauth2-redirect",
            swagger_js_url=f"{base}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{base}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{base}{DOCS_ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # Swagger UI would send the spec to validator.swagger.io
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        base = root(request)
        return get_redoc_html(
            openapi_url=base + spec_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{base}{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{base}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )


class _App(FastAPI):
    """The app, its spec documenting the error bodies the handlers send (``_document_errors``)."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            _document_errors(super().openapi())  # FastAPI keeps the spec it built: amended in place
        return super().openapi()


def create_app() -> FastAPI:
    settings = get_settings()
    assets = _docs_assets_dir()
    app = _App(
        title="rlm-pipeline",
        version="0.1.0",
        description="Load text into buffers and ask questions answered by a Celery fan-out of analysts.",
        # without the dependency, FastAPI's own pages (which need the CDN) rather than none
        docs_url=None if assets else "/docs",
        redoc_url=None if assets else "/redoc",
    )
    if assets:
        _serve_docs(app, assets)
    else:
        logging.getLogger("rlm.api").warning("fastapi-offline is not installed: /docs and /redoc load from a CDN")
    for module in (health, buffers, uploads, queries, batches, chunks, search, sessions, ui_routes):
        app.include_router(module.router)
    app.mount("/ui/static", ui_routes.static_files(), name="ui-static")

    @app.exception_handler(RLMError)
    async def _rlm_error(_request: Request, exc: RLMError) -> JSONResponse:
        return JSONResponse({"error": {"type": exc.type, "message": exc.api_message}}, status_code=_status_of(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 401/404/405 from FastAPI itself get the same {"error": {...}} shape as everything else.
        kind = HTTP_ERROR_TYPES.get(exc.status_code, "error")
        return JSONResponse(
            {"error": {"type": kind, "message": str(exc.detail)}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": {"type": "invalid_input", "message": describe_errors(list(exc.errors()))}},
            status_code=422,
        )

    # Added last is outermost: the catch-all sees everything, admission comes before the key check (which
    # uses the database), the key is checked before the body is counted.
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(KeyFirst)
    # outside KeyFirst: the key lookup takes a pooled connection too
    app.add_middleware(Admission, slots=max(1, POOL_MAX_SIZE // 2), queue=settings.api_queue)
    app.add_middleware(CatchAll)
    return app
