"""System prompts and the user messages each stage sends (pure, apart from reading prompt files).

Chunk text is untrusted: it goes inside ``<content>…</content>`` and anything
in it that looks like an opening or closing ``content`` tag is defused first,
so a chunk can never end its own block and speak as the orchestrator.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_NAMES = ("primary", "subcall", "synthesizer")
#: a prompt file larger than this is a mistake, not a prompt
MAX_PROMPT_BYTES = 256 * 1024
#: the synthesizer sees at most this much findings text; the rest is summarised by a count
MAX_SYNTH_FINDINGS_CHARS = 300_000

# "<" and the characters that render like it, optional slash and spaces, then "content".
_TAG_LOOKALIKE = re.compile(r"[<\uFF1C\uFE64\u2039\u3008\u27E8\u276E]\s*[/\u2215\u2044\uFF0F]?\s*content", re.I)


def _shipped_dirs() -> list[Path]:
    here = Path(__file__).resolve()
    # a source checkout / editable install first, then the copy a wheel installs under share/
    return [here.parents[2] / "prompts", Path(sys.prefix) / "share" / "rlm-pipeline" / "prompts"]


def load_prompt(name: str, *, prompt_dir: str | Path | None = None) -> str:
    """The system prompt ``name``: ``RLM_PROMPT_DIR/name.md`` when present, else the shipped one.

    Read on every call, so an override takes effect at the next query without a restart.
    """
    if name not in PROMPT_NAMES:
        raise ValueError(f"unknown prompt {name!r}")
    candidates = ([Path(prompt_dir).expanduser() / f"{name}.md"] if prompt_dir else []) + \
        [d / f"{name}.md" for d in _shipped_dirs()]
    for path in candidates:
        try:
            if path.is_file() and 0 < path.stat().st_size <= MAX_PROMPT_BYTES:
                text = path.read_text(encoding="utf-8").strip()
                if text:
                    return text
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable override falls back to the shipped prompt
    raise FileNotFoundError(f"the shipped prompt {name}.md is missing from {_shipped_dirs()[0]}")


def escape_content(text: str) -> str:
    """Defuse every ``<content`` / ``</content`` look-alike so the block can't be closed from inside."""
    return _TAG_LOOKALIKE.sub(lambda m: "&lt;" + m.group(0)[1:], text)


def content_block(text: str) -> str:
    return f"<content>\n{escape_content(text)}\n</content>"


@dataclass(frozen=True)
class ChunkForPrompt:
    chunk_id: int
    buffer: str
    path: str
    start_line: int
    end_line: int
    text: str


def _system(prompt: str) -> dict[str, str]:
    return {"role": "system", "content": prompt}


def build_plan_messages(system_prompt: str, query: str, chunk_count: int, byte_size: int,
                        buffers: Sequence[str]) -> list[dict[str, str]]:
    user = (f"## Query\n\n{query}\n\n## Dataset\n\n"
            f"- buffers: {', '.join(buffers)}\n- chunks: {chunk_count}\n- bytes: {byte_size}\n\n"
            "Reply with the JSON plan only.")
    return [_system(system_prompt), {"role": "user", "content": user}]


def build_analyst_messages(system_prompt: str, query: str, chunks: Sequence[ChunkForPrompt],
                           focus_topics: Sequence[str] = ()) -> list[dict[str, str]]:
    parts = [f"## Query\n\n{query}"]
    if focus_topics:
        parts.append("## Focus topics\n\n" + "\n".join(f"- {t}" for t in focus_topics))
    blocks = [f"### Chunk {c.chunk_id}\n\nsource: {c.buffer}:{c.path}:{c.start_line}-{c.end_line}\n\n"
              f"{content_block(c.text)}" for c in chunks]
    parts.append("## Chunks\n\n" + "\n\n".join(blocks))
    parts.append(f"Reply with a JSON array of exactly {len(chunks)} entries, one per chunk id above.")
    return [_system(system_prompt), {"role": "user", "content": "\n\n".join(parts)}]


def _finding_block(f: Mapping[str, Any]) -> str:
    lines = [f"relevance: {f['relevance']}"]
    if f.get("summary"):
        lines.append(f"summary: {f['summary']}")
    lines += [f"- {x}" for x in f.get("findings") or []]
    if f.get("follow_up"):
        lines.append("follow-up: " + "; ".join(f["follow_up"]))
    return "\n".join(lines)


def build_synthesizer_messages(system_prompt: str, query: str, kept: Sequence[Mapping[str, Any]],
                               stats: Mapping[str, Any]) -> list[dict[str, str]]:
    """Findings in collect order; the analysts' words came from untrusted text, so they are data too."""
    blocks, used, omitted = [], 0, 0
    for f in kept:
        block = (f"### Chunk {f['chunk_id']}\n\nsource: {f['buffer']}:{f['path']}:{f['start_line']}-{f['end_line']}"
                 f"\n\n{content_block(_finding_block(f))}")
        if used + len(block) > MAX_SYNTH_FINDINGS_CHARS and blocks:
            omitted += 1
            continue
        blocks.append(block)
        used += len(block)
    stat_lines = "\n".join(f"- {k}: {', '.join(v) if isinstance(v, list | tuple) else v}" for k, v in stats.items())
    user = f"## Query\n\n{query}\n\n## Dataset\n\n{stat_lines}\n\n## Findings\n\n" + "\n\n".join(blocks)
    if omitted:
        user += f"\n\n({omitted} lower-ranked findings omitted for length; use the tools to look further.)"
    return [_system(system_prompt), {"role": "user", "content": user}]


def canned_no_findings_report(query: str) -> str:
    shown = query if len(query) <= 200 else query[:200] + "…"
    return ("## No relevant findings\n\n"
            f"The analysts read the chunks the search selected for “{shown}” and none of them held "
            "relevant evidence (or every finding fell below the finding threshold).\n\n"
            "Try: a lower `--threshold`, another `--search-mode` (`bm25` for exact names, `semantic` for "
            "concepts), a larger `--top-k`/`--max-chunks`, or check that the right buffer is loaded "
            "(`rlm buffer show NAME`).")
