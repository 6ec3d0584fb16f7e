"""The offline provider: what answers when no model is configured, from the record each stage rendered its prompt
from (``CompletionRequest.stage_input``), never from the prompt.  No model reads or writes anything here: every
chunk is cut into passages, ranked against the question by BM25 over the passages and by the cosine of the local
embedding model (the search's query encoder), the rankings fused by Reciprocal Rank Fusion; the best are quoted
verbatim with file:line and graded by their fused score against the message's best and how much of the question
they hold.  Chunk text is measured, never obeyed, and shown with markdown's tags and line breaks escaped.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from ..config import get_settings
from ..errors import LLMError
from ..ingest.embed import get_embedder, resolve_runtime
from ..ingest.vector_memo import VectorMemo
from ..models import RELEVANCE_RANK, Record
from ..records.lines import extract_records
from ..records.totals import aggregate, records_markdown, stem_terms
from ..search.preview import CUT, shorten
from ..search.provenance import cite_of, page_span
from ..search.service import query_vector
from ..search.tokenize import tokenize
from .protocol import Completion, CompletionRequest
from .replies import cited_chunk_ids
from .stage_input import ChunkForPrompt, DirectInput, FindingsInput, PlanInput, Question, ReadInput, ShownFinding

__all__ = ["ExtractiveProvider", "check_by_rules", "direct_answer", "extract_records", "write_report"]

#: quotes per chunk, their length, evidence passages (one per chunk; more are counted), passages opening an answer
MAX_QUOTES, MAX_QUOTE_CHARS, MAX_REPORT_PASSAGES, MAX_ANSWER_PASSAGES = 3, 400, 8, 5
#: a passage: a sentence of WINDOW lines at most, else windows of WINDOW lines; a short one without a full stop runs on
WINDOW, MIN_PASSAGE_CHARS = 3, 40
#: Reciprocal Rank Fusion's constant (Cormack et al.); passages embedded per message at most, and their length
RRF_K, MAX_EMBEDDED, MAX_EMBED_CHARS = 60, 320, 240
#: a grade's floor: the best passage's fused score as a share of the message's best, and the share of the
#: question it holds (``_rank``'s evidence); a chunk's other quotes score KEEP_SHARE of its best
HIGH_SHARE, MEDIUM_SHARE, HIGH_EVIDENCE, MEDIUM_EVIDENCE, KEEP_SHARE = 0.8, 0.5, 0.6, 0.35, 0.8
#: cosines of the default encoder (all-MiniLM-L6-v2) that mean "unrelated" and "says the same"
UNRELATED, SAME = 0.3, 0.8
MAX_FOLLOW_UPS, MAX_FOLLOW_UP_WORDS, MAX_GAPS = 3, 6, 5

_QUOTE = re.compile(r'^"(.*)" \([^()\n]*\)$', re.S)  # a finding as written here: "quote" (file:line)
_MD_HTML = re.compile(r"<(?=[/!?A-Za-z])")  # what markdown would take for HTML
_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD = re.compile(r"\w+")


def _md_text(text: str) -> str:
    """Document text for one line of markdown: as written, but a tag escaped and no line break."""
    return _MD_HTML.sub(r"\\<", _LINE_BREAKS.sub(" ", text))


def _clip(s: str, n: int = MAX_QUOTE_CHARS) -> str:
    # a quote is what the answer opens with: cut after a whole sentence (or word), and marked, so that it never
    # reads as the file having said less
    cut = shorten(s, n, sentences=True)
    if cut != s and cut.count("**") % 2 and (before := cut[: cut.rindex("**")].rstrip()):
        # the cut fell inside a bold span, whose opening "**" the page would show as it is: cut before it
        cut = f"{before} {CUT}"
    return cut


def _quoted(finding: str) -> str:
    """A finding's quote (``"quote" (file:line)``, as written here), or the finding as it is."""
    return m.group(1) if (m := _QUOTE.match(finding)) else finding


def _source(c: ChunkForPrompt | ShownFinding) -> str:
    """``buffer:path:12-30``, or ``buffer:spec.pdf p. 4–5 § Transport`` for a document."""
    return _md_text(cite_of(c, f"{c.buffer}:{c.path}"))


