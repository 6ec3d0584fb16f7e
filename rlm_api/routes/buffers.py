"""Buffers of one tenant: upload (JSON documents or multipart files), list, show, delete.

Uploaded names are only ever used as relative paths inside a fresh temporary
directory; the server never reads a path the client names.
"""

from __future__ import annotations

import logging
import uuid
from typing import IO, Annotated, Any, BinaryIO, TypeVar

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from rlm_workers.engine import (
    MAX_INLINE_UPLOAD_BYTES,
    BufferInfo,
    BufferNotFound,
    FileInfo,
    InvalidInput,
    buffer_info,
    buffer_not_found,
    check_names,
    connection,
    create_upload,
    delete_buffer,
    get_app,
    get_buffer,
    list_buffers,
    list_files,
    load_upload,
    validate_buffer_name,
)

from ..deps import ConnDep, TenantDep
from ..schemas import (
    MAX_UPLOAD_FILES,
    BufferCreate,
    BufferOptions,
    LoadResponse,
    UploadAccepted,
    describe_errors,
    upload_name_ok,
)

router = APIRouter(prefix="/v1/buffers", tags=["buffers"])
log = logging.getLogger("rlm.api")

#: an upload's files by path: a JSON document's bytes, or a multipart part's spooled file
Files = list[tuple[str, bytes | BinaryIO]]
Options = TypeVar("Options", bound=BufferOptions)


def _load(tenant: str, opts: BufferOptions, files: Files) -> LoadResponse:
    # one transaction: a failed upload leaves the previous buffer intact; a bad name is a 422 before anything
    report, info = load_upload(
        tenant=tenant,
        buffer=opts.name,
        files=files,
        chunker=opts.chunker,
        chunk_size=opts.chunk_size,
        overlap=opts.overlap,
    )
    return LoadResponse(buffer=info, **{k: getattr(report, k) for k in LoadResponse.model_fields if k != "buffer"})


_FORM_FIELDS = set(BufferOptions.model_fields)


async def _from_multipart(request: Request) -> tuple[BufferOptions, Files]:
    # Starlette spools parts over 1 MB to disk; the body limit middleware has already bounded the total.
    form = await request.form(max_files=MAX_UPLOAD_FILES, max_fields=len(_FORM_FIELDS) + 10)
    fields: dict[str, str] = {}
    for key, value in form.multi_items():
        if key == "files":
            continue
        if key not in _FORM_FIELDS:
            raise InvalidInput(f"{key}: unknown form field (expected name, chunker, chunk_size, overlap, files)")
        if not isinstance(value, str):
            raise InvalidInput(f"{key}: must be a plain form field, not a file")
        fields[key] = value
    parts = form.getlist("files")
    if not parts:
        raise InvalidInput("files: a multipart upload needs one or more 'files' parts")
    uploads = [f for f in parts if isinstance(f, UploadFile)]
    if len(uploads) != len(parts):
        raise InvalidInput("files: every 'files' part must be a file with a filename")
    names = [f.filename or "" for f in uploads]
    _check_part_names(names)
    return _validated(BufferOptions, fields), [(name, f.file) for name, f in zip(names, uploads, strict=True)]


