"""Structured outputs: the reply models of the JSON stages and the JSON Schemas sent for them.

Each stage that parses JSON (plan, analyst, shared read, rewrite; the completeness check's model is
``pipeline/check.py::CheckVerdict``) sends the schema of the very model that then validates the reply, as
``response_format: {"type": "json_schema", ...}`` (docs/contract.md#structured-outputs).  The schema is what a
server may enforce; the models stay lenient, because a server that enforces nothing (``json_object``, ``off``, or
an old one) still gets the prompt's words only: a grade spelled "critical", a chunk id sent as "chunk 7" or a
number as "20" are read as before, and a field that cannot be read is left unset rather than failing the reply.

Schemas are kept to what llama.cpp's grammar conversion, vLLM, Ollama and OpenAI all accept: a top-level object,
local references inlined, no titles, and ``strict`` false (strict mode would need every property required, and
the plan's fields are optional by design).

The JSON action form of a tool call (``{"action": ..., "arguments": {...}}`` or ``{"answer": ...}``) is here too:
it is what a synthesizer on a server without native tool calling replies with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, WithJsonSchema, model_validator

from ..models import AnalystBatchSize, MaxChunks, Relevance, Route, SearchMode, Threshold, TopK
from ..search.provenance import cite_of
from .replies import cited_chunk_ids, clip, json_candidates

#: words models use for grades, mapped onto ours
GRADES = {
    "critical": Relevance.high,
    "high": Relevance.high,
    "medium": Relevance.medium,
    "moderate": Relevance.medium,
    "low": Relevance.low,
    "minor": Relevance.low,
    "none": Relevance.none,
    "irrelevant": Relevance.none,
    "no": Relevance.none,
}
MAX_FOCUS_TOPICS = 10
MAX_ROUTE_REASON_BYTES = 300
#: an answering analyst's answer at most (a few sentences: its allowance of tokens bounds it too)
MAX_BATCH_ANSWER_CHARS = 800


def as_chunk_id(raw: Any) -> int | None:
    """An id as models write it: 7, "7" or "chunk 7"; None when there is no number (a bool is no id)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        m = re.search(r"\d+", raw)
        return int(m.group()) if m else None
    return None


def _texts(raw: Any) -> list[str]:
    """A list of texts from a string or a list; items that are not strings become JSON text, empty ones go."""
    items = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    return [
        item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
        for item in items
        if item not in (None, "")
    ]


# --------------------------------------------------------------------------- plan


_PLANNED: dict[str, TypeAdapter[Any]] = {
    "search_mode": TypeAdapter(SearchMode),
    "threshold": TypeAdapter(Threshold),
    "top_k": TypeAdapter(TopK),
    "max_chunks": TypeAdapter(MaxChunks),
    "batch_size": TypeAdapter(AnalystBatchSize),
}


class PlanReply(BaseModel):
    """The planner's reply: every field optional ("leave out any field you have no opinion on"); one that is out
    of bounds or not a number is left unset, as if the planner had not set it."""

    model_config = ConfigDict(extra="ignore", use_enum_values=True)

    search_mode: SearchMode | None = None
    threshold: Threshold | None = None
    top_k: TopK | None = None
    max_chunks: MaxChunks | None = None
    batch_size: AnalystBatchSize | None = None
    focus_topics: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=MAX_FOCUS_TOPICS)
    route: Route | None = None
    route_reason: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        out: dict[str, Any] = {}
        for name, adapter in _PLANNED.items():
            value = raw.get(name)
            if isinstance(value, bool) or value is None:
                continue
            if name == "search_mode":
                value = str(value).lower()
            elif isinstance(value, int | float | str):
                try:
                    value = float(value) if name == "threshold" else int(float(value))  # models send "20" or 20.0
                except (ValueError, OverflowError):
                    continue
            else:
                continue
            try:
                out[name] = adapter.validate_python(value)
            except ValidationError:
                continue  # out of bounds or not a number: the field stays unset
        topics = raw.get("focus_topics")
        if isinstance(topics, list):
            out["focus_topics"] = [clip(t, 200) for t in topics if isinstance(t, str) and t.strip()][:MAX_FOCUS_TOPICS]
        route = str(raw.get("route") or "").strip().lower()
        if route in {r.value for r in Route}:
            out["route"] = route
            out["route_reason"] = clip(str(raw.get("route_reason") or ""), MAX_ROUTE_REASON_BYTES)
        return out


