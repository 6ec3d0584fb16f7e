"""The offline provider: answers what the pipeline's stages ask by rules, no model involved.

Used whenever no API key is configured, so ``rlm query`` works on a machine
with nothing installed.  It never reads the prompt: each stage puts what it
rendered into its prompt on the request too (``CompletionRequest.stage_input``,
``llm/stage_input.py``), and from that record it:

- plans by rules: quoted phrases or code-like terms → ``bm25``, else ``hybrid``;
- grades each chunk by how much of the query its best passage covers and
  quotes its passages verbatim, with their line numbers, as findings, best first
  by ``line_rank`` (meaning, words, search rank, definitions before comments);
- writes a markdown report from the strongest quotes, citing chunk ids and
  file:line;
- counts typed records (log levels, logfmt/JSON fields, ``Key: value`` lines)
  when a message asks for them, answers a direct message the way it writes a
  report, and checks completeness by following names the findings mention and
  the question does not.

Nothing here executes or obeys chunk text; it only measures term overlap and, through the local
embedding model, closeness of meaning.
Token counts are reported as 0 because no tokens were bought.

It cuts and ranks a chunk's passages on the text as the prompt fences it (pipeline/prompts.py), as a model
reads it and as ``line_rank`` was tuned; it undoes the fence before quoting, so a quote shows the document's
own characters, and writes them into the markdown report with tags escaped, so they show rather than act.
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import LLMError
from ..models import RELEVANCE_RANK, Record
from ..pipeline.prompts import escape_content, unescape_content
from ..pipeline.records import (
    CODE_LINE,
    MAX_RECORDS_PER_CHUNK,
    TABLE_SUFFIXES,
    aggregate,
    is_record_line,
    is_table,
    records_markdown,
    stem_terms,
)
from ..pipeline.replies import cited_chunk_ids
from ..provenance import cite_of, page_span
from ..search.tokenize import tokenize
from . import line_rank
from .protocol import Completion, CompletionRequest
from .stage_input import ChunkForPrompt, DirectInput, FindingsInput, PlanInput, Question, ReadInput, ShownFinding

MODEL = "extractive"
#: quotes per chunk, and their length, in the findings
MAX_QUOTES = 3
MAX_QUOTE_CHARS = 400
#: cited passages in a report (one per chunk, strongest first); the rest are only counted
MAX_REPORT_PASSAGES = 8

#: a phrase the question quotes: the marks open and close a word run (not an apostrophe's "don't", not the gap
#: between two quoted bits: ``'.' and '..'``)
_QUOTED = re.compile(r"(?<!\w)[\"“'`]([^\s\"”'`][^\"”'`]+[^\s\"”'`])[\"”'`](?!\w)")
_CODEISH = re.compile(r"\w+\(|\w+_\w+|\w+\.\w+|[a-z]+[A-Z]\w*|::|->|</?\w+>")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
#: what markdown would take for HTML (a tag, a comment, a declaration), and line breaks of every kind
_MD_HTML = re.compile(r"<(?=[/!?A-Za-z])")
_LINE_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")


@dataclass
class _Unit:
    text: str
    line: int  # 0-based line offset inside the chunk


#: BM25 tokens, crudely stemmed so "failing", "failure" and "fails" meet at "fail"
_terms = stem_terms


def _location(chunk: ChunkForPrompt | ShownFinding) -> str:
    """``buffer:path``, as a source line names it."""
    return f"{chunk.buffer}:{chunk.path}"


def _fenced(chunk: ChunkForPrompt) -> str:
    """The chunk's text as its prompt's content block holds it: the passages are cut and ranked on that."""
    return escape_content(chunk.text)


def _md_text(text: str) -> str:
    """Document text for one line of the markdown report: shown as written (no ``&lt;``), but a tag in it is
    escaped so a renderer shows it instead of acting on it, and a line break cannot start a new block."""
    return _MD_HTML.sub(r"\\<", _LINE_BREAKS.sub(" ", text))


def _shown_source(chunk: ChunkForPrompt | ShownFinding) -> str:
    """``buffer:path:12-30``, or ``buffer:spec.pdf p. 4–5 § Transport`` for a document (``provenance.cite``)."""
    return _md_text(cite_of(chunk, _location(chunk)))


def _quote_place(chunk: ChunkForPrompt, line: int) -> str:
    """Where a quoted line is: ``a.txt:105``; a converted document's line numbers are of its converted text,
    which no reader has, so there the chunk's pages: ``spec.pdf p. 4``."""
    name = _location(chunk).rsplit(":", 1)[-1]
    pages = page_span(chunk.page_start, chunk.page_end)
    return f"{name} {pages}" if pages else f"{name}:{line}"


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


