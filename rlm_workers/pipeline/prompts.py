"""The shipped system prompts, and the fence every untrusted text is put in before a model reads it.

Each stage builds its own user message (in its own module); what they share is
here.  Chunk text is untrusted: it goes inside ``<content>…</content>`` and
anything in it that looks like an opening or closing ``content`` tag is defused
first, so a chunk can never end its own block and speak as the orchestrator.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROMPT_NAMES = ("primary", "subcall", "synthesizer")
#: a prompt file larger than this is a mistake, not a prompt
MAX_PROMPT_BYTES = 256 * 1024

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
    candidates = ([Path(prompt_dir).expanduser() / f"{name}.md"] if prompt_dir else []) + [
        d / f"{name}.md" for d in _shipped_dirs()
    ]
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


def system_message(prompt: str) -> dict[str, str]:
    return {"role": "system", "content": prompt}
