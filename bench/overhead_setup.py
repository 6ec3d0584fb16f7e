"""What ``bench/overhead.py`` sets up and measures with: the fixed-latency scripted model, quiet workers, the
corpus and buffer, Celery's own task events and the CPU meter over the bench's processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

BUFFER = "overhead"
QUERY = "How does this code schedule, retry and acknowledge tasks?"
CORPUS_FILES = 60
CORPUS_CHARS = 2400  # under the 3000-char chunk size: one chunk per file
TARGET = 0.10  # within 10 % of the ideal critical path at 10 batches
_CHUNK_ID = re.compile(r"### Chunk (\d+)\n")


@dataclass
class Call:
    model: str
    arrived: float
    done: float = 0.0


class Model:
    """Fixed latency for every call; replies shaped so no stage needs a second call."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.lock = threading.Lock()
        self.calls: list[Call] = []

    def reset(self) -> list[Call]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls

    def __call__(self, req: dict) -> Any:
        from tests.support.scripted_llm import Reply, last_user_message

        call = Call(req.get("model") or "?", time.time())
        with self.lock:
            self.calls.append(call)
        model = call.model
        if model == "plan-model":
            content = json.dumps({"search_mode": "hybrid", "focus_topics": ["task scheduling"]})
        elif model == "analyst-model":
            ids = _CHUNK_ID.findall(last_user_message(req))
            content = json.dumps(
                [
                    {
                        "chunk_id": int(cid),
                        "relevance": "medium",
                        "findings": [f"Chunk {cid} shows how a task is scheduled."],
                        "summary": "Task scheduling code.",
                        "follow_up": [],
                    }
                    for cid in ids
                ]
            )
        else:
            content = "## Answer\n\nTasks are scheduled by the worker and acknowledged late [chunk 1]."
        # The wait happens here rather than in Reply.delay so the instant the answer leaves is recorded too.
        time.sleep(self.latency)
        call.done = time.time()
        return Reply.text(content)


def no_delay_handler() -> type:
    """The scripted server's handler with TCP_NODELAY on each accepted socket.

    http.server writes a response's headers and body in two send() calls; on a keep-alive connection
    reused at once (asyncio.gather, back-to-back calls) Nagle holds the body until the client's delayed
    ACK, ~40 ms later, so each call would look 540 ms long.  A real API server sets TCP_NODELAY.
    """
    from tests.support.scripted_llm import _Handler

    return type("NoDelayHandler", (_Handler,), {"disable_nagle_algorithm": True})