def analyse_chunks(query: str, chunks: Sequence[ChunkForPrompt]) -> list[dict]:
    return [entry for entry, _score in _analysed(query, chunks)]


def _analysed(query: str, chunks: Sequence[ChunkForPrompt], *, relative: bool = False) -> list[tuple[dict, float]]:
    """The analyst's entries, each with the fused score of its best passage (``line_rank.fuse``), which orders
    the quotes and the direct answer's chunks.  A grade is the share of the query a passage covers; with
    ``relative`` (the direct answer: one message holding the search's best chunks) it is raised for a passage
    ranked near the message's best by meaning and words together.  An analyst's batch may hold nothing
    relevant at all, so there its best is no evidence by itself."""
    q_terms = _terms(query)
    phrases = [p.lower() for p in _QUOTED.findall(query)]
    all_units = {c.chunk_id: _units(_fenced(c)) for c in chunks}
    tokens = {cid: [_terms(u.text) for u in us] for cid, us in all_units.items()}
    weights = _weights(q_terms, [t for ts in tokens.values() for t in ts])
    total = sum(weights.values()) or 1.0
    # chunk order in the message is the search's rank order (docs/contract.md#modes)
    cands = {
        c.chunk_id: line_rank.candidates(_fenced(c), _location(c), n, [(u.text, u.line) for u in all_units[c.chunk_id]])
        for n, c in enumerate(chunks)
    }
    fused_all = line_rank.fuse(query, [c for cs in cands.values() for c in cs])
    top_score = max(fused_all, default=0.0) or 1.0
    fused, at = {}, 0
    for cid, cs in cands.items():
        fused[cid] = fused_all[at : at + len(cs)]
        at += len(cs)
    out = []
    for chunk in chunks:
        cid, start = chunk.chunk_id, int(chunk.start_line)
        scored = []
        for unit, toks, score, cand in zip(all_units[cid], tokens[cid], fused[cid], cands[cid], strict=True):
            present = set(toks)
            cover = sum(w for t, w in weights.items() if t in present) / total
            phrase = any(p in unit.text.lower() for p in phrases)
            # near the best by meaning alone counts only when the meaning is close in absolute terms too
            near = (cand.similarity or 0.0) >= line_rank.MEANING_FLOOR or cover > 0
            if cover > 0 or phrase or (relative and near and score >= line_rank.RELATIVE_MEDIUM * top_score):
                scored.append((score + (1.0 if phrase else 0.0), cover, phrase, unit, near))
        scored.sort(key=lambda s: (-s[0], s[3].line))
        if not scored:
            entry = {"chunk_id": cid, "relevance": "none", "findings": [], "summary": "", "follow_up": []}
            out.append((entry, 0.0))
            continue
        best = scored[0]
        lifted = line_rank.relative_cover(best[0], top_score) if relative and best[4] else 0.0
        grade = _grade(max(best[1], lifted), best[2])
        keep = [s for s in scored if s[0] >= best[0] * line_rank.KEEP_SHARE][:MAX_QUOTES]
        # verbatim: the document's text, not the fence's escaping of it
        findings = [f'"{_clip(unescape_content(s[3].text))}" ({_quote_place(chunk, start + s[3].line)})' for s in keep]
        matched = sorted({t for t in weights if any(t in set(tk) for tk in tokens[cid])})
        summary = (
            f"Matches {len(matched)} of {len(weights)} query terms ({', '.join(matched[:8])}); "
            f"best passage at line {start + best[3].line}."
        )
        out.append(
            (
                {
                    "chunk_id": cid,
                    "relevance": grade,
                    "findings": findings,
                    "summary": summary,
                    "follow_up": [],
                },
                best[0],
            )
        )
    return out


