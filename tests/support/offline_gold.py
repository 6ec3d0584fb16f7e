"""Questions about code nobody on this project wrote, with the file and the line that answer each.

Three corpora, all installed by the packages constraints.txt pins, so a clean checkout has them:

- ``celery``: Celery 5.7.0's ``celery/app`` subpackage (16 files, about 290 KB).
- ``httpx``: httpx 0.28.1's top-level modules (17 files, about 250 KB), and ``click``: click 8.5.1's (17 files).

This is no held-out set.  The questions were written while the offline provider was a rule engine, whose
weights were tuned on the Celery questions (httpx and click were written afterwards by someone who had not read
its code).  The ranking that replaced it (BM25 and the local encoder, fused by RRF) was not tuned on any of them,
but they were seen while its gate was set; the held-out measure is bench/answer_eval.py's held-out set.

The questions are phrased as a user would ask them, about a third without the identifier's words ("how long
before a task is tried again" for ``default_retry_delay``).  Each gold line is a substring of the one line a
good answer quotes (unique in its corpus, or asked with words that pick one of its definitions).

Used by tests/support/offline_answer.py (the gate, one test module per corpus) and bench/offline_answer.py (the figure).
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import NamedTuple


def first_quote(report: str) -> str:
    """The answer's first quoted passage (its ``> `` line), "" when it quotes none."""
    return next(iter(quotes(report)), "")


def quotes(report: str) -> list[str]:
    """The passages an answer opens with (its ``> `` lines), best first."""
    return [line for line in report.split("\n") if line.startswith("> ")]


class Gold(NamedTuple):
    question: str
    path: str  # relative to the loaded folder
    line: str  # a substring of the line that answers

    def quoted_first(self, report: str) -> bool:
        return self.line in first_quote(report)

    def quoted(self, report: str) -> bool:
        """Among the passages the answer opens with."""
        return any(self.line in q for q in quotes(report))

    def in_sources(self, paths: list[str]) -> bool:
        return any(p.endswith("/" + self.path) for p in paths)


class Corpus(NamedTuple):
    name: str
    package: str  # the installed package whose source is loaded
    subdir: str  # the folder under it, "" for the package's own top-level modules
    gold: list[Gold]

    @property
    def buffer(self) -> str:
        return f"{self.name}-src"

    def copy(self, dest: Path) -> Path:
        """The corpus's ``.py`` files copied under ``dest`` (no caches, no subfolders), so a load takes exactly
        them; returns the folder to load."""
        src = Path(importlib.import_module(self.package).__file__).parent / self.subdir
        out = dest / (self.subdir or self.package)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.glob("*.py")):
            shutil.copyfile(f, out / f.name)
        return out


CELERY = Corpus(
    "celery",
    "celery",
    "app",
    [
        Gold("What is the default broker heartbeat interval?", "defaults.py", "heartbeat=Option(120"),
        Gold("Where is the default prefetch multiplier defined?", "defaults.py", "prefetch_multiplier=Option(4"),
        Gold(
            "Where does celery define the default prefetch multiplier?", "defaults.py", "prefetch_multiplier=Option(4"
        ),
        Gold("How many times is a failing task retried by default?", "task.py", "max_retries = 3"),
        Gold("How long does a task wait before it is tried again?", "task.py", "default_retry_delay = 3 * 60"),
        Gold("What is the name of the default queue?", "defaults.py", "default_queue=Option('celery')"),
        Gold(
            "How many times does it try to reconnect to the broker?", "defaults.py", "connection_max_retries=Option(100"
        ),
        Gold(
            "Which multiprocessing start method does the worker pool use?", "defaults.py", "pool_start_method=Option("
        ),
        Gold("What is the socket timeout of the redis result backend?", "defaults.py", "socket_timeout=Option(120.0"),
        Gold("How long can the repr of a task result be?", "task.py", "resultrepr_maxsize = 1024"),
        Gold("How long does the worker wait for results of lost tasks?", "defaults.py", "lost_wait=Option(10.0"),
        Gold("Where is the function that sends a task by its name?", "base.py", "def send_task("),
        Gold("How does celery find the tasks modules of installed packages?", "base.py", "def autodiscover_tasks("),
        Gold(
            "Where is a router given as a string turned into a router object?", "routes.py", "def expand_router_string("
        ),
        Gold("Which class routes tasks with a dictionary of task names?", "routes.py", "class MapRoute"),
        Gold("Where is the function that schedules a task to run again?", "task.py", "def retry("),
        Gold("Where is the tracer that runs a task and records its state built?", "trace.py", "def build_tracer("),
        Gold("Is UTC enabled by default?", "defaults.py", "enable_utc=Option(True"),
        Gold("When do the event queues expire?", "defaults.py", "queue_expires=Option(60.0"),
        Gold("Which version of the task message protocol is used by default?", "defaults.py", "protocol=Option(2"),
        Gold(
            "Where is the periodic task that deletes expired results registered?",
            "builtins.py",
            "def add_backend_cleanup_task(",
        ),
        Gold("Which format do worker log lines have?", "defaults.py", "log_format=Option(DEFAULT_PROCESS_LOG_FMT)"),
        Gold("How can I tell a worker to stop running a task that was already sent?", "control.py", "def revoke("),
        Gold("How do I check that the workers are alive and answering?", "control.py", "def ping("),
    ],
)

