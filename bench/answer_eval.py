"""Answer quality through the whole pipeline, over the evaluation sets of bench/eval, for any provider.

    .venv/bin/python bench/answer_eval.py --set dev|heldout [--provider extractive|local|openai] [--model NAME]
        [--modes direct,fanout,thinking] [--corpora a,b] [--ids id1,id2] [--limit N] [--timeout S]
        [--no-write] [--section NAME] [--jsonl OUT]

Every question runs as `rlm query` would run it behind a deployment: the
embedded PostgreSQL+pgvector and Valkey under bench/_data/answer_eval, real `rlm worker` processes (rlm.control,
rlm.analyst) and the shipped prompts, never the user's overrides. Providers: ``extractive`` (offline, no key),
``local`` (a model of ``rlm_workers.runtime.local_models.MODELS`` on this machine's local model server, as
``rlm up --local-llm`` runs it) and ``openai`` (whatever OPENAI_API_KEY / OPENAI_BASE_URL the shell holds;
``--model`` names the model of every stage).

A set is JSONL (bench/eval/<set>.jsonl): ``id``, ``corpus``, ``question``, ``kind`` (fact, two-hop, count),
``accept`` and ``reject`` (regular expressions), ``gold`` (``path`` relative to the corpus root, 1-based ``line``,
``text``). Each corpus of bench/eval/corpora.py is materialized once per run and loaded into a buffer named after
it; the load is skipped when the buffer exists and the files' content hash matches the stamp of the last load.

Modes: ``direct`` is mode instant (search + one call); ``fanout`` is mode auto with a batch size given, so a small
corpus still gets plan, analyst chord and synthesis; ``thinking`` is mode thinking at depth 1, asked only the
two-hop questions; ``auto`` is plain auto.

How an answer is judged (the same rules for every provider and set):

- **correct**: some ``accept`` pattern matches the answer (case-insensitive) and no ``reject`` pattern does; an
  empty answer, or a job that failed or ran out of time, is wrong. Citation markup (``[chunk N, path:10-58]``,
  ``chunk N``, ``path.py:12``) is taken out first, so a chunk id or line number is never read as the value.
- **cited right**: a source of the result, or a ``[chunk N]`` in the answer, is a chunk of a gold file whose lines
  (start_line..end_line) hold a gold line (for a two-hop question: any hop's).
- **correct and cited**: both.

Also measured per question, over the whole job tree (the root and its children): LLM calls, tokens (in + out),
replies that did not parse the first time (``llm_calls.parse_ok`` false), wall seconds, job status and route.

The held-out set measures; it never chooses. Rules, weights, prompts and thresholds are tuned on the dev set
only, the held-out questions are not read while changing any of them, and its figures are reported as they came.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(harness.REPO))  # tests.support.workers

TENANT = "local"
#: mode → query options; fanout's batch size keeps a fan-out where auto would answer a small corpus in one call
MODES: dict[str, dict[str, Any]] = {
    "direct": {"mode": "instant"},
    "fanout": {"mode": "auto", "batch_size": 4},
    "thinking": {"mode": "thinking", "depth": 1},
    "auto": {"mode": "auto"},
}
#: modes asked only some kinds of question: thinking is judged on two-hop questions
ONLY_KINDS = {"thinking": {"two-hop"}}
#: what the result's ``provider`` says when each provider answered (a local model said openai before RLM_PROVIDER)
ANSWERED_BY = {"extractive": {"extractive"}, "local": {"local", "openai"}, "openai": {"openai"}}
PARSE_OK_COLUMN = "SELECT 1 FROM information_schema.columns WHERE table_name = 'llm_calls' AND column_name = 'parse_ok'"
CHUNK_REF = re.compile(r"\bchunk (\d+)")
#: citation markup, taken out of an answer before it is judged: [chunk N, …], chunk N, path.ext:line(-line)
CITATION = re.compile(r"\[chunk [^\]]*\]|\bchunk \d+|\S+\.\w+:\d+(?:[-–]\d+)?")


@dataclass
class Outcome:
    """One question asked in one mode: what came back and how it was judged."""

    id: str
    corpus: str
    kind: str
    mode: str
    job_id: str
    status: str
    route: str | None
    seconds: float
    llm_calls: int
    tokens: int
    parse_failures: int
    jobs: int
    correct: bool = False
    cited: bool = False
    #: who the result says answered: extractive, local or openai
    provider: str | None = None
    answer: str = ""
    error: str | None = None
    cited_chunks: list[int] = field(default_factory=list)

    @property
    def both(self) -> bool:
        return self.correct and self.cited

    @property
    def failed(self) -> bool:
        return self.status != "done"


def judge(q: dict, answer: str) -> bool:
    text = CITATION.sub(" ", answer)  # "[chunk 7, a.md:1-5]" must not read as 7, 1 or 5
    if not text.strip() or not any(re.search(p, text, re.I) for p in q["accept"]):
        return False
    return not any(re.search(p, text, re.I) for p in q.get("reject", []))


def cites_gold(q: dict, chunk_ids: list[int], chunks: dict[int, tuple[str, int, int]]) -> bool:
    spans = [chunks[c] for c in chunk_ids if c in chunks]
    return any(p == g["path"] and lo <= g["line"] <= hi for p, lo, hi in spans for g in q["gold"])


def select(path: Path, args: argparse.Namespace) -> list[dict]:
    """The set's questions that --corpora and --ids keep; --limit N takes N spread over them (every kind keeps
    its share when the set is ordered by corpus or kind)."""
    qs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if args.corpora:
        qs = [q for q in qs if q["corpus"] in args.corpora.split(",")]
    if args.ids:
        wanted = args.ids.split(",")
        if missing := sorted(set(wanted) - {q["id"] for q in qs}):
            sys.exit(f"no such question in {path.name}: {', '.join(missing)}")
        qs = [q for q in qs if q["id"] in wanted]
    if args.limit and args.limit < len(qs):
        step = len(qs) / args.limit
        qs = [qs[int(i * step)] for i in range(args.limit)]
    return qs


def import_corpora(eval_dir: Path):
    spec = importlib.util.spec_from_file_location("answer_eval_corpora", eval_dir / "corpora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def content_hash(root: Path) -> str:
    """Every file's path and bytes, in order: what was loaded, without the mtimes a fresh materialization changes."""
    h = hashlib.sha256(root.name.encode())
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            h.update(f"\0{p.relative_to(root)}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def prepare_corpus(conn: Any, name: str, corpora: Any, base: Path) -> dict[int, tuple[str, int, int]]:
    """Materialize and (if changed) load one corpus into buffer ``name``; its chunks: id → (path, first, last line)."""
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths

    dest, stamp = base / name, base / f"{name}.stamp"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    root = Path(corpora.materialize(name, dest))
    digest = content_hash(root)
    loaded = conn.execute("SELECT 1 FROM buffers WHERE tenant = %s AND name = %s", (TENANT, name)).fetchone()
    if loaded and stamp.exists() and stamp.read_text() == digest:
        print(f"corpus {name}: buffer loaded already, content unchanged", flush=True)
    else:
        t0 = time.time()
        report = load_paths(conn, buffer=name, paths=[root], embedder=get_embedder())
        conn.commit()
        stamp.write_text(digest)
        print(f"corpus {name}: loaded {report.files_seen} files in {time.time() - t0:.0f} s", flush=True)
    rows = conn.execute(
        "SELECT c.id, c.path, c.start_line, c.end_line FROM chunks c JOIN buffers b ON b.id = c.buffer_id "
        "WHERE b.tenant = %s AND b.name = %s",
        (TENANT, name),
    ).fetchall()
    conn.commit()
    # stored paths start with the loaded directory's name; gold paths are relative to it
    return {cid: (path.split("/", 1)[-1], lo, hi) for cid, path, lo, hi in rows}


def ask(conn: Any, q: dict, mode: str, chunks: dict, timeout: float, parse_failed: str) -> Outcome:
    from rlm_workers.models import QueryResult
    from rlm_workers.submit import cancel_query, submit_query, wait_for_job

    t0 = time.time()
    job_id, _ = submit_query(conn, tenant=TENANT, query=q["question"], buffers=[q["corpus"]], options=MODES[mode])
    try:
        job = wait_for_job(conn, job_id, timeout=timeout)
        status = job.status
    except TimeoutError:
        cancel_query(conn, job_id=job_id, tenant=TENANT)
        job, status = None, "timeout"
    seconds = time.time() - t0
    tree = [r[0] for r in conn.execute("SELECT id FROM jobs WHERE id = %s OR root_id = %s", (job_id, job_id))]
    calls, tokens, bad = conn.execute(
        f"SELECT count(*), coalesce(sum(tokens_in + tokens_out), 0), count(*) FILTER (WHERE {parse_failed}) "
        "FROM llm_calls WHERE job_id = ANY(%s)",
        (tree,),
    ).fetchone()
    route = conn.execute("SELECT route FROM jobs WHERE id = %s", (job_id,)).fetchone()[0]
    out = Outcome(q["id"], q["corpus"], q["kind"], mode, job_id, status, route, seconds, calls, tokens, bad, len(tree))
    if job is None:
        out.error = f"no answer after {timeout:.0f} s (cancelled)"
    elif job.result is None:
        out.error = (job.error or {}).get("message") or f"no result ({job.status})"
    else:
        result = QueryResult.model_validate(job.result)
        out.answer, out.provider = result.response, result.provider
        out.cited_chunks = sorted(
            {s.chunk_id for s in result.sources} | {int(n) for n in CHUNK_REF.findall(out.answer)}
        )
        out.correct = status == "done" and judge(q, out.answer)
        out.cited = cites_gold(q, out.cited_chunks, chunks)
    return out


def _frac(outs: list[Outcome], attr: str) -> str:
    return f"{sum(getattr(o, attr) for o in outs)}/{len(outs)}"


def _breakdown(outs: list[Outcome], key: str) -> str:
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for o in outs:
        groups[getattr(o, key)].append(o)
    return "; ".join(
        f"{g} {_frac(v, 'correct')} correct, {_frac(v, 'cited')} cited, {_frac(v, 'both')} both"
        for g, v in sorted(groups.items())
    )


def _verdict(o: Outcome) -> str:
    return f"{'correct' if o.correct else 'wrong'}, {'cited' if o.cited else 'not cited'}"


def _gist(o: Outcome) -> str:
    if o.failed:
        return f"job {o.status}: {(o.error or '')[:160]}"
    text = " ".join(o.answer.split())
    return text[:160] if text else "(empty)"


def report(meta: dict[str, str], questions: list[dict], results: dict[str, list[Outcome]]) -> str:
    kinds = Counter(q["kind"] for q in questions)
    head = ", ".join(f"{mode} {_frac(outs, 'both')}" for mode, outs in results.items())
    lines = [
        f"## Answer quality: {meta['set']} set, {' '.join(filter(None, (meta['provider'], meta['model'])))} "
        "(`bench/answer_eval.py`)",
        "",
        f"{harness.machine_line()}.",
        "",
        f"Command: `{harness.command_line()}` at {harness.revision()}. Questions of `{meta['path']}`: {len(questions)} "
        f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}) over {len({q['corpus'] for q in questions})} "
        "corpora; thinking is asked the two-hop ones only. The judging rules are in the bench's docstring.",
        "",
        f"**Correct and cited: {head}.**",
        "",
        "| set | provider | model | mode | questions | correct | cited right | correct and cited | parse failures "
        "| failed jobs | LLM calls | tokens | wall per question (median / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, outs in results.items():
        walls = [o.seconds for o in outs] or [0.0]
        cells = [meta["set"], meta["provider"], meta["model"] or "—", mode, len(outs)]
        cells += [_frac(outs, "correct"), _frac(outs, "cited"), _frac(outs, "both")]
        cells += [sum(o.parse_failures for o in outs), sum(o.failed for o in outs), sum(o.llm_calls for o in outs)]
        cells += [f"{sum(o.tokens for o in outs):,}", f"{statistics.median(walls):.1f} s / {max(walls):.1f} s"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append("")
    for mode, outs in results.items():
        lines.append(f"- {mode}, by corpus: {_breakdown(outs, 'corpus')}. By kind: {_breakdown(outs, 'kind')}.")
    expected = ANSWERED_BY[meta["provider"]] | {None}
    if wrong := sorted({o.provider for outs in results.values() for o in outs if o.provider not in expected}):
        lines += ["", f"**Warning:** some answers came from the {', '.join(wrong)} provider, not {meta['provider']}."]
    for mode, outs in results.items():
        if misses := [o for o in outs if not o.both]:
            lines += ["", f"Not correct and cited in {mode}:", ""]
            lines += [f"- `{o.id}` ({_verdict(o)}) → {_gist(o)}" for o in misses]
    return "\n".join(lines)


def use_provider(args: argparse.Namespace) -> str:
    """Point this process and the workers it starts at the provider; the model label for the report."""
    from rlm_workers.config import get_settings, reset_settings

    for var in ("RLM_PROVIDER", "RLM_LOCAL_LLM"):
        os.environ.pop(var, None)
    if args.provider != "openai":
        for var in ("OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL"):
            os.environ.pop(var, None)
    # said outright where RLM_PROVIDER is known (its `auto` may pick a local model); older code ignores it
    os.environ["RLM_PROVIDER"] = args.provider
    label = args.model or ""
    if args.provider == "openai":
        if not (os.environ.get("OPENAI_API_KEY") or os.environ.get("RLM_API_KEY")):
            sys.exit("--provider openai needs OPENAI_API_KEY (and OPENAI_BASE_URL for another server)")
        for var in ("RLM_PRIMARY_MODEL", "RLM_SUBCALL_MODEL", "RLM_SYNTHESIZER_MODEL"):
            if args.model:
                os.environ[var] = args.model
        reset_settings()
        label = label or get_settings().primary_model
    elif args.provider == "local":
        from rlm_workers.runtime.local_llm import endpoint, resolve_model, setup

        if args.model:  # every stage this model; without one, each stage its default (RLM_*_MODEL may name others)
            os.environ["RLM_LOCAL_LLM"] = resolve_model(args.model).name
        reset_settings()
        s = get_settings()
        for name in s.local_models:
            setup(s.resolved_local_llm_dir, resolve_model(name), say=print)
        endpoint(s)  # started here; the workers find it through the data dir, as every process does
        label = f"plan {s.primary_model}, analysts {s.subcall_model}, synthesis {s.synthesizer_model}"
        if len(s.local_models) == 1:
            label = s.local_models[0]
    reset_settings()
    return label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", required=True, choices=("dev", "heldout"))
    ap.add_argument("--provider", default="extractive", choices=("extractive", "local", "openai"))
    ap.add_argument(
        "--model", help="local: a name of rlm_workers.runtime.local_models.MODELS; openai: every stage's model"
    )
    ap.add_argument("--modes", default="direct,fanout,thinking", help=f"of {', '.join(MODES)}")
    ap.add_argument("--corpora", help="only these corpora (comma-separated)")
    ap.add_argument("--ids", help="only these question ids (comma-separated)")
    ap.add_argument("--limit", type=int, help="at most N questions, spread over the set")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds one question may take")
    ap.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    ap.add_argument("--section", help="the RESULTS.md section (default answer_eval_<set>_<provider>[_<model>])")
    ap.add_argument("--jsonl", type=Path, help="also write one line per question asked, answer included")
    ap.add_argument(
        "--eval-dir", type=Path, default=harness.BENCH_DIR / "eval", help="where the sets and corpora.py are"
    )
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"unknown mode {unknown[0]!r}: one of {', '.join(MODES)}")
    set_path = args.eval_dir / f"{args.set}.jsonl"
    questions = select(set_path, args)
    if not questions:
        sys.exit("no question left to ask")
    corpora = import_corpora(args.eval_dir)

    # a run stopped with SIGTERM (kill, a timeout) still stops its workers and servers in the finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data_dir = harness.isolated_env("answer_eval")
    os.environ["RLM_PROMPT_DIR"] = str(data_dir / "prompts")  # the shipped prompts, never the user's overrides
    from rlm_workers.config import get_settings
    from rlm_workers.runtime.local_llm import stop_server
    from rlm_workers.store.db import connect
    from tests.support.workers import WorkerProcess

    conn = workers = None
    out_file = args.jsonl.open("w") if args.jsonl else None
    try:
        model = use_provider(args)
        settings = get_settings()
        path = set_path.resolve()
        path = path.relative_to(harness.REPO) if path.is_relative_to(harness.REPO) else path
        meta = {"set": args.set, "provider": args.provider, "model": model, "path": str(path)}
        section = args.section or "_".join(
            ["answer_eval", args.set, args.provider] + ([args.model] if args.model else [])
        )
        harness.hand_services_to_workers(settings)
        conn = connect(settings)
        base = data_dir / "corpora"
        chunks = {name: prepare_corpus(conn, name, corpora, base) for name in {q["corpus"]: 0 for q in questions}}
        conn.autocommit = True
        has_parse_ok = conn.execute(PARSE_OK_COLUMN).fetchone()
        parse_failed = "parse_ok = false" if has_parse_ok else "status = 'retried'"
        analysts = {"local": settings.local_llm_parallel, "extractive": 4}.get(args.provider, 8)
        logs = harness.log_dir(data_dir)
        workers = [
            WorkerProcess("ctl", queues="rlm.control", env={}, log_dir=logs, concurrency=2),
            WorkerProcess("an", queues="rlm.analyst", env={}, log_dir=logs, concurrency=analysts),
        ]
        for w in workers:
            w.start()
        results: dict[str, list[Outcome]] = {}
        for mode in modes:
            asked = [q for q in questions if q["kind"] in ONLY_KINDS.get(mode, {q["kind"]})]
            if not asked:
                print(f"{mode}: no question of the kinds it is asked ({', '.join(ONLY_KINDS[mode])})", flush=True)
                continue
            results[mode] = outs = []
            for i, q in enumerate(asked, 1):
                o = ask(conn, q, mode, chunks[q["corpus"]], args.timeout, parse_failed)
                outs.append(o)
                print(
                    f"{o.id} {mode} [{i}/{len(asked)}]: {_verdict(o)}, {o.status}, route {o.route}, {o.seconds:.1f} s",
                    flush=True,
                )
                if out_file:
                    row = {"set": args.set, "provider": args.provider, "model": model, **asdict(o)}
                    out_file.write(json.dumps({**row, "correct_and_cited": o.both}) + "\n")
                    out_file.flush()
            # rewritten after each mode: a long run stopped half-way keeps what it measured
            harness.publish(
                section, report(meta, questions, results), harness.machine_markdown(), write=not args.no_write
            )
    finally:
        if out_file:
            out_file.close()
        for w in workers or []:
            w.stop()
        if conn is not None:
            conn.close()
        if args.provider == "local":
            stop_server(get_settings().data_dir)
        harness.stop_servers(data_dir)


if __name__ == "__main__":
    main()
