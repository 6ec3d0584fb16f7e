"""What ``bench/retrieval.py`` measures: encoding time, the rankings of each arm (BM25, semantic, their fusion)
and where the planted facts land in them, and the end-to-end runs through a real load and ``rlm search``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import
from retrieval_corpus import (  # noqa: E402
    ARMS,
    CHUNK_SIZE,
    CHUNKER,
    KS,
    OVERLAP,
    QTYPES,
    SEMANTIC_WEIGHT,
    Corpus,
    Vectors,
    window_vectors,
)
from retrieval_facts import FACTS  # noqa: E402


def time_encoding(emb, corpus: Corpus, specs: dict, rounds: int, wait_quiet: float) -> dict:
    """Encode seconds per setting for every 4th chunk's windows: best of interleaved rounds.

    On a shared 2-core box one timing is mostly noise; interleaving the settings gives
    each the same chances of a quiet moment, and the best round is the least disturbed.
    """
    sample = corpus.chunks[::4]
    texts = {label: [w for c in sample for w in emb.window_texts(c.text, spec)] for label, spec in specs.items()}
    emb.encode(texts[next(iter(texts))][:64])  # warm-up: first-call allocations are nobody's cost
    times: dict[str, list[float]] = {label: [] for label in texts}
    others, cpu0 = harness.OtherCpu(), time.process_time()
    labels = list(texts)
    busy = 0.0
    for r in range(max(1, rounds)):
        busy = max(busy, harness.wait_for_quiet(wait_quiet))
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            t0 = time.perf_counter()
            emb.encode(texts[label])
            times[label].append(time.perf_counter() - t0)
    out = {"chunks": len(sample), "rounds": max(1, rounds), "busy_before": busy}
    out["busy"] = others.share(time.process_time() - cpu0)
    out["best"] = {label: min(ts) for label, ts in times.items()}
    out["windows"] = {label: len(ts) for label, ts in texts.items()}
    print(f"encode timing ({len(sample)} chunks, best of {out['rounds']}): {out['best']}", flush=True)
    return out


def semantic_scores(v: Vectors, qvec):
    """Each chunk's best-window cosine with the query."""
    import numpy as np

    return np.maximum.reduceat(v.vecs @ qvec, v.starts)


def semantic_ranking(scores) -> list[int]:
    import numpy as np

    return [int(i) for i in np.argsort(-scores, kind="stable")]  # ties: lower chunk id first, like the SQL


def store_fetch(v: Vectors, qvec, limit: int, fanout: int) -> tuple[list[int], int]:
    """The semantic arm as ``search.semantic`` fetches it, but exact: the ``limit × fanout`` nearest windows,
    best per chunk, the first ``limit`` chunks; and how many distinct chunks those windows held."""
    import numpy as np

    sims = v.vecs @ qvec
    top = np.argsort(-sims, kind="stable")[: limit * fanout]
    owners = np.searchsorted(v.starts, top, side="right") - 1
    seen = list(dict.fromkeys(int(c) for c in owners))  # windows come best first, so first sight = best window
    return seen[:limit], len(seen)


def window_fanout() -> int:
    """Windows the store fetches per wanted chunk (a private constant of the semantic arm; 3 when written)."""
    try:
        from rlm_workers.search.semantic import _WINDOW_FANOUT

        return int(_WINDOW_FANOUT)
    except ImportError:
        return 3


def rrf(rankings: list[list[int]], weights: list[float]) -> list[int]:
    """Reciprocal Rank Fusion (k=60), the service's fusion before issue #29: kept for the weighted study."""
    score: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking, w in zip(rankings, weights, strict=True):
        for rank, c in enumerate(dict.fromkeys(ranking), start=1):
            score[c] = score.get(c, 0.0) + w / (60 + rank)
            best[c] = min(best.get(c, rank), rank)
    return sorted(score, key=lambda c: (-score[c], best[c], c))