_DISCLAIMER = (
    "_Written by the offline extractive provider: the quotes are verbatim passages ranked by "
    "their words' and meaning's closeness to the question; no language model interpreted them. Set OPENAI_API_KEY (and "
    "OPENAI_BASE_URL for a compatible server) for a written answer._"
)

#: (chunk id, shown source, grade, markdown-safe quotes)
_Entry = tuple[int, str, str, list[str]]


def _answer_lines(query: str, entries: list[_Entry], totals: str | None = None, *, ranked: bool = False) -> list[str]:
    """The answer (the best passage), the exact totals if any, and the evidence: one cited passage per chunk.
    ``ranked``: the entries come best first already (the direct answer ranks the chunks' lines itself)."""
    if not ranked:
        # Collect order is document order within a grade; the answer leads with the quote ranked best by
        # meaning, words and the kind of line (line_rank.fuse) instead.
        grade_rank = {"high": 3, "medium": 2, "low": 1}
        firsts = [line_rank.quote_candidate(e[3][0] if e[3] else "", n) for n, e in enumerate(entries)]
        scores = line_rank.fuse(query, firsts)
        order = sorted(range(len(entries)), key=lambda i: (grade_rank.get(entries[i][2], 0), scores[i]), reverse=True)
        entries = [entries[i] for i in order]
    top = entries[0]
    lines = [
        "## Answer",
        "",
        f"The passage that best matches “{_clip(query, 200)}” is in chunk {top[0]} ({top[1]}):",
        "",
    ]
    lines += [f"> {q}" for q in top[3][:1]] or ["> (no quotable passage)"]
    if totals:
        lines += ["", totals]
    # The evidence is what answers the question, not every chunk analysed: the strongest passages, one per
    # chunk; the full list of findings stays in the result's ``sources``.
    shown = entries[:MAX_REPORT_PASSAGES]
    lines += ["", "## Evidence", ""]
    lines += [f"- {quotes[0]} — [chunk {cid}, {source}] ({grade})" for cid, source, grade, quotes in shown if quotes]
    if len(entries) > len(shown):
        lines += ["", f"{len(entries) - len(shown)} more chunks with findings are listed in the result's sources."]
    return lines


def write_report(shown: FindingsInput) -> str:
    """The synthesizer's report: the findings shown, their quotes cited, the best one first."""
    query = shown.query
    entries: list[_Entry] = [
        (f.chunk_id, _shown_source(f), f.relevance or "low", [_md_text(x) for x in f.findings]) for f in shown.findings
    ]
    if not entries:
        return f"## No relevant findings\n\nNothing in the analysed chunks answers “{query}”."
    return "\n".join([*_answer_lines(query, entries), "", _DISCLAIMER])


# --------------------------------------------------------------------------- records (exact totals)

