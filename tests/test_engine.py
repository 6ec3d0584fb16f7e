"""The engine is the one interface of the surfaces: ``rlm_api`` imports only ``rlm_workers.engine`` and the
settings (``rlm_workers.config``), and the README's five lines of Python run as written."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"rlm_workers.engine", "rlm_workers.config"}
_IMPORT_CALLS = {"import_module", "__import__"}


def _named(module: str) -> bool:
    return module == "rlm_workers" or module.startswith("rlm_workers.")


def forbidden_imports(source: str) -> list[str]:
    """Every import of ``source`` that names a part of ``rlm_workers`` other than the engine or the settings:
    ``import x``, ``from x import y`` (``from rlm_workers import engine`` names ``rlm_workers.engine``), at any
    depth (module level, under ``TYPE_CHECKING``, inside a function), and ``importlib.import_module("x")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _named(a.name) and a.name not in ALLOWED]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _named(node.module):
            if node.module == "rlm_workers":
                found += [f"rlm_workers.{a.name}" for a in node.names if f"rlm_workers.{a.name}" not in ALLOWED]
            elif node.module not in ALLOWED:
                found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target = node.args[0].value
            if name in _IMPORT_CALLS and isinstance(target, str) and _named(target) and target not in ALLOWED:
                found.append(target)
    return found


@pytest.mark.parametrize(
    "source",
    [
        "from rlm_workers.store.db import connect",
        "import rlm_workers.store.jobs",
        "from rlm_workers import submit",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlm_workers.store.jobs import JobRow",
        "def f():\n    from rlm_workers.celery_app import get_app",
        "import importlib\nimportlib.import_module('rlm_workers.store.keys')",
    ],
)
def test_the_check_finds_every_form_of_import(source):
    assert forbidden_imports(source), source


def test_the_check_allows_the_engine_and_the_settings():
    source = (
        "from rlm_workers import engine\nfrom rlm_workers.engine import get_job\nimport rlm_workers.config\n"
        "def f():\n    from rlm_workers.config import get_settings\n"
    )
    assert forbidden_imports(source) == []


def test_rlm_api_imports_only_the_engine_and_the_settings():
    files = sorted((ROOT / "rlm_api").rglob("*.py"))
    assert len(files) > 30
    bad = {
        str(p.relative_to(ROOT)): found for p in files if (found := forbidden_imports(p.read_text(encoding="utf-8")))
    }
    assert not bad, f"rlm_api must call rlm_workers.engine (and read rlm_workers.config), not: {bad}"


def test_every_name_the_engine_exports_resolves():
    from rlm_workers import engine

    missing = [name for name in engine.__all__ if not hasattr(engine, name)]
    assert not missing
    assert len(engine.__all__) == len(set(engine.__all__))


def test_type_checkers_see_every_lazy_name():
    """A name resolved on first use is imported under ``TYPE_CHECKING`` too, or mypy would not know it."""
    from rlm_workers import engine

    tree = ast.parse((ROOT / "rlm_workers" / "engine.py").read_text(encoding="utf-8"))
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {a.asname or a.name for n in ast.walk(guarded) if isinstance(n, ast.ImportFrom) for a in n.names}
    bound = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    lazy = set(engine.__all__) - bound
    assert lazy and lazy <= seen, sorted(lazy - seen)


def test_importing_the_engine_loads_no_database_or_broker_client():
    """``rlm --help`` imports the engine: what it resolves lazily must stay unloaded."""
    code = "import sys, rlm_workers.engine; print([m for m in ('psycopg', 'celery', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_a_command_that_reads_jobs_loads_no_broker_or_metrics_client():
    """`rlm job show`, `rlm jobs` and `rlm buffers` read PostgreSQL only; the tests start such commands hundreds
    of times, and Redis's client, kombu and the Prometheus client were once half of each one's start."""
    code = (
        "import sys; import rlm_api.cli, rlm_api.cli_jobs, rlm_api.views; "
        "from rlm_workers.engine import connect, get_job, job_ids_starting, list_buffers, list_jobs; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'redis', 'kombu', 'celery', 'prometheus_client'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_reading_a_batch_loads_no_celery_and_sending_one_no_llm_client():
    """`rlm batch status` and `results` read PostgreSQL only; `submit` and `cancel` send a tick but call no
    model.  The openai package alone was most of a second of each such command's start."""
    code = (
        "import sys; import rlm_api.cli_batch; "
        "from rlm_workers.engine import get_overnight, iter_csv, iter_jsonl, list_overnight, status_of; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'openai', 'kombu', 'celery', 'numpy'})); "
        "from rlm_workers.engine import cancel_overnight, submit_overnight; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'openai'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def readme_example() -> str:
    """The code block of README.md's "Use it from Python"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Use it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: 'Use it from Python' has no python block"
    return match.group(1)


def test_the_readme_example_is_five_lines():
    # ruff formats the block too, and wants a blank line after the import: five lines of Python all the same
    assert len([line for line in readme_example().splitlines() if line.strip()]) == 5


def test_the_readme_example_loads_searches_and_answers(rlm_env, tmp_path):
    """As a newcomer runs it: a fresh process in a directory with ``docs/``, no worker running (``ask`` runs
    one in-process), the offline extractive provider answering."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "queries.md").write_text(
        "# Queries\n\nA query is answered in stages: the planner writes a plan, the search finds chunks, analysts "
        "read the chunks in batches and the synthesizer writes the answer from their findings.\n",
        encoding="utf-8",
    )
    (docs / "buffers.md").write_text(
        "# Buffers\n\nA buffer holds the chunks of the files loaded into it, with their embeddings.\n",
        encoding="utf-8",
    )
    out = subprocess.run(
        [sys.executable, "-c", readme_example()],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    hits = [ln for ln in lines if re.match(r"^-?\d\.\d{3} docs:", ln)]
    assert any(" docs:docs/queries.md:" in ln for ln in hits), out.stdout  # buffer:path:lines
    answer = "\n".join(lines[len(hits) :])
    assert "the planner writes a plan" in answer, out.stdout  # the offline provider quotes the passage
