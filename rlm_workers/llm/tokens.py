"""Token counts estimated without a tokenizer: about four characters a token, on the safe side for English and
code.  One figure for every place that sizes text for a model (the direct prompt, the chat history, the rate
limiter's charge before a call)."""

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """Tokens ``text`` takes at most, by the estimate (rounded up)."""
    return -(-len(text) // CHARS_PER_TOKEN)
