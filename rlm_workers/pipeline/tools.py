"""The synthesizer's tools: read-only calls back into storage.

Arguments come from the model, so they are untrusted: size-capped, parsed as
JSON, validated, and scoped to the job's tenant.  Regexes run on RE2 (linear
time), never Python's backtracking engine.  A bad call returns an error object
to the model instead of raising, so one mistake does not end the report.
Results go back as JSON whose strings decode to the stored text exactly, with
content tags defused (``prompts.tool_json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import re2
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from ..limits import MAX_REGEX_BYTES, MAX_TOOL_ARGS_BYTES, MAX_TOOL_ARGS_SUMMARY_CHARS, MAX_TOOL_CALLS_PER_TURN
from ..models import SearchMode, check_storable_text
from ..search.provenance import cite_of
from ..search.sections import read_outline, read_section
from ..search.service import search
from ..store.buffers import buffer_info, get_chunks, iter_chunk_texts, list_buffers, require_buffers
from .prompts import tool_json

MAX_CHUNKS_PER_CALL = 20
MAX_TEXT_CHARS = 4000
MAX_GREP_RESULTS = 50
#: stop grepping after this much text, so one call stays cheap on huge buffers
MAX_GREP_SCAN_BYTES = 50 * 1024 * 1024
#: a section's text in one get_section result: five chunks' worth, as get_chunks shows (then a cut marker)
MAX_SECTION_CHARS = 5 * MAX_TEXT_CHARS
#: headings in one get_outline result (a manual's outline can run to thousands)
MAX_OUTLINE_HEADINGS = 200


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


TOOL_SPECS: list[dict[str, Any]] = [
    _fn(
        "get_chunks",
        "Full text of chunks by id (at most 20).",
        {"chunk_ids": {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_CHUNKS_PER_CALL}},
        ["chunk_ids"],
    ),
    _fn(
        "search",
        "Hybrid/semantic/bm25 search over the job's buffers (or the named ones).",
        {
            "query": {"type": "string"},
            "buffers": {"type": "array", "items": {"type": "string"}},
            "mode": {"type": "string", "enum": [m.value for m in SearchMode]},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        ["query"],
    ),
    _fn(
        "grep_chunks",
        "Lines matching an RE2 regular expression (at most 500 bytes) in the job's buffers.",
        {
            "pattern": {"type": "string"},
            "buffers": {"type": "array", "items": {"type": "string"}},
            "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_GREP_RESULTS},
        },
        ["pattern"],
    ),
    _fn(
        "get_outline",
        "The headings of one document (PDF, DOCX, Markdown…): level, title, heading path, page and lines.",
        {"buffer": {"type": "string"}, "path": {"type": "string"}},
        ["path"],
    ),
    _fn(
        "get_section",
        'The text of one section of a document, subsections included; heading is its path ("A › B") or title.',
        {"buffer": {"type": "string"}, "path": {"type": "string"}, "heading": {"type": "string"}},
        ["path", "heading"],
    ),
    _fn("get_buffer", "Size, chunking and model of one buffer.", {"name": {"type": "string"}}, ["name"]),
    _fn("list_buffers", "All buffers you may read.", {}, []),
    _fn("storage_stats", "Totals: buffers, files, chunks, bytes.", {}, []),
]
TOOL_NAMES = {spec["function"]["name"] for spec in TOOL_SPECS}


class ToolError(Exception):
    """A bad tool call; its message goes back to the model."""


MAX_SUBSET_QUESTION_CHARS = 2000
MAX_SUBSET_CHUNK_IDS = 200
MAX_SUBSET_SEARCH_CHARS = 500


def _tool_schema(schema: dict[str, Any]) -> None:
    """The tool's parameters as the model sees them: no titles, no docstring, no other argument."""
    schema.pop("title", None)
    schema.pop("description", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    schema["additionalProperties"] = False


class SubsetCall(BaseModel):
    """A query_subset call's arguments: the one place its limits are written — the tool's JSON Schema offered to
    the model (``QUERY_SUBSET_SPEC``) and the validation of what the model sent (``parse_subset_call``) both come
    from it."""

    model_config = ConfigDict(json_schema_extra=_tool_schema)

    question: StrictStr = Field(min_length=1, max_length=MAX_SUBSET_QUESTION_CHARS)
    chunk_ids: list[StrictInt] | None = Field(None, min_length=1, max_length=MAX_SUBSET_CHUNK_IDS)
    search: StrictStr | None = Field(None, min_length=1, max_length=MAX_SUBSET_SEARCH_CHARS)

    @model_validator(mode="after")
    def _one_subset(self) -> SubsetCall:
        if (self.chunk_ids is None) == (self.search is None):
            raise ValueError("give exactly one of chunk_ids or search")
        return self


#: what the model is told for each field the arguments got wrong
_SUBSET_FIELD_ERRORS = {
    "question": f"question must be a non-empty string of at most {MAX_SUBSET_QUESTION_CHARS} characters",
    "chunk_ids": f"chunk_ids must be a list of 1 to {MAX_SUBSET_CHUNK_IDS} integers",
    "search": f"search must be a non-empty string of at most {MAX_SUBSET_SEARCH_CHARS} characters",
}

#: the RLM paper's llm_query as a tool: a bounded child job over chosen chunks or a search
QUERY_SUBSET_SPEC: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "query_subset",
        "description": (
            "Ask a sub-question over a subset of the data: a child job (its own analysts) reads the given chunk ids "
            "or the chunks a search finds, and its findings come back as this call's result. Use it when the "
            "findings point at something not yet read. Bounded by depth and budget."
        ),
        "parameters": SubsetCall.model_json_schema(),
    },
}


