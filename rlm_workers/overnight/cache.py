"""The result cache's key: an overnight item is served from the cache only when nothing that shapes its
answer changed (tenant, query, the buffer's id and content, options, provider, models, query defaults, prompts).

The buffer is named by its id and a digest of its content (``store.overnight.buffer_contents``), never by
its name and version: a buffer deleted and reloaded under the same name starts again at version 1, and an
answer about the deleted content (citing its chunk ids) must not be served for the new one.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, TypeGuard

from ..llm.registry import provider_name
from ..pipeline.collect import finding_threshold
from ..pipeline.prompts import PROMPT_NAMES, load_prompt

if TYPE_CHECKING:
    from ..config import Settings

CACHE_VERSION = 3


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def fingerprint(settings: Settings) -> str:
    """Everything besides the item itself that changes an answer: provider, models, defaults, prompts."""
    prompts: dict[str, str | None] = {}
    for name in PROMPT_NAMES:
        try:
            prompts[name] = hashlib.sha256(load_prompt(name, prompt_dir=settings.prompt_dir).encode()).hexdigest()
        except (OSError, FileNotFoundError):
            prompts[name] = None
    online = not settings.offline
    return _sha(
        {
            "v": CACHE_VERSION,
            "provider": provider_name(settings),
            "base_url": settings.base_url if online else None,
            "models": [settings.primary_model, settings.subcall_model, settings.synthesizer_model] if online else [],
            "defaults": {
                "batch_size": settings.batch_size,
                "top_k": settings.search_top_k,
                "threshold": settings.threshold,
                # the threshold in force (the offline provider's default differs from a model's)
                "finding_threshold": finding_threshold(settings),
                # an operator's explicit value beats the tier, an implicit one does not
                "explicit": sorted({"batch_size", "search_top_k"} & settings.model_fields_set),
                "caps": [settings.max_chunks_per_job, settings.max_batches_per_job],
            },
            "embedding_model": settings.embedding_model,
            "prompts": prompts,
        }
    )


def cache_key(*, tenant: str, query: str, buffer_id: int, content: str, options: dict[str, Any], fp: str) -> str:
    return _sha(
        {
            "tenant": tenant,
            "query": query,
            "buffer_id": int(buffer_id),
            "content": content,
            "options": options,
            "fp": fp,
        }
    )


def cacheable(result: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Only clean answers are reused: a result with failed (or unrun) analyst batches would be a degraded answer
    forever."""
    if not result:
        return False
    return not any(result.get(k) for k in ("batches_failed", "batches_not_run", "chunk_load_failures"))
