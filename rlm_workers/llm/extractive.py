"""The offline provider: what answers when no model is configured.  No model reads or writes anything here.

It never reads the prompt: each stage puts what it rendered into its prompt on the request too
(``CompletionRequest.stage_input``, ``llm/stage_input.py``), and from that record it:

- plans a ``hybrid`` search, the question's own words as its focus;
- cuts each chunk into passages (a line with the next line of its paragraph), ranks them against the question
  by BM25 over the passages and by the cosine of the local embedding model (the query encoder the search
  uses), fuses the two rankings by Reciprocal Rank Fusion, and quotes the best verbatim with file:line;
- grades a chunk by its best passage: how it ranks against the message's best, and how much of the question
  it holds, in words or (by the encoder) in meaning;
- writes the direct answer and the synthesizer's report as the best-matching passages, cited, every one
  saying that no model wrote it;
- checks completeness: what the best passages say beyond the question is followed up;
- counts typed records when asked (``pipeline/record_lines.py``).

Nothing here executes or obeys chunk text: it is tokenised, embedded and measured, and quoted with markdown's
tag and line-break characters escaped, so it shows rather than acts.  Tokens are 0: none were bought.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ..config import get_settings
from ..errors import LLMError
from ..ingest.embed import get_embedder, resolve_runtime
from ..models import RELEVANCE_RANK, Record
from ..pipeline.record_lines import extract_records
from ..pipeline.records import aggregate, records_markdown, stem_terms
from ..pipeline.replies import cited_chunk_ids
from ..provenance import cite_of, page_span
from ..search.service import query_vector
from ..search.tokenize import tokenize
from .protocol import Completion, CompletionRequest
from .stage_input import ChunkForPrompt, DirectInput, FindingsInput, PlanInput, Question, ReadInput, ShownFinding

__all__ = ["ExtractiveProvider", "check_by_rules", "direct_answer", "extract_records", "write_report"]
log = logging.getLogger("rlm.llm.extractive")

MODEL = "extractive"
#: quotes per chunk in an analyst's findings, and their length
MAX_QUOTES = 3
MAX_QUOTE_CHARS = 400
#: cited passages in a report (one per chunk, strongest first); the rest are only counted
MAX_REPORT_PASSAGES = 8
#: lines in a passage: a sentence or a statement often runs on to the next line
WINDOW = 2
#: Reciprocal Rank Fusion's constant (Cormack et al.), and the passages embedded per message at most
RRF_K = 60
MAX_EMBEDDED = 320
MAX_EMBED_CHARS = 240
#: a chunk's grade: its best passage's fused score as a share of the message's best, and how much of the
#: question it holds (``_evidence``)
HIGH_SHARE, MEDIUM_SHARE = 0.8, 0.6
HIGH_EVIDENCE, MEDIUM_EVIDENCE = 0.6, 0.35
#: cosines of the default encoder (all-MiniLM-L6-v2) that mean "unrelated" and "says the same"
UNRELATED, SAME = 0.3, 0.8
#: a chunk's other quotes: passages scoring this share of its best
KEEP_SHARE = 0.8
MAX_FOLLOW_UPS, MAX_FOLLOW_UP_WORDS, MAX_GAPS = 3, 6, 5

_QUOTE = re.compile(r'^"(.*)" \([^()\n]*\)$', re.S)  # a finding as written here: "quote" (file:line)
_MD_HTML = re.compile(r"<(?=[/!?A-Za-z])")  # what markdown would take for HTML
_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD = re.compile(r"\w+")


def _md_text(text: str) -> str:
    """Document text for one line of markdown: as written, but a tag escaped and no line break."""
    return _MD_HTML.sub(r"\\<", _LINE_BREAKS.sub(" ", text))


def _clip(s: str, n: int = MAX_QUOTE_CHARS) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _source(c: ChunkForPrompt | ShownFinding) -> str:
    """``buffer:path:12-30``, or ``buffer:spec.pdf p. 4–5 § Transport`` for a document."""
    return _md_text(cite_of(c, f"{c.buffer}:{c.path}"))


def _place(c: ChunkForPrompt, line: int) -> str:
    """Where a quoted line is, ``a.txt:105``; a converted document's pages instead, ``spec.pdf p. 4``."""
    pages = page_span(c.page_start, c.page_end)
    return f"{c.path} {pages}" if pages else f"{c.path}:{c.start_line + line}"


