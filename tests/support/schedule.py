"""The order in which `make test`'s processes take modules: the longest first.

Under ``--dist loadfile --no-loadscope-reorder`` each pytest-xdist process takes the next whole module, in
collection order, whenever it is free.  xdist's own order (most tests first) put the one-test modules that run a
real model or load a corpus at the end, where one process ran them while the others had finished.  Longest first,
the quick modules fill the end instead.  ``tests/module_seconds.json`` holds each module's seconds from a run
(``make test PYTEST_ARGS=--store-module-seconds`` rewrites it); a module it does not name counts as the median.

The two modules whose jobs take a real model through every stage are one unit, taken by one process one after
another, last: each starts its own local model server, and beside three processes loading corpora their jobs took
1.5-1.8x as long as alone (60-80 s against 42-46 s, bench/RESULTS.md#suite); last, the others are finishing.  The
third module that starts a model server (``test_local_default``, one short query) keeps its place by length, long
before them.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

SECONDS_FILE = Path(__file__).resolve().parents[1] / "module_seconds.json"


#: modules that run a local model server (a module marked ``real_model`` must be here)
REAL_MODEL_MODULES = frozenset(
    {"tests/test_local_default.py", "tests/test_real_model.py", "tests/test_real_model_tools.py"}
)
#: those whose jobs take the model through every stage: one unit, which one process runs last (the module docstring)
REAL_MODEL_UNIT = frozenset({"tests/test_real_model.py", "tests/test_real_model_tools.py"})
REAL = "real-model"


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit(module: str) -> str:
    """The unit of work a module belongs to: the module itself, or the real-model unit."""
    return REAL if module in REAL_MODEL_UNIT else module


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-module-seconds",
        action="store_true",
        help=f"write each module's seconds (setup, call and teardown) to {SECONDS_FILE.name} at the end",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = sorted({_module(i.nodeid) for i in items if i.get_closest_marker("real_model")} - REAL_MODEL_MODULES)
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)}: a real-model module, add it to REAL_MODEL_MODULES ({__file__})")
    try:
        seconds = json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        return  # collection order
    if not seconds:
        return
    unknown = statistics.median(seconds.values())
    units: defaultdict[str, float] = defaultdict(float)
    for module in {_module(i.nodeid) for i in items}:
        units[_unit(module)] += seconds.get(module, unknown)
    # stable: a unit's tests stay together and in their order; the real-model unit last (the module docstring)
    items.sort(key=lambda item: ((u := _unit(_module(item.nodeid))) == REAL, -units[u], u))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the real-model modules one unit (``_unit``)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(super()._split_scope(nodeid))

    return _Units(config, log)


class _Recorder:
    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ranked = dict(sorted(((m, round(s)) for m, s in self.seconds.items()), key=lambda kv: (-kv[1], kv[0])))
        SECONDS_FILE.write_text(json.dumps(ranked, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    # the xdist controller sees every process's reports; a worker would see its own share only
    if config.getoption("store_module_seconds") and "PYTEST_XDIST_WORKER" not in os.environ:
        config.pluginmanager.register(_Recorder(), "rlm-module-seconds")
