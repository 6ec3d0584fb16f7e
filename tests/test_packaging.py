"""The wheel is enough on its own: installed outside the repository, it finds every shipped prompt; and building
it warns of nothing deprecated (`make install` printed setuptools' notices on every install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlm_workers.pipeline.prompts import PROMPT_NAMES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

CHECK = """
import sys
target = sys.argv[1]
sys.path.insert(0, target)
import rlm_workers
assert rlm_workers.__file__.startswith(target), rlm_workers.__file__
from rlm_workers.pipeline.prompts import PROMPT_NAMES, load_prompt
for name in PROMPT_NAMES:
    assert len(load_prompt(name)) > 100, name
print("ok", len(PROMPT_NAMES))
"""


def test_installed_wheel_finds_every_shipped_prompt_from_outside_the_repo(tmp_path):
    # build from a copy of what the Dockerfile copies, so the checkout gets no build/ or egg-info
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("rlm_workers", "rlm_api"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("rlm_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"rlm_workers/prompts/{n}.md" for n in PROMPT_NAMES} <= set(names), names

    target = tmp_path / "site"
    subprocess.run(
        pip + ["install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -I: no PYTHONPATH, no cwd on sys.path; only the wheel's dir (first) and the venv's site-packages (deps)
    proc = subprocess.run(
        [sys.executable, "-I", "-c", CHECK, str(target)],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok {len(PROMPT_NAMES)}"


# setuptools' own hook, as pip calls it, with its deprecation notices turned into errors: pip shows them to
# whoever runs `make install`, ~14 lines each, and a notice now is a build that stops working later
METADATA = """
import os, sys, warnings
from setuptools.build_meta import prepare_metadata_for_build_wheel
from setuptools.warnings import SetuptoolsDeprecationWarning
warnings.simplefilter("error", SetuptoolsDeprecationWarning)
src, out = sys.argv[1:]
sys.argv[1:] = []  # setuptools reads its own command line from sys.argv, as pip's build runner leaves it
os.chdir(src)
dist_info = prepare_metadata_for_build_wheel(out)
print(open(os.path.join(out, dist_info, "METADATA"), encoding="utf-8").read())
"""


def test_building_the_metadata_warns_of_nothing_deprecated(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", METADATA, str(src), str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "License-Expression: MIT" in proc.stdout.splitlines()
