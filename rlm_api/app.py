"""The thin HTTP API (docs/contract.md#http-api): routes by resource, one error shape, bounded request bodies.

``create_app()`` builds the app without touching the database or the broker;
connections are opened per request from the process pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlm_workers.errors import RLMError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: RLMError.type → HTTP status; anything else a user can fix is 422, infrastructure is 503
STATUS_BY_TYPE = {
    "invalid_input": 422,
    "buffer_not_found": 404,
    "no_chunks": 422,
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


async def _too_large(send: Send, limit: int) -> None:
    import json

    body = json.dumps({"error": {"type": "too_large", "message": f"request body over {limit} bytes"}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _document_errors(spec: dict) -> None:
    """Make the spec say what the handlers above send: ``{"error": {"type", "message"}}`` for every error
    status (FastAPI would advertise its own 422 ``detail`` list), 401 on /v1, 413 on bodies."""
    from .schemas import ErrorBody, ErrorResponse

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


def create_app() -> FastAPI:
    from rlm_workers.config import get_settings

    from .routes import batches, buffers, health, queries, uploads

    settings = get_settings()
    app = FastAPI(
        title="rlm-pipeline",
        version="0.1.0",
        description="Load text into buffers and ask questions answered by a Celery fan-out of analysts.",
    )
    for module in (health, buffers, uploads, queries, batches):
        app.include_router(module.router)

    @app.exception_handler(RLMError)
    async def _rlm_error(_request: Request, exc: RLMError) -> JSONResponse:
        code = STATUS_BY_TYPE.get(exc.type, 503 if exc.retryable else 500)
        return JSONResponse({"error": {"type": exc.type, "message": exc.message}}, status_code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 401/404/405 from FastAPI itself get the same {"error": {...}} shape as everything else.
        kind = HTTP_ERROR_TYPES.get(exc.status_code, "error")
        return JSONResponse(
            {"error": {"type": kind, "message": str(exc.detail)}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets the usual shape and no internals.
        # A database that is down or a full connection pool is the operator's 503, not a bug.
        import psycopg

        if isinstance(exc, psycopg.OperationalError):
            return JSONResponse(
                {"error": {"type": "service_unavailable", "message": "database unavailable"}}, status_code=503
            )
        return JSONResponse(
            {"error": {"type": "internal", "message": "internal error; see the server log"}}, status_code=500
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        from .schemas import describe_errors

        return JSONResponse(
            {"error": {"type": "invalid_input", "message": describe_errors(list(exc.errors()))}},
            status_code=422,
        )

    original_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            _document_errors(original_openapi())
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    return app