def parse_subset_call(raw: str | None) -> SubsetCall:
    """The model's query_subset arguments, validated (untrusted: ``ToolError`` says what is wrong)."""
    args = parse_arguments(raw)
    try:
        call = SubsetCall.model_validate(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        # blank strings pass min_length; the model is told the same as for an empty one
        raise ToolError(_SUBSET_FIELD_ERRORS.get(field) or first["msg"].removeprefix("Value error, ")) from None
    for name in ("question", "search"):
        value = getattr(call, name)
        if value is not None and not value.strip():
            raise ToolError(_SUBSET_FIELD_ERRORS[name])
        try:
            if value:
                check_storable_text(value, name)
        except ValueError as exc:
            raise ToolError(str(exc)) from None
    return call


@dataclass
class ToolContext:
    conn: Any
    tenant: str
    buffers: list[str]
    settings: Any
    url: str


def parse_arguments(raw: str | None) -> dict[str, Any]:
    raw = raw or "{}"
    if len(raw.encode()) > MAX_TOOL_ARGS_BYTES:
        raise ToolError(f"tool arguments are {len(raw.encode())} bytes; the limit is {MAX_TOOL_ARGS_BYTES}")
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ToolError(f"arguments are not valid JSON: {exc.msg}") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    return args


def run_tool(ctx: ToolContext, name: str, raw_arguments: str | None) -> str:
    """Run one call; always returns JSON text for the model."""
    return _run(ctx, name, raw_arguments)[0]


def _run(ctx: ToolContext, name: str, raw_arguments: str | None) -> tuple[str, str | None]:
    """(JSON text for the model, the error message or None)."""
    try:
        if name not in TOOL_NAMES:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(sorted(TOOL_NAMES))}")
        args = parse_arguments(raw_arguments)
        result = _DISPATCH[name](ctx, args)
    except ToolError as exc:
        result = {"error": str(exc)}
    except Exception as exc:  # e.g. an unknown buffer: the model can correct itself
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        result = {"error": message[:500]}
    return tool_json(result), result.get("error")


def run_tool_logged(
    ctx: ToolContext, name: str, raw_arguments: str | None, *, turn: int, allowed: bool = True
) -> tuple[str, dict[str, Any]]:
    """Run one call (or refuse it: over the turn's limit) and say what happened, for the job's record.

    The record keeps a clipped summary of the arguments, never their full text: they came from the model.
    """
    if allowed:
        content, error = _run(ctx, name, raw_arguments)
    else:
        error = f"over the limit of {MAX_TOOL_CALLS_PER_TURN} tool calls per turn; not run: answer with what you have"
        content = json.dumps({"error": error})
    return content, tool_record(name, raw_arguments, turn=turn, error=error, refused=not allowed)


