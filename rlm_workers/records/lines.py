"""Typed records one chunk shows, read from its lines without a model: what the offline provider counts for
exact totals (``--scope all``, docs/contract.md#modes).

A plain parser of common record formats, not of any one corpus: a log line's level, logfmt ``key=value``
fields, the scalar fields of a JSON line, a ``Key: value`` line, and each cell of a CSV/TSV row under its
column.  Fields that are free text or unique per line (messages, times, ids) are left out: counting them would
count lines, not kinds.  A line of code is no record (``totals.is_record_line``).  Pure: no I/O.
"""

from __future__ import annotations

import csv
import json
import re

from .totals import CODE_LINE, MAX_RECORDS_PER_CHUNK, TABLE_SUFFIXES, is_record_line, is_table

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
