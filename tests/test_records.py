"""Typed records (``--scope all``): tolerant parsing, exact sums, a markdown table that untrusted text cannot break,
and the rules that tell an aggregation question."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from rlm_workers.llm.extractive import ExtractiveProvider, extract_records
from rlm_workers.llm.protocol import CompletionRequest
from rlm_workers.models import AggregateRow, QueryOptions, Record
from rlm_workers.pipeline.analyst import ChunkForPrompt, parse_findings, read_input, render_messages
from rlm_workers.pipeline.analyst import build_messages as build_analyst_messages
from rlm_workers.pipeline.route import first_routing
from rlm_workers.records.totals import (
    MAX_RECORDS_PER_CHUNK,
    RECORDS_INSTRUCTION,
    aggregate,
    aggregation_reason,
    holds_records,
    is_aggregation_question,
    md_safe,
    merge_records,
    parse_records,
    records_markdown,
)

# ---------------------------------------------------------------- parsing


def test_parse_records_accepts_what_models_send_and_skips_the_rest():
    raw = [
        {"label": " level ", "value": "ERROR", "count": 12},
        {"label": "level", "value": "WARN"},  # count defaults to 1
        {"label": "level", "value": "INFO", "count": 3.0},  # an integral float
        {"label": "host", "value": "web-3", "count": " 7 "},  # a numeric string
        {"label": "host", "value": "web-4", "count": "1,204"},  # thousands separators
        {"label": 404, "value": 2.5, "count": 1},  # numbers as text
        {"label": "flag", "value": True, "count": 1},
        {"label": "level", "value": None, "count": 4},  # no value: counted under an empty one
        {"label": "level", "value": "DEBUG", "count": 0},  # nothing to count: dropped, not an error
        {"label": "level", "value": "X", "count": True},  # JSON true is not 1
        {"label": "level", "value": "X", "count": -1},
        {"label": "level", "value": "X", "count": float("nan")},
        {"label": "level", "value": "X", "count": "NaN"},
        {"label": "level", "value": "X", "count": 1e12},
        {"label": "level", "value": "X", "count": 2.5},
        {"label": "level", "value": "X", "count": "many"},
        {"label": "   ", "value": "X", "count": 1},
        {"label": "level", "value": ["X"], "count": 1},
        {"value": "X", "count": 1},
        "level=ERROR",
    ]
    records, skipped = parse_records(raw)
    assert [(r.label, r.value, r.count) for r in records] == [
        ("level", "ERROR", 12),
        ("level", "WARN", 1),
        ("level", "INFO", 3),
        ("host", "web-3", 7),
        ("host", "web-4", 1204),
        ("404", "2.5", 1),
        ("flag", "true", 1),
        ("level", "", 4),
    ]
    assert skipped == 11


def test_parse_records_other_shapes_clipping_and_cap():
    records, skipped = parse_records({"level": {"ERROR": 2, "INFO": "3"}, "host": 5})
    assert [(r.label, r.value, r.count) for r in records] == [("level", "ERROR", 2), ("level", "INFO", 3)]
    assert skipped == 1
    assert parse_records(json.dumps([{"label": "a", "value": "b", "count": 2}]))[0] == [
        Record(label="a", value="b", count=2)
    ]
    assert parse_records(None) == ([], 0) and parse_records([]) == ([], 0)
    assert parse_records("not json") == ([], 1) and parse_records(42) == ([], 1)

    long, _ = parse_records([{"label": "L" * 500, "value": "V" * 500, "count": 1}])
    assert len(long[0].label) == 200 and len(long[0].value) == 300 and long[0].value.endswith("…")

    many, skipped = parse_records([{"label": "n", "value": str(i)} for i in range(MAX_RECORDS_PER_CHUNK + 25)])
    assert len(many) == MAX_RECORDS_PER_CHUNK and skipped == 25


def test_analyst_reply_records_are_read_even_for_a_chunk_graded_none():
    reply = json.dumps(
        [
            {"chunk_id": 1, "relevance": "none", "findings": [], "records": [{"label": "level", "value": "ERROR"}]},
            {"chunk_id": 2, "relevance": "high", "findings": ["x"], "records": {"level": {"INFO": 4}}},
            {"chunk_id": 3, "relevance": "low", "findings": ["y"]},
        ]
    )
    found = {f.chunk_id: f for f in parse_findings(reply, batch_chunk_ids=[1, 2, 3])}
    assert found[1].relevance == "none" and found[1].records == [Record(label="level", value="ERROR", count=1)]
    assert found[2].records == [Record(label="level", value="INFO", count=4)]
    assert found[3].records == []


def test_a_repeated_chunk_entry_is_not_counted_twice():
    entry = {
        "chunk_id": 5,
        "relevance": "high",
        "findings": ["a"],
        "records": [{"label": "level", "value": "ERROR", "count": 3}],
    }
    other = {**entry, "records": [{"label": "Level", "value": "error", "count": 4}, {"label": "kind", "value": "x"}]}
    (f,) = parse_findings(json.dumps([entry, other]), batch_chunk_ids=[5])
    assert {(r.label.lower(), r.value.lower(), r.count) for r in f.records} == {("level", "error", 4), ("kind", "x", 1)}
    # within one entry a pair listed twice is two lots of items
    twice = [Record(label="level", value="ERROR", count=2), Record(label="level", value="ERROR", count=3)]
    assert merge_records(twice, []) == [Record(label="level", value="ERROR", count=5)]


# ---------------------------------------------------------------- summing


def test_aggregate_sums_exactly_grouping_case_and_whitespace():
    per_chunk = {
        9: [Record(label="Level", value="error", count=1)],
        2: [Record(label="level", value="ERROR", count=3), Record(label="level", value="INFO", count=10)],
        4: [
            Record(label="LEVEL", value=" Error ", count=2),
            Record(label="host", value="web  3", count=1),
            Record(label="host", value="WEB 3", count=1),
            Record(label="host", value="web-4", count=5),
        ],
    }
    rows = aggregate(per_chunk)
    # first spelling by chunk id (2 before 4 before 9), not by the mapping's order
    assert rows == [
        AggregateRow(label="host", value="web-4", count=5, chunks=1),
        AggregateRow(label="host", value="web  3", count=2, chunks=1),
        AggregateRow(label="level", value="INFO", count=10, chunks=1),
        AggregateRow(label="level", value="ERROR", count=6, chunks=3),
    ]
    assert aggregate({}) == []


def _log_lines(n: int, seed: int = 11) -> tuple[list[str], Counter]:
    """Synthetic logs in four formats, and the true count of every (label, value) they show."""
    rnd = random.Random(seed)
    levels = ["DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR", "CRITICAL"]
    kinds = ["disk_full", "timeout", "oom", "auth"]
    truth: Counter = Counter()
    lines = []
    for i in range(n):
        level, kind, host = rnd.choice(levels), rnd.choice(kinds), f"web-{rnd.randint(1, 6)}"
        fmt = i % 4
        if fmt == 0:  # a level word, logfmt fields, a free-text msg that names another level
            lines.append(f'2026-03-01T10:00:{i % 60:02d}Z {level} [api] kind={kind} host={host} msg="after ERROR {i}"')
            truth.update([("level", level), ("kind", kind), ("host", host)])
        elif fmt == 1:  # prose: only the level
            lines.append(f"2026-03-01T10:00:{i % 60:02d}Z {level} [api] served request {i} in {rnd.randint(1, 99)} ms")
            truth.update([("level", level)])
        elif fmt == 2:  # JSONL; ts, msg and request_id are unique per line and skipped
            obj = {"ts": i, "level": level.lower(), "kind": kind, "host": host, "msg": f"m{i}", "request_id": i}
            lines.append(json.dumps(obj))
            truth.update([("level", level), ("kind", kind), ("host", host)])
        else:  # pure logfmt
            lines.append(f"ts=2026-03-01T10:00:00Z level={level.lower()} kind={kind} request_id=r{i} duration={i}ms")
            truth.update([("level", level), ("kind", kind)])
    return lines, truth


def test_extracted_records_of_2000_lines_over_40_chunks_sum_to_the_true_counts():
    lines, truth = _log_lines(2000)
    chunks = [
        ChunkForPrompt(
            chunk_id=100 + k,
            buffer="logs",
            path=f"app-{k}.log",
            start_line=1,
            end_line=50,
            text="\n".join(lines[k * 50 : (k + 1) * 50]),
        )
        for k in range(40)
    ]
    # the whole offline path: analyst messages asking for records, the extractive reply, the analyst's parser
    provider = ExtractiveProvider()
    per_chunk: dict[int, list[Record]] = {}
    for b in range(0, 40, 10):
        batch = chunks[b : b + 10]
        read = read_input("how many errors of each kind?", batch, records_wanted=True)
        messages = render_messages("S", read)
        request = CompletionRequest(role="analyst", model="m", messages=messages, max_tokens=10, stage_input=read)
        reply = provider.complete(request).text
        for f in parse_findings(reply, batch_chunk_ids=[c.chunk_id for c in batch]):
            per_chunk[f.chunk_id] = f.records
    assert len(per_chunk) == 40
    rows = aggregate(per_chunk)
    assert {(r.label, r.value): r.count for r in rows} == dict(truth)
    assert sum(r.count for r in rows if r.label == "level") == 2000
    # the same straight from the text
    direct = aggregate({c.chunk_id: [Record(**r) for r in extract_records(c.text)] for c in chunks})
    assert direct == rows


# ---------------------------------------------------------------- markdown


def test_markdown_escapes_untrusted_labels_and_values():
    evil_value = "a|b <script>alert(1)</script> `rm -rf` [x](http://e.vil)\nnext line\u2028| --- |"
    rows = [
        AggregateRow(label="kind", value=evil_value, count=3, chunks=1),
        AggregateRow(label="lab|el<img src=x>\n## Heading", value="v", count=1, chunks=1),
        AggregateRow(label="kind", value="", count=1, chunks=1),
    ]
    md = records_markdown(rows, "which kinds?")
    # every "<", backtick and bracket of the text is backslash-escaped: none can open a tag, a code span or a link
    assert not re.search(r"(?<!\\)[<`\[\]]", md.replace("`records`", ""))
    assert "\u2028" not in md and "\n## Heading" not in md
    table_rows = [ln for ln in md.split("\n") if ln.startswith("| ") and "---" not in ln and ln != "| value | count |"]
    for ln in table_rows:
        # exactly the table's own three pipes: every pipe of the text is escaped
        assert ln.replace("\\|", "").count("|") == 3, ln
    assert r"a\|b \<script\>" in md
    assert "| _(empty)_ | 1 |" in md
    assert md_safe("x\r\ny") == "x y"


def test_markdown_puts_the_labels_the_query_names_first_and_counts_what_is_left_out():
    rows = [AggregateRow(label=f"big{i}", value="v", count=1000 + i, chunks=1) for i in range(8)]
    rows += [AggregateRow(label="host", value=f"web-{i}", count=1, chunks=1) for i in range(60)]
    md = records_markdown(rows, "which hosts failed?", max_labels=3, max_values=50)
    assert md.startswith("## Exact totals\n")
    headings = [ln for ln in md.split("\n") if ln.startswith("### ")]
    assert headings == ["### host", "### big7", "### big6"]
    assert "60 in total, 60 distinct values." in md
    assert "…and 10 more values (10 items)." in md
    assert "Not shown: 6 more labels (6 values) and 10 more values of the labels above." in md
    assert "result's `records`" in md
    # a value that shares a term with the query also pulls its label forward
    rows2 = [
        AggregateRow(label="big", value="x", count=99, chunks=1),
        AggregateRow(label="k", value="timeout", count=1, chunks=1),
    ]
    assert records_markdown(rows2, "how many timeouts?").index("### k") < records_markdown(
        rows2, "how many timeouts?"
    ).index("### big")
    assert "No chunk reported anything" in records_markdown([], "q")


# ---------------------------------------------------------------- aggregation questions


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("How many ERROR lines are there?", "how many"),
        ("Count the failed logins", "count"),
        ("error counts per host", "counts"),
        ("List all   services that restarted", "list all"),
        ("list every host", "list every"),
        ("what happens every night", "every"),
        ("the number of retries", "number of"),
        ("How often each error code occurs", "how often"),
        ("total bytes sent", "total"),
        ("tally the votes", "tally"),
        ("distinct user agents", "distinct"),
        ("errors of each kind", "each kind"),
        ("each type of request", "each type"),
        ("frequency of warnings", "frequency"),
    ],
)
def test_aggregation_questions(query, reason):
    assert is_aggregation_question(query)
    assert aggregation_reason(query) == reason


@pytest.mark.parametrize(
    "query",
    [
        "why did the account get locked?",
        "what is everything about",
        "describe the counter class",
        "totally lost",
        "",
        # the frequency of a behaviour (a schedule, an interval the text states), not a count over records
        "How often does the beat scheduler wake up?",
        "how often do workers restart",
        "How often did it time out?",
        "how often is the cache flushed",
    ],
)
def test_not_aggregation_questions(query):
    assert not is_aggregation_question(query)
    assert aggregation_reason(query) is None


def test_analyst_message_asks_for_records_only_when_wanted():
    chunk = ChunkForPrompt(chunk_id=3, buffer="b", path="f.log", start_line=1, end_line=2, text="x")
    plain = build_analyst_messages("S", "q", [chunk], ["t"])[1]["content"]
    assert "## Records" not in plain
    text = build_analyst_messages("S", "q", [chunk], ["t"], records_wanted=True)[1]["content"]
    # the instruction is the same for every call, so it sits with the chunks before the query (prompt caching)
    assert f"</content>\n\n## Records\n\n{RECORDS_INSTRUCTION}\n\n## Query\n\nq\n\n## Focus topics" in text


# ---------------------------------------------------------------- routing a counting question by what the buffers hold

#: Celery-like source: keyword arguments (``name=None,``), a level word in a code string, a docstring
CODE = '''"""The periodic task scheduler."""

import time

DEFAULT_MAX_INTERVAL = 300  # the beat wakes up at least every 5 minutes


class Scheduler:
    def __init__(self, app, schedule=None, max_interval=None,
                 Producer=None, lazy=False, sync_every=None,
                 name=None, app_name=None, **kwargs):
        self.max_interval = (max_interval or DEFAULT_MAX_INTERVAL)
        logger.debug("DEBUG beat: waking up in %s", self.max_interval)

    def apply_async(self, entry, producer=None, advance=True,
                    name=None, countdown=None, expires=None):
        return self.send_task(entry.task, entry.args, name=name,
                              countdown=countdown, expires=expires)
'''
LOGS = "\n".join(
    f"2026-03-01T10:00:{i:02d}Z {'ERROR' if i % 3 else 'INFO'} [beat] kind=timeout host=web-{i % 4}" for i in range(40)
)
CSV = "order_id,region,status\n" + "\n".join(f"{i},north,shipped" for i in range(40))
PROSE = "# Beat\n\nThe beat wakes up every five minutes.\n\nEach kind of task has its own queue.\n"


@pytest.mark.parametrize(
    ("samples", "holds"),
    [
        ([("celery/beat.py", CODE)] * 10, False),
        ([("docs/beat.md", PROSE)] * 10, False),
        ([("app.log", LOGS)], True),
        ([("orders.csv", CSV)], True),
        ([("app.jsonl", '{"level": "info", "msg": "x"}\n' * 5)], True),
        ([("celery/beat.py", CODE)] * 8 + [("app.log", LOGS)] * 2, True),  # logs beside the code: counted
        ([], False),
    ],
)
def test_holds_records_tells_records_from_code_and_prose(samples, holds):
    assert holds_records(samples) is holds


@pytest.mark.parametrize(
    ("query", "records", "route", "says"),
    [
        ("How often does the beat scheduler wake up?", True, "fanout", "default"),
        ("How often does the beat scheduler wake up?", False, "fanout", "default"),
        ("How many errors of each kind are there?", True, "exhaustive", "'how many'"),
        ("How many errors of each kind are there?", False, "fanout", "no records to count"),
        ("count of each status", True, "exhaustive", "'count'"),
        ("count of each status", False, "fanout", "no records to count"),
        ("How often each error code occurs", True, "exhaustive", "'how often'"),
    ],
)
def test_only_a_counting_question_over_records_is_routed_exhaustive(query, records, route, says):
    asked = []

    def has_records() -> bool:
        asked.append(query)
        return records

    r = first_routing(QueryOptions(), None, query, is_child=False, has_records=has_records)
    assert r.route == route and says in r.reason
    assert asked == ([query] if is_aggregation_question(query) else [])  # no sample read for other questions


def test_scope_search_and_a_planner_route_do_not_read_a_sample():
    def never() -> bool:
        raise AssertionError("sampled")

    q = "How many errors are there?"
    assert first_routing(QueryOptions(scope="search"), None, q, is_child=False, has_records=never).route == "fanout"
    assert first_routing(QueryOptions(scope="all"), None, q, is_child=False, has_records=never).route == "exhaustive"
    planned = {"route": "exhaustive", "route_reason": "a full list"}
    assert first_routing(QueryOptions(), planned, q, is_child=False, has_records=never).route == "exhaustive"


def test_code_yields_no_records_of_keyword_arguments_or_levels_in_code_strings():
    labels = {r["label"] for r in extract_records(CODE, "celery/beat.py")}
    assert labels == set(), labels
    counted = {(r["label"], r["value"]): r["count"] for r in extract_records(LOGS, "app.log")}
    assert counted[("level", "ERROR")] == 26 and counted[("kind", "timeout")] == 40
    assert counted[("host", "web-0")] == 10
