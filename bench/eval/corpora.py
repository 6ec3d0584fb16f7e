"""Corpora for the question sets in this folder (stdlib only).

`materialize(name, dest)` writes one corpus into the directory `dest` (cleared first, so the call is
idempotent) and returns the root directory to load. Gold paths in `heldout.jsonl` / `dev.jsonl` are
relative to that root.

The package corpora are read from the interpreter that runs this module: run it with the project's
locked virtualenv (`.venv/bin/python`) so the versions match the ones in `README.md`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent

CORPORA: dict[str, str] = {
    "uvicorn": "HELD-OUT code: the installed uvicorn package's .py files",
    "readmes": "HELD-OUT documents: README bodies (package long descriptions) of ten installed distributions",
    "licenses": "HELD-OUT documents: GPL-3, Apache-2.0, MPL-2.0 and LGPL-2.1 from /usr/share/common-licenses",
    "invented-heldout": "HELD-OUT invented facts: the town of Veyrholt and the company Kestrine Systems",
    "kombu": "DEV code: the installed kombu package's .py files",
    "invented-dev": "DEV invented facts: the village of Orvik Fell and the Morrowlight Institute",
}

# Distributions whose README body forms the `readmes` corpus. All ten are present in the locked venv with
# a body of at least 500 characters (prometheus_client is the shortest, about 540), so all ten are used:
# fastapi, pydantic, typer, rich, kombu, flower, psycopg, pgvector, prometheus_client, platformdirs.
README_DISTS: tuple[str, ...] = (
    "fastapi",
    "pydantic",
    "typer",
    "rich",
    "kombu",
    "flower",
    "psycopg",
    "pgvector",
    "prometheus_client",
    "platformdirs",
)
README_MIN_CHARS = 500

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSES: tuple[str, ...] = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1")

INVENTED_DIRS: dict[str, Path] = {
    "invented-heldout": HERE / "invented_heldout",
    "invented-dev": HERE / "invented_dev",
}


def _reset(dest: Path) -> Path:
    dest = Path(dest)
    resolved = dest.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home() or (resolved / ".git").exists():
        raise ValueError(f"refusing to clear {resolved}: pass a dedicated directory")
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return dest


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"package {package!r} is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def _copy_package(package: str, dest: Path) -> None:
    src = _package_dir(package)
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if "__pycache__" in rel.parts:
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def readme_body(dist: str) -> str:
    """The long description of an installed distribution (the METADATA body after the headers)."""
    meta = importlib.metadata.metadata(dist)
    body = meta.get_payload()  # type: ignore[attr-defined]
    if isinstance(body, bytes):
        body = body.decode("utf-8")
    return body or ""


def readme_dists() -> list[str]:
    """The distributions actually used: installed and with a body of at least README_MIN_CHARS."""
    used = []
    for dist in README_DISTS:
        try:
            body = readme_body(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if len(body) >= README_MIN_CHARS:
            used.append(dist)
    return used


def _write_readmes(dest: Path) -> None:
    for dist in readme_dists():
        (dest / f"{dist}.md").write_text(readme_body(dist), encoding="utf-8")


def _copy_licenses(dest: Path) -> None:
    for name in LICENSES:
        shutil.copyfile(LICENSE_DIR / name, dest / f"{name}.txt")


def _copy_invented(src: Path, dest: Path) -> None:
    files = sorted(src.glob("*.md"))
    if not files:
        raise FileNotFoundError(f"no invented corpus files under {src}")
    for path in files:
        shutil.copyfile(path, dest / path.name)


def materialize(name: str, dest: Path) -> Path:
    """Write corpus `name` into directory `dest` and return the root to load.

    `dest` is deleted and recreated first, so repeated calls give the same tree; pass a directory used only
    for this (a temporary directory is the usual choice).
    """
    if name not in CORPORA:
        raise KeyError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    root = _reset(Path(dest))
    if name in ("uvicorn", "kombu"):
        _copy_package(name, root)
    elif name == "readmes":
        _write_readmes(root)
    elif name == "licenses":
        _copy_licenses(root)
    else:
        _copy_invented(INVENTED_DIRS[name], root)
    return root


def versions() -> dict[str, str]:
    """Versions of the distributions the code and readme corpora come from."""
    names = ["uvicorn", "kombu", *README_DISTS]
    out: dict[str, str] = {}
    for dist in dict.fromkeys(names):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for corpus in sys.argv[1:] or list(CORPORA):
            root = materialize(corpus, Path(tmp) / corpus)
            files = [p for p in root.rglob("*") if p.is_file()]
            print(f"{corpus}: {len(files)} files")
