"""Which LLM provider answers: a name per provider, one builder per name.

No API key means the offline extractive provider; a key (and optionally a base
URL) means the OpenAI-compatible client.  Everything that prints or fingerprints
the provider asks ``provider_name`` instead of re-deriving it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .extractive import ExtractiveProvider
from .limiter import Limits
from .openai_provider import OpenAIProvider

if TYPE_CHECKING:
    from ..config import Settings
    from .protocol import LLMProvider


def _extractive(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    return ExtractiveProvider()


def _openai(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    return OpenAIProvider(settings, limiter=Limits.from_settings(settings, redis()))


#: provider name → builder(settings, redis client factory); the name is what QueryResult.provider shows
PROVIDERS: dict[str, Callable[[Settings, Callable[[], Any]], LLMProvider]] = {
    "extractive": _extractive,
    "openai": _openai,
}


def provider_name(settings: Settings) -> str:
    return "extractive" if settings.offline else "openai"


def build_provider(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    return PROVIDERS[provider_name(settings)](settings, redis)