def _check_part_names(names: list[str]) -> None:
    """A part's filename is its path in the buffer.  curl sends only the base name of ``-F files=@dir/a.md``,
    so two files of the same name from different directories collide: the message says how to send paths."""
    seen: set[str] = set()
    for name in names:
        try:
            upload_name_ok(name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        if name in seen:
            raise InvalidInput(
                f"file {name!r} appears twice in the upload; give each part its relative path as filename "
                f"(curl: -F 'files=@DIR/{name};filename=DIR/{name}')"
            )
        seen.add(name)


def _size(files: Files) -> int:
    total = 0
    for _, data in files:
        if isinstance(data, bytes):
            total += len(data)
        else:  # a spooled part: its end is its size
            data.seek(0, 2)
            total += data.tell()
    return total


def _validated(model: type[Options], data: object) -> Options:
    try:
        if isinstance(data, bytes):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(describe_errors(exc.errors())) from None


def _inlined(schema: dict) -> dict:
    """A pydantic schema with its ``$defs`` substituted in place: an OpenAPI requestBody's ``$ref``s resolve
    against the whole document, where pydantic's local ``#/$defs/…`` would dangle."""
    defs = schema.pop("$defs", {})

    def sub(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return sub(defs[ref.removeprefix("#/$defs/")])
            return {k: sub(v) for k, v in node.items()}
        return [sub(v) for v in node] if isinstance(node, list) else node

    return sub(schema)


_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["name", "files"],
    "properties": {
        **{k: v for k, v in BufferOptions.model_json_schema()["properties"].items()},
        "files": {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "description": "One part per file; its filename is the relative path inside the buffer.",
        },
    },
}


def _queue(tenant: str, opts: BufferOptions, files: Files) -> UploadAccepted:
    """Stage the files in PostgreSQL and send their id to the ingest queue (the API never embeds)."""
    app = get_app()

    validate_buffer_name(opts.name)
    check_names(name for name, _ in files)
    staged = [(name, data if isinstance(data, bytes) else _read(data)) for name, data in files]
    upload_id = uuid.uuid4().hex
    with connection() as conn:
        create_upload(
            conn,
            upload_id=upload_id,
            tenant=tenant,
            buffer=opts.name,
            files=staged,
            options=opts.model_dump(include={"chunker", "chunk_size", "overlap"}),
        )
    try:
        app.send_task("rlm.ingest", (upload_id,), argsrepr=f"upload={upload_id}")
    except Exception as exc:  # stored: the reconciler sends it once the broker is back
        log.warning("upload %s stored but not sent (%s); the reconciler will send it", upload_id, exc)
    return UploadAccepted(upload_id=upload_id, buffer=opts.name, status_url=f"/v1/uploads/{upload_id}")


def _read(part: IO[bytes]) -> bytes:  # a spooled upload file
    part.seek(0)
    return part.read()


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=LoadResponse,
    responses={
        202: {
            "model": UploadAccepted,
            "description": "with wait=false, or wait unset and over 256 KB: stored and queued for an ingest "
            "worker; follow status_url",
        },
        422: {"description": "invalid body, buffer name or file name"},
        413: {"description": "body over RLM_MAX_REQUEST_BYTES"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _inlined(BufferCreate.model_json_schema())},
                "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
            },
        }
    },
)
async def create_buffer(
    request: Request,
    tenant: TenantDep,
    wait: Annotated[
        bool | None,
        Query(
            description=(
                "Unset (default): uploads up to 256 KB load in this request (201 with the report), larger ones "
                "are queued (202).  true: load in this request, refused (422) over 256 KB.  false: store the "
                "files, answer 202 at once, and let an `rlm.ingest` worker load them (the API process never "
                "embeds them); follow `status_url`."
            )
        ),
    ] = None,
) -> LoadResponse | JSONResponse:
    """Load documents into a buffer (created if new).

    Files already there with the same content and chunking are kept without re-embedding; files under an
    uploaded top-level directory that this upload no longer has are removed (as `rlm load DIR` does).
    """
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        opts, files = await _from_multipart(request)
    else:
        # Parsing up to RLM_MAX_REQUEST_BYTES of JSON takes seconds: off the event loop, which serves everyone.
        body = await run_in_threadpool(_validated, BufferCreate, await request.body())
        opts, files = body, [(d.path, d.text.encode("utf-8")) for d in body.documents]
    size = await run_in_threadpool(_size, files)
    if wait and size > MAX_INLINE_UPLOAD_BYTES:
        # Embedding runs at some 13 KB/s on the API's own CPU: a big load would hold it for minutes or hours.
        raise InvalidInput(
            f"wait=true loads at most {MAX_INLINE_UPLOAD_BYTES // 1024} KB in the request (this upload is "
            f"{size:,} bytes): leave wait unset or send wait=false, and follow the upload's status_url"
        )
    if wait is False or (wait is None and size > MAX_INLINE_UPLOAD_BYTES):
        accepted = await run_in_threadpool(_queue, tenant, opts, files)
        return JSONResponse(
            accepted.model_dump(),
            status_code=status.HTTP_202_ACCEPTED,
            headers={"Location": accepted.status_url},
        )
    # Writing, chunking and embedding are blocking: all of it runs in the threadpool.
    return await run_in_threadpool(_load, tenant, opts, files)


@router.get("", response_model=list[BufferInfo])
def list_all(conn: ConnDep, tenant: TenantDep) -> list[BufferInfo]:
    """The caller's buffers (other tenants' are never listed)."""
    return list_buffers(conn, tenant=tenant)


def _possible(name: str) -> str:
    """A name no buffer can have (bad characters, NUL, too long) is simply not found; never sent to SQL."""
    try:
        return validate_buffer_name(name)
    except InvalidInput:
        raise BufferNotFound(name[:128]) from None


@router.get("/{name}", response_model=BufferInfo, responses={404: {"description": "no such buffer"}})
def show(name: str, conn: ConnDep, tenant: TenantDep) -> BufferInfo:
    """Files, chunks, bytes, chunking and embedding model of one buffer."""
    return buffer_info(conn, tenant=tenant, name=_possible(name))


@router.get(
    "/{name}/files",
    response_model=list[FileInfo],
    responses={404: {"description": "no such buffer"}},
)
def files(
    name: str,
    conn: ConnDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    after: Annotated[str | None, Query(max_length=1024, description="Last path of the previous page.")] = None,
) -> list[FileInfo]:
    """The buffer's files in path order, with their size and chunk count, a page at a time."""
    row = get_buffer(conn, tenant=tenant, name=_possible(name))
    if row is None:
        raise buffer_not_found(conn, tenant=tenant, name=name)
    if after and "\x00" in after:  # PostgreSQL text cannot hold one
        raise InvalidInput("after: contains a NUL character")
    return list_files(conn, buffer_id=row.id, limit=limit, after=after)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses={404: {"description": "no such buffer"}})
def delete(name: str, conn: ConnDep, tenant: TenantDep) -> Response:
    """Delete the buffer with its chunks and embeddings (jobs that already ran keep their results)."""
    if not delete_buffer(conn, tenant=tenant, name=_possible(name)):
        raise buffer_not_found(conn, tenant=tenant, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