#: `rlm worker` as rlm_api.cli runs it, less -E, with Celery's task events switched off in the config
#: (``celery control disable_events`` cannot do it: a worker started with -E sends every event group)
_QUIET_WORKER = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from rlm_workers.celery_app import app
app.conf.worker_send_task_events = False
app.conf.task_send_sent_event = False
app.worker_main(["worker", "--without-gossip", "--without-mingle", *sys.argv[1:]])
"""


def quiet_worker_class(base: type) -> type:
    """tests.support.workers.WorkerProcess, started through _QUIET_WORKER instead of `rlm worker`."""

    class QuietWorker(base):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", _QUIET_WORKER, *self.worker_options()]

    return QuietWorker


def ensure_buffer(conn, corpus: Path) -> int:
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=BUFFER)
    conn.commit()
    if buf is None:
        loaded = load_paths(conn, buffer=BUFFER, paths=[corpus])
        conn.commit()
        print(f"loaded {loaded.chunks_written} chunks into buffer {BUFFER!r}", flush=True)
    n = harness.buffer_chunks(conn, BUFFER)
    if n < 50:
        raise SystemExit(f"buffer {BUFFER!r} has only {n} chunks; need >= 50")
    return n


class EventLog:
    """Every task event the workers (and this process) publish: sent, received, started, succeeded.

    The config already turns task events on (``-E``, ``task_send_sent_event``), so listening costs the
    workers nothing extra; each event carries the sender's ``time.time()``, the same host clock.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.events: list[dict] = []
        self.task: dict[str, tuple[str, str]] = {}  # uuid → (task name, job id)
        self.ready = threading.Event()
        self.recv = None
        self.thread = threading.Thread(target=self._run, name="celery-events", daemon=True)

    def start(self) -> EventLog:
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError("could not subscribe to Celery's task events")
        return self

    def stop(self) -> None:
        if self.recv is not None:
            self.recv.should_stop = True
        self.thread.join(timeout=5)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self.recv = self.app.events.Receiver(conn, handlers={"*": self._on})
            orig = self.recv.on_consume_ready

            def ready(*a: Any, **kw: Any) -> None:
                orig(*a, **kw)
                self.ready.set()

            self.recv.on_consume_ready = ready
            self.recv.capture(limit=None, timeout=None, wakeup=False)

    def _on(self, event: dict) -> None:
        if not str(event.get("type", "")).startswith("task-"):
            return
        with self.lock:
            if event.get("name"):
                m = re.search(r"job=([0-9a-f]+)", str(event.get("args") or ""))
                self.task[event["uuid"]] = (event["name"], m.group(1) if m else "")
            self.events.append(event)

    def of_job(self, job_id: str) -> dict[tuple[str, str], list[dict]]:
        """{(task name, event type): [events sorted by time]} for one job; removes them from the log."""
        out: dict[tuple[str, str], list[dict]] = {}
        with self.lock:
            keep = []
            for e in self.events:
                name, job = self.task.get(e["uuid"], ("", ""))
                if job == job_id:
                    out.setdefault((name, e["type"][5:]), []).append(e)
                else:
                    keep.append(e)
            self.events = keep
        for v in out.values():
            v.sort(key=lambda e: e["timestamp"])
        return out


def _children(ppid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


class CpuMeter:
    """CPU seconds spent by each part of the system between two snapshots.

    PostgreSQL = the postmaster and its backends (the pools keep their connections, so backends
    live across runs); the bench process holds the client, the scripted server and the event listener.
    """

    def __init__(self, data_dir: Path, workers: list) -> None:
        self.data_dir = data_dir
        self.workers = workers

    def _groups(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {"bench process (client + scripted server)": [os.getpid()]}
        for w in self.workers:
            key = "ctl worker" if w.name == "ctl" else "analyst worker(s)"
            groups.setdefault(key, []).append(w.proc.pid)
        try:
            pm = int((self.data_dir / "pg" / "postmaster.pid").read_text().split()[0])
            groups["PostgreSQL"] = [pm, *_children(pm)]
        except (OSError, ValueError, IndexError):
            pass
        try:
            groups["Valkey"] = [int(json.loads((self.data_dir / "valkey" / "server.json").read_text())["pid"])]
        except (OSError, ValueError, KeyError):
            pass
        return groups

    def snapshot(self) -> dict[str, dict[int, float]]:
        return {g: {pid: harness.process_cpu(pid) for pid in pids} for g, pids in self._groups().items()}

    @staticmethod
    def delta(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
        return {g: sum(v - a.get(g, {}).get(pid, 0.0) for pid, v in pids.items()) for g, pids in b.items()}


#: the critical path, as consecutive segments that add up to what the client sees
CHAIN = (
    "submit → plan task started",
    "plan task started → plan call sent",
    "plan call (scripted latency)",
    "plan answered → first analyst task started (search + chord sent, in the plan task)",
    "first analyst task started → its call sent",
    "first → last analyst call sent",
    "last analyst call (scripted latency)",
    "last analyst answered → collect task started",
    "collect started → synth call sent (collect, then synthesis in the same task)",
    "synth call (scripted latency)",
    "synth answered → job finished (DB)",
    "job finished → client saw it (wait_for_job: NOTIFY)",
)

#: the same, when the workers send no task events (--no-task-events)
COARSE_CHAIN = (
    "submit → plan call sent",
    "plan call (scripted latency)",
    "plan answered → first analyst call sent",
    "first → last analyst call sent",
    "last analyst call (scripted latency)",
    "last analyst answered → synth call sent",
    "synth call (scripted latency)",
    "synth answered → job finished (DB)",
    "job finished → client saw it (wait_for_job: NOTIFY)",
)
