"""Small real-text corpora written on the fly for load and search tests."""

from __future__ import annotations

from pathlib import Path

PY_MODULE = '''"""Billing helpers."""

import decimal


def compute_invoice_total(lines, tax_rate):
    """Sum invoice lines and apply the tax rate."""
    subtotal = sum(decimal.Decimal(str(line.amount)) for line in lines)
    return subtotal * (1 + decimal.Decimal(str(tax_rate)))


class RefundPolicy:
    """Refunds are allowed for thirty days after purchase."""

    window_days = 30

    def allows(self, days_since_purchase):
        return days_since_purchase <= self.window_days
'''

GUIDE_MD = """# Operations guide

## Backups

Nightly backups run at 02:00 UTC and are kept for fourteen days. Restores are
tested every Monday by the on-call engineer.

## Incidents

When the pager fires, acknowledge within five minutes. Open an incident channel,
write down the timeline as you go, and hand over explicitly at the end of a shift.

## Pets

The office cat sat on the mat near the window every afternoon, ignoring everyone.
"""

FILLER = (
    "Gardeners in temperate climates usually sow tomatoes indoors in early spring, moving the seedlings "
    "outside once the nights stay warm. Compost improves the soil structure and keeps moisture around the "
    "roots during dry spells. Mulch suppresses weeds and slowly feeds the ground as it breaks down. "
)


def write_mixed_tree(root: Path) -> Path:
    """Code, markdown, a binary, a latin-1 file, an empty file and directories that must be skipped."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "billing.py").write_text(PY_MODULE)
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text(GUIDE_MD)
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    (root / "legacy.txt").write_bytes("Le café est très chaud aujourd'hui.".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / "node_modules" / "left-pad").mkdir(parents=True)
    (root / "node_modules" / "left-pad" / "index.js").write_text("module.exports = 1;\n")
    return root


def long_chunk_text(tail_sentence: str, *, size: int = 2900) -> str:
    """One paragraph of ~size chars whose LAST sentence is the one to find."""
    body = (FILLER * (size // len(FILLER) + 1))[: size - len(tail_sentence) - 1]
    body = body[: body.rfind(". ") + 1]
    return body + " " + tail_sentence + "\n"
