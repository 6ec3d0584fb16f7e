"""The order in which `make test`'s processes take modules: the longest first.

Under ``--dist loadfile --no-loadscope-reorder`` each pytest-xdist process takes the next whole module, in
collection order, whenever it is free.  xdist's own order (most tests first) put the one-test modules that run a
real model or load a corpus at the end, where one process ran them while the others had finished.  Longest first,
the quick modules fill the end instead.  ``tests/module_seconds.json`` holds each module's seconds from a run
(``make test PYTEST_ARGS=--store-module-seconds`` rewrites it); a module it does not name counts as the median.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).resolve().parents[1] / "module_seconds.json"


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-module-seconds",
        action="store_true",
        help=f"write each module's seconds (setup, call and teardown) to {SECONDS_FILE.name} at the end",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    try:
        seconds = json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        return  # collection order
    if not seconds:
        return
    unknown = statistics.median(seconds.values())
    # stable: a module's tests stay together and in their order
    items.sort(key=lambda item: -seconds.get(_module(item.nodeid), unknown))


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
