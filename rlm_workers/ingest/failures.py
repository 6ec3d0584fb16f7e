"""How a failed load attempt ends: for good, with a reason the client may see, or retried.

One policy for an upload loaded whole (``uploads.run_ingest``) and for one file group of a split upload
(``groups.run_group``): bad input fails the same way on every attempt, so it ends the load at once; anything
else may pass on the next delivery, so the task raises and is retried, up to a number of attempts.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..errors import RLMError, error_record

BAD_DATA = {
    "type": "invalid_input",
    "message": "the upload holds text the database cannot store (such as a NUL character); "
    "fix the file and upload it again",
}


def final_error(exc: BaseException) -> dict[str, Any] | None:
    """The error the load ends with when ``exc`` will recur on every attempt (an ``RLMError`` that is not
    retryable, or values the database refuses); None when another attempt may succeed."""
    if isinstance(exc, RLMError):
        return None if exc.retryable else error_record(exc)
    # SQLSTATE class 22 (data exception): the values themselves are refused, whatever the server's state.
    return BAD_DATA if isinstance(exc, psycopg.errors.DataError) else None


def internal_error(exc: BaseException) -> dict[str, str]:
    """What the client sees of an unexpected failure: never the exception text, which can carry SQL, the data
    and the server's temporary paths (the worker log has it)."""
    return {
        "type": "internal_error",
        "message": f"the ingest worker could not load the upload ({type(exc).__name__}); its log has the details",
    }


def gave_up(attempts: int, last: dict[str, Any] | None) -> dict[str, str]:
    """The error of a load failed for good after ``attempts`` attempts, quoting the last one's."""
    why = last.get("message", "no error recorded") if last else "no error recorded"
    return {"type": "gave_up", "message": f"not loaded after {attempts} attempts; last: {why}"}
