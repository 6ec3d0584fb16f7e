"""The sandbox that runs model-written programs (docs/architecture.md#sandbox)."""