def tool_record(
    name: str, raw_arguments: str | None, *, turn: int, error: str | None, refused: bool = False
) -> dict[str, Any]:
    """One tool call as the job records it: a clipped summary of the arguments, never their full text (they
    came from the model), and how it ended."""
    raw = raw_arguments or ""
    summary = raw if len(raw) <= MAX_TOOL_ARGS_SUMMARY_CHARS else raw[: MAX_TOOL_ARGS_SUMMARY_CHARS - 1] + "…"
    return {
        "turn": turn,
        "name": str(name)[:100],
        "args": summary,
        "status": "ok" if error is None else ("refused" if refused else "error"),
        "error": None if error is None else str(error)[:300],
    }


def _buffers(ctx: ToolContext, args: dict[str, Any]) -> list[str]:
    names = args.get("buffers") or ctx.buffers
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > 50:
        raise ToolError("buffers must be a list of at most 50 buffer names")
    return names


def as_chunk_id(value: Any) -> int | None:
    """A chunk id a model gave: an int, or a digit string (small models quote numbers, "5"); None for anything
    else (a bool, a word, a number too long to be an id)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 18:
        return int(value)
    return None


def _get_chunks(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    given = args.get("chunk_ids")
    found = [as_chunk_id(i) for i in given] if isinstance(given, list) else [None]
    ids = [i for i in found if i is not None]
    if len(ids) != len(found):
        raise ToolError("chunk_ids must be a list of integers")
    if len(ids) > MAX_CHUNKS_PER_CALL:
        raise ToolError(f"at most {MAX_CHUNKS_PER_CALL} chunk ids per call")
    rows = get_chunks(ctx.conn, tenant=ctx.tenant, chunk_ids=ids)
    return {
        "chunks": [
            {
                "chunk_id": c.id,
                "buffer": c.buffer,
                "path": c.path,
                "lines": f"{c.start_line}-{c.end_line}",
                **_located(c),
                "text": c.text[:MAX_TEXT_CHARS],
            }
            for c in (rows.get(i) for i in ids)
            if c is not None
        ],
        "missing": [i for i in ids if i not in rows],
    }


def _search(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    query = args.get("query")
    if not isinstance(query, str):
        raise ToolError("query must be a string")
    top_k = args.get("top_k", 10)
    if not isinstance(top_k, int) or not 1 <= top_k <= 20:
        raise ToolError("top_k must be an integer from 1 to 20")
    hits = search(
        ctx.conn,
        settings=ctx.settings,
        url=ctx.url,
        tenant=ctx.tenant,
        buffers=_buffers(ctx, args),
        query=query,
        mode=args.get("mode", "hybrid"),
        top_k=top_k,
    )
    return {
        "results": [
            {
                "chunk_id": h.chunk_id,
                "buffer": h.buffer,
                "path": h.path,
                "lines": f"{h.start_line}-{h.end_line}",
                **_located(h),
                "score": h.score,
                "text": h.text[:600],
            }
            for h in hits
        ]
    }


def _located(c: Any) -> dict[str, str]:
    """A document's chunk also says its page and section, as a report cites it; plain text needs only lines."""
    if c.page_start is None and not c.heading_path:
        return {}
    return {"cite": cite_of(c)}


def compile_regex(pattern: Any):
    if not isinstance(pattern, str) or not pattern:
        raise ToolError("pattern must be a non-empty string")
    if len(pattern.encode()) > MAX_REGEX_BYTES:
        raise ToolError(f"pattern is {len(pattern.encode())} bytes; the limit is {MAX_REGEX_BYTES}")
    options = re2.Options()
    options.max_mem = 8 << 20
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        raise ToolError(f"invalid RE2 pattern: {exc}") from None


