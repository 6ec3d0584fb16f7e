"""Code mode against ``--scope all`` and ``auto`` on the aggregation sets (#44): accuracy, calls, tokens, wall time.

    python -m bench.code_mode local --set heldout [--modes code,all,auto] [--questions ID,...] [--rounds 4]
    python -m bench.code_mode scripted
    python -m bench.code_mode report bench/_data/code_mode_*.json --section ID --title T --what W --write

Each run saves its rows under bench/_data; ``report`` writes saved runs into one section of bench/RESULTS.md.

``local``: the default provider (the local model on this machine), one ``rlm query`` per question and mode
through the CLI with its in-process worker, as a user runs it.  The held-out set is the headline; it is never
used to tune anything (bench/aggregation_sets.py).

``scripted``: the machinery alone, on the dev set: the scripted OpenAI-protocol server plays a root model that
writes a reference program per question (``REFERENCE``) and a helper model that labels a remark by its words;
real worker processes run the stage, the sandbox and the sub-call chords.  Its accuracy is the pipeline's
exactness given a right program, not a model's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.aggregation_sets import DEV, HELDOUT, AggregationSet, Question, score
from bench.harness import (
    REPO,
    ScriptedRun,
    command_line,
    isolated_env,
    machine_line,
    machine_markdown,
    publish,
    revision,
    stop_servers,
)

SETS = {"dev": DEV, "heldout": HELDOUT}
MODES = {"code": ["--mode", "code"], "all": ["--scope", "all"], "auto": []}
RLM = str(Path(sys.executable).with_name("rlm"))

# --------------------------------------------------------------------------- local: the CLI and the local model


def load_set(data_dir: Path, s: AggregationSet, env: dict[str, str]) -> str:
    corpus = data_dir / "corpus" / s.name
    for rel, text in s.files.items():
        f = corpus / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    buffer = f"agg-{s.name}"
    subprocess.run([RLM, "load", str(corpus), "--buffer", buffer], env=env, check=True, capture_output=True)
    return buffer


def ask(q: Question, buffer: str, mode: str, env: dict[str, str], timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [RLM, "query", q.text, "--buffer", buffer, *MODES[mode], "--format", "json", "--timeout", str(timeout)],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    row = {"question": q.id, "mode": mode, "expected": q.answer, "wall_s": round(wall, 1), "exit": proc.returncode}
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        row |= {"correct": False, "error": proc.stderr.strip().splitlines()[-1:] or ["no output"]}
        return row
    row |= {
        "correct": score(q, result["response"]),
        "answer": " ".join(result["response"].split())[:160],
        "llm_calls": result["llm_calls"],
        "tokens": result["total_tokens"],
        "rounds": len(result.get("code_rounds") or []),
        "route": result.get("route"),
        "chunks": result.get("chunks_analyzed"),
    }
    if proc.returncode:
        row["error"] = proc.stderr.strip().splitlines()[-1:]
    return row


def run_local(args: argparse.Namespace) -> list[dict]:
    data_dir = isolated_env("code_mode")
    env = {**os.environ, "RLM_CODE_MAX_ROUNDS": str(args.rounds)}
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "RLM_API_KEY", "RLM_BASE_URL", "RLM_PROVIDER"):
        env.pop(var, None)  # the default provider: the local model
    s = SETS[args.set]
    buffer = load_set(data_dir, s, env)
    wanted = [q for q in s.questions if not args.questions or q.id in args.questions.split(",")]
    rows = []
    try:
        for q in wanted:
            for mode in args.modes.split(","):
                row = ask(q, buffer, mode, env, args.timeout)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if not args.keep_servers:
            stop_servers(data_dir)
    return rows


# --------------------------------------------------------------------------- scripted: the machinery, dev set

_PATH = "path = outline()['buffers'][0]['files'][0]['path']\nlines = read(path).splitlines()\n"
#: the scripted root model's program for each dev question (the dev set only: the held-out set has none)
REFERENCE = {
    "dev-failed-checkouts": "n = sum('action=checkout status=failed' in l for l in lines)\nfinal(f'{n}', [])",
    "dev-busiest-user": "import collections\n"
    "c = collections.Counter(re.search(r'user=(\\S+)', l).group(1) for l in lines)\n"
    "final(c.most_common(1)[0][0], [])",
    "dev-worst-day": "import collections\nc = collections.Counter(l[:10] for l in lines if 'status=failed' in l)\n"
    "final(c.most_common(1)[0][0], [])",
    "dev-refund-users": "n = len({re.search(r'user=(\\S+)', l).group(1) for l in lines if 'action=refund' in l})\n"
    "final(f'{n}', [])",
    "dev-checkout-pairs": "import collections\ng = collections.defaultdict(set)\nfor l in lines:\n"
    "    if 'action=checkout' in l:\n"
    "        g[(l[:10], re.search(r'region=(\\S+)', l).group(1))].add(re.search(r'user=(\\S+)', l).group(1))\n"
    "final(f'{sum(len(u) * (len(u) - 1) // 2 for u in g.values())}', [])",
    "dev-payment-failures": "notes = [l.split('note=', 1)[1] for l in lines if 'status=failed' in l]\n"
    "labels = llm_query_batched([['What caused it: payment, network or user?', n] for n in notes])\n"
    "final(f\"{sum(x == 'payment' for x in labels)}\", [])",
    "dev-frequent-logins": "import collections\n"
    "c = collections.Counter(re.search(r'user=(\\S+)', l).group(1) for l in lines if 'action=login' in l)\n"
    "final(f'{sum(v >= 5 for v in c.values())}', [])",
    "dev-ap-south": "final(f\"{sum('region=ap-south' in l for l in lines)}\", [])",
}
_PAYMENT = re.compile(r"declined|issuer|funds|gateway", re.I)


class ReferenceModel:
    """Code mode's root model writes the reference program of the question it is asked, its helper labels a
    remark; every other stage (the planner, analysts, synthesizer of ``--scope all`` and ``auto``) gets the
    pipeline's scripted model (tests/support/pipeline_model.py), which reads no meaning."""

    def __init__(self) -> None:
        from tests.support.pipeline_model import Model

        self.by_text = {q.text: REFERENCE[q.id] for q in DEV.questions}
        self.pipeline = Model()

    def __call__(self, req: dict):
        from tests.support.scripted_llm import Reply, last_user_message

        text = last_user_message(req)
        system = (req.get("messages") or [{}])[0].get("content") or ""
        if "writing Python programs" in system:
            asked = re.search(r"## Question\n\n(.*?)\n\n## ", req["messages"][1]["content"], re.S)
            program = _PATH + self.by_text.get(asked.group(1) if asked else "", "final('?', [])")
            return Reply.text(f"```python\nimport re\n{program}\n```", prompt_tokens=1500, completion_tokens=120)
        if req.get("model") == "analyst-model" and "## Question" not in text and "### Chunk" not in text:
            return Reply.text("payment" if _PAYMENT.search(text) else "other", prompt_tokens=80, completion_tokens=2)
        return self.pipeline(req)


