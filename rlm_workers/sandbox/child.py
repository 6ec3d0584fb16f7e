"""The sandbox's own process (docs/architecture.md#sandbox): runs model-written Python in rounds.

Started by ``sandbox/runner.py`` as ``python -I -S -B child.py PARENT_PID MEMORY_BYTES CPU_SECONDS OUTPUT_CHARS
API_JSON`` with the standard library only, so nothing of the package (settings, database, secrets) is loaded here.
Before it reads any program it sets its resource limits, loads every module a program may import, and installs a
seccomp filter that allows only the system calls a running interpreter needs on pipes it already holds: no file
is opened, no socket made, no process forked or signalled from then on, whatever the program does.  The Python
layer above it (a reduced ``__builtins__``, an import allowlist) only turns the common attempts into clear
errors; the kernel filter is the boundary.

It speaks JSON lines on its standard input and output; a program's prints are captured, never written there.
"""

import ast
import builtins
import ctypes
import json
import linecache
import os
import resource
import struct
import sys
import traceback

#: what a program may import; each is loaded before the filter, since nothing can be read from disk after it
ALLOWED_MODULES = (
    "bisect",
    "collections",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "textwrap",
    "typing",
    "unicodedata",
)
#: builtins a program does not get: files, the terminal, the debugger, the interpreter's exit
REMOVED_BUILTINS = ("open", "input", "breakpoint", "help", "exit", "quit", "copyright", "credits", "license")

# System calls left open once the filter is in, by architecture (audit arch, numbers).  Reading and writing the
# pipes held at start, memory, signals for the interpreter's own use, clocks, random bytes and exit; everything
# else fails with EPERM, so an interpreter that reaches for it sees an OSError and the program an error.
_ALLOWED_CALLS = {
    "x86_64": (
        0xC000003E,
        {
            "read": 0, "write": 1, "close": 3, "fstat": 5, "poll": 7, "lseek": 8, "mmap": 9, "mprotect": 10,
            "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14, "rt_sigreturn": 15, "readv": 19,
            "writev": 20, "select": 23, "sched_yield": 24, "mremap": 25, "madvise": 28, "nanosleep": 35,
            "getpid": 39, "exit": 60, "fcntl": 72, "gettimeofday": 96, "getrusage": 98, "sigaltstack": 131,
            "gettid": 186, "futex": 202, "clock_gettime": 228, "clock_getres": 229, "clock_nanosleep": 230,
            "exit_group": 231, "pselect6": 270, "ppoll": 271, "getrandom": 318, "rseq": 334,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "fcntl": 25, "close": 57, "lseek": 62, "read": 63, "write": 64, "readv": 65, "writev": 66,
            "pselect6": 72, "ppoll": 73, "fstat": 80, "exit": 93, "exit_group": 94, "futex": 98, "nanosleep": 101,
            "clock_gettime": 113, "clock_getres": 114, "clock_nanosleep": 115, "sched_yield": 124,
            "sigaltstack": 132, "rt_sigaction": 134, "rt_sigprocmask": 135, "rt_sigreturn": 139, "getrusage": 165,
            "gettimeofday": 169, "getpid": 172, "gettid": 178, "brk": 214, "munmap": 215, "mremap": 216,
            "mmap": 222, "mprotect": 226, "madvise": 233, "getrandom": 278, "rseq": 293,
        },
    ),
}  # fmt: skip
#: x86_64's x32 calls carry this bit; they are refused whatever their number
_X32_BIT = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | 1
_RET_KILL = 0x80000000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06


class ApiError(Exception):
    """What an API call of the sandbox answered with an error (the program may catch it)."""


class _Final(BaseException):
    """final() ends the round, whatever the program's own ``except Exception`` says."""


class _OutputFlood(BaseException):
    """The program printed far past the round's output limit."""


def _filter_program(machine):
    arch, calls = _ALLOWED_CALLS[machine]
    numbers = sorted(calls.values())
    n = len(numbers)

    def stmt(code, k):
        return struct.pack("HBBI", code, 0, 0, k)

    def jump(code, k, jt, jf):
        return struct.pack("HBBI", code, jt, jf, k)

    prog = [
        stmt(_LD_W_ABS, 4),  # seccomp_data.arch
        jump(_JEQ_K, arch, 1, 0),
        stmt(_RET_K, _RET_KILL),  # another ABI's numbers mean other calls
        stmt(_LD_W_ABS, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        prog.append(jump(_JGE_K, _X32_BIT, n, 0))  # over the allowed numbers to the EPERM
    # each allowed number jumps over the rest and the EPERM to the ALLOW at the end
    prog += [jump(_JEQ_K, nr, n - i, 0) for i, nr in enumerate(numbers)]
    prog += [stmt(_RET_K, _RET_EPERM), stmt(_RET_K, _RET_ALLOW)]
    return prog


def _close_system_calls():
    machine = os.uname().machine
    if machine not in _ALLOWED_CALLS:
        raise OSError(f"no system call filter for the {machine} architecture (x86_64 and aarch64 have one)")
    prog = _filter_program(machine)
    code = b"".join(prog)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(prog), code)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "the kernel refused the seccomp filter")


def _die_with_parent(parent_pid):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the worker goes, even mid-loop
    if os.getppid() != parent_pid:  # it went before the line above took effect
        os._exit(1)