def fused(
    lex: list[tuple[int, float]], dense: list[int], scores, k: int, semantic_weight: float | None = None
) -> list[int]:
    """service.rank's hybrid: each arm fetched at 2×k, fused by ``search.fusion.fused_top``; with a
    ``semantic_weight``, RRF with the semantic arm weighted so (not what the service does)."""
    from rlm_workers.search.fusion import fused_top

    if semantic_weight is not None:
        return rrf([[c for c, _ in lex[: 2 * k]], dense[: 2 * k]], [1.0, semantic_weight])[:k]
    return [c for c, _ in fused_top(lex[: 2 * k], [(c, float(scores[c])) for c in dense[: 2 * k]], k)]


def first_hit(ranking: list[int], holders: set[int]) -> int | None:
    """1-based rank of the first chunk holding the fact, or None."""
    return next((i + 1 for i, c in enumerate(ranking) if c in holders), None)


def evaluate(corpus: Corpus, v: Vectors, bm25, qvecs: dict, qtokens: dict) -> dict:
    """{qtype: {arm: {"ranks": [rank or None per fact], "r5": .., "r10": ..}}} plus score facts for calibration."""
    out: dict = {}
    fanout = window_fanout()
    for qt in QTYPES:
        # found: per k, which facts were in the top k (the runtime comparison names the ones that moved)
        arms: dict = {a: {"ranks": [], "hits5": 0, "hits10": 0, "found": {k: [] for k in KS}} for a in ARMS}
        # the same two arms with the store's window fan-out instead of every window
        arms |= {f"{a}/fanout": {"ranks": [], "hits5": 0, "hits10": 0, "short": 0} for a in ("semantic", "hybrid")}
        # hybrid with the semantic arm weighted up: not what the service does, what might reach the target
        arms["hybrid/weighted"] = {"ranks": [], "hits5": 0, "hits10": 0}
        cal: dict = {"hit": [], "nonhit": [], "nonhit10": []}
        for i, f in enumerate(FACTS):
            q = getattr(f, qt)
            holders = corpus.holders[i]
            lexs = bm25.top_k(qtokens[q], len(corpus.chunks))
            lex = [c for c, _ in lexs]
            scores = semantic_scores(v, qvecs[q])
            dense = semantic_ranking(scores)
            cal["hit"].append(max(float(scores[c]) for c in holders))
            wrong = [float(scores[c]) for c in dense[: len(holders) + 10] if c not in holders]
            cal["nonhit"].append(wrong[0])
            cal["nonhit10"].append(wrong[9])  # the score a fact chunk must beat to be in the top 10
            for arm, ranking in (("bm25", lex), ("semantic", dense)):
                r = first_hit(ranking, holders)
                arms[arm]["ranks"].append(r)
                for k in KS:
                    arms[arm]["found"][k].append(r is not None and r <= k)
            # a hybrid top 5 is not the head of its top 10: each k fuses arms fetched at 2×k
            r10 = first_hit(fused(lexs, dense, scores, 10), holders)
            r5 = first_hit(fused(lexs, dense, scores, 5), holders)
            arms["hybrid"]["ranks"].append(r10)
            arms["hybrid"]["found"][5].append(r5 is not None)
            arms["hybrid"]["found"][10].append(r10 is not None)
            for k in KS:
                sem, distinct = store_fetch(v, qvecs[q], k, fanout)
                hyb = fused(lexs, store_fetch(v, qvecs[q], 2 * k, fanout)[0], scores, k)
                arms["semantic/fanout"][f"hits{k}"] += first_hit(sem, holders) is not None
                arms["hybrid/fanout"][f"hits{k}"] += first_hit(hyb, holders) is not None
                arms["semantic/fanout"]["short"] += distinct < k  # fewer chunks than asked for
                weighted = fused(lexs, dense, scores, k, semantic_weight=SEMANTIC_WEIGHT)
                arms["hybrid/weighted"][f"hits{k}"] += first_hit(weighted, holders) is not None
        for a in arms.values():
            if "found" in a:
                a["hits5"], a["hits10"] = sum(a["found"][5]), sum(a["found"][10])
            a["r5"], a["r10"] = a["hits5"] / len(FACTS), a["hits10"] / len(FACTS)
        out[qt] = {"arms": arms, "cal": cal}
    return out