HTTPX = Corpus(
    "httpx",
    "httpx",
    "",
    [
        # --- default values / constants / settings ---
        Gold("What is the default timeout?", "_config.py", "DEFAULT_TIMEOUT_CONFIG = Timeout(timeout=5.0)"),
        Gold("How many redirects does it follow at most?", "_config.py", "DEFAULT_MAX_REDIRECTS = 20"),
        Gold(
            "How many connections are kept alive by default?",
            "_config.py",
            "DEFAULT_LIMITS = Limits(max_connections=100",
        ),
        Gold(
            "How long may an unused pooled connection sit idle before it is dropped?",
            "_config.py",
            "keepalive_expiry: float | None = 5.0",
        ),
        Gold("Which user agent does the client send?", "_client.py", 'USER_AGENT = f"python-httpx/{__version__}"'),
        Gold("How long can an address be before it is rejected as too long?", "_urlparse.py", "MAX_URL_LENGTH = 65536"),
        Gold("Which compression formats can it unpack from a response body?", "_decoders.py", "SUPPORTED_DECODERS = {"),
        Gold(
            "Which header values get masked out when headers are printed?",
            "_models.py",
            'SENSITIVE_HEADERS = {"authorization", "proxy-authorization"}',
        ),
        Gold(
            "How many bytes at a time are read from a file being uploaded in a form?",
            "_multipart.py",
            "CHUNK_SIZE = 64 * 1024",
        ),
        Gold("Which version of httpx is installed?", "__version__.py", '__version__ = "0.28.1"'),
        Gold(
            "Which port numbers are left out of an address because they are the usual one for its scheme, "
            "e.g. for ws or ftp?",
            "_urlparse.py",
            'default_port = {"ftp": 21, "http": 80, "https": 443, "ws": 80, "wss": 443}',
        ),
        Gold(
            "What Accept-Encoding value does the client send by default?", "_client.py", 'ACCEPT_ENCODING = ", ".join('
        ),
        # --- other behaviour questions answered by one line ---
        Gold(
            "If the type of an uploaded file cannot be worked out from its name, what type is it sent as?",
            "_multipart.py",
            'mimetypes.guess_type(filename)[0] or "application/octet-stream"',
        ),
        Gold(
            "Which URL schemes are allowed for a proxy?",
            "_config.py",
            'if url.scheme not in ("http", "https", "socks5", "socks5h"):',
        ),
        Gold(
            "How is the multipart boundary generated when none is given?",
            "_multipart.py",
            'boundary = os.urandom(16).hex().encode("ascii")',
        ),
        # --- where is the function/class that does X ---
        Gold(
            "Where is the function that parses a URL string into its components?",
            "_urlparse.py",
            "def urlparse(url: str",
        ),
        Gold(
            "Where does a POST get turned into a GET after a 301, 302 or 303 response?",
            "_client.py",
            "def _redirect_method(self, request: Request, response: Response)",
        ),
        Gold(
            "Where does the client drop credentials when it is sent on to a different site?",
            "_client.py",
            "def _redirect_headers(self, request: Request, url: URL, method: str)",
        ),
        Gold(
            "Where is the function that reads proxy settings from environment variables?",
            "_utils.py",
            "def get_environment_proxies()",
        ),
        Gold("Where is the SSL context created?", "_config.py", "def create_ssl_context("),
        Gold(
            "Where are '.' and '..' segments resolved in an address path?",
            "_urlparse.py",
            "def normalize_path(path: str)",
        ),
        Gold(
            "Where is the exception for too many redirects defined?",
            "_exceptions.py",
            "class TooManyRedirects(RequestError):",
        ),
        Gold("Where is gzip decompression implemented?", "_decoders.py", "class GZipDecoder(ContentDecoder):"),
        Gold(
            "Where does a response throw an error when the server answered with a failure status?",
            "_models.py",
            "def raise_for_status(self)",
        ),
    ],
)

