"""Typed records for exact totals (``--scope all``, docs/contract.md#modes), without a model or I/O.

``totals.py`` parses the records a reply lists, sums and shows them; ``lines.py`` reads them off a chunk's
own lines.  The pipeline's analysts and reports and the offline provider (``llm/extractive.py``) both use
them, so they live apart from either: ``llm/`` imports nothing from ``pipeline/``.
"""
