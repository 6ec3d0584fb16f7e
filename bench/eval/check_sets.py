"""Validate bench/eval/heldout.jsonl and bench/eval/dev.jsonl against freshly materialized corpora.

Run with the locked venv so the package corpora match:  .venv/bin/python bench/eval/check_sets.py
Prints per-corpus and per-kind counts; exits 1 on any problem.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import CORPORA, materialize  # noqa: E402

HERE = Path(__file__).resolve().parent
SETS: dict[str, set[str]] = {
    "heldout.jsonl": {"uvicorn", "readmes", "licenses", "invented-heldout"},
    "dev.jsonl": {"kombu", "invented-dev"},
}
KINDS = {"fact", "two-hop", "count"}
REQUIRED = ("id", "corpus", "question", "kind", "accept", "reject", "gold")
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()


def _compile(pattern: object, where: str, problems: list[str]) -> re.Pattern[str] | None:
    if not isinstance(pattern, str) or not pattern:
        problems.append(f"{where}: pattern must be a non-empty string, got {pattern!r}")
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        problems.append(f"{where}: bad regex {pattern!r}: {exc}")
        return None


def check_question(q: dict, root: Path, problems: list[str]) -> None:
    qid = q.get("id", "?")
    for key in REQUIRED:
        if key not in q:
            problems.append(f"{qid}: missing field {key!r}")
            return
    if q["kind"] not in KINDS:
        problems.append(f"{qid}: unknown kind {q['kind']!r}")
    if not isinstance(q["question"], str) or not q["question"].strip():
        problems.append(f"{qid}: empty question")
    answer = q.get("answer")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        problems.append(f"{qid}: 'answer' must be a non-empty string when present")
        answer = None

    gold_texts: list[str] = []
    gold_files: set[str] = set()
    if not isinstance(q["gold"], list) or not q["gold"]:
        problems.append(f"{qid}: gold must be a non-empty list")
    else:
        for g in q["gold"]:
            path, line, text = g.get("path"), g.get("line"), g.get("text")
            if not isinstance(path, str) or not isinstance(line, int) or not isinstance(text, str):
                problems.append(f"{qid}: malformed gold {g!r}")
                continue
            f = root / path
            if not f.is_file():
                problems.append(f"{qid}: gold path does not exist: {path}")
                continue
            lines = f.read_text(encoding="utf-8").split("\n")
            if not 1 <= line <= len(lines):
                problems.append(f"{qid}: gold line {line} out of range for {path} ({len(lines)} lines)")
                continue
            actual = lines[line - 1].strip()
            if actual != text.strip():
                problems.append(f"{qid}: {path}:{line} is {actual!r}, gold says {text!r}")
                continue
            gold_texts.append(actual)
            gold_files.add(path)
    if q["kind"] == "two-hop" and len(gold_files) < 2:
        problems.append(f"{qid}: two-hop question needs gold lines in at least two files, has {sorted(gold_files)}")

    accept = [_compile(p, f"{qid} accept", problems) for p in q["accept"]] if isinstance(q["accept"], list) else []
    reject = [_compile(p, f"{qid} reject", problems) for p in q["reject"]] if isinstance(q["reject"], list) else []
    if not accept:
        problems.append(f"{qid}: accept must be a non-empty list")
    for rx in accept:
        if rx is None:
            continue
        if not any(rx.search(t) for t in gold_texts) and answer is None:
            problems.append(f"{qid}: accept {rx.pattern!r} matches no gold line and there is no 'answer' (paraphrase)")
    if answer is not None:
        if not any(rx is not None and rx.search(answer) for rx in accept):
            problems.append(f"{qid}: no accept regex matches answer {answer!r}")
        for rx in reject:
            if rx is not None and rx.search(answer):
                problems.append(f"{qid}: reject {rx.pattern!r} matches answer {answer!r}")

    if q["kind"] == "count":
        # A count is only a count if the number itself is never written in the gold file(s).
        m = re.fullmatch(r"\s*(\d+)\b.*", answer or "", re.S)
        if not m:
            problems.append(f"{qid}: count question needs an 'answer' starting with the number")
        else:
            n = int(m.group(1))
            word = NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else None
            pat = re.compile(rf"(?<!\d)(?<!\d[.,]){n}(?!\d|[.,]\d)" + (rf"|\b{word}\b" if word else ""), re.IGNORECASE)
            for path in sorted(gold_files):
                hit = pat.search((root / path).read_text(encoding="utf-8"))
                if hit:
                    problems.append(f"{qid}: count {n} is written in {path} ({hit.group(0)!r})")


def main() -> int:
    problems: list[str] = []
    questions: list[tuple[str, dict]] = []
    for name, allowed in SETS.items():
        path = HERE / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not raw.strip():
                continue
            try:
                q = json.loads(raw)
            except json.JSONDecodeError as exc:
                problems.append(f"{name}:{lineno}: invalid JSON: {exc}")
                continue
            if q.get("corpus") not in CORPORA:
                problems.append(f"{name}:{lineno}: unknown corpus {q.get('corpus')!r}")
                continue
            if q["corpus"] not in allowed:
                problems.append(f"{name}:{lineno}: corpus {q['corpus']!r} does not belong in {name}")
            questions.append((name, q))

    ids = Counter(q.get("id") for _, q in questions)
    for qid, n in ids.items():
        if n > 1:
            problems.append(f"duplicate id {qid!r} ({n}x)")

    with tempfile.TemporaryDirectory() as tmp:
        roots: dict[str, Path] = {}
        for corpus in sorted({q["corpus"] for _, q in questions}):
            roots[corpus] = materialize(corpus, Path(tmp) / corpus)
        for _, q in questions:
            check_question(q, roots[q["corpus"]], problems)

    for name in SETS:
        per_corpus = Counter(q["corpus"] for n, q in questions if n == name)
        per_kind = Counter((q["corpus"], q.get("kind")) for n, q in questions if n == name)
        total = sum(per_corpus.values())
        print(f"{name}: {total} questions")
        for corpus, count in sorted(per_corpus.items()):
            kinds = ", ".join(f"{k} {per_kind[(corpus, k)]}" for k in sorted(KINDS) if per_kind[(corpus, k)])
            print(f"  {corpus:18} {count:3}  ({kinds})")

    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nall gold lines, ids and regexes check out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
