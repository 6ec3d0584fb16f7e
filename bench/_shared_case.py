"""The shared-reads case of ``bench/batch.py`` (``--case shared``): Q questions over one buffer, ``--scope all``.

    .venv/bin/python bench/batch.py --case shared [--questions 10] [--chunks 500] [--batch-size 10] [--no-write]

The same overnight batch runs twice on real workers against the scripted OpenAI-protocol server: once with
shared reads (``RLM_SHARED_READ_QUESTIONS`` = the question count, ``RLM_BATCH_PARALLEL`` likewise), once one by
one (``RLM_SHARED_READ_QUESTIONS=1``), the result cache emptied between them.  Reported from the logged calls
(``llm_calls``): analyst input tokens billed with and without sharing, the cached-token share, and the cost at
list prices (the scripted models priced as ``gpt-5-mini``) interactively and through the Batch API (its 50 %
discount on the same tokens).  Goals (issue #14): shared input ≤ 0.25× of one by one; overnight cost (shared,
Batch API) ≤ 0.3× of the items one by one interactively.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import _util

PRICE = [0.25, 0.025, 2.0]  # gpt-5-mini list prices, USD per 1M tokens: input, cached input, output
_CHUNK = re.compile(r"### Chunk (\d+)\n\n")
_QUESTION = re.compile(r"^### Question (\d+)$", re.M)


class Model:
    """Analyst: one short entry per (question, chunk); synthesizer: a fixed answer."""

    def __call__(self, req: dict):
        from tests.support.scripted_llm import last_user_message

        text = last_user_message(req)
        if req.get("model") == "analyst-model":
            ids = [int(c) for c in _CHUNK.findall(text)]
            qs = [int(q) for q in _QUESTION.findall(text)] or [None]
            out = [
                {
                    "chunk_id": c,
                    "relevance": "low",
                    "findings": [f"c{c}"],
                    "summary": "",
                    "follow_up": [],
                    "records": [],
                }
                | ({"question": q} if q else {})
                for q in qs
                for c in ids
            ]
            return json.dumps(out)
        return "## Answer\n\nA scripted answer [chunk 1]."


def _corpus(root: Path, chunks: int) -> Path:
    d = root / "shared-corpus"
    d.mkdir(parents=True, exist_ok=True)
    words = "tide marsh clock kelp glacier lantern orchard quarry harbour meadow".split()
    for i in range(chunks):
        w = words[i % len(words)]
        (d / f"note-{i:04d}.md").write_text(
            f"# Note {i}\n\nThe {w} survey of section {i} recorded {i % 17} findings about {w}s "
            f"and {words[(i + 3) % len(words)]}s, with remarks on method, weather and the tools used.\n"
        )
    return d


def run(args) -> None:
    data_dir = _util.isolated_env("batch-shared")
    from tests.support.scripted_llm import ScriptedLLM
    from tests.support.workers import WorkerProcess

    srv = ScriptedLLM(Model()).start()
    q = args.questions
    os.environ.update(
        {
            **_util.scripted_llm_env(srv.base_url, data_dir),
            "RLM_BATCH_PARALLEL": str(q),
            "RLM_BATCH_TICK_SECONDS": "0.5",
            "RLM_MAX_CHUNKS_PER_JOB": str(max(args.chunks, 1000)),
            "RLM_PRICES": json.dumps({m: PRICE for m in ("analyst-model", "synth-model", "plan-model")}),
        }
    )
    for var in ("RLM_API_KEY", "RLM_BASE_URL", "RLM_RPM", "RLM_TPM"):
        os.environ.pop(var, None)
    from rlm_workers.config import get_settings, reset_settings

    reset_settings()
    settings = get_settings()
    import redis

    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.local_servers import broker_url, database_url
    from rlm_workers.overnight.submit import submit_overnight
    from rlm_workers.store import overnight as store
    from rlm_workers.store.db import connect

    conn = connect(settings)
    load_paths(conn, buffer="shared-bench", paths=[_corpus(data_dir, args.chunks)])
    conn.commit()
    conn.autocommit = True
    os.environ["RLM_DATABASE_URL"] = database_url(settings)
    os.environ["RLM_BROKER_URL"] = broker_url(settings)
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    nonce = time.strftime("%H%M%S")
    queries = [f"Run {nonce}: which notes mention finding number {i}?" for i in range(q)]
    results = {}
    an = WorkerProcess("an", queues="rlm.analyst", env={}, log_dir=logs, concurrency=8).start()
    try:
        for label, per_read in (("shared", q), ("one by one", 1)):
            conn.execute("DELETE FROM result_cache")
            redis.Redis.from_url(broker_url(settings)).flushdb()
            ctl = WorkerProcess(
                f"ctl-{per_read}",
                queues="rlm.control",
                env={"RLM_SHARED_READ_QUESTIONS": str(per_read)},
                log_dir=logs,
                concurrency=4,
            ).start()
            try:
                srv.reset()
                t0 = time.time()
                batch_id, _ = submit_overnight(
                    conn,
                    tenant="local",
                    queries=queries,
                    buffers=["shared-bench"],
                    options={"scope": "all", "batch_size": args.batch_size, "skip_plan": True},
                )
                while store.get_overnight(conn, batch_id=batch_id).status != "done":
                    if time.time() - t0 > 3600:
                        raise RuntimeError(f"{label}: batch {batch_id} not done after an hour")
                    time.sleep(0.5)
                elapsed = time.time() - t0
            finally:
                ctl.stop()
            row = conn.execute(
                """SELECT sum(c.tokens_in) FILTER (WHERE c.stage = 'analyst'),
                          sum(c.cached_tokens) FILTER (WHERE c.stage = 'analyst'),
                          sum(c.tokens_in + c.tokens_out), sum(c.cost_usd), round(sum(1.0 / c.shared)),
                          count(DISTINCT i.item_no) FILTER (WHERE i.status = 'done')
                   FROM batch_items i JOIN llm_calls c ON c.job_id = i.job_id WHERE i.batch_id = %s""",
                (batch_id,),
            ).fetchone()
            results[label] = {
                "analyst_in": int(row[0] or 0),
                "cached": int(row[1] or 0),
                "tokens": int(row[2] or 0),
                "cost": float(row[3] or 0.0),
                "calls": int(row[4] or 0),
                "done": int(row[5] or 0),
                "seconds": elapsed,
            }
            print(label, results[label], flush=True)
    finally:
        an.stop()
        conn.close()
        srv.stop()
        if not args.keep_servers:
            _util.stop_servers(data_dir)
    sh, solo = results["shared"], results["one by one"]
    ratio = sh["analyst_in"] / solo["analyst_in"] if solo["analyst_in"] else float("nan")
    overnight = sh["cost"] * 0.5  # the Batch API bills the same tokens at half the list price
    cost_ratio = overnight / solo["cost"] if solo["cost"] else float("nan")
    md = "\n".join(
        [
            "## Shared reads across a batch's questions (`bench/batch.py --case shared`)",
            "",
            f"Command: `{_util.command_line()}`",
            "",
            _util.machine_markdown(),
            "",
            f"Setup: one overnight batch of {q} questions × 1 buffer of {args.chunks} chunks, `--scope all`, "
            f"`batch_size` {args.batch_size}, `skip_plan`; scripted OpenAI-protocol server (its usage counts ~4 "
            "characters a token and reports no prompt caching); the scripted models priced as gpt-5-mini "
            f"({PRICE[0]} / {PRICE[1]} / {PRICE[2]} USD per 1M tokens). Run twice on real workers: "
            f"`RLM_SHARED_READ_QUESTIONS={q}` and `=1`, result cache emptied between.",
            "",
            "| | shared | one by one |",
            "| --- | --- | --- |",
            f"| items done | {sh['done']} | {solo['done']} |",
            f"| LLM calls (HTTP) | {sh['calls']} | {solo['calls']} |",
            f"| analyst input tokens | {sh['analyst_in']:,} | {solo['analyst_in']:,} |",
            f"| cached-token share of analyst input | {sh['cached'] / max(1, sh['analyst_in']):.0%} | "
            f"{solo['cached'] / max(1, solo['analyst_in']):.0%} |",
            f"| all tokens | {sh['tokens']:,} | {solo['tokens']:,} |",
            f"| cost, interactive prices | ${sh['cost']:.4f} | ${solo['cost']:.4f} |",
            f"| cost through the Batch API (50 %) | ${overnight:.4f} | ${solo['cost'] * 0.5:.4f} |",
            f"| wall time | {sh['seconds']:.0f} s | {solo['seconds']:.0f} s |",
            "",
            f"Analyst input with sharing / one by one: **{ratio:.2f}×** (goal ≤ 0.25×). Overnight cost (shared, "
            f"Batch API) / the items one by one interactively: **{cost_ratio:.2f}×** (goal ≤ 0.3×).",
        ]
    )
    _util.publish("shared-reads", md, _util.machine_markdown(), write=not args.no_write)
