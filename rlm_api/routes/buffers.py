"""Buffers of one tenant: upload (JSON documents or multipart files), list, show, delete.

Uploaded names are only ever used as relative paths inside a fresh temporary
directory; the server never reads a path the client names.
"""

from __future__ import annotations

import tempfile
from pathlib import Path, PurePosixPath

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from rlm_workers.errors import BufferNotFound, InvalidInput
from rlm_workers.models import BufferInfo

from ..deps import ConnDep, TenantDep
from ..schemas import MAX_UPLOAD_FILES, BufferCreate, BufferOptions, LoadResponse, describe_errors

router = APIRouter(prefix="/v1/buffers", tags=["buffers"])
MAX_DEPTH = 32


def safe_relative(name: str) -> PurePosixPath:
    """A client file name as a relative path, or InvalidInput: no absolute paths, no '..', no tricks."""
    if not name or "\\" in name or len(name) > 1024 or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidInput(f"invalid file name {name[:80]!r}: use a relative path with '/' separators")
    path = PurePosixPath(name)
    if path.is_absolute() or any(p.strip() in ("..", ".", "") for p in name.split("/")) or len(path.parts) > MAX_DEPTH:
        raise InvalidInput(f"invalid file name {name[:80]!r}: absolute paths and '.'/'..' segments are refused")
    return path


def _write_all(root: Path, files: list[tuple[str, object]]) -> None:
    """Write (name, bytes | binary file) pairs under ``root``; every name is checked before anything is written."""
    import shutil

    targets: list[Path] = []
    seen: set[Path] = set()
    for name, _data in files:
        target = root.joinpath(*safe_relative(name).parts)
        if target in seen:
            raise InvalidInput(f"file {name!r} appears twice in the upload")
        seen.add(target)
        targets.append(target)
    for target, (_name, data) in zip(targets, files, strict=True):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise InvalidInput(f"{_name!r} puts a file under another uploaded file's name") from None
        if target.is_dir():
            raise InvalidInput(f"{_name!r} is also used as a directory in this upload")
        with open(target, "wb") as out:
            if isinstance(data, bytes):
                out.write(data)
            else:
                data.seek(0)
                shutil.copyfileobj(data, out)


def _load(tenant: str, opts: BufferOptions, root: Path, files: list[tuple[str, object]]) -> LoadResponse:
    from rlm_workers.config import get_settings
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import buffer_info
    from rlm_workers.store.db import connect

    _write_all(root, files)
    settings = get_settings()
    conn = connect(settings)  # one transaction: a failed upload leaves the previous buffer intact
    try:
        # The embedder is the process-wide one (get_embedder caches it), loaded on the first upload.
        report = load_paths(conn, buffer=opts.name, paths=sorted(root.iterdir()), chunker=opts.chunker,
                            chunk_size=opts.chunk_size, overlap=opts.overlap, tenant=tenant,
                            embed_batch_size=settings.embed_batch_size, max_file_bytes=settings.max_file_bytes)
        conn.commit()
        info = buffer_info(conn, tenant=tenant, name=opts.name)
    finally:
        conn.close()
    return LoadResponse(buffer=info, **{k: getattr(report, k) for k in LoadResponse.model_fields if k != "buffer"})


_FORM_FIELDS = set(BufferOptions.model_fields)


async def _from_multipart(request: Request) -> tuple[BufferOptions, list[tuple[str, object]]]:
    from starlette.datastructures import UploadFile

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
    if not all(isinstance(f, UploadFile) for f in parts):
        raise InvalidInput("files: every 'files' part must be a file with a filename")
    return _validated(BufferOptions, fields), [(f.filename or "", f.file) for f in parts]


def _validated(model: type[BufferOptions], data: object) -> BufferOptions:
    from pydantic import ValidationError

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

    def sub(node):  # noqa: ANN001, ANN202
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return sub(defs[ref.removeprefix("#/$defs/")])
            return {k: sub(v) for k, v in node.items()}
        return [sub(v) for v in node] if isinstance(node, list) else node

    return sub(schema)


_MULTIPART_SCHEMA = {"type": "object", "required": ["name", "files"], "properties": {
    **{k: v for k, v in BufferOptions.model_json_schema()["properties"].items()},
    "files": {"type": "array", "items": {"type": "string", "format": "binary"},
              "description": "One part per file; its filename is the relative path inside the buffer."}}}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=LoadResponse,
             responses={422: {"description": "invalid body, buffer name or file name"},
                        413: {"description": "body over RLM_MAX_REQUEST_BYTES"}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": _inlined(BufferCreate.model_json_schema())},
                 "multipart/form-data": {"schema": _MULTIPART_SCHEMA}}}})
async def create_buffer(request: Request, tenant: TenantDep) -> LoadResponse:
    """Load documents into a buffer (created if new).

    Files already there with the same content and chunking are kept without re-embedding; files under an
    uploaded top-level directory that this upload no longer has are removed (as `rlm load DIR` does).
    """
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        opts, files = await _from_multipart(request)
    else:
        body = _validated(BufferCreate, await request.body())
        opts, files = body, [(d.path, d.text.encode("utf-8")) for d in body.documents]
    with tempfile.TemporaryDirectory(prefix="rlm-upload-") as tmp:
        # Writing, chunking and embedding are blocking: all of it runs in the threadpool.
        return await run_in_threadpool(_load, tenant, opts, Path(tmp), files)


@router.get("", response_model=list[BufferInfo])
def list_all(conn: ConnDep, tenant: TenantDep) -> list[BufferInfo]:
    """The caller's buffers (other tenants' are never listed)."""
    from rlm_workers.store.buffers import list_buffers

    return list_buffers(conn, tenant=tenant)


def _possible(name: str) -> str:
    """A name no buffer can have (bad characters, NUL, too long) is simply not found; never sent to SQL."""
    from rlm_workers.store.buffers import validate_buffer_name

    try:
        return validate_buffer_name(name)
    except InvalidInput:
        raise BufferNotFound(name[:128]) from None


@router.get("/{name}", response_model=BufferInfo, responses={404: {"description": "no such buffer"}})
def show(name: str, conn: ConnDep, tenant: TenantDep) -> BufferInfo:
    """Files, chunks, bytes, chunking and embedding model of one buffer."""
    from rlm_workers.store.buffers import buffer_info

    return buffer_info(conn, tenant=tenant, name=_possible(name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses={404: {"description": "no such buffer"}})
def delete(name: str, conn: ConnDep, tenant: TenantDep) -> Response:
    """Delete the buffer with its chunks and embeddings (jobs that already ran keep their results)."""
    from rlm_workers.store.buffers import delete_buffer

    if not delete_buffer(conn, tenant=tenant, name=_possible(name)):
        raise BufferNotFound(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
