"""Reading the one row a statement always returns.

An aggregate (``count(*)``), ``now()``, ``to_regclass`` or ``INSERT … RETURNING`` yields exactly one row, but
psycopg's ``fetchone`` is typed ``Row | None`` for every statement; ``one`` says which kind of statement this is,
so the type checker knows the row is there and a missing one fails loudly instead of as a ``TypeError``."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import psycopg

Row = TypeVar("Row")


def one(cursor: psycopg.Cursor[Row]) -> Row:
    """The cursor's first row, for a statement that cannot return none."""
    row = cursor.fetchone()
    if row is None:
        raise LookupError(f"the statement returned no row ({cursor.statusmessage})")
    return row