CLICK = Corpus(
    "click",
    "click",
    "",
    [
        # --- default values / constants / settings ---
        Gold(
            "If the terminal is really wide, how wide can the help page get at most by default?",
            "formatting.py",
            "max_width = 80",
        ),
        Gold(
            "What is the default maximum width of the first column when HelpFormatter writes a definition list?",
            "formatting.py",
            "col_max: int = 30,",
        ),
        Gold(
            "What status code does my program exit with when someone passes bad arguments on the command line?",
            "exceptions.py",
            "exit_code: t.ClassVar[int] = 2",
        ),
        Gold(
            "What are the default help option names if I don't set help_option_names?",
            "core.py",
            'help_option_names = ["--help"]',
        ),
        Gold(
            "What message does version_option print by default?",
            "decorators.py",
            'message = _("%(prog)s, version %(version)s")',
        ),
        Gold(
            "What question is shown by default for the 'are you sure?' flag before something destructive runs?",
            "decorators.py",
            'kwargs.setdefault("prompt", _("Do you want to continue?"))',
        ),
        Gold(
            "Which date formats does the DateTime type accept when no formats are given?",
            "types.py",
            "self.formats = formats or [",
        ),
        Gold(
            "Which environment variable name makes my program print tab-completion output instead of running?",
            "core.py",
            'complete_var = f"_{complete_name}_COMPLETE".upper()',
        ),
        Gold(
            "What is the maximum number of bytes written in one go to the Windows console?",
            "_winconsole.py",
            "MAX_BYTES_WRITTEN = 32767",
        ),
        Gold(
            "Which text editors are tried, in order, when neither VISUAL nor EDITOR is set on Linux?",
            "_termui_impl.py",
            'for editor in "sensible-editor", "vim", "nano":',
        ),
        Gold(
            "What charset does CliRunner use by default for input and output?",
            "testing.py",
            'charset: str = "utf-8",',
        ),
        # --- where is the function/class that does X ---
        Gold(
            "Where is the class for a command that holds other subcommands?",
            "core.py",
            "class Group(Command):",
        ),
        Gold(
            "Where does click work out the per-user folder where an application should keep its config files?",
            "utils.py",
            "def get_app_dir(",
        ),
        Gold(
            "Where is the CliRunner class for invoking commands in tests?",
            "testing.py",
            "class CliRunner:",
        ),
        Gold(
            "Where is the exception raised when the user passes an option that doesn't exist?",
            "exceptions.py",
            "class NoSuchOption(UsageError):",
        ),
        Gold(
            "Where is the function that breaks a command line string into tokens the way a shell would?",
            "shell_completion.py",
            "def split_arg_string(",
        ),
        Gold(
            "Where is the ProgressBar class implemented?",
            "_termui_impl.py",
            "class ProgressBar(t.Generic[V]):",
        ),
        Gold(
            "Where is the IntRange parameter type defined?",
            "types.py",
            "class IntRange(",
        ),
        Gold(
            "Where is get_current_context, which returns the current click context?",
            "globals.py",
            "def get_current_context(silent: bool = False)",
        ),
        Gold(
            "Where is the enum that records the source of a parameter's value (command line, environment, default)?",
            "core.py",
            "class ParameterSource(enum.IntEnum):",
        ),
        # --- how do I ... ---
        Gold(
            "How do I echo text with colors and style in a single call?",
            "termui.py",
            "def secho(",
        ),
        Gold(
            "How do I launch a URL in the user's web browser from my tool?",
            "termui.py",
            "def launch(",
        ),
        Gold(
            "How do I echo long output through a pager?",
            "termui.py",
            "def echo_via_pager(",
        ),
        Gold(
            "How do I ask the user to confirm with a yes/no prompt?",
            "termui.py",
            "def confirm(",
        ),
    ],
)

CORPORA = {c.name: c for c in (CELERY, HTTPX, CLICK)}