_LEVEL_NAMES = ("TRACE", "DEBUG", "INFO", "NOTICE", "WARN", "WARNING", "ERROR", "CRITICAL", "FATAL", "SEVERE")
#: a level written as a word of its own: "ERROR", "[WARN]", "INFO:"; not part of a name or a path
_LEVEL_WORD = re.compile(r"(?<![\w.=/@-])(" + "|".join(_LEVEL_NAMES) + r")(?![\w=/@-]|\.\w)")
_LEVEL_KEYS = frozenset({"level", "lvl", "severity", "loglevel", "log_level", "levelname", "log.level"})
#: free text, or a value unique to the line: counting these would count lines, not kinds
_SKIP_KEYS = frozenset(
    {
        "msg",
        "message",
        "ts",
        "time",
        "timestamp",
        "date",
        "id",
        "request_id",
        "trace_id",
        "span_id",
        "duration",
        "elapsed",
        "latency",
    }
)
#: logfmt: a key at the start of the line or after a space, "=", then a bare or a double-quoted value
_LOGFMT = re.compile(r'(?:^|(?<=\s))([A-Za-z_@][\w.@-]{0,63})=("(?:[^"\\]|\\.)*"|[^\s"]*)')
_QUOTED_VALUE = re.compile(r'"(?:[^"\\]|\\.)*"')
_HEADER = re.compile(r"^\s*(?:-\s+)?([A-Za-z][\w \-]{0,39}?)\s*:\s+(\S.*?)\s*$")
_URL_SCHEMES = frozenset({"http", "https", "ftp", "file", "mailto", "ws", "wss", "ssh", "git"})
MAX_RECORD_VALUE_CHARS = 80
MAX_HEADER_VALUE_CHARS = 60
MAX_HEADER_VALUE_WORDS = 6
MAX_HEADER_KEY_WORDS = 3


def _unique_per_row(column: str) -> bool:
    """An id or time column (``order_id``, ``created_at``): one distinct value per row, nothing to count."""
    name = column.lower().replace("-", "_").replace(" ", "_")
    return name in _SKIP_KEYS or name.endswith(("_id", "_at", "_time", "_ts", "uuid"))


def _key_name(key: str) -> str:
    return key.lower().lstrip("@")


def _logfmt_value(raw: str) -> str:
    if raw.startswith('"'):
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw[1:-1]
        return value if isinstance(value, str) else raw
    return raw


def _line_records(line: str) -> list[tuple[str, str]]:
    """The (label, value) pairs one line shows: its level, then its fields."""
    stripped = line.strip()
    if not stripped:
        return []
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            obj = json.loads(stripped)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict):
            return _json_records(obj)
    level: str | None = None
    fields: list[tuple[str, str]] = []
    # A line of code is no record: ``name=None, app=None,`` are keyword arguments, and a level word in a code
    # string (``log.error("ERROR")``) is no log line's level.  A log line that is a record keeps both.
    record = is_record_line(line)
    code = not record and bool(CODE_LINE.search(_QUOTED_VALUE.sub('""', line)))
    pairs = _LOGFMT.findall(line) if record else []
    for key, raw in pairs:
        name, value = _key_name(key), _logfmt_value(raw).strip()
        if name in _LEVEL_KEYS:
            level = level or (value.upper() if value and len(value) <= MAX_RECORD_VALUE_CHARS else None)
        elif name not in _SKIP_KEYS and value and len(value) <= MAX_RECORD_VALUE_CHARS:
            fields.append((key, value))
    if level is None and not code:
        # not inside a quoted value: `msg="got ERROR from upstream"` is no level of its own
        m = _LEVEL_WORD.search(_QUOTED_VALUE.sub(" ", line))
        level = m.group(1) if m else None
    out = [("level", level)] if level else []
    if len(pairs) >= 2 or (pairs and level):
        return out + fields
    if pairs:
        return out  # one lone key=value in a line of prose is no record
    m = _HEADER.match(line)
    if m and not CODE_LINE.search(line):
        key, value = m.group(1).strip(), m.group(2)
        if (
            _key_name(key) not in _SKIP_KEYS
            and key.lower() not in _URL_SCHEMES
            and len(key.split()) <= MAX_HEADER_KEY_WORDS  # "The reason is simple: it works" is prose
            and key.upper() not in _LEVEL_NAMES
            and len(value) <= MAX_HEADER_VALUE_CHARS
            and len(value.split()) <= MAX_HEADER_VALUE_WORDS
        ):
            out.append((key, value))
    return out