def fact_ranks(corpus: Corpus, v: Vectors, bm25, qvecs: dict, qtokens: dict) -> dict:
    """{qtype: {"semantic": [rank per fact], "hybrid": [...]}}: the fact chunk's rank in the exact semantic
    ranking and in the service's fusion of both whole rankings. Unlike recall, these move when a fact moves inside
    the top k."""
    from rlm_workers.search.fusion import fuse_arms

    out: dict = {}
    for qt in QTYPES:
        sem, hyb = [], []
        for i, f in enumerate(FACTS):
            q = getattr(f, qt)
            lex = bm25.top_k(qtokens[q], len(corpus.chunks))
            scores = semantic_scores(v, qvecs[q])
            dense = semantic_ranking(scores)
            sem.append(first_hit(dense, corpus.holders[i]))
            both = fuse_arms(lex, [(c, float(scores[c])) for c in dense])
            hyb.append(first_hit([c for c, _ in both], corpus.holders[i]))
        out[qt] = {"semantic": sem, "hybrid": hyb}
    return out


def compare_runtimes(
    corpus: Corpus, spec, ref: Vectors, ref_qvecs: dict, runtimes: list[str], bm25, qtokens: dict, wait_quiet: float
) -> dict:
    """Per runtime: torch's windows of ``spec`` encoded by it, the questions embedded by it, recall and fact ranks,
    and the cosine of its vectors to torch's (``ref``, ``ref_qvecs``) window by window and question by question.

    The ONNX runtimes are encoded on every run, never cached: what is compared is the export this checkout makes.
    """
    import numpy as np

    from rlm_workers.ingest.embed import get_embedder

    torch_emb = get_embedder(runtime="torch")
    texts = [w for c in corpus.chunks for w in torch_emb.window_texts(c.text, spec)]
    out: dict = {}
    for rt in runtimes:
        if rt == "torch":
            emb, v, qvecs = torch_emb, ref, ref_qvecs
        else:
            emb = get_embedder(runtime=rt)  # the first use of a runtime exports the model (cached on disk)
            harness.wait_for_quiet(wait_quiet)  # the encode is timed (a side fact in the table)
            # torch's windows, so every runtime's vectors pair up with the reference's one by one
            v = window_vectors(emb, corpus, spec, None, cut_with=torch_emb)
            qvecs = {q: emb.encode_query(q) for q in ref_qvecs}
        if v.n_windows != ref.n_windows:
            raise SystemExit(f"{rt}: {v.n_windows} windows, torch {ref.n_windows}: not the same windows")
        # the loader cuts with the runtime's own tokenizer: the comparison holds for it only if the cuts agree
        own_cut = sum(emb.window_texts(c.text, spec) != torch_emb.window_texts(c.text, spec) for c in corpus.chunks)
        wcos = np.einsum("ij,ij->i", v.vecs.astype(np.float64), ref.vecs.astype(np.float64))
        # int8 activations are quantized with one scale per batch, so a window's vector may depend on its
        # batch-mates: the same windows again, in batches of 64 in document order instead of sorted by length
        again = np.concatenate([emb.encode(texts[i : i + 64]) for i in range(0, len(texts), 64)])
        rcos = np.einsum("ij,ij->i", v.vecs.astype(np.float64), again.astype(np.float64))
        qcos = np.array([float(qvecs[q] @ ref_qvecs[q]) for q in ref_qvecs])
        out[rt] = {
            "vectors": v,
            "qvecs": qvecs,
            "eval": evaluate(corpus, v, bm25, qvecs, qtokens),
            "ranks": fact_ranks(corpus, v, bm25, qvecs, qtokens),
            "wcos": {"mean": float(wcos.mean()), "min": float(wcos.min()), "p1": float(np.percentile(wcos, 1))},
            "wcos_low": int((wcos < 0.99).sum()),
            "qcos": {"mean": float(qcos.mean()), "min": float(qcos.min())},
            "rebatch": {"mean": float(rcos.mean()), "min": float(rcos.min())},
            "own_cut_differs": own_cut,
        }
        ev = out[rt]["eval"]["paraphrase"]["arms"]
        print(
            f"runtime {rt:>9}: window cosine vs torch mean {wcos.mean():.4f} min {wcos.min():.4f}"
            f" | paraphrase @10 sem {ev['semantic']['r10']:.2f} hyb {ev['hybrid']['r10']:.2f}"
            f" | encode {v.meta.get('encode_s', float('nan')):.1f} s{' (cached)' if v.cached else ''}",
            flush=True,
        )
    return out