def run_scripted(args: argparse.Namespace) -> list[dict]:
    run = ScriptedRun("code_mode_scripted", ReferenceModel(), {"RLM_CODE_MAX_ROUNDS": "3"}, ("RLM_RPM", "RLM_TPM"))
    workers = []
    rows = []
    try:
        corpus = run.data_dir / "corpus" / "dev"
        for rel, text in DEV.files.items():
            (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
            (corpus / rel).write_text(text)
        from rlm_workers.ingest.embed import get_embedder

        run.load("agg-dev", corpus, embedder=get_embedder())
        run.ready()
        workers = [run.worker("ctl", "rlm.control", 4), run.worker("an", "rlm.analyst", 16)]
        for w in workers:
            w.start()
        for q in DEV.questions:
            for mode in args.modes.split(","):
                row = _scripted_row(run, q, mode)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        run.stop(workers)
    return rows


#: the options each mode sends, as the CLI's flags of ``MODES`` do
_OPTIONS = {"code": {"mode": "code"}, "all": {"scope": "all"}, "auto": {}}


def _scripted_row(run: ScriptedRun, q: Question, mode: str) -> dict:
    from rlm_workers.models import QueryResult
    from rlm_workers.submit import submit_query, wait_for_job

    t0 = time.perf_counter()
    job_id, _ = submit_query(run.conn, tenant="local", query=q.text, buffers=["agg-dev"], options=_OPTIONS[mode])
    job = wait_for_job(run.conn, job_id, timeout=600)
    wall = time.perf_counter() - t0
    r = QueryResult.model_validate(job.result)
    return {
        "question": q.id,
        "mode": mode,
        "expected": q.answer,
        # the scripted analysts and synthesizer read no meaning: only code mode's answer is worth scoring here
        "correct": score(q, r.response) if mode == "code" else None,
        "answer": r.response[:80],
        "llm_calls": r.llm_calls,
        "tokens": r.total_tokens,
        "sub_calls": sum(x.sub_calls for x in r.code_rounds),
        "route": r.route,
        "chunks": r.chunks_analyzed,
        "wall_s": round(wall, 2),
    }


# --------------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    out = ["| mode | right | LLM calls | tokens | wall (s) |", "| --- | --- | --- | --- | --- |"]
    for m in modes:
        mine = [r for r in rows if r["mode"] == m]
        scored = [r["correct"] for r in mine if r["correct"] is not None]
        right = f"{sum(scored)}/{len(mine)}" if len(scored) == len(mine) else "n/a"
        calls = sum(r.get("llm_calls", 0) for r in mine)
        tokens = sum(r.get("tokens", 0) for r in mine)
        wall = sum(r["wall_s"] for r in mine)
        out.append(f"| {m} | {right} | {calls} | {tokens} | {wall:.0f} |")
    out += [
        "",
        "| question | mode | route | expected | right | calls | chunks read | wall (s) | answer (start) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        said = " ".join(str(r.get("answer") or r.get("error") or "").split()).replace("|", "\\|")[:70]
        out.append(
            f"| {r['question']} | {r['mode']} | {r.get('route') or '-'} | {r['expected']} | {_verdict(r['correct'])} | "
            f"{r.get('llm_calls', '-')} | {r.get('chunks', '-')} | {r['wall_s']} | {said} |"
        )
    return "\n".join(out)


def _verdict(correct: bool | None) -> str:
    return "n/a" if correct is None else "yes" if correct else "no"


def save(rows: list[dict], tag: str) -> Path:
    """The run's rows with what produced them, for ``report`` to publish."""
    out = REPO / "bench" / "_data" / f"code_mode_{tag}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {
        "command": command_line(),
        "revision": revision(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_line(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return out


def section(title: str, runs: list[dict], what: str) -> str:
    lines = [f"## {title} (`bench/code_mode.py`, issue #44)", ""]
    lines += [
        f"- command: `{r['meta']['command']}` at {r['meta']['revision']}; {r['meta']['date']}"
        + (f"; {r['meta']['machine']}" if r["meta"].get("machine") else "")
        for r in runs
    ]
    lines += [f"- {what}", ""]
    return "\n".join(lines) + "\n" + table([row for r in runs for row in r["rows"]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="the local model through the CLI")
    local.add_argument("--set", choices=sorted(SETS), default="heldout")
    local.add_argument("--modes", default="code,all,auto")
    local.add_argument("--questions", default="", help="comma-separated question ids (default: all)")
    local.add_argument("--rounds", type=int, default=4, help="RLM_CODE_MAX_ROUNDS for the runs")
    local.add_argument("--timeout", type=float, default=1800.0, help="seconds one query may take")
    local.add_argument("--keep-servers", action="store_true")
    scripted = sub.add_parser("scripted", help="the machinery with reference programs, dev set")
    scripted.add_argument("--modes", default="code,all,auto")
    report = sub.add_parser("report", help="publish saved runs as one section of bench/RESULTS.md")
    report.add_argument("runs", nargs="+", type=Path, help="bench/_data/code_mode_*.json files")
    report.add_argument("--section", required=True, help="the section's id in RESULTS.md")
    report.add_argument("--title", required=True)
    report.add_argument("--what", required=True, help="one line: what was run")
    report.add_argument("--write", action="store_true")
    args = p.parse_args()
    if args.command == "report":
        runs = [json.loads(f.read_text()) for f in args.runs]
        publish(args.section, section(args.title, runs, args.what), machine_markdown(), write=args.write)
        return
    if any(m not in MODES for m in args.modes.split(",")):
        p.error(f"--modes: each of {', '.join(MODES)}")
    if args.command == "local":
        rows = run_local(args)
        tag = f"local_{args.set}_{args.modes.replace(',', '-')}"
    else:
        rows = run_scripted(args)
        tag = "scripted"
    print(table(rows))
    print(f"saved {save(rows, tag)}")


if __name__ == "__main__":
    main()
