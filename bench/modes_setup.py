"""What ``bench/modes.py`` sets up: its constants and targets, the scripted OpenAI-protocol server that answers
every mode, and the two corpora (code files, generated logs) loaded as buffers.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.* (scripted server, worker processes)

CODE_BUFFER = "modes-code"
LOG_BUFFER = "modes-logs"
CODE_FILES = 120
CODE_CHARS = 2400  # under the 3000-char chunk size: one chunk per file
LOG_FILES = 40
LOG_CHUNKS_PER_FILE = 250  # 40 × 250 = 10,000 chunks
#: the most files ``--batches`` may ask for: 200 × 250 = 50,000 chunks, 1,000 batches
MAX_LOG_FILES = 200
LOG_CHUNK_SIZE = 250
LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")
MAX_CONCURRENCY = 100
#: one thread per call in flight: a thread beyond RLM_MAX_CONCURRENCY could only poll the limiter for a slot
ANALYST_THREADS = MAX_CONCURRENCY
CONTROL_THREADS = 8
QUERY = "How does Celery schedule, retry and acknowledge tasks?"
COUNT_QUERY = "How many log lines are there of each level (ERROR, WARN, INFO, DEBUG)?"
#: the completeness check's follow-ups, one list per round; the round after the last is complete
FOLLOW_UPS = (
    (
        "How are task retries scheduled with a countdown or an eta?",
        "How does a worker acknowledge messages late (acks_late)?",
        "How does celery beat schedule periodic tasks?",
    ),
    (
        "How does a result backend store the state of a task?",
        "How are tasks routed to queues?",
    ),
)
#: (name, options) of each part on the code buffer; the targets are in TARGETS
MODE_RUNS = (
    ("instant", {"mode": "instant"}),
    ("auto", {"mode": "auto"}),
    ("fanout", {"mode": "auto", "batch_size": 10}),
    ("thinking", {"mode": "thinking", "depth": 2}),
)
#: (name, rlm.analyst worker processes sharing ANALYST_THREADS threads) of each `--scope all` series: one
#: process as the issue asks, and two, to see how much of the time one process's GIL costs; four (issue #43's
#: 1,000 batches) only when asked for
EXHAUSTIVE_RUNS = (("exhaustive", 1), ("exhaustive-2p", 2), ("exhaustive-4p", 4))
#: most a run may take, as a multiple of its ideal (issue #11); None: reported, no target
TARGETS = {
    "instant": 1.2,
    "auto": None,
    "fanout": None,
    "thinking": 1.15,
    "exhaustive": 1.15,
    "exhaustive-2p": 1.15,
    "exhaustive-4p": 1.15,
}
#: `--scope all` batches (of 50 chunks) per log file, and the target of a count other than the full 200 batches
#: (issue #29: a single wave has less time to hide a fixed overhead in, and is held to a tighter ratio; issue #43:
#: 1,000 batches on four analyst processes, the same 1.10)
BATCHES_PER_FILE = LOG_CHUNKS_PER_FILE // 50
SMALL_EXHAUSTIVE_TARGET = 1.10


_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: [^\n]*\n\n<content>\n(.*?)\n</content>", re.S)
_LEVEL = re.compile(r"\b(ERROR|WARN|INFO|DEBUG)\b")


def user_text(req: dict) -> str:
    msgs = [m for m in req.get("messages") or [] if m.get("role") == "user"]
    return (msgs[-1].get("content") or "") if msgs else ""


def line_level(line: str) -> str | None:
    """The level a log line is written at: the first level word on it (messages never contain one)."""
    m = _LEVEL.search(line)
    return m.group(1) if m else None


class Responder:
    """Answers by model name; every reply is shaped so that no stage needs a second call."""

    def __call__(self, req: dict) -> Any:
        from tests.support.scripted_llm import Reply

        model = req.get("model")
        text = user_text(req)
        if model == "plan-model":
            content = json.dumps({"search_mode": "hybrid", "focus_topics": ["task scheduling"]})
        elif model == "analyst-model":
            content = json.dumps(self.analyst(text, counting="## Records" in text))
        elif model == "check-model":
            content = json.dumps(self.check(text))
        else:
            cited = _CHUNK.search(text) or re.search(r"### Chunk (\d+)", text)
            ref = f" [chunk {cited.group(1)}]" if cited else ""
            content = f"## Answer\n\nTasks are scheduled by the worker, retried with a countdown and acked late{ref}."
        return Reply.text(content)

    @staticmethod
    def analyst(text: str, *, counting: bool) -> list[dict]:
        out = []
        for cid, body in _CHUNK.findall(text):
            entry: dict[str, Any] = {"chunk_id": int(cid), "summary": "", "follow_up": []}
            if counting:
                levels: dict[str, int] = {}
                for line in body.split("\n"):
                    if lvl := line_level(line):
                        levels[lvl] = levels.get(lvl, 0) + 1
                errors = levels.get("ERROR", 0)
                entry["relevance"] = "medium" if errors else "none"
                entry["findings"] = [f"{errors} ERROR lines"] if errors else []
                entry["records"] = [{"label": "level", "value": k, "count": v} for k, v in sorted(levels.items())]
            else:
                first = body.strip().split("\n", 1)[0][:120]
                entry["relevance"] = "medium"
                entry["findings"] = [f"The chunk begins: {first}"]
                entry["summary"] = "Task scheduling code."
            out.append(entry)
        return out

    @staticmethod
    def check(text: str) -> dict:
        asked = 0
        if "## Asked already" in text:
            section = text.split("## Asked already", 1)[1].split("\n## ", 1)[0]
            asked = sum(1 for line in section.splitlines() if line.startswith("- "))
        rnd = next((i for i in range(len(FOLLOW_UPS)) if asked == sum(len(r) for r in FOLLOW_UPS[:i])), None)
        if rnd is None:
            return {"complete": True, "confidence": 0.9, "gaps": [], "follow_ups": []}
        return {"complete": False, "confidence": 0.4, "gaps": ["not yet covered"], "follow_ups": list(FOLLOW_UPS[rnd])}


def responder() -> Responder:
    """``--responder modes_setup:responder``: the model above, on a server with Nagle off.

    http.server writes a response's headers and body in two send() calls; on a reused keep-alive connection
    Nagle would hold the body until the client's delayed ACK (~40 ms a call).  A real API server sets
    TCP_NODELAY, and so does this one (the handler class reads the flag per connection).
    """
    from tests.support import scripted_llm

    scripted_llm._Handler.disable_nagle_algorithm = True
    return Responder()


class Server:
    """The scripted server as its own process; its stats and received requests read over HTTP."""

    def __init__(self, latency_ms: float, log_path: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(harness.REPO), str(harness.BENCH_DIR)]),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "tests.support.scripted_llm", "--port", "0", "--latency-ms", f"{latency_ms:g}"]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*argv, "--responder", "modes_setup:responder"],
            cwd=harness.REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        m = re.search(r"listening on (\S+)", got[0] if got else "")
        if not m:
            self.stop()
            raise RuntimeError(f"the scripted server did not start (see {log_path})")
        self.base_url = m.group(1)
        self.root = self.base_url.rsplit("/v1", 1)[0]

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.root + path, timeout=60) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.root + "/_reset", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def stats(self) -> dict:
        return self._get("/_stats")

    def requests(self) -> list[dict]:
        return self._get("/_requests")["requests"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


_SERVICES = ("api", "billing", "auth", "search", "mailer", "scheduler", "gateway", "inventory")
_WORDS = (
    "request served from cache",
    "user session refreshed",
    "payment declined by issuer",
    "retrying upstream call after timeout",
    "queue depth above soft limit",
    "connection pool exhausted, waiting",
    "order shipped to warehouse",
    "token expired for client",
    "slow query on orders table",
    "disk usage at eighty percent",
    "config reloaded from file",
    "health check passed",
    "invoice rendered as pdf",
    "webhook delivery failed with status 502",
)
_WEIGHTS = {"ERROR": 6, "WARN": 14, "INFO": 68, "DEBUG": 12}


def _log_lines(rng: random.Random, n: int, file_no: int) -> list[str]:
    lines = []
    for i in range(n):
        level = rng.choices(LEVELS, weights=[_WEIGHTS[x] for x in LEVELS])[0]
        secs = file_no * 86_400 // LOG_FILES + i * 3
        stamp = f"2026-11-20T{secs // 3600 % 24:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}.{rng.randrange(1000):03d}Z"
        svc = rng.choice(_SERVICES)
        msg = rng.choice(_WORDS)
        extra = " ".join(f"k{j}={rng.randrange(10_000)}" for j in range(rng.randrange(0, 5)))
        lines.append(
            f"{stamp} {svc}-{rng.randrange(1, 9):02d} {svc}[{rng.randrange(1000, 9999)}]: {level} {msg} {extra}"
        )
    return [line.rstrip() for line in lines]


def _chunk_count(text: str) -> int:
    from rlm_workers.ingest.chunkers import chunk_text

    return len(chunk_text(text, path="x.log", chunker="fixed", chunk_size=LOG_CHUNK_SIZE, overlap=0))


def _write_logs(out: Path, files: int) -> None:
    """``files`` log files of exactly 250 fixed chunks each into ``out``; the first 40 the same whatever ``files``."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(11)
    for f in range(files):
        lines = _log_lines(rng, 1200, f)
        # the fewest lines that the fixed chunker cuts into LOG_CHUNKS_PER_FILE chunks (monotone in n)
        lo, hi = 1, len(lines)
        while lo < hi:
            mid = (lo + hi) // 2
            if _chunk_count("\n".join(lines[:mid]) + "\n") >= LOG_CHUNKS_PER_FILE:
                hi = mid
            else:
                lo = mid + 1
        text = "\n".join(lines[:lo]) + "\n"
        if _chunk_count(text) != LOG_CHUNKS_PER_FILE:
            raise RuntimeError(f"could not cut log file {f} into exactly {LOG_CHUNKS_PER_FILE} chunks")
        (out / f"service-{f:02d}.log").write_text(text)