def _place(c: ChunkForPrompt, line: int) -> str:
    """Where a quoted line is, ``a.txt:105``; a converted document's pages instead, ``spec.pdf p. 4``."""
    return f"{c.path} {pages}" if (pages := page_span(c.page_start, c.page_end)) else f"{c.path}:{c.start_line + line}"


def _passages(text: str) -> list[tuple[int, int, str]]:
    """A chunk's passages and their first and last 0-based lines: each paragraph's sentences, one longer than WINDOW
    lines (code: few full stops) cut into windows, one short with no full stop (a heading) run on into the next."""
    lines, out, para, carry = [ln.strip() for ln in text.split("\n")], [], [], None
    for i, line in enumerate([*lines, ""]):
        if line:
            para.append(i)
            continue
        joined, at = " ".join(lines[j] for j in para), 0
        starts = list(accumulate((len(lines[j]) + 1 for j in para[:-1]), initial=0))
        for sentence in _SENTENCE_END.split(joined) if para else []:
            at = joined.index(sentence, at)
            first, last = (para[bisect_right(starts, x) - 1] for x in (at, at + len(sentence) - 1))
            if carry:
                first, sentence, carry = carry[0], f"{carry[2]} {sentence}", None
            if len(sentence) < MIN_PASSAGE_CHARS and not sentence.endswith((".", "!", "?")):
                carry = (first, last, sentence)
            elif last - first < WINDOW:
                out.append((first, last, sentence))
            else:
                ends = {k: min(k + WINDOW, last + 1) for k in range(first, last + 1) if lines[k]}
                out += [(k, end - 1, " ".join(filter(None, lines[k:end]))) for k, end in ends.items()]
        para = []
    return out + [carry] if carry else out


_encoder_failed = False


#: passage vectors kept per process (ingest/vector_memo.py): 20,000 of a 384-dimension encoder are 30 MB
_passage_vectors = VectorMemo(20_000)


def _meaning(query: str, texts: Sequence[str]) -> list[float] | None:
    """Cosines to the query by the buffers' (local) encoder, ``max_size`` read as "max size"; None without one."""
    global _encoder_failed
    if _encoder_failed or not texts:
        return None
    try:
        runtime = resolve_runtime(model := get_settings().embedding_model)
        readable = [_CAMEL.sub(" ", t[:MAX_EMBED_CHARS]).replace("_", " ") for t in texts]
        embedder = get_embedder(model, runtime)
        vectors = _passage_vectors.encode(f"{embedder.model_id}/{embedder.runtime}", readable, embedder.encode)
        return [float(x) for x in vectors @ np.asarray(query_vector(model, query, runtime))]
    except Exception as exc:  # no model files, no runtime: rank by words, and say so once
        _encoder_failed = True
        logging.getLogger(__name__).warning(
            "the offline provider ranks passages by words only: no embedding model (%s)", exc
        )
        return None


def _rank(query: str, texts: Sequence[str]) -> tuple[list[float], list[float]]:
    """Per passage (given best-first by search rank): its fused score (RRF of its BM25 and cosine ranks) and its
    evidence, the share of the question it holds (its distinct words, or its meaning by the encoder)."""
    q, docs = list(dict.fromkeys(stem_terms(query))), [stem_terms(t) for t in texts]
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
    high = share >= HIGH_SHARE and evidence >= HIGH_EVIDENCE
    medium = share >= MEDIUM_SHARE and evidence >= MEDIUM_EVIDENCE
    return "high" if high else "medium" if medium else "low" if evidence > 0 else "none"


