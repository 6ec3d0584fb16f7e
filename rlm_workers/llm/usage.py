"""Reading an OpenAI chat completion: its usage block (what was billed) and its reply, as a ``Completion``.

Shared by the ordinary provider (``openai_provider.py``) and the Batch API's output lines (``batch_api.py``), so
a reply is read, and its tokens counted, the same way whichever way it came.  Nothing here imports ``openai``:
the response is read by attribute, as the client's models (or a gateway's near-copies) carry it.
"""

from __future__ import annotations

from typing import Any

from .protocol import Completion, ToolCall


class BadResponse(Exception):
    """A 200 whose body is not a usable chat completion (proxies and gateways do this)."""


def token_usage(response: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) the response says were billed; 0 for a count absent or unreadable."""
    usage = getattr(response, "usage", None)
    if usage is None:
        return 0, 0

    def count(name: str) -> int:
        try:
            return max(0, int(getattr(usage, name, 0) or 0))
        except (TypeError, ValueError):  # a gateway's garbage is no count; the call is still logged
            return 0

    return count("prompt_tokens"), count("completion_tokens")


def cached_tokens(response: Any, tokens_in: int) -> int:
    """Input tokens served from the provider's prompt cache (``usage.prompt_tokens_details.cached_tokens``);
    0 when absent, and never more than ``tokens_in``, of which they are a part."""
    details = getattr(getattr(response, "usage", None), "prompt_tokens_details", None)
    try:
        cached = int(getattr(details, "cached_tokens", 0) or 0)
    except (TypeError, ValueError):  # a gateway's garbage: the call is priced as uncached
        return 0
    return min(max(0, cached), tokens_in)


def to_completion(response: Any, model: str, usage: tuple[int, int]) -> Completion:
    """The response's first choice as a ``Completion`` carrying ``usage``; ``model`` when the server names none.
    Raises ``BadResponse`` for a body without a message."""
    choices = getattr(response, "choices", None)
    if not choices or getattr(choices[0], "message", None) is None:
        raise BadResponse(f"no choices in the response: {str(response)[:200]}")
    message = choices[0].message
    finish_reason = getattr(choices[0], "finish_reason", None)
    tool_calls = [
        ToolCall(id=tc.id, name=tc.function.name, arguments=tc.function.arguments or "")
        for tc in (message.tool_calls or [])
        if getattr(tc, "function", None) is not None
    ]
    raw: dict[str, Any] = {"role": "assistant", "content": message.content}
    if tool_calls:
        raw["tool_calls"] = [
            {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
            for tc in tool_calls
        ]
    return Completion(
        text=message.content or "",
        model=getattr(response, "model", None) or model,
        tokens_in=usage[0],
        tokens_out=usage[1],
        tool_calls=tool_calls,
        raw_message=raw,
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
    )
