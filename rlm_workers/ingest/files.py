"""Finding the files an ``rlm load`` covers and reading them as text.

Nothing here raises on bad *content*: binary (a NUL anywhere), non-UTF-8, empty and unreadable
files come back as a skip reason the loader counts (docs/contract.md#limits).  Only a path
the user named that does not exist or whose name cannot be stored (``path_problem``) is an
error, and it is reported before anything is read so a typo never leaves a half-done load;
such names met while walking a directory are skipped and counted.
"""

from __future__ import annotations

import hashlib
import os
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInput
from ..limits import MAX_NAME_COMPONENT_BYTES

# Build outputs, caches and VCS metadata: large, generated, never what a question is about.
SKIP_DIRS = frozenset(
    {
        ".git",
        "node_modules",
        ".venv",
        "venv",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".idea",
        "dist",
        "build",
        ".eggs",
    }
)

BINARY_SNIFF_BYTES = 8192
_BOM = b"\xef\xbb\xbf"
# Magic numbers of common binary formats that may not contain a NUL early on.
_BINARY_MAGIC = (
    b"\x89PNG\r\n\x1a\n",  # PNG
    b"\xff\xd8\xff",  # JPEG
    b"GIF87a",
    b"GIF89a",
    b"%PDF-",
    b"PK\x03\x04",
    b"PK\x05\x06",
    b"PK\x07\x08",  # zip and everything built on it (jar, docx, whl)
    b"\x1f\x8b",  # gzip
    b"\x7fELF",
    b"BZh91",  # bzip2 (with the usual block size, so plain text starting "BZh" is not caught)
    b"\xfd7zXZ\x00",  # xz
    b"7z\xbc\xaf\x27\x1c",
    b"\x28\xb5\x2f\xfd",  # zstd
)


@dataclass(frozen=True)
class Candidate:
    abs_path: Path
    rel_path: str  # what the database stores and users see; POSIX separators
    size: int


@dataclass
class DiscoverReport:
    skipped_dirs: int = 0
    skipped_too_large: list[str] = field(default_factory=list)
    skipped_symlinks: int = 0
    skipped_special: int = 0  # FIFOs, sockets, devices: reading a FIFO would block forever
    skipped_duplicates: int = 0
    #: files and directories whose names cannot be stored (``path_problem``)
    skipped_bad_names: int = 0
    unreadable_dirs: int = 0


# Cc: C0, DEL and C1 controls (a newline in a name forges lines in listings and prompts); Cs: lone surrogates
# (a non-UTF-8 name from the file system) that PostgreSQL cannot store; Zl/Zp: Unicode line breaks.
_BAD_NAME_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def path_problem(rel: str) -> str | None:
    """Why a stored file path is refused ("contains …"), or None: the one check behind `rlm load`, the API and
    the ingest worker.

    Paths end up in listings, logs and model prompts, one per line, so a control character is never
    allowed; a component over 255 bytes cannot be a file name on common file systems.
    """
    for ch in rel:
        if (category := unicodedata.category(ch)) == "Cs":
            return "is not valid UTF-8"
        if category in _BAD_NAME_CATEGORIES:
            return f"contains a control character (U+{ord(ch):04X})"
    for part in rel.split("/"):
        if len(part.encode("utf-8")) > MAX_NAME_COMPONENT_BYTES:
            return f"has a component over {MAX_NAME_COMPONENT_BYTES} bytes ({part[:40]!r}…)"
    return None


def skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.endswith(".egg-info")


def discover(paths: Sequence[Path | str], *, max_file_bytes: int) -> tuple[list[Candidate], DiscoverReport]:
    """Every loadable file under ``paths``, in a deterministic order, without reading any of them.

    Paths the user names are followed even if they are symlinks (that is what
    they asked for); symlinks met while walking are skipped and counted, which
    also rules out cycles and escapes from the tree.
    """
    for p in paths:
        if not os.path.exists(p):  # also catches a dangling symlink
            raise FileNotFoundError(f"no such file or directory: {p}")
        # The stored paths start with this name (see _walk's prefix), so it must be storable too.
        name = Path(p).resolve().name
        if problem := path_problem(name):
            raise InvalidInput(f"cannot load {name!r}: the name {problem}; rename it")
    report = DiscoverReport()
    out: list[Candidate] = []
    seen: set[str] = set()
    for p in paths:
        root = Path(p).resolve()
        if root.is_dir():
            found = _walk(root, root.name, max_file_bytes, report)
        elif root.is_file():
            found = _one_file(root, root.name, root.stat().st_size, max_file_bytes, report)
        else:
            report.skipped_special += 1
            continue
        for cand in found:
            if cand.rel_path in seen:
                report.skipped_duplicates += 1
                continue
            seen.add(cand.rel_path)
            out.append(cand)
    return out, report


def _one_file(path: Path, rel: str, size: int, max_file_bytes: int, report: DiscoverReport) -> Iterator[Candidate]:
    if size > max_file_bytes:
        report.skipped_too_large.append(rel)
    else:
        yield Candidate(abs_path=path, rel_path=rel, size=size)


def _sorted_entries(path: Path, report: DiscoverReport) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        report.unreadable_dirs += 1
        return []


def _walk(root: Path, prefix: str, max_file_bytes: int, report: DiscoverReport) -> Iterator[Candidate]:
    # An explicit stack of iterators, not recursion: deep trees must not hit the recursion limit.
    stack = [(iter(_sorted_entries(root, report)), prefix)]
    while stack:
        entries, rel = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        child = f"{rel}/{entry.name}" if rel else entry.name
        try:
            if path_problem(entry.name):
                report.skipped_bad_names += 1
            elif entry.is_symlink():
                report.skipped_symlinks += 1
            elif entry.is_dir(follow_symlinks=False):
                if skip_dir(entry.name):
                    report.skipped_dirs += 1
                else:
                    stack.append((iter(_sorted_entries(Path(entry.path), report)), child))
            elif entry.is_file(follow_symlinks=False):
                size = entry.stat(follow_symlinks=False).st_size
                yield from _one_file(Path(entry.path), child, size, max_file_bytes, report)
            else:
                report.skipped_special += 1
        except OSError:  # vanished or unreadable between listing and stat
            report.skipped_special += 1


def under(path: str, roots: list[tuple[str, bool]]) -> bool:
    """Whether a stored path lies under one of a load's roots (a folder's ``name/`` prefix, or a file's own name):
    only those are removed when a new version of the buffer no longer has them."""
    return any(path.startswith(prefix) if is_dir else path == prefix for prefix, is_dir in roots)


def looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:BINARY_SNIFF_BYTES] or data.startswith(_BINARY_MAGIC)


def decode_text(data: bytes) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, skip_reason)`` for raw file bytes."""
    if not data:
        return None, "empty"
    if looks_binary(data):
        return None, "binary"
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not-utf8"
    if "\x00" in text:  # past the sniff window; PostgreSQL text cannot hold NUL, so a late one would fail the load
        return None, "binary"
    if not text.strip():
        return None, "empty"
    # Chunk offsets are defined on this normalised text, so Windows files get stable line numbers.
    return text.replace("\r\n", "\n"), None


def read_text(c: Candidate) -> tuple[str | None, str | None, str]:
    """``(text, skip_reason, sha256 of the raw bytes)``; exactly one of text and skip_reason is None."""
    try:
        with open(c.abs_path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None, "unreadable", ""
    text, reason = decode_text(data)
    return text, reason, hashlib.sha256(data).hexdigest()
