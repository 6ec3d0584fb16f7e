"""The shipped system prompts, and the fence every untrusted text is put in before a model reads it.

Each stage builds its own user message (in its own module); what they share is
here.  Chunk text is untrusted: it goes inside ``<content>…</content>`` and
anything in it that looks like an opening or closing ``content`` tag is defused
first, so a chunk can never end its own block and speak as the orchestrator.
The short untrusted fields written outside a block (file paths, buffer names,
the planner's focus topics) are quoted instead: one JSON string on one line.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from ..llm.stage_input import ChunkForPrompt, ShownFinding
from ..search.provenance import page_span, section_of

PROMPT_NAMES = (
    "primary", "subcall", "answering", "synthesizer", "check", "direct", "rewrite", "shared", "code", "subquery",
    "code_children",
)  # fmt: skip
#: a prompt file larger than this is a mistake, not a prompt
MAX_PROMPT_BYTES = 256 * 1024

# "<" and the characters that render like it, optional slash and spaces, then "content".
_TAG_LOOKALIKE = re.compile(r"[<\uFF1C\uFE64\u2039\u3008\u27E8\u276E]\s*[/\u2215\u2044\uFF0F]?\s*content", re.I)
#: what ``escape_content`` made of a tag's bracket: ``&lt;`` for "<", a character reference for a look-alike
_ESCAPED_TAG = re.compile(r"&(lt|#x[0-9A-Fa-f]{1,6});(?=\s*[/\u2215\u2044\uFF0F]?\s*content)", re.I)


def _shipped(name: str) -> Traversable:
    # package data (rlm_workers/prompts/), so a wheel, an editable install and a checkout all find them
    return resources.files("rlm_workers") / "prompts" / f"{name}.md"


def _read(path: Path | Traversable) -> str | None:
    try:
        if path.is_file():
            data = path.read_bytes()
            if 0 < len(data) <= MAX_PROMPT_BYTES:
                return data.decode("utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        pass  # an unreadable override falls back to the shipped prompt
    return None


def load_prompt(name: str, *, prompt_dir: str | Path | None = None) -> str:
    """The system prompt ``name``: ``RLM_PROMPT_DIR/name.md`` when present, else the shipped one.

    An override is read on every call, so it takes effect at the next query without a restart; the shipped one
    is read once per process (it is the installed package's, and an analyst asks for it per batch).
    """
    if name not in PROMPT_NAMES:
        raise ValueError(f"unknown prompt {name!r}")
    if prompt_dir:
        text = _read(Path(prompt_dir).expanduser() / f"{name}.md")
        if text:
            return text
    return _shipped_text(name)


@functools.cache
def _shipped_text(name: str) -> str:
    text = _read(_shipped(name))
    if text:
        return text
    raise FileNotFoundError(f"the shipped prompt {name}.md is missing from the rlm_workers package (prompts/)")


def escape_content(text: str) -> str:
    """Defuse every ``<content`` / ``</content`` look-alike so the block can't be closed from inside.

    The bracket becomes an HTML character reference, so ``unescape_content`` can give the text back."""

    def defuse(m: re.Match[str]) -> str:
        bracket = m.group(0)[0]
        return ("&lt;" if bracket == "<" else f"&#x{ord(bracket):X};") + m.group(0)[1:]

    return _TAG_LOOKALIKE.sub(defuse, text)


def unescape_content(text: str) -> str:
    """The text as it was before ``escape_content``, for a verbatim quote taken from inside a fence (a chunk
    that itself spelled ``&lt;/content`` reads back as ``</content``: the one case it cannot tell apart)."""
    return _ESCAPED_TAG.sub(lambda m: "<" if m.group(1).lower() == "lt" else chr(int(m.group(1)[2:], 16)), text)


def tool_json(value: Any) -> str:
    """A tool result for the model: JSON whose strings decode to the text exactly as stored, but with the bracket of
    any content tag (or look-alike) in them written as a JSON escape (``\\u003c/content>``).  A tool result is data
    like a content block, yet not inside one: a file's own ``</content>`` must not reach the model as a marker, and
    an HTML escape here would be read back as the file's words."""

    def defuse(m: re.Match[str]) -> str:
        return f"\\u{ord(m.group(0)[0]):04x}{m.group(0)[1:]}"

    return _TAG_LOOKALIKE.sub(defuse, json.dumps(value, ensure_ascii=False))


def content_block(text: str) -> str:
    return f"<content>\n{escape_content(text)}\n</content>"


#: line breaks ``json.dumps`` keeps as they are (it escapes only the ASCII controls)
_UNICODE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def quote_field(text: str) -> str:
    """An untrusted one-line field outside a content block, as a JSON string: a newline, a quote or a
    ``## heading`` in a file name stays inside the string, and content tags in it are defused."""
    quoted = json.dumps(str(text), ensure_ascii=False)
    for ch, escaped in _UNICODE_BREAKS.items():
        quoted = quoted.replace(ch, escaped)
    return escape_content(quoted)


def source_line(
    buffer: str,
    path: str,
    start_line: int,
    end_line: int,
    page_start: int | None = None,
    page_end: int | None = None,
    heading_path: Sequence[str] | None = None,
) -> str:
    """Where a chunk comes from, for a prompt: ``source: "<buffer>:<path>":<start>-<end>``
    (docs/contract.md#analyst-message), then a document's pages and section, so the model can cite them:
    ``source: "docs:spec.pdf":40-52 p. 4–5 § "2.1 Transport"``.  The heading is the document's own words,
    untrusted like the path: quoted the same way."""
    line = f"source: {quote_field(f'{buffer}:{path}')}:{int(start_line)}-{int(end_line)}"
    if pages := page_span(page_start, page_end):
        line += f" {pages}"
    if section := section_of(heading_path):
        line += f" § {quote_field(section)}"
    return line


def chunk_source_line(c: ChunkForPrompt | ShownFinding) -> str:
    """``source_line`` of a chunk or finding record, its pages and section included."""
    return source_line(c.buffer, c.path, c.start_line, c.end_line, c.page_start, c.page_end, c.heading_path)


def finding_block(f: ShownFinding) -> str:
    """A collected finding as the synthesizer and the completeness check read it (inside a content block:
    the analysts' words derive from untrusted text)."""
    lines = [f"relevance: {f.relevance}"]
    if f.summary:
        lines.append(f"summary: {f.summary}")
    lines += [f"- {x}" for x in f.findings]
    if f.follow_up:
        lines.append("follow-up: " + "; ".join(f.follow_up))
    return "\n".join(lines)


def _chunk_finding_block(f: ShownFinding) -> str:
    return f"### Chunk {f.chunk_id}\n\n{chunk_source_line(f)}\n\n{content_block(finding_block(f))}"


def shown_findings(kept: Sequence[Mapping[str, Any]], max_chars: int) -> tuple[tuple[ShownFinding, ...], int]:
    """The collected findings a prompt shows, in collect order, while their blocks fit ``max_chars`` (always at
    least one): (those findings, how many lower-ranked ones were left out)."""
    shown: list[ShownFinding] = []
    used, omitted = 0, 0
    for k in kept:
        f = ShownFinding.of(k)
        size = len(_chunk_finding_block(f))
        if used + size > max_chars and shown:
            omitted += 1
            continue
        shown.append(f)
        used += size
    return tuple(shown), omitted


def findings_blocks(shown: Sequence[ShownFinding]) -> list[str]:
    """The findings ``shown_findings`` chose, as ``### Chunk`` blocks."""
    return [_chunk_finding_block(f) for f in shown]


def system_message(prompt: str) -> dict[str, str]:
    return {"role": "system", "content": prompt}