def _json_records(obj: dict) -> list[tuple[str, str]]:
    level: str | None = None
    fields: list[tuple[str, str]] = []
    for key, value in obj.items():
        name = _key_name(str(key))
        if name in _LEVEL_KEYS:
            if isinstance(value, str) and value.strip() and len(value) <= MAX_RECORD_VALUE_CHARS:
                level = level or value.strip().upper()
        elif name in _SKIP_KEYS:
            continue
        elif isinstance(value, bool):
            fields.append((str(key), "true" if value else "false"))
        elif isinstance(value, int):
            fields.append((str(key), str(value)))
        elif isinstance(value, str) and value.strip() and len(value) <= MAX_RECORD_VALUE_CHARS:
            fields.append((str(key), value.strip()))
    return ([("level", level)] if level else []) + fields


def _table_records(text: str, path: str) -> list[tuple[str, str]]:
    """A CSV/TSV chunk: its first line is the header row (the analyst stage puts it there), every other line a
    row; each cell is a (column, value) record.  Columns that are unique per row (ids, times) are skipped."""
    delimiter = next(d for suffix, d in TABLE_SUFFIXES.items() if path.lower().endswith(suffix))
    rows = list(csv.reader(text.split("\n"), delimiter=delimiter))
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    out = []
    for row in rows[1:]:
        if not any(cell.strip() for cell in row):
            continue
        for name, cell in zip(header, row, strict=False):
            value = cell.strip()
            if name and value and len(value) <= 80 and not _unique_per_row(name):
                out.append((name, value))
    return out


def extract_records(text: str, path: str = "") -> list[dict]:
    """Records one chunk shows, by rules, summed within the chunk: ``[{"label", "value", "count"}]``.

    Per line: (a) its log level, the first standalone uppercase level word (TRACE … SEVERE) or a logfmt or
    JSON ``level`` field, as ``("level", "ERROR")``; (b) logfmt ``key=value`` / ``key="quoted"`` fields when
    the line has two of them or a level; (c) the scalar fields of a JSON object line (JSONL); (d) a
    ``Key: value`` line (headers, YAML) with a short value.  Keys that are free text or unique per line (msg,
    ts, id, duration, …) are skipped.  A CSV/TSV chunk (by its path) is read as a table instead: its first line
    is the header row and each cell of the other rows a (column, value) record.  At most MAX_RECORDS_PER_CHUNK
    distinct pairs, first seen first.
    """
    counts: dict[tuple[str, str], int] = {}
    pairs = (
        _table_records(text, path) if is_table(path) else (p for line in text.split("\n") for p in _line_records(line))
    )
    for pair in pairs:
        if pair in counts:
            counts[pair] += 1
        elif len(counts) < MAX_RECORDS_PER_CHUNK:
            counts[pair] = 1
    return [{"label": label, "value": value, "count": n} for (label, value), n in counts.items()]


def analyst_reply(chunks: Sequence[ChunkForPrompt], question: Question) -> list[dict]:
    """The analyst's entries; when the question wants records, every entry (even one graded none) has them."""
    entries = analyse_chunks(question.query, chunks)
    if question.records_wanted:
        by_id = {c.chunk_id: c for c in chunks}
        for e in entries:
            chunk = by_id.get(e["chunk_id"])
            e["records"] = extract_records(chunk.text, _location(chunk)) if chunk else []
    return entries


def shared_analyst_reply(read: ReadInput) -> list[dict]:
    """A shared read (docs/contract.md#shared-reads): each numbered question answered over the same chunks, as
    if it were a read of its own, every entry tagged with its question's number.  The chunks a question grades
    none with nothing to say (nor to count) go into that question's one compact ``"none"`` list."""
    out: list[dict] = []
    for n, question in enumerate(read.questions, 1):
        nothing: list[int] = []
        for entry in analyst_reply(read.chunks, question):
            empty = not any(entry.get(k) for k in ("findings", "summary", "follow_up", "records"))
            if entry["relevance"] == "none" and empty:
                nothing.append(entry["chunk_id"])
            else:
                out.append({**entry, "question": n})
        if nothing:
            out.append({"question": n, "none": nothing})
    return out


