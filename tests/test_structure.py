"""The layout rules of docs/architecture.md#layout, checked so they stay true."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.workers import ROOT

CODE = ("rlm_workers", "rlm_api")
SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b")


def _tracked() -> list[str]:
    """The project's files: what git tracks (or would), or, outside a checkout (an exported tree), every file
    but the ignored kinds."""
    proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0:
        return [p for p in proc.stdout.split() if (ROOT / p).is_file()]
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "_data", "build", "dist"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def _python_files() -> list:
    return sorted(p for pkg in CODE for p in (ROOT / pkg).rglob("*.py"))


def test_sql_lives_only_in_store():
    outside = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _python_files()
        if "store" not in p.parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if SQL.search(line)
    ]
    assert outside == []


def test_every_docs_anchor_the_code_cites_exists():
    cited = {
        (m.group(1), m.group(2))
        for p in _python_files()
        for m in re.finditer(r"docs/([a-z_]+\.md)#([a-z0-9-]+)", p.read_text())
    }
    assert cited, "the code cites its docs"
    missing = [
        f"{doc}#{anchor}" for doc, anchor in sorted(cited) if f'id="{anchor}"' not in (ROOT / "docs" / doc).read_text()
    ]
    assert missing == []


#: a citation of the design file that lives beside the repo, not in it (section marks, or a path into the
#: sibling folder); spelled from parts so that this file does not cite it itself
OUTSIDE = re.compile("DESIGN" + r" §|\.\./" + "shared/|" + r"\b" + "shared/" + "DESIGN")


def test_nothing_refers_to_a_design_file_outside_the_repo():
    offenders = [p for p in _tracked() if OUTSIDE.search((ROOT / p).read_text(errors="replace"))]
    assert offenders == []


def test_ruff_lint_and_format_pass():
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_task_adapters_hold_no_logic():
    """Each Celery task is one line that hands over to pipeline/, overnight/ or ingest/."""
    import ast

    for path in sorted((ROOT / "rlm_workers" / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "shared_task" for d in node.decorator_list
            ):
                body = [s for s in node.body if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)]
                assert len(body) == 1 and isinstance(body[0], ast.Return), f"{path.name}:{node.name}"
