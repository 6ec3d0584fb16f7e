"""How often the offline answer quotes the line that answers, on installed packages' source (issue #26).

    .venv/bin/python bench/offline_answer.py [--corpus celery|httpx|click] [--code PATH] [--keep-servers]

Loads each corpus of tests/support/offline_gold.py (Celery's ``celery/app``, httpx, click: no held-out set, see
there) into its own buffer under bench/_data/offline-answer and asks each of its questions with ``rlm query
--mode instant --format json`` (no API key: the extractive provider), then prints three rates per corpus: the
gold line is the answer's first quote, it is among the passages the answer opens with, and the gold file is among
the result's sources.  ``--code`` runs the ``rlm`` of another checkout (a ``git worktree`` of an earlier commit)
over the same buffers and questions, for a before/after figure; the buffers are loaded by this checkout's code.
The answer quality to quote is bench/answer_eval.py's, on its held-out set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, isolated_env, stop_servers  # noqa: E402
from tests.support.offline_gold import CORPORA, first_quote  # noqa: E402


def rlm(code: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(code)}
    for var in ("RLM_API_KEY", "OPENAI_API_KEY"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *args], cwd=code, env=env, capture_output=True, text=True, check=False
    )


def ask(corpus, code: Path) -> None:
    buffer = corpus.buffer
    with tempfile.TemporaryDirectory() as tmp:
        out = rlm(REPO, "load", str(corpus.copy(Path(tmp))), "--buffer", buffer)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
    first = quoted = files = 0
    t0 = time.perf_counter()
    for gold in corpus.gold:
        out = rlm(code, "query", gold.question, "--buffer", buffer, "--mode", "instant", "--format", "json")
        if out.returncode != 0:
            raise SystemExit(f"{gold.question}: {out.stderr}")
        result = json.loads(out.stdout)
        quote = first_quote(result["response"])
        hit = gold.quoted_first(result["response"])
        found = gold.in_sources([s["path"] for s in result["sources"]])
        first += hit
        quoted += gold.quoted(result["response"])
        files += found
        print(f"{'ok  ' if hit else 'MISS'} {'file' if found else '----'} {gold.question}  →  {quote[:100]}")
    n = len(corpus.gold)
    print(
        f"\n{corpus.name} by {code}: first quote is the gold line {first}/{n} ({first / n:.0%}), the gold line is "
        f"quoted {quoted}/{n} ({quoted / n:.0%}), gold file in sources {files}/{n} ({files / n:.0%}); "
        f"{time.perf_counter() - t0:.0f} s for {n} questions\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", type=Path, default=REPO, help="checkout whose rlm answers (default: this one)")
    ap.add_argument("--keep-servers", action="store_true")
    ap.add_argument("--corpus", choices=sorted(CORPORA), action="append", help="default: every corpus")
    args = ap.parse_args()
    data_dir = isolated_env("offline-answer")
    try:
        for name in args.corpus or sorted(CORPORA):
            ask(CORPORA[name], args.code)
    finally:
        if not args.keep_servers:
            stop_servers(data_dir)


if __name__ == "__main__":
    main()