def _analysed(query: str, chunks: Sequence[ChunkForPrompt]) -> list[tuple[dict, float]]:
    """An entry per chunk and its best passage's fused score, its passages ranked with all of the message's."""
    cut = [(c, first, last, text) for c in chunks for first, last, text in _passages(c.text)]
    fused, evidence = _rank(query, [text for *_where, text in cut])
    top, out = max(fused, default=0.0) or 1.0, []
    for chunk in chunks:
        mine = sorted((-fused[i], first, i) for i, (c, first, _l, _t) in enumerate(cut) if c is chunk)
        if not mine or evidence[mine[0][2]] <= 0:  # nothing of the question in it: nothing to quote
            out.append(({"chunk_id": chunk.chunk_id, "relevance": "none", "findings": [], "summary": ""}, 0.0))
            continue
        best = -mine[0][0]
        quotes: list[str] = []
        used: set[int] = set()
        for score, first, i in mine:
            span = set(range(first, cut[i][2] + 1))
            if len(quotes) < MAX_QUOTES and -score >= KEEP_SHARE * best and not used & span:
                quotes.append(f'"{_clip(cut[i][3])}" ({_place(chunk, first)})')
                used |= span
        grade = _grade(best / top, evidence[mine[0][2]])
        summary = f"Best-matching passage at line {chunk.start_line + mine[0][1]} (no model read it)."
        out.append(({"chunk_id": chunk.chunk_id, "relevance": grade, "findings": quotes, "summary": summary}, best))
    return out


_DISCLAIMER = (
    "_No model wrote this: the offline extractive provider quotes, verbatim, the passages whose words and meaning "
    "best match the question. Set OPENAI_API_KEY (and OPENAI_BASE_URL for a compatible server) for a written answer._"
)


def _entry(c: ChunkForPrompt | ShownFinding, relevance: str, quotes: Sequence[str]) -> tuple:
    """(chunk id, its shown source, its grade, its quotes made safe for markdown)"""
    return c.chunk_id, _source(c), relevance, [_md_text(q) for q in quotes]


def _answer_lines(query: str, entries: list[tuple[int, str, str, list[str]]], totals: str | None) -> list[str]:
    """The best of all the entries' quotes, the exact totals if any, and the evidence: each entry's first quote."""
    quotes = [(q, f"[chunk {cid}, {source}]") for cid, source, _grade, qs in entries for q in qs]
    fused, _ = _rank(query, [_quoted(q) for q, _cite in quotes])
    best = sorted(range(len(quotes)), key=lambda i: -fused[i])[:MAX_ANSWER_PASSAGES]
    lines = ["## Answer", "", f"No model: the best-matching passages for “{_md_text(_clip(query, 200))}”:", ""]
    lines += [x for i in best for x in (f"> {quotes[i][0]} — {quotes[i][1]}", "")] + ([totals, ""] if totals else [])
    shown = entries[:MAX_REPORT_PASSAGES]
    lines += ["## Evidence", ""] + [f"- {q[0]} — [chunk {c}, {s}] ({g})" for c, s, g, q in shown]
    if len(entries) > len(shown):
        lines += ["", f"{len(entries) - len(shown)} more chunks with findings are listed in the result's sources."]
    return lines


def write_report(shown: FindingsInput) -> str:
    """The synthesizer's report: the findings' first quotes ranked against the question, by grade first."""
    found = [f for f in shown.findings if f.findings]
    if not found:
        return f"## No relevant findings\n\nNothing in the analysed chunks answers “{_md_text(shown.query)}”."
    fused, _ = _rank(shown.query, [_quoted(f.findings[0]) for f in found])
    order = sorted(range(len(found)), key=lambda i: (-RELEVANCE_RANK.get(found[i].relevance, 0), -fused[i]))
    entries = [_entry(f, f.relevance, f.findings) for f in map(found.__getitem__, order)]
    return "\n".join([*_answer_lines(shown.query, entries, None), "", _DISCLAIMER])


def analyst_reply(chunks: Sequence[ChunkForPrompt], question: Question) -> list[dict]:
    """The analyst's entries; when the question wants records, every entry (even one graded none) has them."""
    entries = [entry for entry, _score in _analysed(question.query, chunks)]
    for entry, chunk in zip(entries, chunks, strict=True) if question.records_wanted else ():
        entry["records"] = extract_records(chunk.text, chunk.path)
    return entries


