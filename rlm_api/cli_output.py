"""How ``rlm`` commands write: one-line errors on stderr, JSON on stdout, a query's report, sizes for a person,
and progress as log lines where stderr is not a terminal."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import typer

from .cli_types import Fmt

if TYPE_CHECKING:
    from rlm_workers.engine import QueryResult


def err(message: str) -> None:
    """``error: message`` on stderr, the one shape every known failure prints."""
    typer.echo(f"error: {message}", err=True)


@contextlib.contextmanager
def one_transaction_interrupt(buffer: str) -> Iterator[None]:
    """Ctrl-C inside: say the buffer was not changed and exit 130.  For a command whose writes are one
    transaction; typer would otherwise turn the KeyboardInterrupt into a silent exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        err(f"interrupted; buffer {buffer!r} was not changed")
        raise typer.Exit(130) from None


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False, indent=None))


def print_result(result: QueryResult, fmt: Fmt) -> None:
    """A finished query: its QueryResult as JSON, or the report and a status line."""
    # the status line's module pulls in psycopg and kombu: imported by the commands that print a result
    from rlm_workers.engine import status_line

    if fmt == Fmt.json:
        typer.echo(result.model_dump_json())
        return
    typer.echo(result.response.rstrip())
    typer.echo("")
    typer.echo(status_line(result))


def plural(n: int, noun: str) -> str:
    """The noun for a count of ``n``: ``chunk`` for 1, ``chunks`` for the rest (0 included)."""
    return noun if n == 1 else noun + "s"


def human(n: float) -> str:
    """A byte count for a person: ``512 B``, ``3.4 MB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Ticker:
    """Progress as plain log lines, for a stderr that is not a terminal (CI logs, `2> file`), where a rich bar
    prints nothing: quiet for the first ``after`` seconds (a short run stays silent), then a line at most every
    ``every`` seconds, or at once when ``force`` says something worth a line happened (a new stage)."""

    def __init__(self, *, after: float, every: float) -> None:
        self._clock = time.monotonic
        self.t0 = self._clock()
        self.after, self.every = after, every
        self.last: float | None = None

    def maybe(self, line: Callable[[float], str], *, force: bool = False) -> bool:
        """Print ``line(seconds since start)`` if it is time to; True when it was printed."""
        now = self._clock()
        if now - self.t0 < self.after:
            return False
        if force or self.last is None or now - self.last >= self.every:
            self.last = now
            typer.echo(line(now - self.t0), err=True)
            return True
        return False
