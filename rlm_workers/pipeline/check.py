"""Check: the completeness check of thinking mode (docs/contract.md#modes).

After a fan-out round, a checker model reads the query and the findings kept so
far and says whether they answer it; if not, it names follow-up questions that
run as child jobs.  This module holds its user message and the parsing of its
verdict.  The findings are quoted inside content blocks (they derive from
untrusted text), and so are the questions asked already, which are repeated so
that the checker does not ask them again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError, WithJsonSchema, field_validator

from ..errors import ParseError
from ..llm.replies import clip, json_candidates
from ..llm.stage_input import FindingsInput
from .prompts import escape_content, findings_blocks, quote_field, shown_findings, system_message

CHECK_MAX_TOKENS = 1024
#: the checker sees at most this much findings text; the rest is counted
MAX_CHECK_FINDINGS_CHARS = 200_000
MAX_FOLLOW_UPS_PER_CHECK = 4
MAX_GAPS = 10
MAX_GAP_BYTES = 300
MAX_FOLLOW_UP_BYTES = 500


# --------------------------------------------------------------------------- messages


def check_input(query: str, kept: Sequence[Mapping[str, Any]], asked: Sequence[str]) -> FindingsInput:
    """What the checker is shown: the query, the findings that fit, the questions asked already."""
    shown, omitted = shown_findings(kept, MAX_CHECK_FINDINGS_CHARS)
    return FindingsInput(query=query, findings=shown, omitted=omitted, asked=tuple(asked))


def render_messages(system_prompt: str, shown: FindingsInput) -> list[dict[str, str]]:
    """The query, the questions asked already (follow-ups of earlier rounds) and the findings in collect order."""
    user = f"## Query\n\n{escape_content(shown.query)}"
    if shown.asked:
        user += "\n\n## Asked already\n\n" + "\n".join(f"- {quote_field(q)}" for q in shown.asked)
    blocks = findings_blocks(shown.findings)
    user += "\n\n## Findings\n\n" + ("\n\n".join(blocks) if blocks else "(none)")
    if shown.omitted:
        user += f"\n\n({shown.omitted} lower-ranked findings omitted for length.)"
    user += "\n\nReply with the JSON verdict only."
    return [system_message(system_prompt), {"role": "user", "content": user}]


def build_messages(
    system_prompt: str, query: str, kept: Sequence[Mapping[str, Any]], asked: Sequence[str]
) -> list[dict[str, str]]:
    """The checker's messages, rendered from ``check_input``."""
    return render_messages(system_prompt, check_input(query, kept, asked))


# --------------------------------------------------------------------------- the verdict

_TRUE = {"true", "yes", "1"}
_FALSE = {"false", "no", "0"}


