"""The layout rules of docs/architecture.md#layout, checked so they stay true."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

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
    assert not missing, f"anchors the code cites that its docs lack: {', '.join(missing)}"


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
    for path in sorted((ROOT / "rlm_workers" / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "shared_task" for d in node.decorator_list
            ):
                body = [s for s in node.body if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)]
                assert len(body) == 1 and isinstance(body[0], ast.Return), f"{path.name}:{node.name}"


# --- the module list, tasks and queues of docs/architecture.md, and the import graph -------------------------
#
# Read from the source with ast, never imported: these checks must hold (and fail legibly) without a database,
# a broker or the heavy libraries.

ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: where each package's module table starts in docs/architecture.md#layout; its rows name modules by their
#: path relative to the package (``pipeline/reads.py``)
MODULE_TABLES = {"rlm_workers": "modules-workers", "rlm_api": "modules-api"}
#: libraries that take seconds to import or pull in a browser or an agent protocol: only the edges that use
#: them may import them (docs/architecture.md#layout)
HEAVY = ("torch", "transformers", "onnxruntime", "sentence_transformers", "playwright", "mcp")
#: a Celery task or queue name as the doc writes it (``rlm.read``, ``rlm.ingest.group``), not a pattern
#: (``rlm.batch.*``, ``rlm.*``)
RLM_NAME = re.compile(r"(?<![\w.:/-])rlm(?:\.[a-z_]+)+(?![\w*]|\.\*|\.[a-z_])")


def _modules() -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its own name), with its file."""
    found = {}
    for path in _python_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _architecture() -> str:
    return ARCHITECTURE.read_text()


def _table_after(anchor: str) -> list[list[str]]:
    """The rows (as cells) of the first markdown table after ``<a id="anchor">``, header and rule left out."""
    text = _architecture()
    mark = f'<a id="{anchor}"></a>'
    assert mark in text, f"docs/architecture.md has no {mark}"
    lines = text.split(mark, 1)[1].splitlines()
    rows: list[list[str]] = []
    for line in lines:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def _named_modules(package: str) -> list[str]:
    """The first cells of the package's module table; each must be one backticked path, ``dir/name.py``."""
    cells = [row[0] for row in _table_after(MODULE_TABLES[package])]
    odd = [c for c in cells if not re.fullmatch(r"`(?:[a-z_]+/)*[a-z_0-9]+\.py`", c)]
    assert not odd, f"rows of #{MODULE_TABLES[package]} must start with a `path/relative/to/{package}.py`: {odd}"
    return [c.strip("`") for c in cells]