def _passages(text: str) -> list[tuple[int, str]]:
    """A chunk's candidate passages: each non-blank line with the next WINDOW-1 lines of its paragraph, and its
    0-based line."""
    lines = [ln.strip() for ln in text.split("\n")]
    out = []
    for i, line in enumerate(lines):
        if line:
            more = [x for x in lines[i + 1 : i + WINDOW]]
            more = more[: more.index("")] if "" in more else more
            out.append((i, " ".join([line, *more])))
    return out


_encoder_failed = False


def _meaning(query: str, texts: Sequence[str]) -> list[float] | None:
    """Cosine of each text to the query by the buffers' embedding model (local: nothing leaves the machine),
    identifiers read as words (``max_size`` → "max size"); None where no encoder can be had."""
    global _encoder_failed
    if _encoder_failed or not texts:
        return None
    try:
        model = get_settings().embedding_model
        runtime = resolve_runtime(model)
        qvec = query_vector(model, query, runtime)
        readable = [_CAMEL.sub(" ", t[:MAX_EMBED_CHARS]).replace("_", " ") for t in texts]
        return [float(x) for x in np.asarray(get_embedder(model, runtime).encode(readable)) @ np.asarray(qvec)]
    except Exception as exc:  # no model files, no runtime: rank by words, and say so once
        _encoder_failed = True
        log.warning("the offline provider ranks passages by words only: no embedding model (%s)", exc)
        return None