def _strings(raw: Any) -> list[str]:
    """A list of strings from a string, a list of strings, or a list of ``{"question": …}`` objects."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        return []
    out = []
    for item in raw:
        if isinstance(item, dict):
            item = next((item[k] for k in ("question", "query", "follow_up", "text") if k in item), None)
        if isinstance(item, str) and item.strip():
            out.append(" ".join(item.split()))
    return out


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int | str):
        word = str(v).strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ValueError(f"complete must be true or false, not {v!r}")


class CheckVerdict(BaseModel):
    """Whether the findings answer the query, and if not, what to ask next (at most MAX_FOLLOW_UPS_PER_CHECK)."""

    complete: bool
    confidence: float = Field(ge=0.0, le=1.0)
    # the schema bounds each string too, so a grammar-bound small model cannot ramble on in one; the validators
    # below clip whatever a server that enforces nothing sends
    gaps: list[Annotated[str, WithJsonSchema({"type": "string", "maxLength": MAX_GAP_BYTES})]] = Field(
        default_factory=list, max_length=MAX_GAPS
    )
    follow_ups: list[Annotated[str, WithJsonSchema({"type": "string", "maxLength": MAX_FOLLOW_UP_BYTES})]] = Field(
        default_factory=list, max_length=MAX_FOLLOW_UPS_PER_CHECK
    )

    @field_validator("complete", mode="before")
    @classmethod
    def _complete(cls, v: Any) -> bool:
        return _as_bool(v)

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, v: Any) -> float:
        if isinstance(v, bool):
            raise ValueError("confidence must be a number")
        try:
            if isinstance(v, str):  # "0.8", or "80%"
                word = v.strip()
                x = float(word.rstrip("%")) / (100 if word.endswith("%") else 1)
            else:
                x = float(v)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"confidence must be a number, not {v!r}") from None
        return 0.0 if math.isnan(x) else min(1.0, max(0.0, x))

    @field_validator("gaps", mode="before")
    @classmethod
    def _gaps(cls, v: Any) -> list[str]:
        return [clip(g, MAX_GAP_BYTES) for g in _strings(v)][:MAX_GAPS]

    @field_validator("follow_ups", mode="before")
    @classmethod
    def _follow_ups(cls, v: Any) -> list[str]:
        out: dict[str, str] = {}
        for q in _strings(v):
            out.setdefault(q.casefold(), clip(q, MAX_FOLLOW_UP_BYTES))
        return list(out.values())[:MAX_FOLLOW_UPS_PER_CHECK]


def parse_check(text: str) -> CheckVerdict:
    """The checker's reply → a verdict; ``ParseError`` when it holds no usable one.

    Lenient like the planner's parsing: the first JSON object found (fences and prose around it are fine),
    ``{"verdict": {…}}`` unwrapped, ``follow_up`` for ``follow_ups``.  A verdict without ``complete`` is
    complete when it asks nothing; one without ``confidence`` is as confident as its ``complete``.
    """
    obj = next((v for v in json_candidates(text or "") if isinstance(v, dict)), None)
    if obj is not None and len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
        obj = next(iter(obj.values()))  # {"verdict": {...}}
    if obj is None or not {"complete", "follow_ups", "follow_up"} & obj.keys():
        raise ParseError(f"the completeness check reply is not a JSON verdict: {(text or '')[:120]!r}")
    fields = dict(obj)
    if "follow_ups" not in fields and "follow_up" in fields:
        fields["follow_ups"] = fields["follow_up"]
    fields.setdefault("follow_ups", [])
    if "complete" not in fields:
        fields["complete"] = not _strings(fields["follow_ups"])
    try:
        if fields.get("confidence") is None:
            fields["confidence"] = 1.0 if _as_bool(fields["complete"]) else 0.0
        return CheckVerdict.model_validate(
            {k: fields.get(k) for k in ("complete", "confidence", "gaps", "follow_ups") if k in fields}
        )
    except (ValidationError, ValueError) as exc:
        first = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise ParseError(f"the completeness check verdict is unusable ({first}): {(text or '')[:120]!r}") from None


# --------------------------------------------------------------------------- follow-ups asked before

#: words that tell two questions of the same subject nothing apart
_FILLER = frozenset(
    "a an the of in on at to for from by with about into over is are was were be been do does did can could "
    "what which who whom whose where when why how this that these those there its it their and or any all "
    "please tell me find show give list".split()
)
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
#: two questions whose content words overlap this much (Jaccard) ask the same thing
SAME_QUESTION = 0.75


def question_words(question: str) -> frozenset[str]:
    """The content words of a question, case, punctuation, filler words and a plural ``s`` aside."""
    words = (w.casefold() for w in _WORD.findall(question or ""))
    return frozenset(
        w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in words if w not in _FILLER
    )


def same_question(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` ask the same thing: the same words once normalised, or nearly the same set."""
    wa, wb = question_words(a), question_words(b)
    if not wa or not wb:
        return " ".join(a.casefold().split()) == " ".join(b.casefold().split())
    return len(wa & wb) / len(wa | wb) >= SAME_QUESTION


def fresh_follow_ups(follow_ups: Sequence[str], asked: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the follow-ups worth asking, those asked before): a follow-up that repeats, or nearly repeats, a
    question of the tree (``asked``) or an earlier follow-up of the same verdict is not asked again; a checker
    that asks only those has nothing new to ask (docs/contract.md#recursion)."""
    new: list[str] = []
    repeated: list[str] = []
    for q in follow_ups:
        if any(same_question(q, earlier) for earlier in [*asked, *new]):
            repeated.append(q)
        else:
            new.append(q)
    return new, repeated
