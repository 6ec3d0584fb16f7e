"""The shipped system prompts, and the fence every untrusted text is put in before a model reads it.

Each stage builds its own user message (in its own module); what they share is
here.  Chunk text is untrusted: it goes inside ``<content>…</content>`` and
anything in it that looks like an opening or closing ``content`` tag is defused
first, so a chunk can never end its own block and speak as the orchestrator.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

PROMPT_NAMES = ("primary", "subcall", "synthesizer")
#: a prompt file larger than this is a mistake, not a prompt
MAX_PROMPT_BYTES = 256 * 1024

# "<" and the characters that render like it, optional slash and spaces, then "content".
_TAG_LOOKALIKE = re.compile(r"[<\uFF1C\uFE64\u2039\u3008\u27E8\u276E]\s*[/\u2215\u2044\uFF0F]?\s*content", re.I)


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

    Read on every call, so an override takes effect at the next query without a restart.
    """
    if name not in PROMPT_NAMES:
        raise ValueError(f"unknown prompt {name!r}")
    if prompt_dir:
        text = _read(Path(prompt_dir).expanduser() / f"{name}.md")
        if text:
            return text
    text = _read(_shipped(name))
    if text:
        return text
    raise FileNotFoundError(f"the shipped prompt {name}.md is missing from the rlm_workers package (prompts/)")


def escape_content(text: str) -> str:
    """Defuse every ``<content`` / ``</content`` look-alike so the block can't be closed from inside."""
    return _TAG_LOOKALIKE.sub(lambda m: "&lt;" + m.group(0)[1:], text)


def content_block(text: str) -> str:
    return f"<content>\n{escape_content(text)}\n</content>"


def system_message(prompt: str) -> dict[str, str]:
    return {"role": "system", "content": prompt}