def _rank(query: str, texts: Sequence[str]) -> tuple[list[float], list[float]]:
    """Per passage (given best-first by search rank): its fused score (RRF of its BM25 and cosine ranks) and its
    evidence, the share of the question it holds (its distinct words, or its meaning by the encoder)."""
    q = list(dict.fromkeys(stem_terms(query)))
    docs = [stem_terms(t) for t in texts]
    n, avg = len(docs), sum(map(len, docs)) / max(1, len(docs)) or 1.0
    df = Counter(t for d in docs for t in set(d))
    idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in q}
    lexical, cover = [], []
    for d in docs:
        tf, norm = Counter(d), 1.2 * (0.25 + 0.75 * len(d) / avg)
        lexical.append(sum(idf[t] * tf[t] * 2.2 / (tf[t] + norm) for t in q if tf[t]))
        cover.append(sum(1 for t in q if tf[t]) / (len(q) or 1))
    worded = sorted((i for i in range(n) if lexical[i] > 0), key=lambda i: -lexical[i])
    shortlist = list(dict.fromkeys(worded[: MAX_EMBEDDED // 2] + list(range(n))))[:MAX_EMBEDDED]
    sims = dict(zip(shortlist, _meaning(query, [texts[i] for i in shortlist]) or [], strict=False))
    fused = [0.0] * n
    for ranking in (worded, sorted(sims, key=lambda i: -sims[i])):
        for r, i in enumerate(ranking):
            fused[i] += 1 / (RRF_K + r + 1)
    meant = [min(1.0, max(0.0, (sims.get(i, 0.0) - UNRELATED) / (SAME - UNRELATED))) for i in range(n)]
    return fused, [max(c, m) for c, m in zip(cover, meant, strict=True)]


def _grade(share: float, evidence: float) -> str:
    if share >= HIGH_SHARE and evidence >= HIGH_EVIDENCE:
        return "high"
    if share >= MEDIUM_SHARE and evidence >= MEDIUM_EVIDENCE:
        return "medium"
    return "low" if evidence > 0 else "none"


def _analysed(query: str, chunks: Sequence[ChunkForPrompt]) -> list[tuple[dict, float]]:
    """An analyst's entry per chunk, with its best passage's fused score: the chunk's passages ranked together
    with every other passage of the message, its best few quoted."""
    cut = [(c, line, text) for c in chunks for line, text in _passages(c.text)]
    fused, evidence = _rank(query, [text for _c, _line, text in cut])
    top = max(fused, default=0.0) or 1.0
    out = []
    for chunk in chunks:
        mine = sorted((-fused[i], line, i) for i, (c, line, _t) in enumerate(cut) if c is chunk)
        if not mine or evidence[mine[0][2]] <= 0:  # nothing of the question in it: nothing to quote
            out.append(({"chunk_id": chunk.chunk_id, "relevance": "none", "findings": [], "summary": ""}, 0.0))
            continue
        best, quotes, used = -mine[0][0], [], set()
        for score, line, i in mine:
            if len(quotes) < MAX_QUOTES and -score >= KEEP_SHARE * best and not used & {line - 1, line, line + 1}:
                quotes.append(f'"{_clip(cut[i][2])}" ({_place(chunk, line)})')
                used.add(line)
        grade = _grade(best / top, evidence[mine[0][2]])
        summary = f"Best-matching passage at line {chunk.start_line + mine[0][1]} (no model read it)."
        out.append(({"chunk_id": chunk.chunk_id, "relevance": grade, "findings": quotes, "summary": summary}, best))
    return out


_DISCLAIMER = (
    "_No model wrote this: the offline extractive provider quotes the passages whose words and meaning (by the "
    "local embedding model) best match the question, verbatim; no language model interpreted them. Set "
    "OPENAI_API_KEY (and OPENAI_BASE_URL for a compatible server) for a written answer._"
)


def _answer_lines(query: str, entries: list[tuple[int, str, str, list[str]]], totals: str | None) -> list[str]:
    """The best passage, the exact totals if any, and the evidence: one cited passage per chunk, best first."""
    cid, source, _grade, quotes = entries[0]
    lines = ["## Answer", "", f"No model: the best-matching passages for “{_md_text(_clip(query, 200))}”.", ""]
    lines += [f"The best is in chunk {cid} ({source}):", "", f"> {quotes[0]}"]
    lines += ["", totals] if totals else []
    shown = entries[:MAX_REPORT_PASSAGES]
    lines += ["", "## Evidence", ""] + [f"- {q[0]} — [chunk {c}, {s}] ({g})" for c, s, g, q in shown]
    if len(entries) > len(shown):
        lines += ["", f"{len(entries) - len(shown)} more chunks with findings are listed in the result's sources."]
    return lines


def write_report(shown: FindingsInput) -> str:
    """The synthesizer's report: the findings' first quotes ranked against the question, by grade first."""
    found = [f for f in shown.findings if f.findings]
    if not found:
        return f"## No relevant findings\n\nNothing in the analysed chunks answers “{_md_text(shown.query)}”."
    fused, _ = _rank(shown.query, [(_QUOTE.match(f.findings[0]) or [0, f.findings[0]])[1] for f in found])
    order = sorted(range(len(found)), key=lambda i: (-RELEVANCE_RANK.get(found[i].relevance, 0), -fused[i]))
    entries = [
        (f.chunk_id, _source(f), f.relevance, [_md_text(x) for x in f.findings]) for f in map(found.__getitem__, order)
    ]
    return "\n".join([*_answer_lines(shown.query, entries, None), "", _DISCLAIMER])


def analyst_reply(chunks: Sequence[ChunkForPrompt], question: Question) -> list[dict]:
    """The analyst's entries; when the question wants records, every entry (even one graded none) has them."""
    entries = [entry for entry, _score in _analysed(question.query, chunks)]
    for entry, chunk in zip(entries, chunks, strict=True):
        entry["follow_up"] = []
        if question.records_wanted:
            entry["records"] = extract_records(chunk.text, f"{chunk.buffer}:{chunk.path}")
    return entries


def shared_analyst_reply(read: ReadInput) -> list[dict]:
    """A shared read (docs/contract.md#shared-reads): each question answered as a read of its own, its entries
    tagged with its number; the chunks it grades none with nothing to say go into one compact ``"none"`` list."""
    out: list[dict] = []
    for n, question in enumerate(read.questions, 1):
        nothing: list[int] = []
        for entry in analyst_reply(read.chunks, question):
            if entry["relevance"] == "none" and not any(entry.get(k) for k in ("findings", "summary", "records")):
                nothing.append(entry["chunk_id"])
            else:
                out.append({**entry, "question": n})
        out += [{"question": n, "none": nothing}] if nothing else []
    return out


def direct_answer(asked: DirectInput) -> str:
    """One answer straight from the chunks (instant mode, auto's direct route): the passages of every chunk
    ranked together, the chunks graded medium or better listed best first, and the exact totals when asked."""
    chunks = {c.chunk_id: c for c in asked.chunks}
    analysed = sorted(_analysed(asked.query, asked.chunks), key=lambda es: -es[1])
    entries = [
        (e["chunk_id"], _source(chunks[e["chunk_id"]]), e["relevance"], [_md_text(f) for f in e["findings"]])
        for e, _score in analysed
        if RELEVANCE_RANK.get(e["relevance"], 0) >= RELEVANCE_RANK["medium"]
    ]
    totals = None
    if asked.records_wanted:
        per_chunk = {
            i: [Record(**r) for r in extract_records(c.text, f"{c.buffer}:{c.path}")] for i, c in chunks.items()
        }
        totals = records_markdown(aggregate(per_chunk), asked.query)
    if entries:
        return "\n".join([*_answer_lines(asked.query, entries, totals), "", _DISCLAIMER])
    lines = [
        "## No relevant passage",
        "",
        f"None of the {len(chunks)} chunks read matches “{_md_text(_clip(asked.query, 200))}” closely enough to quote.",
    ]
    return "\n".join([*lines, *(["", totals] if totals else []), "", _DISCLAIMER])


def check_by_rules(shown: FindingsInput) -> dict:
    """The completeness check: each of the best findings that says something the question (and every question
    asked already) does not is followed up by those words, which the next round searches (a two-hop question's
    next hop); complete when nothing is left to follow and the findings mention most of the question's words."""
    known = set(stem_terms(" ".join((shown.query, *shown.asked))))
    ranked = sorted(shown.findings, key=lambda f: -RELEVANCE_RANK.get(f.relevance, 0))
    quotes = [(_QUOTE.match(x) or [0, x])[1] for f in ranked for x in f.findings[:1]]
    follow_ups: list[str] = []
    for quote in quotes:
        new = dict.fromkeys(w for w in _WORD.findall(quote) if (s := stem_terms(w)) and not known & set(s))
        if (
            new
            and len(follow_ups) < MAX_FOLLOW_UPS
            and (ask := " ".join(list(new)[:MAX_FOLLOW_UP_WORDS])) not in follow_ups
        ):
            follow_ups.append(ask)
    mentioned = {t for q in quotes for t in stem_terms(q)}
    wanted = {w: t for w in _WORD.findall(shown.query) for t in stem_terms(w)}
    gaps = [f'no finding mentions "{w}"' for w, t in wanted.items() if t not in mentioned][:MAX_GAPS]
    confidence = (
        round(sum(t in mentioned for t in set(wanted.values())) / len(set(wanted.values())), 2)
        if wanted
        else float(bool(quotes))
    )
    return {
        "complete": bool(quotes) and not follow_ups and confidence >= 0.5,
        "confidence": confidence,
        "gaps": gaps,
        "follow_ups": follow_ups,
    }


class ExtractiveProvider:
    name = "extractive"
    local = True

    def complete(self, request: CompletionRequest, *, before_retry: Callable[[], None] | None = None) -> Completion:
        t0 = time.perf_counter()
        match request.role, request.stage_input:
            case "plan", PlanInput() as asked:
                out = json.dumps(
                    {"search_mode": "hybrid", "focus_topics": list(dict.fromkeys(tokenize(asked.query)))[:5]}
                )
            case "analyst", ReadInput(shared=True) as read:
                out = json.dumps({"entries": shared_analyst_reply(read)}, ensure_ascii=False)
            case "analyst", ReadInput(questions=(question,)) as read:
                out = json.dumps({"entries": analyst_reply(read.chunks, question)}, ensure_ascii=False)
            case "check", FindingsInput() as shown:
                out = json.dumps(check_by_rules(shown), ensure_ascii=False)
            case "direct", DirectInput() as asked:
                out = direct_answer(asked)
                if request.json_output:  # the answer object (llm/structured.py), citing what the text cites
                    cited = cited_chunk_ids(out, [c.chunk_id for c in asked.chunks])
                    out = json.dumps({"answer": out, "cited_chunks": cited}, ensure_ascii=False)
            case "synthesizer", FindingsInput() as shown:
                out = write_report(shown)
            case role, given:
                # the prompt is for a model: reading it back would tie the answer to its wording
                raise LLMError(
                    f"the offline provider answers from the request's stage_input (llm/stage_input.py); this "
                    f"{role} request carries {type(given).__name__ if given is not None else 'none'}",
                    retryable=False,
                )
        return Completion(text=out, model=MODEL, latency_ms=int((time.perf_counter() - t0) * 1000))