def shared_analyst_reply(read: ReadInput) -> list[dict]:
    """A shared read (docs/contract.md#shared-reads): each question read alone, entries tagged with its number."""
    out: list[dict] = []
    for n, question in enumerate(read.questions, 1):
        entries = analyst_reply(read.chunks, question)
        empty = [e["relevance"] == "none" and not any(e.get(k) for k in ("findings", "records")) for e in entries]
        out += [{**e, "question": n} for e, nothing in zip(entries, empty, strict=True) if not nothing]
        out += [{"question": n, "none": [e["chunk_id"] for e, x in zip(entries, empty, strict=True) if x]}] * any(empty)
    return out


def direct_answer(asked: DirectInput) -> str:
    """One answer straight from the chunks (instant mode, auto's direct route): the passages of every chunk
    ranked together, the chunks graded medium or better listed best first, and the exact totals when asked."""
    chunks = {c.chunk_id: c for c in asked.chunks}
    analysed = sorted(_analysed(asked.query, asked.chunks), key=lambda es: -es[1])
    kept = [e for e, _score in analysed if RELEVANCE_RANK[e["relevance"]] >= RELEVANCE_RANK["medium"]]
    entries = [_entry(chunks[e["chunk_id"]], e["relevance"], e["findings"]) for e in kept]
    totals = None
    if asked.records_wanted:
        counted = {i: [Record(**r) for r in extract_records(c.text, c.path)] for i, c in chunks.items()}
        totals = records_markdown(aggregate(counted), asked.query)
    if entries:
        return "\n".join([*_answer_lines(asked.query, entries, totals), "", _DISCLAIMER])
    none = f"None of the {len(chunks)} chunks read matches “{_md_text(_clip(asked.query, 200))}” closely enough."
    return "\n".join(["## No relevant passage", "", none, *(["", totals] if totals else []), "", _DISCLAIMER])


def check_by_rules(shown: FindingsInput) -> dict:
    """Each best finding is followed up by its words no question asked holds (a two-hop question's next hop);
    complete when nothing is left to follow and the findings mention half the question's words or more."""
    known = set(stem_terms(" ".join((shown.query, *shown.asked))))
    best_first = sorted(shown.findings, key=lambda f: -RELEVANCE_RANK.get(f.relevance, 0))
    quotes = [_quoted(f.findings[0]) for f in best_first if f.findings]
    follow_ups: list[str] = []
    for quote in quotes:
        new = list(dict.fromkeys(w for w in _WORD.findall(quote) if (s := stem_terms(w)) and not known & set(s)))
        if new and (ask := " ".join(new[:MAX_FOLLOW_UP_WORDS])) not in follow_ups:
            follow_ups.append(ask)
    mentioned = {t for q in quotes for t in stem_terms(q)}
    wanted = {w: t for w in _WORD.findall(shown.query) for t in stem_terms(w)}
    gaps = [f'no finding mentions "{w}"' for w, t in wanted.items() if t not in mentioned][:MAX_GAPS]
    terms = set(wanted.values())
    confidence = round(len(terms & mentioned) / len(terms), 2) if terms else float(bool(quotes))
    done = bool(quotes) and not follow_ups and confidence >= 0.5
    return {"complete": done, "confidence": confidence, "gaps": gaps, "follow_ups": follow_ups[:MAX_FOLLOW_UPS]}


class ExtractiveProvider:
    name = "extractive"
    local = True

    def complete(self, request: CompletionRequest, *, before_retry: Callable[[], None] | None = None) -> Completion:
        t0 = time.perf_counter()
        match request.role, request.stage_input:
            case "plan", PlanInput() as asked:
                focus = list(dict.fromkeys(tokenize(asked.query)))[:5]
                out = json.dumps({"search_mode": "hybrid", "focus_topics": focus})
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
            case role, given:  # the prompt is for a model: reading it back would tie the answer to its wording
                carried = type(given).__name__ if given is not None else "none"
                raise LLMError(f"the offline provider reads stage_input; this {role} has {carried}", retryable=False)
        return Completion(text=out, model=self.name, latency_ms=int((time.perf_counter() - t0) * 1000))