def run_e2e(corpus: Corpus, data_dir: Path, runtime: str) -> dict:
    """Load through the real loader on ``runtime``, ask through service.search (which embeds the query on the
    buffer's runtime): recalls and the top-k lists, and the window vectors the loader stored."""
    from rlm_workers.config import get_settings
    from rlm_workers.ingest.embed import get_embedder
    from rlm_workers.ingest.loader import load_paths
    from rlm_workers.ingest.windows import DEFAULT_WINDOWS
    from rlm_workers.search.service import search
    from rlm_workers.store.db import connect, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    label = DEFAULT_WINDOWS.label
    # The name carries the window label, the runtime and the corpus digest, so a buffer left by an
    # earlier run is reused only when it holds exactly these vectors.
    buffer = f"needles-{re.sub(r'[^A-Za-z0-9]+', '-', label)}-{runtime}-{corpus.digest}"
    root = data_dir / f"corpus-{corpus.digest}"
    root.mkdir(parents=True, exist_ok=True)
    for name, text in corpus.texts.items():
        if not (root / name).exists() or (root / name).read_text() != text:
            (root / name).write_text(text)
    conn = connect(settings, url=url)
    res: dict = {"buffer": buffer, "label": label, "runtime": runtime}
    try:
        t0 = time.perf_counter()
        rep = load_paths(
            conn,
            buffer=buffer,
            paths=[root],
            chunker=CHUNKER,
            chunk_size=CHUNK_SIZE,
            overlap=OVERLAP,
            embedder=get_embedder(runtime=runtime),
            embed_batch_size=settings.embed_batch_size,
            max_file_bytes=settings.max_file_bytes,
        )
        conn.commit()
        res["load"] = {
            "seconds": time.perf_counter() - t0,
            "files_loaded": rep.files_loaded,
            "files_unchanged": rep.files_unchanged,
            "chunks": rep.chunks_written,
            "windows": rep.windows_embedded,
        }
        # a reused buffer's load report is the one its first run wrote down
        memo = data_dir / f"{buffer}.load.json"
        if rep.files_loaded:
            memo.write_text(json.dumps(res["load"]))
        else:
            res["load"] = (json.loads(memo.read_text()) if memo.exists() else {"seconds": float("nan")}) | {
                "reused": True
            }
        print(f"e2e load: {res['load']}", flush=True)
        ref = {(c.essay, c.text): c.cid for c in corpus.chunks}
        res["stored"] = stored_vectors(conn, corpus, buffer, ref)
        for qt in QTYPES:
            arms: dict = {}
            for arm in ARMS:
                hits = {5: 0, 10: 0}
                lists: dict[int, list[list[int]]] = {k: [] for k in KS}
                for i, f in enumerate(FACTS):
                    q = getattr(f, qt)
                    for k in KS:
                        got = search(
                            conn,
                            settings=settings,
                            url=url,
                            tenant="local",
                            buffers=[buffer],
                            query=q,
                            mode=arm,
                            top_k=k,
                            threshold=-1,
                        )
                        ids = [ref.get((Path(h.path).name, h.text), -1) for h in got]
                        hits[k] += any(c in corpus.holders[i] for c in ids)
                        lists[k].append(ids)
                conn.rollback()
                arms[arm] = {f"r{k}": hits[k] / len(FACTS) for k in KS} | {"lists": lists}
                print(f"e2e {qt:>10} {arm:>8}: " + ", ".join(f"@{k} {hits[k]}/{len(FACTS)}" for k in KS), flush=True)
            res[qt] = arms
    finally:
        conn.close()
    return res