def build_log_corpus(root: Path, files: int = LOG_FILES) -> tuple[Path, dict[str, int]]:
    """40 log files of exactly 250 fixed chunks each, and the number of lines written at each level; with
    ``files`` fewer, a folder of the first ``files`` of them (copies) and their counts; with more (up to
    ``MAX_LOG_FILES``), a folder of that many, the first 40 the same."""
    out = root / "corpus-logs"
    if not (out.is_dir() and len(list(out.glob("*.log"))) == LOG_FILES):
        _write_logs(out, LOG_FILES)
    if files > LOG_FILES:
        out = root / f"corpus-logs-{files}"
        if len(list(out.glob("*.log"))) != files:
            _write_logs(out, files)
    elif files < LOG_FILES:
        part = root / f"corpus-logs-{files}"
        part.mkdir(exist_ok=True)
        for p in sorted(out.glob("*.log"))[:files]:
            if not (part / p.name).exists():
                (part / p.name).write_text(p.read_text())
        out = part
    truth = dict.fromkeys(LEVELS, 0)
    for p in sorted(out.glob("*.log")):
        for line in p.read_text().splitlines():
            if lvl := line_level(line):
                truth[lvl] += 1
    return out, truth


def ensure_buffer(conn, data_dir: Path, name: str, corpus: Path, **chunking: Any) -> dict[str, Any]:
    """The buffer, loaded now if it is not there yet: its chunks, and how long its load took (kept in
    ``loads.json`` beside the data, so a later run can still say)."""
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.buffers import DEFAULT_TENANT, get_buffer

    ledger = data_dir / "loads.json"
    loads = json.loads(ledger.read_text()) if ledger.exists() else {}
    buf = get_buffer(conn, tenant=DEFAULT_TENANT, name=name)
    conn.commit()
    if buf is None:
        t0 = time.perf_counter()
        loaded = load_paths(conn, buffer=name, paths=[corpus], **chunking)
        conn.commit()
        loads[name] = {
            "seconds": time.perf_counter() - t0,
            "windows": loaded.windows_embedded,
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        ledger.write_text(json.dumps(loads, indent=1))
        print(f"loaded {loaded.chunks_written} chunks into {name!r} in {loads[name]['seconds']:.1f} s", flush=True)
    return {"chunks": harness.buffer_chunks(conn, name), "load": loads.get(name)}
