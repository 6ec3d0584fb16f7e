"""Typed records for exact totals (``--scope all``): parsing them from a reply, summing them, showing them.

An aggregation question ("how many errors of each kind?") cannot be answered by
a model reading a sample: every chunk is analysed, each analyst counts what its
chunks show as ``{"label", "value", "count"}`` records, and the sums are done
here, in Python, exactly (docs/contract.md#modes).  The table of totals in the
answer is written by this module, not by a model, so a model cannot misadd it.

Labels and values come from untrusted text (a model that read the chunks, or
the chunks themselves): they are bounded when parsed and escaped when shown.
Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..models import AggregateRow, Record
from ..search.tokenize import tokenize

#: records kept per chunk; a reply listing more is cut (the cut is counted as skipped)
MAX_RECORDS_PER_CHUNK = 500
MAX_LABEL_CHARS = 200
MAX_VALUE_CHARS = 300
#: a larger count is a model's invention, not something one chunk can show
MAX_RECORD_COUNT = 1_000_000_000

#: the ``## Records`` section of an analyst's (or a direct answer's) message
RECORDS_INSTRUCTION = (
    "This question needs exact totals. For every chunk, besides the usual fields, return "
    '"records": a list of {"label": …, "value": …, "count": …} objects that count every item in that chunk '
    'the question is about (for example label "level", value "ERROR", count 12). Use the same label for the '
    "same kind of thing in every chunk. Count only what the chunk itself shows, item by item; never estimate, "
    "extrapolate or round. A chunk with nothing to count gets an empty list. A chunk of a table (CSV, TSV) "
    "always begins with the table's header row: it names the columns and is not a row to count."
)

_SUFFIXES = ("ations", "ation", "ings", "ing", "ures", "ure", "ers", "er", "ies", "ed", "es", "ly", "s")


def stem_terms(text: str) -> list[str]:
    """BM25 tokens, crudely stemmed so "failing", "failure" and "fails" meet at "fail" (the offline provider's
    notion of a term, shared so that relevance here and there agree)."""
    out = []
    for t in tokenize(text):
        if len(t) > 4 and t.isalpha():
            for suf in _SUFFIXES:
                if t.endswith(suf) and len(t) - len(suf) >= 3:
                    t = t[: -len(suf)]
                    break
        out.append(t)
    return out


# --------------------------------------------------------------------------- parsing

_INTEGER = re.compile(r"[+-]?\d{1,30}")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")


def _count(raw: Any) -> int | None:
    """A usable count or None: an int, an integral float or a numeric string, from 0 to MAX_RECORD_COUNT."""
    if raw is None:
        return 1
    if isinstance(raw, bool):
        return None  # JSON true is not 1
    if isinstance(raw, str):
        text = raw.strip()
        if _THOUSANDS.fullmatch(text):
            text = text.replace(",", "")
        try:
            raw = int(text) if _INTEGER.fullmatch(text) else float(text)
        except (ValueError, OverflowError):
            return None
    if isinstance(raw, float):
        if not math.isfinite(raw) or raw != int(raw):
            return None
        raw = int(raw)
    if not isinstance(raw, int) or raw < 0 or raw > MAX_RECORD_COUNT:
        return None
    return raw


def _text(raw: Any, limit: int) -> str | None:
    """A label or value as text: strings and numbers (bools as JSON spells them); anything else is unusable."""
    if isinstance(raw, bool):
        text = "true" if raw else "false"
    elif isinstance(raw, int):
        text = str(raw)
    elif isinstance(raw, float):
        if not math.isfinite(raw):
            return None
        text = str(raw)
    elif isinstance(raw, str):
        text = raw.strip()
    else:
        return None
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _one(label: Any, value: Any, count: Any) -> Record | None:
    lab = _text(label, MAX_LABEL_CHARS)
    val = "" if value is None else _text(value, MAX_VALUE_CHARS)
    n = _count(count)
    if not lab or val is None or n is None:
        return None
    return Record(label=lab, value=val, count=n)


def _entries(raw: Any) -> Iterable[tuple[Any, Any, Any] | None]:
    """(label, value, count) triples of either accepted shape; None for an entry of neither."""
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict):
                yield item.get("label"), item.get("value"), item.get("count")
            else:
                yield None
    elif isinstance(raw, dict):  # {label: {value: count}}
        for label, values in raw.items():
            if isinstance(values, dict):
                for value, count in values.items():
                    yield label, value, count
            else:
                yield None


def parse_records(raw: Any) -> tuple[list[Record], int]:
    """A reply's ``records`` field → (records, entries skipped as unusable or beyond MAX_RECORDS_PER_CHUNK).

    Accepts a list of ``{"label", "value", "count"}`` objects or ``{label: {value: count}}``; a JSON string of
    either is read too.  ``count`` defaults to 1; a count of 0 carries nothing and is dropped without being
    counted as skipped.  Nothing (None, ``[]``) is no records.
    """
    if raw is None or raw == "" or raw == [] or raw == {}:
        return [], 0
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return [], 1
    if not isinstance(raw, list | dict):
        return [], 1
    out: list[Record] = []
    skipped = 0
    for entry in _entries(raw):
        record = _one(*entry) if entry is not None else None
        if record is None:
            skipped += 1
        elif record.count == 0:
            continue
        elif len(out) >= MAX_RECORDS_PER_CHUNK:
            skipped += 1
        else:
            out.append(record)
    return out, skipped


# --------------------------------------------------------------------------- summing


def _key(text: str) -> str:
    """What makes two spellings the same label or value: case and runs of whitespace do not count."""
    return " ".join(text.split()).casefold()


def merge_records(first: Sequence[Record], second: Sequence[Record]) -> list[Record]:
    """The records of two entries one reply gave for the same chunk.

    Not summed: a model that repeats a chunk's entry repeats its counts, and adding them would double the
    chunk.  A pair in both keeps the larger count; pairs in only one are kept as they are.
    """

    def summed(records: Sequence[Record]) -> dict[tuple[str, str], Record]:
        out: dict[tuple[str, str], Record] = {}
        for r in records:  # within one entry, a pair listed twice is two lots of items
            key = (_key(r.label), _key(r.value))
            out[key] = out[key].model_copy(update={"count": out[key].count + r.count}) if key in out else r
        return out

    merged = summed(first)
    for key, r in summed(second).items():
        if key not in merged or r.count > merged[key].count:
            merged[key] = merged[key].model_copy(update={"count": r.count}) if key in merged else r
    return list(merged.values())[:MAX_RECORDS_PER_CHUNK]


def aggregate(per_chunk: Mapping[int, Sequence[Record]]) -> list[AggregateRow]:
    """Exact sums per (label, value) over every chunk; ``chunks`` = how many chunks reported the pair.

    Spellings that differ only in case or whitespace are one pair, shown as first seen (chunks in id order,
    so the result does not depend on the order the mapping was built in); every value of a label is shown
    under the label's first spelling.  Sorted by label, then count (largest first), then value.
    """
    labels: dict[str, str] = {}
    values: dict[tuple[str, str], str] = {}
    counts: dict[tuple[str, str], int] = {}
    seen_in: dict[tuple[str, str], set[int]] = {}
    for chunk_id in sorted(per_chunk):
        for r in per_chunk[chunk_id]:
            lk = _key(r.label)
            key = (lk, _key(r.value))
            labels.setdefault(lk, r.label)
            values.setdefault(key, r.value)
            counts[key] = counts.get(key, 0) + r.count
            seen_in.setdefault(key, set()).add(chunk_id)
    rows = [
        AggregateRow(label=labels[key[0]], value=values[key], count=n, chunks=len(seen_in[key]))
        for key, n in counts.items()
    ]
    rows.sort(key=lambda r: (_key(r.label), -r.count, _key(r.value), r.value))
    return rows


# --------------------------------------------------------------------------- showing

#: line breaks of every kind and the other control characters: one space each in a table cell
_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")
#: what markdown would read as syntax in a cell or a heading: a table's "|", tags, code spans, links, emphasis
_MD_SYNTAX = re.compile(r"([\\`*\[\]<>|#~&!])")
#: an underscore that could open or close emphasis; one inside a word (``disk_full``) never does in CommonMark,
#: so values read as they were written
_MD_EDGE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def md_safe(text: str) -> str:
    """Untrusted text for one table cell or heading: shown as written, never read as markdown or HTML."""
    shown = " ".join(_BREAKS.sub(" ", text).split())
    if not shown:
        return "_(empty)_"
    return _MD_EDGE_UNDERSCORE.sub(r"\\_", _MD_SYNTAX.sub(r"\\\1", shown))


def _relevant(label: str, values: Sequence[AggregateRow], query_terms: set[str]) -> bool:
    if query_terms & set(stem_terms(label)):
        return True
    return any(query_terms & set(stem_terms(r.value)) for r in values)


def records_markdown(rows: Sequence[AggregateRow], query: str, *, max_labels: int = 6, max_values: int = 50) -> str:
    """The "## Exact totals" section of an answer: one value | count table per label.

    Labels the query is about (the label or one of its values shares a term with it) come first, then the
    rest by total count; what does not fit is counted, and the full list stays in the result's ``records``.
    """
    head = ["## Exact totals", ""]
    if not rows:
        return "\n".join([*head, "No chunk reported anything to count."])
    groups: dict[str, list[AggregateRow]] = {}
    for r in rows:
        groups.setdefault(_key(r.label), []).append(r)
    q_terms = set(stem_terms(query))
    totals = {k: sum(r.count for r in g) for k, g in groups.items()}
    order = sorted(
        groups,
        key=lambda k: (not _relevant(groups[k][0].label, groups[k], q_terms), -totals[k], k),
    )
    shown = order[: max(0, max_labels)]
    lines = [
        *head,
        "Summed exactly from what was counted in each chunk; the arithmetic is done by rlm, not by a language model.",
    ]
    hidden_values = 0
    for k in shown:
        group = sorted(groups[k], key=lambda r: (-r.count, _key(r.value), r.value))
        lines += [
            "",
            f"### {md_safe(group[0].label)}",
            "",
            f"{totals[k]} in total, {len(group)} distinct value{'s' if len(group) != 1 else ''}.",
            "",
            "| value | count |",
            "| --- | ---: |",
        ]
        lines += [f"| {md_safe(r.value)} | {r.count} |" for r in group[:max_values]]
        if len(group) > max_values:
            rest = group[max_values:]
            hidden_values += len(rest)
            lines += ["", f"…and {len(rest)} more values ({sum(r.count for r in rest)} items)."]
    left_labels = order[len(shown) :]
    left_out = []
    if left_labels:
        n_values = sum(len(groups[k]) for k in left_labels)
        left_out.append(f"{len(left_labels)} more label{'s' if len(left_labels) != 1 else ''} ({n_values} values)")
    if hidden_values:
        left_out.append(f"{hidden_values} more values of the labels above")
    lines.append("")
    if left_out:
        lines.append(f"Not shown: {' and '.join(left_out)}. The full list is in the result's `records`.")
    else:
        lines.append("The same totals are in the result's `records`.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- which questions need them

#: "how often does the beat wake up / do workers restart": the frequency of a behaviour, which the text (a
#: schedule, an interval) states; not a count over records, so only "how often" that is not asked of a verb is
_BEHAVIOURAL_VERB = r"(?:does|do|did|is|are|was|were|will|would|should|can|could|must|may|might|has|have|had)"
_AGGREGATION = re.compile(
    rf"\b(?:how\s+many|how\s+often(?!\s+{_BEHAVIOURAL_VERB}\b)|number\s+of|list\s+(?:all|every)|counts?|counting|every|totals?|tall(?:y|ies)"
    r"|distinct|each\s+(?:kind|type)s?|frequenc(?:y|ies))\b",
    re.I,
)


def aggregation_reason(query: str) -> str | None:
    """The first phrase that makes ``query`` an aggregation question ("how many", "count", "list all", …),
    lowercased, or None."""
    m = _AGGREGATION.search(query or "")
    return " ".join(m.group(0).lower().split()) if m else None


def is_aggregation_question(query: str) -> bool:
    """Whether answering ``query`` needs every chunk counted (auto mode's ``exhaustive`` route)."""
    return aggregation_reason(query) is not None


#: a line that is one record: it starts with a time or a log level, is a JSON object, holds two logfmt
#: ``key=value`` fields whose bare values carry no code punctuation (``name=None,`` is a keyword argument), or is
#: an unindented ``Key: value`` line that is not code
_RECORD_START = re.compile(
    r"^\s*[\[(]?(?:\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}:\d{2}|\d{1,2}/\w{3}/\d{4}|[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}"
    r"|\d{1,3}(?:\.\d{1,3}){3}\s|(?:TRACE|DEBUG|INFO|NOTICE|WARN|WARNING|ERROR|CRITICAL|FATAL|SEVERE)\b)"
)
_FIELD = re.compile(r'(?:^|(?<=\s))[A-Za-z_@][\w.@-]{0,63}=(?:"(?:[^"\\]|\\.)*"|[^\s"(){}\[\],;]+)(?=\s|$)')
_KEY_VALUE = re.compile(r"^(?:-\s+)?[A-Za-z][\w .-]{0,39}:\s+\S")
#: braces, statements, calls, arrows and keywords: a line of code, whatever else it looks like
CODE_LINE = re.compile(
    r"[{};]|=>|->|\w\(|^\s*(?:def|class|if|elif|else|for|while|case|return|import|from|function|const|let|var)\b"
)
#: a chunk is record-like when this share of its non-blank lines are records; buffers hold countable records
#: when this share of the chunks sampled from them are record-like
RECORD_LINE_SHARE = 0.5
RECORD_CHUNK_SHARE = 0.2


def is_record_line(line: str) -> bool:
    """Whether ``line`` is a structured record (a log line, a JSON object, logfmt fields, a header) rather than
    code or prose: what an exact count counts."""
    stripped = line.strip()
    if not stripped:
        return False
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            return isinstance(json.loads(stripped), dict)
        except (ValueError, RecursionError):
            pass
    if _RECORD_START.match(line) or len(_FIELD.findall(line)) >= 2:
        return True
    return bool(_KEY_VALUE.match(line)) and not CODE_LINE.search(line)


def holds_records(samples: Iterable[tuple[str, str]]) -> bool:
    """Whether chunks sampled from some buffers, as (path, text), show records to count: a table (CSV, TSV) or
    chunks most of whose lines are records.  Source code and prose hold none, whatever counting words they use."""
    total = like = 0
    for path, text in samples:
        total += 1
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if is_table(path) or (lines and sum(map(is_record_line, lines)) >= RECORD_LINE_SHARE * len(lines)):
            like += 1
    return total > 0 and like >= RECORD_CHUNK_SHARE * total


def own_lines(text: str, start_line: int, end_line: int, prev_end_line: int | None, tail: str = "") -> tuple[int, str]:
    """The lines of a chunk that no earlier chunk of its file holds: (first line number, their text).

    Chunks overlap (``--overlap``), so counting every chunk's full text would count the shared lines twice.
    An exhaustive job reads each line once: a line belongs to the first chunk whose text reaches it.  A chunk
    that ends inside a line (the fixed chunker cuts anywhere) owns that whole line — ``tail`` is the file's
    text right after the chunk, from the next chunk — and the next chunk skips it.
    """
    lines = text.split("\n")
    first = start_line if prev_end_line is None else max(start_line, prev_end_line + 1)
    skip = first - start_line
    if skip >= len(lines) or first > end_line:
        return first, ""
    owned = lines[skip:]
    if tail and not text.endswith("\n"):
        owned[-1] += tail.split("\n", 1)[0]
    return first, "\n".join(owned)


#: delimited tables whose rows are records (a header row, then one record per row)
TABLE_SUFFIXES = {".csv": ",", ".tsv": "\t"}


def is_table(path: str) -> bool:
    return any(path.lower().endswith(suffix) for suffix in TABLE_SUFFIXES)
