"""Uploaded files written under a fresh directory, so the loader reads them like `rlm load DIR`.

A client's file name is only ever a relative path inside that directory: the
server never opens a path the client names.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

from ..errors import InvalidInput
from .files import path_problem
from .loader import load_paths

if TYPE_CHECKING:
    import psycopg

    from ..config import Settings
    from .loader import LoadReport

MAX_DEPTH = 32


def safe_relative(name: str) -> PurePosixPath:
    """A client file name as a relative path, or InvalidInput: no absolute paths, no '..', no tricks."""
    if problem := path_problem(name):
        raise InvalidInput(f"invalid file name {name[:80]!r}: it {problem}")
    if not name or "\\" in name or len(name) > 1024:
        raise InvalidInput(f"invalid file name {name[:80]!r}: use a relative path with '/' separators")
    path = PurePosixPath(name)
    if path.is_absolute() or any(p.strip() in ("..", ".", "") for p in name.split("/")) or len(path.parts) > MAX_DEPTH:
        raise InvalidInput(f"invalid file name {name[:80]!r}: absolute paths and '.'/'..' segments are refused")
    return path


def check_names(names: Iterable[str]) -> None:
    """Every name valid and used once, before anything is stored or written."""
    seen: set[PurePosixPath] = set()
    for name in names:
        path = safe_relative(name)
        if path in seen:
            raise InvalidInput(f"file {name!r} appears twice in the upload")
        seen.add(path)


def write_files(root: Path, files: Sequence[tuple[str, bytes | BinaryIO]]) -> None:
    """Write (name, bytes | binary file) pairs under ``root``; every name is checked before anything is written."""
    check_names(name for name, _ in files)
    for name, data in files:
        try:
            _write_one(root, name, data)
        except OSError as exc:
            # A name this server's file system refuses fails the same way on every attempt: the client's to
            # fix, told without the server's temporary path (which ``exc`` carries), so an upload ends at once.
            if exc.errno in (errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL):
                raise InvalidInput(f"invalid file name {name[:80]!r}: {exc.strerror or 'refused'}") from None
            raise


def _write_one(root: Path, name: str, data: bytes | BinaryIO) -> None:
    target = root.joinpath(*safe_relative(name).parts)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InvalidInput(f"{name!r} puts a file under another uploaded file's name") from None
    if target.is_dir():
        raise InvalidInput(f"{name!r} is also used as a directory in this upload")
    with open(target, "wb") as out:
        if isinstance(data, bytes):
            out.write(data)
        else:
            data.seek(0)
            shutil.copyfileobj(data, out)


def load_files(
    conn: psycopg.Connection,
    *,
    tenant: str,
    buffer: str,
    files: Sequence[tuple[str, bytes | BinaryIO]],
    chunker: str,
    chunk_size: int,
    overlap: int,
    settings: Settings,
) -> LoadReport:
    """Load uploaded (name, data) pairs into a buffer as `rlm load` loads a directory; the caller commits.

    The embedder is the process-wide one (cached), loaded on the first load.
    """
    with tempfile.TemporaryDirectory(prefix="rlm-upload-") as tmp:
        root = Path(tmp)
        write_files(root, files)
        return load_paths(
            conn,
            buffer=buffer,
            paths=sorted(root.iterdir()),
            tenant=tenant,
            chunker=chunker,
            chunk_size=chunk_size,
            overlap=overlap,
            embed_batch_size=settings.embed_batch_size,
            max_file_bytes=settings.max_file_bytes,
        )
