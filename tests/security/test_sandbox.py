"""The code sandbox against hostile programs: each is stopped with a clear error, nothing outside it changes,
and the process that runs it (a worker, here the test) lives on and can run the next round."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from rlm_workers.sandbox.child import ALLOWED_MODULES
from rlm_workers.sandbox.runner import CallError, RoundResult, Sandbox

#: reaches the real ``os`` module through object introspection, past the import allowlist: what a program
#: that knows Python's escapes does first, so every hostile test below goes past the Python layer to the kernel's
OS = "g = [c for c in object.__subclasses__() if c.__name__ == '_wrap_close'][0].__init__.__globals__\n"
#: the same for ctypes, which the sandbox loaded to install its filter: system calls by hand
LIBC = OS + "ctypes = g['sys'].modules['ctypes']\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture
def box():
    seen: list[tuple[str, tuple, dict]] = []

    def grep(pattern, n=5):
        seen.append(("grep", (pattern,), {"n": n}))
        if pattern == "(":
            raise CallError("bad pattern: missing )")
        return [{"chunk_id": 7, "line": f"match for {pattern}"}][:n]

    with Sandbox({"grep": grep}, round_seconds=5, memory_bytes=512 * 1024 * 1024, output_chars=2000) as sandbox:
        sandbox.seen = seen  # type: ignore[attr-defined]
        yield sandbox


def assert_alive(box: Sandbox) -> None:
    """The worker side can still run a round (in the same process, or in a fresh one after a kill)."""
    result = box.run("print(6 * 7)")
    assert result.error is None and result.output == "42\n"


def test_rounds_keep_their_variables_and_show_a_closing_expression(box):
    first = box.run("import collections\ncounts = collections.Counter('abcab')\nprint('counted')")
    assert first.error is None and first.output == "counted\n" and first.fresh
    second = box.run("counts.most_common(1)")
    assert second.output == "[('a', 2)]\n" and not second.fresh and not second.ended


def test_api_calls_reach_the_worker_and_errors_come_back_as_api_error(box):
    result = box.run("hits = grep('retry', n=1)\nprint(hits[0]['line'])")
    assert result.output == "match for retry\n" and result.calls == 1
    assert box.seen == [("grep", ("retry",), {"n": 1})]
    caught = box.run("try:\n    grep('(')\nexcept ApiError as e:\n    print('told:', e)")
    assert caught.output == "told: bad pattern: missing )\n"
    wrong = box.run("grep('a', 'b', 'c', 'd')")
    assert "ApiError" in wrong.error and "grep()" in wrong.error
    unsendable = box.run("grep(object())")
    assert "JSON values" in unsendable.error


def test_final_ends_the_round_with_its_answer_and_citations(box):
    result = box.run("final('three retries', [7, 9])\nprint('never')")
    assert result.error is None and result.output == ""
    assert result.final is not None and result.final.answer == "three retries" and result.final.citations == [7, 9]
    caught = box.run("try:\n    final('x')\nexcept Exception:\n    print('swallowed')")
    assert caught.final is not None and caught.output == ""
    count = box.run("final(42, 7)")  # a number is an answer, one id a citation
    assert count.final is not None and count.final.answer == "42" and count.final.citations == [7]
    bad = box.run("final(None)")
    assert bad.final is None and "give the answer" in bad.error
    bad = box.run("final('x', [object()])")
    assert bad.final is None and "citations must be chunk ids" in bad.error


def test_errors_show_only_the_programs_frames(box):
    result = box.run("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in result.error and "<round 1>" in result.error
    assert "child.py" not in result.error and "runner.py" not in result.error
    syntax = box.run("def f(:")
    assert "SyntaxError" in syntax.error
    assert_alive(box)


def test_allowed_modules_import_and_the_rest_are_refused_by_name(box):
    ok = box.run("import " + ", ".join(ALLOWED_MODULES) + "\nprint(statistics.mean([1, 2]), json.dumps([1]))")
    assert ok.error is None and ok.output == "1.5 [1]\n"
    for name in ("os", "ctypes", "socket", "subprocess", "sys", "importlib"):
        result = box.run(f"import {name}")
        assert f"import of '{name}' is not allowed in the sandbox" in result.error, name
    assert_alive(box)


def test_reading_a_file_is_refused_by_python_and_by_the_kernel(box):
    plain = box.run("print(open('/etc/passwd').read())")
    assert "NameError" in plain.error and "root:" not in plain.output
    escaped = box.run(OS + "fd = g['open']('/etc/passwd', g['O_RDONLY'])\nprint(g['read'](fd, 100))")
    assert "PermissionError" in escaped.error and "Operation not permitted" in escaped.error
    assert "root:" not in escaped.output
    listing = box.run(OS + "print(g['listdir']('/'))")
    assert "PermissionError" in listing.error and "etc" not in listing.output
    by_hand = box.run(LIBC + "print(libc.open(b'/etc/passwd', 0), ctypes.get_errno())")
    assert by_hand.output == "-1 1\n"  # EPERM from the filter itself
    assert_alive(box)


def test_writing_outside_is_refused_and_nothing_appears(box, tmp_path):
    target = tmp_path / "planted.txt"
    flags = "g['O_WRONLY'] | g['O_CREAT']"
    result = box.run(OS + f"g['open']({str(target)!r}, {flags})")
    assert "Operation not permitted" in result.error
    removed = box.run(OS + f"g['mkdir']({str(tmp_path / 'made')!r})")
    assert "Operation not permitted" in removed.error
    shell = box.run(OS + f"print(g['system']('touch {target}'))")
    assert shell.error is None
    assert not target.exists() and not (tmp_path / "made").exists()
    assert_alive(box)


def test_no_socket_opens_and_no_connection_arrives():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    with Sandbox({}, round_seconds=5) as box:
        loaded = box.run(OS + "g['sys'].modules['builtins'].__import__('socket')")
        assert "No module named 'socket'" in loaded.error or "Operation not permitted" in loaded.error
        by_hand = box.run(LIBC + "print(libc.socket(2, 1, 0), ctypes.get_errno())")
        assert by_hand.output == "-1 1\n"
        assert_alive(box)
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing connected to the port the program was never able to reach
    listener.close()


def test_a_fork_bomb_forks_nothing(box):
    result = box.run(OS + "while True:\n    g['fork']()")
    assert "PermissionError" in result.error and "Operation not permitted" in result.error
    clone = box.run(LIBC + "print(libc.syscall(57), ctypes.get_errno())")  # fork(2) on x86_64; EPERM elsewhere too
    assert clone.output.startswith("-1 ")
    assert_alive(box)


def test_signals_cannot_reach_the_worker(box):
    result = box.run(OS + "g['kill'](g['getppid'](), 9)")
    assert "Operation not permitted" in result.error
    assert_alive(box)


def test_ten_gigabytes_is_a_memory_error_and_the_round_after_runs(box):
    result = box.run("hoard = bytearray(10 * 1024 ** 3)")
    assert result.error.startswith("memory limit") and not result.ended
    assert_alive(box)


def test_a_loop_forever_is_stopped_at_the_round_limit_and_a_fresh_process_follows():
    with Sandbox({}, round_seconds=1) as box:
        box.run("kept = 1")
        result = box.run("while True:\n    pass")
        assert result.ended and result.error.startswith("time limit: the round ran past 1 s")
        after = box.run("print('kept' in globals())")
        assert after.fresh and after.output == "False\n"


def test_time_spent_in_api_calls_does_not_count_against_the_round():
    def slow() -> str:
        time.sleep(2.5)
        return "done"

    # 5 s in calls against a 2 s round: only the program's own time counts
    with Sandbox({"slow": slow}, round_seconds=2) as box:
        result = box.run("print(slow(), slow())")
        assert result.error is None and result.output == "done done\n"


def test_printing_a_gigabyte_is_cut_and_stopped(box):
    flood = box.run("for _ in range(10 ** 6):\n    print('x' * 1000)")
    assert flood.error.startswith("output limit") and len(flood.output) == 2000 and flood.truncated
    one_string = box.run("print('x' * 1024 ** 3)")
    assert one_string.error.startswith("memory limit")
    raw = box.run(OS + "g['write'](1, b'not a frame\\n' * 3)")  # past the capture, onto the protocol pipe
    assert raw.ended and "not a frame" in raw.error
    assert_alive(box)


def test_a_program_that_stops_reading_cannot_hold_the_worker():
    def big() -> str:
        return "x" * 10_000_000  # far more than a pipe holds

    with Sandbox({"big": big}, round_seconds=2) as box:
        frame = '{"t": "call", "name": "big", "args": [], "kwargs": {}}\\n'
        result = box.run(OS + f"g['write'](1, b'{frame}')\nwhile True:\n    pass")
        assert result.ended and "stopped reading its input" in result.error
        assert_alive(box)


def test_cancel_stops_a_running_round_and_kills_its_process():
    stop = threading.Event()
    with Sandbox({}, round_seconds=30, should_stop=stop.is_set) as box:
        box.run("x = 1")
        pid = box._proc.pid  # type: ignore[union-attr]
        threading.Timer(0.5, stop.set).start()
        result = box.run("while True:\n    pass")
        assert result.ended and result.error.startswith("stopped")
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie_free(pid)
        stop.clear()
        assert_alive(box)


def _is_zombie_free(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] not in {"R", "S"}


def test_the_cpu_limit_ends_the_process():
    with Sandbox({}, round_seconds=30, cpu_seconds=1) as box:
        result = box.run("while True:\n    pass")
        assert result.ended and result.error.startswith("CPU limit")
        assert_alive(box)


def test_round_result_says_when_output_was_cut():
    assert RoundResult(output="ab", output_chars=5).truncated
    assert not RoundResult(output="ab", output_chars=2).truncated