# --------------------------------------------------------------------------- analyst and shared read

#: records are checked one by one by ``records/totals.parse_records`` (a bad one is skipped, not the entry):
#: the model takes them as they come, and only the schema says their shape
_RECORD_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "value": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["label", "value", "count"],
    "additionalProperties": False,
}
#: kept as the model wrote it, a list, ``{label: {value: count}}`` or a JSON string of either: parse_records reads all
Records = Annotated[list[Any] | dict[str, Any] | str | None, WithJsonSchema({"type": "array", "items": _RECORD_SCHEMA})]


class AnalystEntry(BaseModel):
    """One chunk's entry of an analyst reply; ``question`` only in a shared read.  Caps (findings per batch,
    follow-ups, bytes) are applied where the entries become findings (``pipeline/analyst.py``)."""

    model_config = ConfigDict(extra="ignore", use_enum_values=True)

    chunk_id: int
    relevance: Relevance
    findings: list[str]
    summary: str
    follow_up: list[str]
    records: Records = None
    question: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        summary = raw.get("summary")
        return {
            "chunk_id": as_chunk_id(raw.get("chunk_id")),
            "relevance": GRADES.get(str(raw.get("relevance", "")).strip().lower(), Relevance.low),
            "findings": _texts(raw.get("findings")),
            "summary": summary if isinstance(summary, str) else json.dumps(summary) if summary is not None else "",
            "follow_up": _texts(raw.get("follow_up", raw.get("follow_ups"))),
            "records": raw.get("records") if isinstance(raw.get("records"), list | dict | str) else None,
            "question": as_chunk_id(raw.get("question", raw.get("question_no"))),
        }


#: the key of a compact reply object listing the chunks graded "none" (docs/contract.md#shared-reads)
NONE_KEY = "none"


class NoneList(BaseModel):
    """A shared read's compact object: the chunk ids one question grades none (``{"question": 2, "none": [4]}``)."""

    model_config = ConfigDict(extra="ignore")

    question: int | None = None
    none: list[int]

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        items = raw.get(NONE_KEY)
        items = items if isinstance(items, list) else [items]
        return {
            "question": as_chunk_id(raw.get("question", raw.get("question_no"))),
            NONE_KEY: [cid for r in items if (cid := as_chunk_id(r)) is not None],
        }


class AnalystReply(BaseModel):
    """The analyst's reply on the wire: an object wrapping one entry per chunk (a JSON array at the top level is
    not what ``json_object`` servers produce, and llama.cpp's would force one object)."""

    entries: list[AnalystEntry]


class SharedReply(BaseModel):
    """A shared read's reply: entries carrying their question number, and compact none lists."""

    entries: list[AnalystEntry | NoneList]


class BatchAnswer(BaseModel):
    """An answering analyst's reply (RLM_ANALYST_FINDINGS=answers): what its batch says about the question, and
    the chunks that say it (none, or an empty answer, when no chunk bears on it)."""

    model_config = ConfigDict(extra="ignore")

    answer: Annotated[str, Field(max_length=MAX_BATCH_ANSWER_CHARS)]
    cited_chunks: list[int]

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        answer = raw.get("answer")
        return {
            "answer": clip(answer, MAX_BATCH_ANSWER_CHARS) if isinstance(answer, str) else "",
            "cited_chunks": _cited_ids(raw.get("cited_chunks")),
        }


