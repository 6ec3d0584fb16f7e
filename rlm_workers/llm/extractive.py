"""The offline provider: answers the pipeline's own messages by rules, no model involved.

Used whenever no API key is configured, so ``rlm query`` works on a machine
with nothing installed.  It reads the messages built by
``pipeline/`` stage modules (the same ones a real model gets) and:

- plans by rules: quoted phrases or code-like terms → ``bm25``, else ``hybrid``;
- grades each chunk by how much of the query its best passage covers and
  quotes those passages verbatim, with their line numbers, as findings;
- writes a markdown report from the strongest quotes, citing chunk ids and
  file:line.

Nothing here executes or obeys chunk text; it only measures term overlap.
Token counts are reported as 0 because no tokens were bought.

The messages it reads are fenced (pipeline/prompts.py): it undoes the fence
before quoting, so a quote shows the document's own characters, and writes
them into the markdown report with tags escaped, so they show rather than act.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

from ..pipeline.prompts import unescape_content, unquote_field
from ..search.tokenize import tokenize
from .protocol import Completion, CompletionRequest

MODEL = "extractive"
#: quotes per chunk, and their length, in the findings
MAX_QUOTES = 3
MAX_QUOTE_CHARS = 400
#: cited passages in a report (one per chunk, strongest first); the rest are only counted
MAX_REPORT_PASSAGES = 8

_QUERY = re.compile(r"## Query\n\n(.*?)(?:\n\n## (?:Dataset|Focus topics|Chunks)\n|\Z)", re.S)
_CHUNK = re.compile(r"### Chunk (\d+)\n\nsource: ([^\n]*)\n\n<content>\n(.*?)\n</content>", re.S)
_SOURCE = re.compile(r"^(?P<loc>.*):(?P<start>\d+)-(?P<end>\d+)$")
_QUOTED = re.compile(r"[\"“'`]([^\"”'`]{3,})[\"”'`]")
_CODEISH = re.compile(r"\w+\(|\w+_\w+|\w+\.\w+|[a-z]+[A-Z]\w*|::|->|</?\w+>")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
#: what markdown would take for HTML (a tag, a comment, a declaration), and line breaks of every kind
_MD_HTML = re.compile(r"<(?=[/!?A-Za-z])")
_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")


@dataclass
class _Unit:
    text: str
    line: int  # 0-based line offset inside the chunk


_SUFFIXES = ("ations", "ation", "ings", "ing", "ures", "ure", "ers", "er", "ies", "ed", "es", "ly", "s")


def _terms(text: str) -> list[str]:
    """BM25 tokens, crudely stemmed so "failing", "failure" and "fails" meet at "fail"."""
    out = []
    for t in tokenize(text):
        if len(t) > 4 and t.isalpha():
            for suf in _SUFFIXES:
                if t.endswith(suf) and len(t) - len(suf) >= 3:
                    t = t[: -len(suf)]
                    break
        out.append(t)
    return out


def _user_text(request: CompletionRequest) -> str:
    for m in request.messages:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""


def _query_of(text: str) -> str:
    m = _QUERY.search(text)
    return unescape_content(m.group(1).strip()) if m else ""


def _location(source: str) -> tuple[str, int, int]:
    """(``buffer:path``, start, end) of a prompt's ``source:`` line, the quoted location read back."""
    m = _SOURCE.match(source.strip())
    if not m:
        return unquote_field(source.strip()), 1, 1
    return unquote_field(m.group("loc")), int(m.group("start")), int(m.group("end"))


def _md_text(text: str) -> str:
    """Document text for one line of the markdown report: shown as written (no ``&lt;``), but a tag in it is
    escaped so a renderer shows it instead of acting on it, and a line break cannot start a new block."""
    return _MD_HTML.sub(r"\\<", _LINE_BREAKS.sub(" ", text))


def _shown_source(source: str) -> str:
    loc, start, end = _location(source)
    return f"{_md_text(loc)}:{start}-{end}"


def _units(text: str) -> list[_Unit]:
    """Passages to quote: sentences of prose paragraphs, single lines of code-like paragraphs."""
    out: list[_Unit] = []
    lines = text.split("\n")
    para: list[tuple[int, str]] = []

    def flush() -> None:
        if not para:
            return
        body = [t for _, t in para]
        code_like = (
            any(t.startswith(("    ", "\t")) for t in body)
            or sum(bool(_CODEISH.search(t)) for t in body) > len(body) / 2
        )
        if code_like or len(body) == 1 and len(body[0]) < 200:
            out.extend(_Unit(t.strip(), i) for i, t in para if t.strip())
        else:
            joined = " ".join(t.strip() for t in body)
            # map each sentence back to the line it starts on, for the citation
            starts, pos = [], 0
            for i, t in para:
                starts.append((pos, i))
                pos += len(t.strip()) + 1
            offset = 0
            for sentence in _SENTENCE_END.split(joined):
                at = joined.find(sentence, offset)
                offset = at + len(sentence)
                line = max((i for p, i in starts if p <= at), default=para[0][0])
                if sentence.strip():
                    out.append(_Unit(sentence.strip(), line))
        para.clear()

    for i, line in enumerate(lines):
        if line.strip():
            para.append((i, line))
        else:
            flush()
    flush()
    return out


def _weights(query_terms: list[str], units: list[list[str]]) -> dict[str, float]:
    """IDF of each query term over the passages at hand: rare terms matter more."""
    n = max(1, len(units))
    sets = [set(u) for u in units]
    return {t: math.log(1 + n / (1 + sum(t in s for s in sets))) + 0.5 for t in dict.fromkeys(query_terms)}


