"""Reproducible installs: the environment under test is the locked one, and the lock honours pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
#: packages whose API the code calls directly: each needs a lower and an upper bound
RELIED_ON = (
    "typer",
    "click",
    "celery",
    "kombu",
    "fastapi",
    "starlette",
    "pydantic",
    "psycopg",
    "openai",
    "sentence-transformers",
    "redis",
    "uvicorn",
    "httpx",
)


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions only: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_installed_versions_match_the_lock():
    pins = _lock()
    assert "rlm-pipeline" not in pins and len(pins) > 20
    drift = []
    for name, version in sorted(pins.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift.append(f"{name}: locked {version}, not installed")
            continue
        if Version(installed) != Version(version):
            drift.append(f"{name}: locked {version}, installed {installed}")
    assert not drift, "environment drifted from constraints.txt (make install, or make lock on purpose):\n" + "\n".join(
        drift
    )


def test_every_declared_dependency_is_locked_within_its_range():
    pins = _lock()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared but not locked"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock {name}=={pins[name]} outside {req}"


def test_relied_on_apis_have_lower_and_upper_bounds():
    by_name = {canonicalize_name(r.name): r for r in _requirements()}
    for name in RELIED_ON:
        req = by_name.get(canonicalize_name(name))
        assert req is not None, f"{name} is used directly but not declared"
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", ">", "=="} and ops & {"<", "<=", "=="}, f"{req} needs a lower and an upper bound"


def test_make_install_uses_the_lock_and_reinstalls_when_it_changes():
    makefile = (ROOT / "Makefile").read_text()
    stamp_rule = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert stamp_rule and "constraints.txt" in stamp_rule.group(1)
    installs = [ln for ln in makefile.splitlines() if "pip install" in ln and "-e" in ln]
    assert installs and all("-c constraints.txt" in ln for ln in installs), installs
    assert re.search(r"^lock:", makefile, re.M), "make lock regenerates constraints.txt"