def batch_answer_schema(chunk_ids: Sequence[int]) -> dict[str, Any]:
    """An answering analyst's schema for one batch: the ids it may cite are its own chunks'."""
    schema = json.loads(json.dumps(BATCH_ANSWER_SCHEMA))
    props = schema["schema"]["properties"]
    props["answer"]["maxLength"] = MAX_BATCH_ANSWER_CHARS
    _cite_only(props, chunk_ids)
    return schema


def validate_entry(raw: dict) -> dict | None:
    """One reply entry through its model, as a plain dict (canonical keys); None for one we cannot use."""
    model = AnalystEntry if "chunk_id" in raw or NONE_KEY not in raw else NoneList
    try:
        entry = model.model_validate(raw)
    except ValidationError:
        return None
    # the fields as validated, shallow: the values are already plain JSON (the lenient validator rebuilt them
    # from the parsed reply), so a JSON-mode dump of each of a batch's entries only copied them at a cost
    return dict(entry)


# --------------------------------------------------------------------------- direct answer


class CitedAnswer(BaseModel):
    """A direct answer: the text first, then the ids of the chunks it rests on, which we render as citations —
    in free text a small model left them out, or wrote nothing but a citation (docs/contract.md#local-llm)."""

    model_config = ConfigDict(extra="ignore")

    answer: Annotated[str, Field(min_length=1)]
    cited_chunks: list[int]

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            raw = {**raw, "cited_chunks": _cited_ids(raw.get("cited_chunks"))}
        return raw


def parse_answer(text: str) -> CitedAnswer | None:
    """The answer object of a direct reply; None for a reply that is plain markdown (a server that enforced no
    schema), which is then the answer as it stands."""
    stripped = (text or "").strip()
    if not stripped.startswith(("{", "```")):
        return None
    for value in json_candidates(stripped):
        if isinstance(value, dict) and "answer" in value:
            try:
                return CitedAnswer.model_validate(value)
            except ValidationError:
                return None
    # cut at the output limit (a small model that rambles): the words it wrote are still its answer, and the ids
    # it finished writing still its citations
    m = _CUT_ANSWER.match(stripped)
    if m:
        try:
            words = json.loads(f'"{m.group(1)}"').strip()
        except ValueError:
            return None
        written = m.group(3) or ""
        ids = [int(n) for n in re.findall(r"\d+", written)]
        if ids and not written.rstrip().endswith(","):
            ids.pop()  # the last number may have been cut mid-way
        ids = ids if m.group(2) else []
        if words:
            return CitedAnswer(answer=words if m.group(2) else f"{words} …", cited_chunks=ids)
    return None


def render_answer(reply: str, shown: Mapping[int, Any]) -> str:
    """The report of an answer reply: the answer object's text with the chunks it names cited at its end (those the
    text does not cite already, and only chunks the model was shown: ``shown`` maps their ids to anything carrying a
    chunk's place, a prompt's chunk or a shown finding); a plain markdown reply as it is."""
    parsed = parse_answer(reply)
    return reply if parsed is None else render_cited(parsed, shown)


def render_cited(parsed: CitedAnswer, shown: Mapping[int, Any]) -> str:
    """``render_answer`` of a parsed answer object: its text, said once, with the chunks it names cited at its end."""
    text = said_once(parsed.answer.strip())
    inline = set(cited_chunk_ids(text, shown))
    extra = [cid for cid in dict.fromkeys(parsed.cited_chunks) if cid in shown and cid not in inline]
    if extra:
        text += "\n\nSources: " + ", ".join(f"[chunk {cid}, {cite_of(shown[cid])}]" for cid in extra)
    return text


def said_once(text: str) -> str:
    """``text`` with every sentence after its first saying dropped: a small model at temperature 0 can fall into a
    loop, writing one sentence again and again until its output limit, and the copies add nothing.  Short
    sentences (a list item, a table cell) may rightly repeat and are kept, and so is fenced code."""
    seen: set[str] = set()
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        fence = line.lstrip().startswith("```")
        fenced ^= fence
        if fenced or fence or not line.strip():
            out.append(line)
            continue
        kept = []
        for sentence in _SENTENCE_END.split(line):
            key = " ".join(sentence.lower().split()).rstrip(" …")
            cut = sentence.rstrip().endswith("…")
            if key and (len(key) >= MIN_REPEAT_CHARS or cut) and any(k.startswith(key) for k in seen):
                continue  # said before, or a copy cut short at the output limit
            seen.add(key)
            kept.append(sentence)
        if kept:
            out.append(" ".join(kept))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