def _grade(coverage: float, phrase: bool) -> str:
    if phrase or coverage >= 0.6:
        return "high"
    if coverage >= 0.35:
        return "medium"
    if coverage > 0:
        return "low"
    return "none"


def _clip(s: str, n: int = MAX_QUOTE_CHARS) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def plan_by_rules(query: str) -> dict:
    quoted = [q.strip() for q in _QUOTED.findall(query)]
    code_like = bool(_CODEISH.search(query))
    mode = "bm25" if quoted or code_like else "hybrid"
    terms = list(dict.fromkeys(quoted + [t for t in tokenize(query) if len(t) > 2]))
    return {"search_mode": mode, "focus_topics": terms[:5]}


def analyse_chunks(user_text: str) -> list[dict]:
    query = _query_of(user_text)
    q_terms = _terms(query)
    phrases = [p.lower() for p in _QUOTED.findall(query)]
    chunks = _CHUNK.findall(user_text)
    all_units = {cid: _units(body) for cid, _, body in chunks}
    tokens = {cid: [_terms(u.text) for u in us] for cid, us in all_units.items()}
    weights = _weights(q_terms, [t for ts in tokens.values() for t in ts])
    total = sum(weights.values()) or 1.0
    out = []
    for cid, source, _body in chunks:
        loc, start, _end = _location(source)
        scored = []
        for unit, toks in zip(all_units[cid], tokens[cid], strict=True):
            present = set(toks)
            cover = sum(w for t, w in weights.items() if t in present) / total
            phrase = any(p in unit.text.lower() for p in phrases)
            if cover > 0 or phrase:
                scored.append((cover + (1.0 if phrase else 0.0), cover, phrase, unit))
        scored.sort(key=lambda s: (-s[0], s[3].line))
        if not scored:
            out.append({"chunk_id": int(cid), "relevance": "none", "findings": [], "summary": "", "follow_up": []})
            continue
        best = scored[0]
        grade = _grade(best[1], best[2])
        keep = [s for s in scored if s[0] >= max(0.15, best[0] * 0.5)][:MAX_QUOTES]
        # verbatim: the document's text, not the fence's escaping of it
        findings = [
            f'"{_clip(unescape_content(s[3].text))}" ({loc.rsplit(":", 1)[-1]}:{start + s[3].line})' for s in keep
        ]
        matched = sorted({t for t in weights if any(t in set(tk) for tk in tokens[cid])})
        summary = (
            f"Matches {len(matched)} of {len(weights)} query terms ({', '.join(matched[:8])}); "
            f"best passage at line {start + best[3].line}."
        )
        out.append(
            {
                "chunk_id": int(cid),
                "relevance": grade,
                "findings": findings,
                "summary": summary,
                "follow_up": [],
            }
        )
    return out


_GRADE_LINE = re.compile(r"^relevance: (\w+)$", re.M)


def write_report(user_text: str) -> str:
    query = _query_of(user_text)
    entries = []
    for cid, source, body in _CHUNK.findall(user_text):
        grade = (_GRADE_LINE.search(body) or [None, "low"])[1]
        quotes = [_md_text(unescape_content(ln[2:])) for ln in body.split("\n") if ln.startswith("- ")]
        entries.append((int(cid), _shown_source(source), grade, quotes))
    if not entries:
        return f"## No relevant findings\n\nNothing in the analysed chunks answers “{query}”."
    # Within a grade, collect order is document order; the answer leads with the quote that covers
    # most of the question instead.
    q_terms = _terms(query)
    weights = _weights(q_terms, [_terms(q) for e in entries for q in e[3]])
    total = sum(weights.values()) or 1.0
    grade_rank = {"high": 3, "medium": 2, "low": 1}

    def score(entry: tuple[int, str, str, list[str]]) -> tuple[float, float]:
        best = max((sum(w for t, w in weights.items() if t in set(_terms(q))) for q in entry[3]), default=0.0)
        return (grade_rank.get(entry[2], 0), best / total)

    entries.sort(key=score, reverse=True)
    top = entries[0]
    lines = [
        "## Answer",
        "",
        f"The passage that best matches “{_clip(query, 200)}” is in chunk {top[0]} ({top[1]}):",
        "",
    ]
    lines += [f"> {q}" for q in top[3][:1]] or ["> (no quotable passage)"]
    # The evidence is what answers the question, not every chunk analysed: the strongest passages, one per
    # chunk; the full list of findings stays in the result's ``sources``.
    shown = entries[:MAX_REPORT_PASSAGES]
    lines += ["", "## Evidence", ""]
    lines += [f"- {quotes[0]} — [chunk {cid}, {source}] ({grade})" for cid, source, grade, quotes in shown if quotes]
    if len(entries) > len(shown):
        lines += ["", f"{len(entries) - len(shown)} more chunks with findings are listed in the result's sources."]
    lines += [
        "",
        "_Written by the offline extractive provider: the quotes are verbatim passages ranked by "
        "overlap with the question; no language model interpreted them. Set OPENAI_API_KEY (and "
        "OPENAI_BASE_URL for a compatible server) for a written answer._",
    ]
    return "\n".join(lines)


class ExtractiveProvider:
    name = "extractive"
    local = True

    def complete(self, request: CompletionRequest) -> Completion:
        t0 = time.perf_counter()
        text = _user_text(request)
        if request.role == "plan":
            out = json.dumps(plan_by_rules(_query_of(text)))
        elif request.role == "analyst":
            out = json.dumps(analyse_chunks(text), ensure_ascii=False)
        else:
            out = write_report(text)
        return Completion(text=out, model=MODEL, latency_ms=int((time.perf_counter() - t0) * 1000))