def test_architecture_names_every_module_and_only_modules_that_exist():
    for package in CODE:
        named = _named_modules(package)
        real = {str(p.relative_to(ROOT / package)) for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"}
        missing, extra = sorted(real - set(named)), sorted(set(named) - real)
        assert not missing, f"modules of {package}/ missing from docs/architecture.md#layout: {', '.join(missing)}"
        assert not extra, f"docs/architecture.md#layout names modules {package}/ lacks: {', '.join(extra)}"
        twice = sorted(n for n in set(named) if named.count(n) > 1)
        assert not twice, f"named twice in docs/architecture.md#layout: {', '.join(twice)}"


def test_every_python_file_the_architecture_cites_exists():
    """Outside the module tables too: a module renamed or deleted must not live on in the prose."""
    files = [p for p in _tracked() if p.endswith(".py")]
    cited = set(re.findall(r"`([\w/]+\.py)`", _architecture()))
    missing = [c for c in sorted(cited) if not any(f == c or f.endswith("/" + c) for f in files)]
    assert not missing, f"docs/architecture.md cites files that do not exist: {', '.join(missing)}"


def _shared_tasks() -> dict[str, str]:
    """Every ``@shared_task(name=...)`` of rlm_workers/tasks/, name → its module's file name."""
    tasks = {}
    for path in sorted((ROOT / "rlm_workers" / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "shared_task":
                name = next(k.value.value for k in node.keywords if k.arg == "name")
                tasks[name] = path.name
    return tasks


def _queues_and_routes() -> tuple[dict[str, str], list[tuple[str, str]], str]:
    """The queues (constant → name) of constants.py, celery_app.py's ``task_routes`` as (pattern, queue) in
    order, and its default queue."""
    queues = {}
    for node in ast.parse((ROOT / "rlm_workers" / "constants.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("QUEUE_"):
                    queues[target.id] = node.value.value
    routes, default = [], ""
    for node in ast.walk(ast.parse((ROOT / "rlm_workers" / "celery_app.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "task_routes":
                    for pattern, route in zip(value.keys, value.values, strict=True):
                        queue = next(v for k, v in zip(route.keys, route.values, strict=True) if k.value == "queue")
                        routes.append((pattern.value, queues[queue.id]))
                if isinstance(key, ast.Constant) and key.value == "task_default_queue":
                    default = queues[value.id]
    assert queues and routes and default, "celery_app.py routes tasks to the QUEUE_* of constants.py"
    return queues, routes, default


def _queue_of(task: str, routes: list[tuple[str, str]], default: str) -> str:
    """Where Celery routes ``task``: an exact route first, then the first glob that matches, else the default."""
    exact = dict(routes)
    if task in exact:
        return exact[task]
    return next((queue for pattern, queue in routes if fnmatch.fnmatchcase(task, pattern)), default)


def test_architecture_names_every_task_and_queue_where_it_runs():
    """Each queue has a row of the table in docs/architecture.md#queues naming every task routed to it."""
    tasks = _shared_tasks()
    queues, routes, default = _queues_and_routes()
    assert {"rlm.plan", "rlm.read", "rlm.ingest.group"} <= set(tasks)
    rows = {row[0].strip("`"): row[1] for row in _table_after("queues") if row}
    rowless = sorted(set(queues.values()) - set(rows))
    assert not rowless, f"queues without a row in docs/architecture.md#queues: {', '.join(rowless)}"
    misplaced = [
        f"{task} ({module}) -> {_queue_of(task, routes, default)}"
        for task, module in sorted(tasks.items())
        if f"`{task}`" not in rows.get(_queue_of(task, routes, default), "")
    ]
    assert not misplaced, "tasks missing from their queue's row in docs/architecture.md#queues:\n" + "\n".join(
        misplaced
    )


def test_every_task_name_the_architecture_uses_exists():
    known = set(_shared_tasks()) | set(_queues_and_routes()[0].values())
    named = set(RLM_NAME.findall(_architecture()))
    unknown = sorted(named - known)
    assert not unknown, f"rlm.* names in docs/architecture.md that are no task or queue: {', '.join(unknown)}"


def _imports(module: str, path: Path) -> list[tuple[ast.stmt, str, str]]:
    """Every import statement of a module with its target resolved to an absolute dotted name, and when it
    runs: ``"load"`` when the module is imported (module level, including under a module-level ``if``/``try``),
    ``"typing"`` never (under ``if TYPE_CHECKING:``, for annotations), ``"call"`` when a function runs."""
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[ast.stmt, str, str]] = []

    def visit(node: ast.AST, when: str) -> None:
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node, ".".join([*base, *([node.module] if node.module else [])]), when))
        elif isinstance(node, ast.Import):
            found.extend((node, alias.name, when) for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            when = "call"
        elif isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            # `if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`
            for child in node.body:
                visit(child, "typing" if when == "load" else when)
            for child in node.orelse:
                visit(child, when)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, when)

    visit(tree, "load")
    return found


def _targets(node: ast.stmt, target: str) -> list[str]:
    """What one import names: its module, and for ``from pkg import name`` also ``pkg.name`` (a submodule, if
    ``name`` is one)."""
    return [target] + [f"{target}.{a.name}" for a in node.names if isinstance(node, ast.ImportFrom)]


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    offenders = [
        f"{module}:{node.lineno} from {target} import {alias.name}"
        for module, path in modules.items()
        for node, target, _ in _imports(module, path)
        if isinstance(node, ast.ImportFrom) and target in modules and target != module
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not offenders, "private names imported from another module (share them under a public name):\n" + "\n".join(
        offenders
    )


def _import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports anywhere: when it is imported, under ``if TYPE_CHECKING:`` and
    inside functions alike (``from pkg import mod`` counts ``pkg.mod``; an import of a package counts the
    package, its ``__init__.py``).  An import tucked into a function or under TYPE_CHECKING to dodge a circle
    still ties the two modules to each other, so it counts."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node, target, _ in _imports(module, path):
            graph[module] |= {t for t in _targets(node, target) if t in modules and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_among_the_projects_modules():
    """Counting every import (``_import_graph``): module level, TYPE_CHECKING and in-function ones."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles (what two modules share belongs in a third):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_llm_layer_imports_nothing_from_the_pipeline():
    """``llm/`` is a leaf below ``pipeline/`` (docs/architecture.md#layout): the stages call the providers, never
    the other way round, at load, under TYPE_CHECKING or in a function.  What both need lives where neither
    owns it: reading replies in ``llm/replies.py``, typed records in ``records/``."""
    offenders = [
        f"{module}:{node.lineno} ({when}): {ast.unparse(node)}"
        for module, path in _modules().items()
        if module.split(".")[:2] == ["rlm_workers", "llm"]
        for node, target, when in _imports(module, path)
        if any(name.split(".")[:2] == ["rlm_workers", "pipeline"] for name in _targets(node, target))
    ]
    assert not offenders, "llm/ imports from pipeline/:\n" + "\n".join(offenders)


def test_the_root_of_rlm_workers_holds_at_most_ten_modules():
    """The root is the first thing a newcomer reads: the app, the settings and what everything shares.  Anything
    else goes in the package it belongs to (docs/architecture.md#layout)."""
    root = sorted(p.name for p in (ROOT / "rlm_workers").glob("*.py"))
    assert len(root) <= 10, f"rlm_workers/ holds {len(root)} modules (at most 10): {', '.join(root)}"


def test_light_entry_points_import_nothing_heavy():
    """The pipeline and the HTTP app start without the heavy libraries; only the edges that use them load them."""
    probe = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    for entry in ("rlm_workers.pipeline.flow", "rlm_api.app"):
        proc = subprocess.run([sys.executable, "-c", probe, entry], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "[]", f"import {entry} loads {proc.stdout.strip()}"


#: ``(x or {}).get(`` that stays: dicts no job column holds (a JSON column has a typed model: store/job_state.py)
NOT_JOB_COLUMNS = {
    # the OpenAI reply's extra fields (a llama.cpp server's timings), from an external server
    "rlm_workers/llm/openai_provider.py": ['(getattr(response, "model_extra", None) or {}).get("timings")',
                                           '(params.get("response_format") or {}).get("type")'],
    # the ASGI scope's state, set by Starlette
    "rlm_api/mcp_server.py": ['(request.scope.get("state") or {}).get(TENANT_KEY)'],
    # one of pydantic's validation error entries
    "rlm_api/schemas.py": ['(first.get("ctx") or {}).get("error")'],
}  # fmt: skip


def test_no_job_column_is_read_as_an_untyped_dict():
    """A job's JSON column is read by attribute from its model, never as ``(x or {}).get(…)``, which hides a
    misspelt key as a missing one; what remains reads dicts from elsewhere, named above."""
    pattern = re.compile(r"\([^()]*(?:\([^()]*\))?[^()]* or \{\}\)\.get\(")
    found = [
        f"{p.relative_to(ROOT)}: {line.strip()}"
        for p in _python_files()
        for line in p.read_text().splitlines()
        if pattern.search(line) and not any(ok in line for ok in NOT_JOB_COLUMNS.get(str(p.relative_to(ROOT)), []))
    ]
    assert found == []


#: classes that declare a place of their own, not a chunk's or passage's location (``Location``), each with why
OWN_PLACE = {
    # a chunk as the chunker cuts it: no buffer yet, and its byte offsets are what loading stores
    "Chunk": "rlm_workers/ingest/chunkers.py",
    # a chunk's span in its file (byte offsets, no buffer or path): what stitching a section back together needs
    "SpanChunk": "rlm_workers/store/buffers.py",
    # a heading's span in its document's outline: its path is the heading path, not a file's
    "Heading": "rlm_workers/search/sections.py",
    # get_outline's row for one heading: the heading's span, printed with the heading's own keys
    "OutlineHeading": "rlm_api/mcp_server.py",
}


def _annotated(node: ast.ClassDef) -> set[str]:
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_where_a_chunk_sits_is_declared_once_in_location():
    """A class that says where something sits inherits ``models.Location`` instead of declaring ``start_line``
    beside a path, pages or a heading path again, so a new location field reaches every such record
    (docs/architecture.md#layout)."""
    models = ast.parse((ROOT / "rlm_workers" / "models.py").read_text())
    location = next(n for n in models.body if isinstance(n, ast.ClassDef) and n.name == "Location")
    # the lines alone are no location: a line span (a batch's, a quote's) may be declared anywhere
    beside = _annotated(location) - {"start_line", "end_line"}
    assert {"buffer", "path", "page_start", "heading_path"} <= beside
    found = {
        (node.name, str(path.relative_to(ROOT)))
        for path in _python_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and "start_line" in (names := _annotated(node)) and names & beside
    }
    offenders = sorted(
        f"{where}:{name}" for name, where in found - set(OWN_PLACE.items()) - {("Location", "rlm_workers/models.py")}
    )
    assert not offenders, "classes declaring a location of their own (inherit models.Location):\n" + "\n".join(
        offenders
    )
    stale = sorted(set(OWN_PLACE.items()) - found)
    assert not stale, f"OWN_PLACE names classes that declare no place of their own (any more): {stale}"