#: a sentence shorter than this is never taken for a loop's copy
MIN_REPEAT_CHARS = 30


#: an answer object cut short: its answer string (closed, group 2, or not), then what was written of the ids
_CUT_ANSWER = re.compile(
    r'\{\s*"answer"\s*:\s*"((?:[^"\\]|\\.)*)(?:(")\s*,?\s*(?:"cited_chunks"\s*:\s*\[([\d\s,]*))?)?\Z', re.S
)


# --------------------------------------------------------------------------- chat rewrite


class RewriteReply(BaseModel):
    """The standalone question a chat turn's follow-up becomes."""

    model_config = ConfigDict(extra="ignore")

    question: Annotated[str, Field(min_length=1, max_length=2000)]


# --------------------------------------------------------------------------- tool calls as JSON actions


class ToolAction(BaseModel):
    """A tool call written as text by a model without native tool calling; the arguments are untrusted and go
    to the tool runner, which validates and caps them as it does native calls."""

    model_config = ConfigDict(extra="ignore")

    action: Annotated[str, Field(min_length=1, max_length=100)]
    arguments: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _function_call_shape(cls, raw: Any) -> Any:
        """Small models write a native call's JSON as text instead — ``{"name": ..., "arguments": ...}`` (seen from
        qwen2.5-coder-0.5b under llama-server), ``"parameters"`` for the arguments, or the arguments as a JSON
        string — and mean the same call."""
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        if "action" not in out and isinstance(out.get("name"), str):
            out["action"] = out["name"]
        if "arguments" not in out and isinstance(out.get("parameters"), dict):
            out["arguments"] = out["parameters"]
        if isinstance(out.get("arguments"), str):
            try:
                out["arguments"] = json.loads(out["arguments"])
            except ValueError:
                pass
        return out


class FinalAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    answer: str


def parse_action(text: str, tool_names: set[str]) -> ToolAction | FinalAnswer | None:
    """A JSON action reply (``{"action": name, "arguments": {...}}``, or a function call's own shape
    ``{"name": ..., "arguments": ...}``, naming one of ``tool_names``; or ``{"answer": "..."}``); None for anything
    else, such as a plain markdown report."""
    reply = _json_reply(text)
    if isinstance(reply, ToolAction) and reply.action not in tool_names:
        return None
    return reply


def stray_action(text: str) -> str | None:
    """The tool named by a reply that is nothing but a JSON action, whether or not that tool was offered; None for
    a report (even one quoting JSON), an answer object or anything else.  The caller decides whether the call was
    allowed: a model that writes a call it was not offered has written no report."""
    reply = _json_reply(text)
    return reply.action if isinstance(reply, ToolAction) else None


def _json_reply(text: str) -> ToolAction | FinalAnswer | None:
    """The action or answer object a reply consists of, whatever tool it names."""
    stripped = (text or "").strip().removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
    if not stripped.startswith(("{", "[", "```")):
        return None  # a report that merely contains braces is a report
    if stripped.startswith("```") and (end := stripped.find("```", 3)) > 0:
        stripped = stripped[: end + 3]  # the opening block is the reply's JSON; one further down is quoted in a report
    for value in chain(json_candidates(stripped), _leading_value(stripped)):
        if not isinstance(value, dict):
            continue
        try:
            if "action" in value or ("name" in value and ("arguments" in value or "parameters" in value)):
                return ToolAction.model_validate(value)
            if "answer" in value:
                return FinalAnswer.model_validate(value)
        except ValidationError:
            return None
    return None