# --------------------------------------------------------------------------- direct answer


def direct_answer(asked: DirectInput) -> str:
    """One answer straight from the chunks (instant mode, auto's direct route): the analyst's grading of the
    raw chunks, written up as the report is, plus exact totals of the records the chunks show when asked."""
    query = asked.query
    chunks = {c.chunk_id: c for c in asked.chunks}
    floor = RELEVANCE_RANK["medium"]  # as Collect does offline: "low" only means "shares a query term"
    analysed = sorted(
        _analysed(query, asked.chunks, relative=True), key=lambda es: -es[1]
    )  # best passage first, search rank on ties
    entries: list[_Entry] = [
        (e["chunk_id"], _shown_source(chunks[e["chunk_id"]]), e["relevance"], [_md_text(f) for f in e["findings"]])
        for e, _score in analysed
        if RELEVANCE_RANK.get(e["relevance"], 0) >= floor
    ]
    totals = None
    if asked.records_wanted:
        per_chunk = {cid: [Record(**r) for r in extract_records(c.text, _location(c))] for cid, c in chunks.items()}
        totals = records_markdown(aggregate(per_chunk), query)
    if entries:
        return "\n".join([*_answer_lines(query, entries, totals, ranked=True), "", _DISCLAIMER])
    lines = [
        "## No relevant passage",
        "",
        f"None of the {len(chunks)} chunks read matches “{_md_text(_clip(query, 200))}” closely enough to quote.",
    ]
    if totals:
        lines += ["", totals]
    return "\n".join([*lines, "", _DISCLAIMER])


# --------------------------------------------------------------------------- completeness check

MAX_RULE_FOLLOW_UPS = 3
MAX_RULE_GAPS = 5
#: an extractive finding: a verbatim quote and where it is, `"…" (a.md:12)`; only the quote names things
_QUOTE_AND_PLACE = re.compile(r'^"(.*)" \([^()\n]*:\d+\)$', re.S)
_IDENTIFIER = re.compile(
    r"\b[A-Za-z_][\w]*_\w+\b"  # snake_case
    r"|\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b"  # dotted.names
    r"|\b[A-Za-z]+[a-z0-9][A-Z]\w*\b"  # CamelCase, camelCase
    r"|\b[A-Z][A-Z0-9]{2,}\b"  # ALLCAPS
)
_UPPER, _LOWER = "A-ZÀ-ÖØ-Þ", "a-zß-öø-ÿ"
_CAPITALISED = re.compile(rf"\b[{_UPPER}][{_LOWER}]+(?: [{_UPPER}][{_LOWER}]+)*\b")
#: what ends a sentence or opens a quote: a capitalised word right after one is no name by itself
_SENTENCE_OPENERS = set(".!?:;\"“‘'([{*•-–—>")
_ENTITY_STOPWORDS = frozenset(
    stem_terms(
        " ".join(_LEVEL_NAMES)
        + " todo fixme note http https url uri api json xml html yaml csv utc gmt null none true false etc"
        " january february march april may june july august september october november december"
        " monday tuesday wednesday thursday friday saturday sunday today yesterday tomorrow"
    )
)