def _grep(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    regex = compile_regex(args.get("pattern"))
    limit = args.get("max_results", 20)
    if not isinstance(limit, int) or not 1 <= limit <= MAX_GREP_RESULTS:
        raise ToolError(f"max_results must be an integer from 1 to {MAX_GREP_RESULTS}")
    rows = require_buffers(ctx.conn, tenant=ctx.tenant, names=_buffers(ctx, args))
    matches, scanned, truncated = [], 0, False
    texts = iter_chunk_texts(ctx.conn, buffer_ids=[r.id for r in rows])
    try:
        for cid, buf, path, start, text in texts:
            scanned += len(text)
            for offset, line in enumerate(text.split("\n")):
                if regex.search(line):
                    matches.append(
                        {
                            "chunk_id": cid,
                            "buffer": buf,
                            "path": path,
                            "line": start + offset,
                            "text": line[:300],
                        }
                    )
                    if len(matches) >= limit:
                        break
            if len(matches) >= limit or scanned > MAX_GREP_SCAN_BYTES:
                truncated = True
                break
    finally:
        texts.close()  # ends the cursor's transaction now, not when the generator is collected
    return {"matches": matches, "truncated": truncated}


def _document_buffer(ctx: ToolContext, args: dict[str, Any]) -> Any:
    """The buffer a document tool reads: the one named, or the job's own when it reads just one."""
    name = args.get("buffer")
    if name is None:
        if len(ctx.buffers) != 1:
            raise ToolError(f"buffer is required: this job reads {len(ctx.buffers)} buffers ({', '.join(ctx.buffers)})")
        return ctx.buffers[0]
    return name  # checked, and looked up among the tenant's buffers only, by sections


def _get_outline(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    outline = read_outline(ctx.conn, tenant=ctx.tenant, buffer=_document_buffer(ctx, args), path=args.get("path"))
    out: dict[str, Any] = {"buffer": outline.buffer, "path": outline.path, "format": outline.format}
    if not outline.headings:
        out["headings"] = []
        out["message"] = f"{outline.path} has no headings; read it with search or get_chunks"
        return out
    out["headings"] = [
        {
            "level": h.level,
            "title": h.title,
            "heading": h.joined,
            "page": h.page,
            "lines": f"{h.start_line}-{h.end_line}",
        }
        for h in outline.headings[:MAX_OUTLINE_HEADINGS]
    ]
    if len(outline.headings) > MAX_OUTLINE_HEADINGS:
        out["truncated"] = f"first {MAX_OUTLINE_HEADINGS} of {len(outline.headings)} headings"
    return out


def _get_section(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    section = read_section(
        ctx.conn,
        tenant=ctx.tenant,
        buffer=_document_buffer(ctx, args),
        path=args.get("path"),
        heading=args.get("heading"),
        max_chars=MAX_SECTION_CHARS,
    )
    out: dict[str, Any] = {
        "buffer": section.buffer,
        "path": section.path,
        "heading": section.heading.joined,
        "cite": section.cite,
        "lines": f"{section.start_line}-{section.end_line}",
        "page_start": section.page_start,
        "page_end": section.page_end,
        "truncated": section.truncated,
        "text": section.text,
    }
    if section.same_path_at:
        lines = ", ".join(str(n) for n in section.same_path_at)
        out["note"] = f"other sections with this same heading path start at lines {lines}"
    return out


def _get_buffer(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    name = args.get("name")
    if not isinstance(name, str):
        raise ToolError("name must be a string")
    return buffer_info(ctx.conn, tenant=ctx.tenant, name=name).model_dump()


def _list_buffers(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "buffers": [
            {"name": b.name, "files": b.files, "chunks": b.chunks, "bytes": b.bytes}
            for b in list_buffers(ctx.conn, tenant=ctx.tenant)
        ]
    }


def _storage_stats(ctx: ToolContext, args: dict[str, Any]) -> dict[str, Any]:
    infos = list_buffers(ctx.conn, tenant=ctx.tenant)
    return {
        "buffers": len(infos),
        "files": sum(b.files for b in infos),
        "chunks": sum(b.chunks for b in infos),
        "bytes": sum(b.bytes for b in infos),
    }


_DISPATCH = {
    "get_chunks": _get_chunks,
    "search": _search,
    "grep_chunks": _grep,
    "get_outline": _get_outline,
    "get_section": _get_section,
    "get_buffer": _get_buffer,
    "list_buffers": _list_buffers,
    "storage_stats": _storage_stats,
}
