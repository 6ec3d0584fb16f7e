"""Which LLM provider answers: a name per provider, one builder per name.

The settings resolve RLM_PROVIDER (docs/contract.md#providers): a key or base URL means the OpenAI-compatible
client, a local model the same client pointed at the local model server, neither the offline extractive
provider.  Everything that prints or fingerprints the provider asks ``provider_name`` instead of re-deriving it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .extractive import ExtractiveProvider
from .limiter import Limits

if TYPE_CHECKING:
    from ..config import Settings
    from .protocol import LLMProvider


def _extractive(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    return ExtractiveProvider()


def _openai(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    # the openai package is a heavy edge (its types alone take most of a second to import): a process that
    # never calls a model, such as `rlm batch cancel` or the API's reads, does not load it
    from .openai_provider import OpenAIProvider

    return OpenAIProvider(settings, limiter=Limits.from_settings(settings, redis()))


#: provider name → builder(settings, redis client factory); the name is what QueryResult.provider shows
PROVIDERS: dict[str, Callable[[Settings, Callable[[], Any]], LLMProvider]] = {
    "extractive": _extractive,
    "openai": _openai,
    "local": _openai,
}


def provider_name(settings: Settings) -> str:
    return settings.resolved_provider


def build_provider(settings: Settings, redis: Callable[[], Any]) -> LLMProvider:
    return PROVIDERS[provider_name(settings)](settings, redis)