def stored_vectors(conn, corpus: Corpus, buffer: str, ref: dict) -> Vectors:
    """The window vectors the loader wrote (halfvec, batched as the loader batches), in the bench's chunk order."""
    import numpy as np

    from rlm_workers.store.buffers import get_buffer
    from rlm_workers.store.vectors import vector_table

    buf = get_buffer(conn, tenant="local", name=buffer)
    rows = conn.execute(
        f"SELECT c.path, c.text, v.win, v.embedding FROM {vector_table(buf.id)} v JOIN chunks c ON c.id = v.chunk_id"
    ).fetchall()
    conn.rollback()
    keyed = sorted((ref[(Path(path).name, text)], win, emb) for path, text, win, emb in rows)
    vecs = np.stack([np.asarray(e.to_numpy(), dtype=np.float32) for _, _, e in keyed])
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)  # pgvector's <=> is a cosine: half-precision rounding aside
    cids = np.asarray([c for c, _, _ in keyed], dtype=np.int64)
    starts = np.searchsorted(cids, np.arange(len(corpus.chunks)))
    return Vectors("stored", vecs, starts, len(vecs), {}, False)


def in_process_lists(corpus: Corpus, v: Vectors, bm25, qvecs: dict, qtokens: dict) -> dict:
    """The top-k chunk-id lists in-process, per qtype, arm and k, to compare with service.search's."""
    out: dict = {}
    for qt in QTYPES:
        out[qt] = {a: {k: [] for k in KS} for a in ARMS}
        for f in FACTS:
            q = getattr(f, qt)
            lexs = bm25.top_k(qtokens[q], 2 * max(KS))
            scores = semantic_scores(v, qvecs[q])
            dense = semantic_ranking(scores)
            for k in KS:
                out[qt]["bm25"][k].append([c for c, _ in lexs[:k]])
                out[qt]["semantic"][k].append(dense[:k])
                out[qt]["hybrid"][k].append(fused(lexs, dense, scores, k))
    return out


def compare_e2e(corpus: Corpus, e: dict, rt: dict, torch_vectors: Vectors, bm25, qtokens: dict) -> None:
    """Set e["same"]: how many of service.search's lists equal the exact in-process ones, over the runtime's
    vectors from the comparison ("vectors") and over the vectors the loader stored ("stored"); the second
    leaves only what the HNSW walk changes. Also the stored vectors' recall and cosine to torch's."""
    import numpy as np

    st: Vectors = e["stored"]
    refs = {"vectors": in_process_lists(corpus, rt["vectors"], bm25, rt["qvecs"], qtokens)}
    aligned = st.n_windows == torch_vectors.n_windows and np.array_equal(st.starts, torch_vectors.starts)
    if np.all(np.diff(np.append(st.starts, st.n_windows)) > 0):  # every chunk has windows: the ranking is defined
        refs["stored"] = in_process_lists(corpus, st, bm25, rt["qvecs"], qtokens)
        e["stored_eval"] = evaluate(corpus, st, bm25, rt["qvecs"], qtokens)
    if aligned:
        cos = np.einsum("ij,ij->i", st.vecs.astype(np.float64), torch_vectors.vecs.astype(np.float64))
        e["stored_cos"] = {"mean": float(cos.mean()), "min": float(cos.min()), "low": int((cos < 0.99).sum())}
    e["aligned"] = aligned
    e["same"] = {
        name: {
            qt: {
                arm: {
                    k: sum(a == b for a, b in zip(e[qt][arm]["lists"][k], lists[qt][arm][k], strict=True)) for k in KS
                }
                for arm in ARMS
            }
            for qt in QTYPES
        }
        for name, lists in refs.items()
    }