class _Capture:
    """A round's prints: the first ``limit`` characters kept, the rest counted; a flood ends the round."""

    def __init__(self, limit):
        self.limit = limit
        self.parts = []
        self.kept = 0
        self.total = 0

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.total += len(text)
        room = self.limit - self.kept
        if room > 0:
            piece = text[:room]
            self.parts.append(piece)
            self.kept += len(piece)
        if self.total > 10 * self.limit:
            raise _OutputFlood()
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


class _Discard:
    """Where prints go between rounds."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


class _Channel:
    def __init__(self):
        self.inp = sys.stdin.buffer
        self.out = sys.stdout.buffer

    def send(self, frame):
        self.out.write(json.dumps(frame).encode() + b"\n")
        self.out.flush()

    def receive(self):
        line = self.inp.readline()
        if not line:
            os._exit(0)  # the worker closed the pipe: nothing more to run
        return json.loads(line)


def _api_function(channel, name):
    def call(*args, **kwargs):
        frame = {"t": "call", "name": name, "args": list(args), "kwargs": kwargs}
        try:
            channel.send(frame)  # encoded before anything is written: a value that is not JSON sends nothing
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}(): arguments must be JSON values (str, int, float, bool, None, list, dict): {exc}"
            ) from None
        reply = channel.receive()
        if reply.get("t") == "result":
            return reply.get("value")
        raise ApiError(str(reply.get("message", "the call failed")))

    call.__name__ = call.__qualname__ = name
    return call


def _final_function(state):
    def final(answer, citations=()):
        """End the program with its answer, citing the chunk ids it read (from the API's results)."""
        if answer is None:
            raise TypeError("final(): give the answer, in words")
        if not isinstance(answer, str):  # a count or a list is an answer too: said as Python writes it
            answer = str(answer)
        cites = [citations] if isinstance(citations, (str, int)) else list(citations)
        if not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in cites):
            raise TypeError("final(): citations must be chunk ids (int or str)")
        state["final"] = {"answer": answer, "citations": cites}
        raise _Final()

    return final


def _guarded_import(modules):
    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        if level:
            raise ImportError("relative imports are not available in the sandbox")
        top = name.partition(".")[0]
        if top not in modules or name not in sys.modules:
            raise ImportError(
                f"import of {name!r} is not allowed in the sandbox; allowed: {', '.join(sorted(modules))}"
            )
        return sys.modules[name if fromlist else top]

    return __import__


def _user_traceback(exc):
    """The error as the program sees it: only its own rounds' frames, none of the sandbox's."""
    report = traceback.TracebackException.from_exception(exc)
    frames = [f for f in report.stack if f.filename.startswith("<round ")]
    report.stack = traceback.StackSummary.from_list(frames)
    return "".join(report.format()).rstrip()


def _run(code, number, namespace, state, output_limit):
    capture = _Capture(output_limit)
    sys.stdout = sys.stderr = capture
    filename = f"<round {number}>"
    state["final"] = None
    error = None
    try:
        tree = ast.parse(code, filename)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:  # like a REPL: a closing expression shows its value
            value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
            if value is not None:
                print(repr(value))
    except _Final:
        pass
    except _OutputFlood:
        error = f"output limit: the round printed more than {10 * output_limit} characters and was stopped"
    except MemoryError:
        error = "memory limit: the program asked for more memory than the sandbox allows (MemoryError)"
    except SyntaxError as exc:
        error = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    except BaseException as exc:  # the program's own error, SystemExit and KeyboardInterrupt included
        error = _user_traceback(exc)
    finally:
        sys.stdout = sys.stderr = _Discard()
    return {
        "t": "done",
        "output": "".join(capture.parts),
        "output_chars": capture.total,
        "error": error,
        "final": state["final"],
    }


def main(argv):
    parent_pid, memory, cpu_seconds, output_limit = (int(a) for a in argv[1:5])
    api_names = json.loads(argv[5])
    channel = _Channel()
    try:
        _die_with_parent(parent_pid)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))  # SIGXCPU, then SIGKILL
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        for name in ALLOWED_MODULES:
            __import__(name)
        os.closerange(3, 1 << 16)
        _close_system_calls()
    except (OSError, ValueError, ImportError) as exc:
        channel.send({"t": "fail", "message": f"{type(exc).__name__}: {exc}"})
        return 3
    state = {"final": None}
    allowed = frozenset(ALLOWED_MODULES)
    user_builtins = {k: v for k, v in vars(builtins).items() if k not in REMOVED_BUILTINS}
    user_builtins["__import__"] = _guarded_import(allowed)
    api = {name: _api_function(channel, name) for name in api_names}
    api["final"] = _final_function(state)
    api["ApiError"] = ApiError
    namespace = {"__name__": "__sandbox__", "__builtins__": user_builtins}
    sys.stdin = None
    sys.stdout = sys.stderr = _Discard()
    channel.send({"t": "ready"})
    number = 0
    while True:
        frame = channel.receive()
        if frame.get("t") != "run":
            return 0
        # the worker's round number, so a traceback names the round the model is shown; a count when not sent
        number = frame["round"] if isinstance(frame.get("round"), int) else number + 1
        namespace.update(api)  # a program that defined its own read() or final() gets the real ones back
        channel.send(_run(str(frame.get("code", "")), number, namespace, state, output_limit))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
