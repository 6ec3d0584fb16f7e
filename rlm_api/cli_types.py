"""What every ``rlm`` command group shares: how a group is built, the option types both `query` and
`batch submit` take, the tenant and the database connection a command acts with, and how click's exceptions
are recognised (typer >= 0.25 vendors click as ``typer._click``; older typer uses the ``click`` package — both
must end as a one-line usage error).

Every ``cli_*`` module is imported for ``rlm --help``: what needs the settings, the database (psycopg), the
broker (celery), rich or the loader is imported inside the command that uses it, so the CLI starts fast.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rlm_workers.engine import InvalidInput, SearchMode

from .auth import validate_tenant

if TYPE_CHECKING:
    import psycopg

    from rlm_workers.config import Settings

#: ``-h`` everywhere; click passes these settings down to every sub-command's context.
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


def new_typer(**kwargs: Any) -> typer.Typer:
    """A command group with the CLI's shared settings.

    Plain click help (``rich_markup_mode=None``) wraps help text instead of cutting option names
    (``--idempotency-k…``) to fit an 80-column terminal.
    """
    # completion options belong on the root command only (`rlm --install-completion`); groups pass nothing
    kwargs.setdefault("add_completion", False)
    return typer.Typer(
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings=CONTEXT_SETTINGS,
        **kwargs,
    )


SearchModeOpt = Annotated[
    SearchMode | None,
    typer.Option("--search-mode", help="Search arm: hybrid (both arms fused), semantic or bm25."),
]


TenantOpt = Annotated[
    str | None,
    typer.Option("--tenant", help="Tenant whose data this touches (default RLM_TENANT, 'local')."),
]


def resolve_tenant(tenant: str | None) -> str:
    """``--tenant`` or the configured default, checked like an API key's tenant (bad name: exit 2)."""
    from rlm_workers.config import get_settings

    return validate_tenant(get_settings().tenant if tenant is None else tenant)


@contextlib.contextmanager
def open_db() -> Iterator[tuple[Settings, str, psycopg.Connection]]:
    """``(settings, database url, connection)`` for one command; the connection is closed on the way out."""
    from rlm_workers.config import get_settings
    from rlm_workers.engine import connect, resolve_url

    settings = get_settings()
    url = resolve_url(settings)
    conn = connect(settings, url=url)
    try:
        yield settings, url, conn
    finally:
        conn.close()


#: what may be a job or batch id given short: 4 or more of its hex digits (ids are 32), as git takes commits
ID_PREFIX = re.compile(r"^[0-9a-f]{4,31}$")


def unique_prefix(given: str, starting: Callable[[str], list[str]], *, what: str) -> str | None:
    """The one id that starts with ``given`` (``starting(prefix)`` lists a few that do); None when none does.

    Several is a one-line error (exit 2): acting on whichever came first could show, or cancel, the wrong one.
    """
    prefix = given.lower()
    if not ID_PREFIX.match(prefix):
        return None
    ids = starting(prefix)
    if len(ids) > 1:
        shown = ", ".join(ids[:3]) + (", …" if len(ids) > 3 else "")
        raise InvalidInput(f"{what} id prefix {given!r} is ambiguous: {shown} start with it; give more characters")
    return ids[0] if ids else None


def _classes(*names: str) -> dict[str, tuple[type[BaseException], ...]]:
    """The click exception classes by role, from every click this process can see."""
    found: dict[str, list[type[BaseException]]] = {n: [] for n in names}
    for modname in ("typer", "typer._click.exceptions", "click.exceptions"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for n in names:
            cls = getattr(mod, n, None)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found[n]:
                found[n].append(cls)
    return {n: tuple(v) for n, v in found.items()}


def click_error_kind(exc: BaseException) -> tuple[str, int] | None:
    """``(kind, exit code)`` for a click/typer control-flow exception, None for anything else."""
    c = _classes("Exit", "Abort", "UsageError", "ClickException")
    if c["Exit"] and isinstance(exc, c["Exit"]):
        return "exit", int(getattr(exc, "exit_code", 0) or 0)
    if c["Abort"] and isinstance(exc, c["Abort"]):
        return "abort", 1
    if c["UsageError"] and isinstance(exc, c["UsageError"]):
        return "usage", 2
    if c["ClickException"] and isinstance(exc, c["ClickException"]):
        return "click", int(getattr(exc, "exit_code", 1) or 1)
    return None


class Fmt(str, Enum):
    """``--format`` of the commands that print text for a person or JSON for a program."""

    text = "text"
    json = "json"
