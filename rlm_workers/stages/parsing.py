"""Lenient parsing of LLM replies, then a typed error (PaperQA2 style).

Models wrap JSON in prose or fences, rename the wrapping key, send ids as
strings or grade with words we did not ask for.  We accept all of that, cap
what DESIGN §7 caps, and raise ``ParseError`` only when no JSON of the right
shape can be found at all.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..constants import MAX_FINDING_BYTES, MAX_FINDINGS_PER_BATCH, MAX_FOLLOW_UPS, SEARCH_MODES
from ..errors import ParseError
from ..models import AnalysisPlan, Finding

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)
#: words models use for grades, mapped onto ours
_RELEVANCE = {"critical": "high", "high": "high", "medium": "medium", "moderate": "medium", "low": "low",
              "minor": "low", "none": "none", "irrelevant": "none", "no": "none"}


def _json_candidates(text: str) -> list[Any]:
    """Every JSON value we can find: the whole text, fenced blocks, then the outermost brackets."""
    out: list[Any] = []
    stripped = text.strip()
    pieces = [stripped] + [m.group(1).strip() for m in _FENCE.finditer(text)]
    for open_, close in (("[", "]"), ("{", "}")):
        i, j = stripped.find(open_), stripped.rfind(close)
        if 0 <= i < j:
            pieces.append(stripped[i:j + 1])
    for piece in pieces:
        try:
            out.append(json.loads(piece))
        except (ValueError, RecursionError):
            continue
    return out


def _clip(s: Any, limit: int = MAX_FINDING_BYTES) -> str:
    text = s if isinstance(s, str) else json.dumps(s, ensure_ascii=False) if s is not None else ""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", "ignore") + "…"


def _entries(value: Any) -> list[dict] | None:
    """The findings array itself, an object wrapping it under one key, or a single finding object."""
    if isinstance(value, list):
        return [v for v in value if isinstance(v, dict)] if any(isinstance(v, dict) for v in value) or not value \
            else None
    if isinstance(value, dict):
        if "chunk_id" in value:
            return [value]
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) == 1:
            return _entries(lists[0])
    return None


def _chunk_id(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        m = re.search(r"\d+", raw)
        return int(m.group()) if m else None
    return None


def parse_findings(text: str, *, batch_chunk_ids: list[int]) -> list[Finding]:
    """The analyst's reply → findings for chunks of this batch only, capped per DESIGN §7."""
    entries = next((e for v in _json_candidates(text or "") if (e := _entries(v)) is not None), None)
    if entries is None:
        raise ParseError(f"the analyst reply is not a JSON findings array: {(text or '')[:120]!r}")
    allowed = set(batch_chunk_ids)
    merged: dict[int, Finding] = {}
    budget = MAX_FINDINGS_PER_BATCH
    for e in entries:
        cid = _chunk_id(e.get("chunk_id"))
        if cid is None or cid not in allowed:
            continue  # an id we never sent: the model invented or misread it
        rel = _RELEVANCE.get(str(e.get("relevance", "")).strip().lower(), "low")
        raw_findings = e.get("findings") or []
        if isinstance(raw_findings, str):
            raw_findings = [raw_findings]
        items = [_clip(f) for f in raw_findings if f not in (None, "")][:budget]
        budget -= len(items)
        follow = e.get("follow_up", e.get("follow_ups")) or []
        if isinstance(follow, str):
            follow = [follow]
        finding = Finding(chunk_id=cid, relevance=rel, findings=items, summary=_clip(e.get("summary") or ""),
                          follow_up=[_clip(f, 1000) for f in follow][:MAX_FOLLOW_UPS])
        prev = merged.get(cid)
        if prev is not None:  # the same chunk twice: keep the stronger grade and every finding
            best = max((prev.relevance, finding.relevance), key=["none", "low", "medium", "high"].index)
            finding = Finding(chunk_id=cid, relevance=best, findings=prev.findings + finding.findings,
                              summary=prev.summary or finding.summary,
                              follow_up=(prev.follow_up + finding.follow_up)[:MAX_FOLLOW_UPS])
        merged[cid] = finding
    return list(merged.values())


def parse_plan(text: str) -> AnalysisPlan:
    """The planner's reply → a plan holding only the fields it set sensibly (the rest stays unset)."""
    obj = next((v for v in _json_candidates(text or "") if isinstance(v, dict)), None)
    if obj is None:
        raise ParseError(f"the planner reply is not a JSON object: {(text or '')[:120]!r}")
    if len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
        obj = next(iter(obj.values()))  # {"plan": {...}}
    fields: dict[str, Any] = {}
    mode = str(obj.get("search_mode", "")).lower()
    if mode in SEARCH_MODES:
        fields["search_mode"] = mode
    ranges = {"threshold": (float, -1.0, 1.0), "top_k": (int, 1, 10_000), "max_chunks": (int, 1, 100_000),
              "batch_size": (int, 1, 1000)}
    for name, (kind, lo, hi) in ranges.items():
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            continue
        try:
            number = kind(float(value))
        except ValueError:
            continue
        if lo <= number <= hi:
            fields[name] = number
    topics = obj.get("focus_topics")
    if isinstance(topics, list):
        fields["focus_topics"] = [_clip(t, 200) for t in topics if isinstance(t, str) and t.strip()][:10]
    return AnalysisPlan(**fields)