def _entities(text: str) -> list[str]:
    """Names in a finding, in order: identifiers (snake_case, dotted.names, CamelCase, ALLCAPS) and runs of
    capitalised words that do not merely start a sentence."""
    found: list[tuple[int, str]] = []
    taken: list[tuple[int, int]] = []
    for m in _IDENTIFIER.finditer(text):
        word = m.group(0)
        if word.isupper() and sum(c.isalpha() for c in word) < 3:
            continue
        found.append((m.start(), word))
        taken.append(m.span())
    for m in _CAPITALISED.finditer(text):
        if any(a < m.end() and m.start() < b for a, b in taken):
            continue
        words, at = m.group(0).split(" "), m.start()
        before = text[:at].rstrip()
        if not before or before[-1] in _SENTENCE_OPENERS:
            at += len(words[0]) + 1
            words = words[1:]  # "The Zephyrine Station" at a sentence start names "Zephyrine Station"
        if words:
            found.append((at, " ".join(words)))
    return [w for _, w in sorted(found)]


def _finding_texts(finding: ShownFinding) -> list[str]:
    out = []
    for text in finding.findings:
        m = _QUOTE_AND_PLACE.match(text.strip())
        out.append(m.group(1) if m else text.strip())
    return out


def check_by_rules(shown: FindingsInput) -> dict:
    """The completeness check by rules: follow up what the findings name and the question does not.

    Candidates are the names in the findings' lines (see ``_entities``) whose terms appear neither in the
    query nor in a question asked already; ranked by how many chunks name them, then by first appearance.
    Each follow-up is the name as a quoted phrase, so that the offline planner searches it exactly.
    Confidence is the weighted share of query terms the findings mention.
    """
    query = shown.query
    asked_terms = {t for q in shown.asked for t in _terms(q)}
    texts_by_chunk = [(f.chunk_id, _finding_texts(f)) for f in shown.findings]
    q_terms = _terms(query)
    known = set(q_terms) | asked_terms
    names: dict[str, str] = {}  # casefolded → first spelling
    chunks_naming: dict[str, set[int]] = {}
    for cid, texts in texts_by_chunk:
        for text in texts:
            for name in _entities(text):
                terms = set(_terms(name))
                if not terms or terms & known or terms <= _ENTITY_STOPWORDS or len(name) < 3:
                    continue
                key = name.casefold()
                names.setdefault(key, name)
                chunks_naming.setdefault(key, set()).add(cid)
    first = {k: i for i, k in enumerate(names)}
    ranked = sorted(names, key=lambda k: (-len(chunks_naming[k]), first[k]))
    follow_ups = [f'"{names[k]}"' for k in ranked[:MAX_RULE_FOLLOW_UPS]]

    units = [_terms(t) for _cid, texts in texts_by_chunk for t in texts]
    mentioned = {t for u in units for t in u}
    weights = _weights(q_terms, units)
    if weights:
        confidence = sum(w for t, w in weights.items() if t in mentioned) / sum(weights.values())
    else:  # a query of stopwords only: nothing to measure, so the findings' presence decides
        confidence = 1.0 if units else 0.0
    confidence = round(confidence, 2)
    # the gaps name the query's own words, not their stems
    spelled: dict[str, str] = {}
    for token in tokenize(query):
        spelled.setdefault(next(iter(_terms(token)), token), token)
    gaps = [f'no finding mentions "{spelled.get(t, t)}"' for t in weights if t not in mentioned][:MAX_RULE_GAPS]
    return {
        "complete": not follow_ups and confidence >= 0.5,
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
                out = json.dumps(plan_by_rules(asked.query))
            case "analyst", ReadInput(shared=True) as read:
                out = json.dumps({"entries": shared_analyst_reply(read)}, ensure_ascii=False)
            case "analyst", ReadInput(questions=(question,)) as read:
                reply = analyst_reply(read.chunks, question)
                out = json.dumps({"entries": reply}, ensure_ascii=False)  # the wire shape (llm/structured.py)
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
                # the prompt is for a model: reading it back would tie these rules to its wording
                raise LLMError(
                    f"the offline provider answers from the request's stage_input (llm/stage_input.py); this "
                    f"{role} request carries {type(given).__name__ if given is not None else 'none'}",
                    retryable=False,
                )

        return Completion(text=out, model=MODEL, latency_ms=int((time.perf_counter() - t0) * 1000))
