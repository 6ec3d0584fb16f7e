"""API keys: created once and printed once, stored only as a sha256, each bound to one tenant.

The logic is the engine's (``rlm_workers.engine``, keys); the API, the CLI and the tests name it here too.
"""

from __future__ import annotations

from rlm_workers.engine import KEY_PREFIX, create_key, hash_key, list_keys, revoke_key, tenant_for_key, validate_tenant

__all__ = ["KEY_PREFIX", "create_key", "hash_key", "list_keys", "revoke_key", "tenant_for_key", "validate_tenant"]
