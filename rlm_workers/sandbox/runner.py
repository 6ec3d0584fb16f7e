"""Model-written programs run in rounds in a sandboxed child process (docs/architecture.md#sandbox).

``Sandbox`` starts ``sandbox/child.py`` and runs one program a round in it; the program keeps its variables from
round to round.  The functions the caller hands in (``api``) are what the program can reach outside: a call
from the program comes back here as a JSON frame, runs in this process and its JSON answer goes back.  A round
is bounded in time (its own time: the time the calls spend here does not count), memory, CPU and output, and is
stopped at once when ``should_stop`` says so; a round that is stopped or kills its process ends the sandbox,
and the next round starts a fresh one, which the result says.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..errors import RLMError
from ..limits import (
    MAX_CODE_CPU_SECONDS,
    MAX_CODE_FRAME_BYTES,
    MAX_CODE_MEMORY_BYTES,
    MAX_CODE_OUTPUT_CHARS,
    MAX_CODE_ROUND_SECONDS,
)

CHILD = Path(__file__).with_name("child.py")
#: how long a fresh process may take to load its modules and close its system calls
_START_SECONDS = 30.0
#: how often a waiting round asks ``should_stop``
_POLL_SECONDS = 0.2


class SandboxUnavailable(RLMError):
    """This host cannot run the sandbox (no seccomp, another architecture): code mode cannot run here."""

    type = "sandbox_unavailable"


class CallError(Exception):
    """Raised by an API function for an error the program should see (it gets ``ApiError`` with the text)."""


class FinalAnswer(BaseModel):
    answer: str
    citations: list[int | str] = []


class RoundResult(BaseModel):
    """What one round did: its printed output (cut to the limit), its error, its final answer if it gave one."""

    output: str = ""
    #: characters the round printed in all; more than ``len(output)`` means the output was cut
    output_chars: int = 0
    error: str | None = None
    final: FinalAnswer | None = None
    calls: int = 0
    #: the round's own seconds, without the time its API calls took here
    seconds: float = 0.0
    #: the process ended with this round (stopped, out of limits, killed): the next round starts without its state
    ended: bool = False
    #: the round started a fresh process, so no earlier round's variables exist
    fresh: bool = False

    @property
    def truncated(self) -> bool:
        return self.output_chars > len(self.output)


class Sandbox:
    """One sandboxed interpreter that runs programs in rounds; use as a context manager, or ``close()`` it."""

    def __init__(
        self,
        api: Mapping[str, Callable[..., Any]],
        *,
        round_seconds: float = MAX_CODE_ROUND_SECONDS,
        memory_bytes: int = MAX_CODE_MEMORY_BYTES,
        cpu_seconds: int = MAX_CODE_CPU_SECONDS,
        output_chars: int = MAX_CODE_OUTPUT_CHARS,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.api = dict(api)
        self.round_seconds = round_seconds
        self.memory_bytes = memory_bytes
        self.cpu_seconds = cpu_seconds
        self.output_chars = output_chars
        self.should_stop = should_stop or (lambda: False)
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the process and wait until its filter is in; ``SandboxUnavailable`` if it cannot be."""
        if self.running:
            return
        self.close()
        argv = [
            sys.executable, "-I", "-S", "-B", str(CHILD), str(os.getpid()), str(self.memory_bytes),
            str(self.cpu_seconds), str(self.output_chars), json.dumps(sorted(self.api)),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={}, cwd="/"
        )
        assert self._proc.stdin is not None
        os.set_blocking(self._proc.stdin.fileno(), False)  # _send writes what the pipe takes, with a deadline
        self._pending = b""
        frame = self._read_frame(time.monotonic() + _START_SECONDS)
        if isinstance(frame, dict) and frame.get("t") == "ready":
            return
        self.close()
        detail = frame.get("message") if isinstance(frame, dict) else frame
        raise SandboxUnavailable(f"the code sandbox could not start on this host: {detail}")

    def run(self, code: str, number: int | None = None) -> RoundResult:
        """Run one program (round ``number``, which its traceback names); its output, error and final answer come
        back, never an exception of its own."""
        fresh = not self.running
        self.start()
        request: dict[str, Any] = {"t": "run", "code": code}
        if number is not None:
            request["round"] = number
        if why := self._send(_line(request)):
            return self._ended(why, calls=0, fresh=fresh)
        started = time.monotonic()
        waited = 0.0
        calls = 0
        while True:
            deadline = started + waited + self.round_seconds
            frame = self._read_frame(deadline)
            if isinstance(frame, str):
                return self._ended(frame, calls=calls, seconds=time.monotonic() - started - waited, fresh=fresh)
            kind = frame.get("t")
            if kind == "call":
                calls += 1
                began = time.monotonic()
                reply = self._call(frame)
                waited += time.monotonic() - began
                if why := self._send(reply):
                    return self._ended(why, calls=calls, fresh=fresh)
            elif kind == "done":
                return self._done(frame, calls, time.monotonic() - started - waited, fresh)
            else:
                return self._ended(f"the sandbox sent an unknown frame ({str(kind)[:40]!r})", calls=calls, fresh=fresh)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _call(self, frame: dict[str, Any]) -> bytes:
        """The answer to a call frame, encoded: the function's JSON value, or the error the program is told."""
        name = frame.get("name")
        fn = self.api.get(name) if isinstance(name, str) else None
        args, kwargs = frame.get("args"), frame.get("kwargs")
        if fn is None or not isinstance(args, list) or not isinstance(kwargs, dict):
            return _line({"t": "error", "message": f"no such API function: {str(name)[:80]!r}"})
        try:
            return _line({"t": "result", "value": fn(*args, **kwargs)})
        except CallError as exc:
            return _line({"t": "error", "message": str(exc)})
        except TypeError as exc:  # wrong arguments from the program: its error, told to it
            return _line({"t": "error", "message": f"{name}(): {exc}"})

    def _done(self, frame: dict[str, Any], calls: int, seconds: float, fresh: bool) -> RoundResult:
        try:
            final = FinalAnswer.model_validate(frame["final"]) if frame.get("final") else None
            return RoundResult(
                output=str(frame.get("output", ""))[: self.output_chars],
                output_chars=int(frame.get("output_chars", 0)),
                error=frame.get("error"),
                final=final,
                calls=calls,
                seconds=round(seconds, 3),
                fresh=fresh,
            )
        except (ValueError, TypeError, KeyError) as exc:  # a program that wrote its own frames to the pipe
            return self._ended(f"the sandbox sent a malformed result ({type(exc).__name__})", calls=calls, fresh=fresh)

    def _ended(self, why: str, *, calls: int, fresh: bool, seconds: float = 0.0) -> RoundResult:
        self.close()
        return RoundResult(error=why, calls=calls, seconds=round(max(seconds, 0.0), 3), ended=True, fresh=fresh)

    def _send(self, line: bytes) -> str | None:
        """Write an encoded frame, never blocking past the round's limit: a program that stops reading its pipe (it
        can, through the interpreter's internals) must not hold the worker.  Why it could not, or None."""
        assert self._proc is not None and self._proc.stdin is not None
        data = memoryview(line)
        fd = self._proc.stdin.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        deadline = time.monotonic() + self.round_seconds
        while data:
            left = deadline - time.monotonic()
            if left <= 0 or self.should_stop():
                return f"the sandbox stopped reading its input; the round was stopped after {self.round_seconds:g} s"
            if not poller.poll(min(left, _POLL_SECONDS) * 1000):
                continue
            try:
                sent = os.write(fd, data[: 1 << 16])
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return None  # the process has gone: the next read sees its end and says why
            data = data[sent:]
        return None

    def _read_frame(self, deadline: float) -> dict[str, Any] | str:
        """The next frame, or why there is none (time, stop, limit, the process gone)."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        poller = select.poll()  # not select(): a worker may hold more than 1,024 descriptors
        poller.register(fd, select.POLLIN | select.POLLHUP)
        while b"\n" not in self._pending:
            if len(self._pending) > MAX_CODE_FRAME_BYTES:
                return f"output limit: the sandbox wrote more than {MAX_CODE_FRAME_BYTES} bytes in one frame"
            if self.should_stop():
                return "stopped: the job was cancelled"
            left = deadline - time.monotonic()
            if left <= 0:
                return f"time limit: the round ran past {self.round_seconds:g} s and was stopped"
            if poller.poll(min(left, _POLL_SECONDS) * 1000):
                data = os.read(fd, 1 << 16)
                if not data:
                    return self._exit_reason(proc)
                self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        try:
            frame = json.loads(line)
        except ValueError:
            return "the sandbox sent a line that is not a frame"
        return frame if isinstance(frame, dict) else "the sandbox sent a frame that is not an object"

    def _exit_reason(self, proc: subprocess.Popen[bytes]) -> str:
        code = proc.wait()
        if code == -24:  # SIGXCPU: RLIMIT_CPU
            return f"CPU limit: the sandbox used its {self.cpu_seconds} s of CPU and was stopped"
        if code < 0:
            return f"the sandbox process was killed by signal {-code}"
        return f"the sandbox process exited (status {code})"


def _line(frame: dict[str, Any]) -> bytes:
    """A frame as the child reads it: one line of JSON (a value that is not JSON raises TypeError)."""
    return json.dumps(frame).encode() + b"\n"