def _leading_value(text: str) -> list[Any]:
    """The first complete JSON object at the head of ``text`` (or of a leading array), whatever follows it: a small
    model that repeats one tool call until its output limit writes no single parseable value, yet called a tool."""
    body = text.removeprefix("```json").removeprefix("```JSON").removeprefix("```").lstrip()
    if body.startswith("["):
        body = body[1:].lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        return []
    return [value]


def action_schema(tools: list[dict[str, Any]], *, answer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schema of a JSON action reply for these OpenAI-format tool specs: one tool call, or the answer (``answer``:
    the ``response_format.json_schema`` of the stage's answer object; by default ``{"answer": "..."}``)."""
    actions = [
        {
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["action", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    final = (answer or response_schema("answer", FinalAnswer))["schema"]
    return {"name": "tool_action", "schema": {"anyOf": [*actions, final]}, "strict": False}


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """The system note that offers the tools in words to a model that cannot call them natively."""
    lines = [
        "## Tools",
        "",
        "Tools cannot be called natively here. To call one, reply with only a JSON object "
        '{"action": "<tool name>", "arguments": {...}}; its result comes back in the next message. '
        'When you are ready to answer, reply with the answer object {"answer": "...", ...} the message asks for.',
        "",
    ]
    for t in tools:
        fn = t["function"]
        lines.append(f"- {fn['name']}: {fn.get('description', '')} Arguments: {json.dumps(fn.get('parameters') or {})}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- schemas


def response_schema(name: str, model: type[BaseModel]) -> dict[str, Any]:
    """``response_format.json_schema`` for ``model``: ``{"name", "schema", "strict"}``, portable (see above)."""
    raw = model.model_json_schema(mode="validation")
    return {"name": name, "schema": _portable(raw, raw.get("$defs") or {}), "strict": False}


def _portable(node: Any, defs: dict[str, Any]) -> Any:
    """References inlined; titles, descriptions (our docstrings) and defaults gone; an optional field's
    ``anyOf [T, null]`` reduced to T
    (leaving it out is how a reply says null; some grammar converters choke on the union)."""
    if isinstance(node, list):
        return [_portable(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _portable(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    out = {k: _portable(v, defs) for k, v in node.items() if k not in {"title", "default", "description", "$defs"}}
    options = out.get("anyOf")
    if isinstance(options, list):
        kept = [o for o in options if o != {"type": "null"}]
        if len(kept) == 1 and len(kept) < len(options):
            out.pop("anyOf")
            out = {**kept[0], **out}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


PLAN_SCHEMA = response_schema("analysis_plan", PlanReply)
ANALYST_SCHEMA = response_schema("analyst_findings", AnalystReply)
SHARED_SCHEMA = response_schema("shared_read_findings", SharedReply)
REWRITE_SCHEMA = response_schema("standalone_question", RewriteReply)
ANSWER_SCHEMA = response_schema("answer", CitedAnswer)
BATCH_ANSWER_SCHEMA = response_schema("batch_answer", BatchAnswer)


def answer_schema(chunk_ids: list[int]) -> dict[str, Any]:
    """The direct answer's schema for one prompt: at least one citation, and only of the chunks it shows, so a
    grammar-constrained model can neither leave its citations out nor invent one."""
    if not chunk_ids:
        return ANSWER_SCHEMA
    schema = json.loads(json.dumps(ANSWER_SCHEMA))
    _cite_only(schema["schema"]["properties"], chunk_ids)
    return schema


def _cited_ids(value: Any) -> list[int]:
    """A reply's ``cited_chunks`` as chunk ids: one id or a list, each as ``as_chunk_id`` reads it, junk dropped."""
    items = value if isinstance(value, list) else [value] if value is not None else []
    return [i for i in map(as_chunk_id, items) if i is not None]


def _cite_only(props: dict[str, Any], chunk_ids: Sequence[int]) -> None:
    """Narrow an answer schema's ``cited_chunks`` to at least one of these ids."""
    props["cited_chunks"].update(minItems=1, items={"enum": sorted(set(chunk_ids))})
