"""Questions about Celery's ``celery/app`` subpackage, with the file and the line that answer each.

The corpus is code nobody on this project wrote: the ``celery`` package that constraints.txt pins (5.7.0)
installs it, so a clean checkout has it.  The questions are phrased as a user would ask them, about a third
without the identifier's words ("how long before a task is tried again" for ``default_retry_delay``).  Each
gold line is a substring of the line a good answer quotes first; a setting defined twice (``queue_expires``
of two namespaces) is asked with the words of its namespace.

Used by tests/test_offline_answer.py (the gate) and bench/offline_answer.py (the figure).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import celery


class Gold(NamedTuple):
    question: str
    path: str  # relative to the loaded folder
    line: str  # a substring of the line that answers


#: the loaded folder: 16 files, about 290 KB
SUBPACKAGE = "app"

GOLD = [
    Gold("What is the default broker heartbeat interval?", "defaults.py", "heartbeat=Option(120"),
    Gold("Where is the default prefetch multiplier defined?", "defaults.py", "prefetch_multiplier=Option(4"),
    Gold("Where does celery define the default prefetch multiplier?", "defaults.py", "prefetch_multiplier=Option(4"),
    Gold("How many times is a failing task retried by default?", "task.py", "max_retries = 3"),
    Gold("How long does a task wait before it is tried again?", "task.py", "default_retry_delay = 3 * 60"),
    Gold("What is the name of the default queue?", "defaults.py", "default_queue=Option('celery')"),
    Gold("How many times does it try to reconnect to the broker?", "defaults.py", "connection_max_retries=Option(100"),
    Gold("Which multiprocessing start method does the worker pool use?", "defaults.py", "pool_start_method=Option("),
    Gold("What is the socket timeout of the redis result backend?", "defaults.py", "socket_timeout=Option(120.0"),
    Gold("How long can the repr of a task result be?", "task.py", "resultrepr_maxsize = 1024"),
    Gold("How long does the worker wait for results of lost tasks?", "defaults.py", "lost_wait=Option(10.0"),
    Gold("Where is the function that sends a task by its name?", "base.py", "def send_task("),
    Gold("How does celery find the tasks modules of installed packages?", "base.py", "def autodiscover_tasks("),
    Gold("Where is a router given as a string turned into a router object?", "routes.py", "def expand_router_string("),
    Gold("Which class routes tasks with a dictionary of task names?", "routes.py", "class MapRoute"),
    Gold("Where is the function that schedules a task to run again?", "task.py", "def retry("),
    Gold("Where is the tracer that runs a task and records its state built?", "trace.py", "def build_tracer("),
    Gold("Is UTC enabled by default?", "defaults.py", "enable_utc=Option(True"),
    Gold("When do the event queues expire?", "defaults.py", "queue_expires=Option(60.0"),
    Gold("Which version of the task message protocol is used by default?", "defaults.py", "protocol=Option(2"),
    Gold(
        "Where is the periodic task that deletes expired results registered?",
        "builtins.py",
        "def add_backend_cleanup_task(",
    ),
    Gold("Which format do worker log lines have?", "defaults.py", "log_format=Option(DEFAULT_PROCESS_LOG_FMT)"),
    Gold("How can I tell a worker to stop running a task that was already sent?", "control.py", "def revoke("),
    Gold("How do I check that the workers are alive and answering?", "control.py", "def ping("),
]


def copy_corpus(dest: Path) -> Path:
    """The subpackage's ``.py`` files copied under ``dest`` (no caches), so a test loads exactly them."""
    src = Path(celery.__file__).parent / SUBPACKAGE
    out = dest / SUBPACKAGE
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.py")):
        shutil.copyfile(f, out / f.name)
    return out
