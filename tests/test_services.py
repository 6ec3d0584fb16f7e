"""Embedded servers: start once, reuse from other processes, recover from crashes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
import redis

from rlm_workers.errors import MissingExtension
from rlm_workers.runtime import local_servers as services
from tests.support.services import start_services


def _in_subprocess(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_valkey_is_reused_by_a_second_process(tmp_path):
    url = services.embedded_valkey_url(tmp_path)
    try:
        state = json.loads((tmp_path / "valkey" / "server.json").read_text())
        other = _in_subprocess(
            f"from pathlib import Path; from rlm_workers.runtime import local_servers as services; "
            f"print(services.embedded_valkey_url(Path({str(tmp_path)!r})))"
        )
        assert other == url
        assert json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"] == state["pid"]
    finally:
        services.stop_embedded_valkey(tmp_path)


def test_valkey_recovers_from_a_killed_server(tmp_path):
    import redis

    url = services.embedded_valkey_url(tmp_path)
    pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
    redis.Redis.from_url(url).set("k", "v")
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 5
    while services.is_valkey(pid) and time.time() < deadline:
        time.sleep(0.05)
    try:
        url2 = services.embedded_valkey_url(tmp_path)  # stale server.json / pid file left behind
        new_pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
        assert new_pid != pid
        assert redis.Redis.from_url(url2).ping()
    finally:
        services.stop_embedded_valkey(tmp_path)
    assert not services.is_valkey(new_pid)


def test_postgres_is_reused_and_recovers_after_kill(tmp_path):
    url = services.embedded_postgres_url(tmp_path)
    try:
        with psycopg.connect(url) as c:
            pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
            postmaster = int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0])
            assert pid != postmaster
        other = _in_subprocess(
            f"from pathlib import Path; from rlm_workers.runtime import local_servers as services; "
            f"print(services.embedded_postgres_url(Path({str(tmp_path)!r})))"
        )
        assert other == url
        assert int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0]) == postmaster  # no twin
        os.kill(postmaster, signal.SIGKILL)
        time.sleep(0.5)
        assert (tmp_path / "pg" / "postmaster.pid").exists()  # stale pid file from the crash
        url2 = _in_subprocess(
            f"from pathlib import Path; from rlm_workers.runtime import local_servers as services; "
            f"print(services.embedded_postgres_url(Path({str(tmp_path)!r})))"
        )
        with psycopg.connect(url2) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
    finally:
        services.stop_embedded_postgres(tmp_path)


def _plain_postgres() -> str | None:
    """The machine's own PostgreSQL, which has no pgvector (docs/contract.md#components)."""
    url = os.environ.get("RLM_TEST_PLAIN_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        with psycopg.connect(url, connect_timeout=2) as c:
            if c.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone():
                return None
    except psycopg.OperationalError:
        return None
    return url


def test_postgres_without_pgvector_gives_one_line_error():
    url = _plain_postgres()
    if url is None:
        pytest.skip("no PostgreSQL without pgvector reachable (set RLM_TEST_PLAIN_PG_URL)")
    with psycopg.connect(url, autocommit=True) as c, pytest.raises(MissingExtension) as info:
        services.ensure_pgvector(c)
    assert "pgvector" in info.value.message and "\n" not in info.value.message


def test_cli_reports_missing_pgvector(tmp_path):
    url = _plain_postgres()
    if url is None:
        pytest.skip("no PostgreSQL without pgvector reachable (set RLM_TEST_PLAIN_PG_URL)")
    env = {**os.environ, "RLM_DATABASE_URL": url, "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pgvector" in lines[0]


def test_bad_setting_is_one_clear_line(tmp_path):
    env = {**os.environ, "RLM_MAX_CONCURRENCY": "lots", "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "error: invalid setting RLM_MAX_CONCURRENCY: Input should be a valid integer, "
        "unable to parse string as an integer"
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("-1", "Input should be greater than or equal to 0"),
        ("abc", "Input should be a valid integer, unable to parse string as an integer"),
    ],
)
def test_a_bad_gpu_layer_count_is_one_clear_line(tmp_path, value, why):
    """RLM_LOCAL_LLM_GPU_LAYERS is refused like every setting, before a model is fetched or a server started."""
    env = {**os.environ, "RLM_LOCAL_LLM_GPU_LAYERS": value, "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "services", "setup-llm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: invalid setting RLM_LOCAL_LLM_GPU_LAYERS: {why}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["buffers"], ["worker", "-Q", "rlm.control"]])
def test_a_job_timeout_not_below_the_visibility_timeout_is_refused_at_start_up(tmp_path, command):
    """It was cut to the visibility timeout in the watchdog without a word."""
    env = {**os.environ, "RLM_JOB_TIMEOUT": "3600", "RLM_VISIBILITY_TIMEOUT": "3600", "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *command], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: invalid settings: RLM_JOB_TIMEOUT (3600) must be below RLM_VISIBILITY_TIMEOUT (3600): "
        "Redis would redeliver a stuck job's tasks before it is pushed on"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any embedded server started


def test_a_settings_reset_starts_no_embedded_broker(tmp_path, monkeypatch):
    """Restoring default settings (a test's teardown) once started a Valkey under the user's data dir."""
    from rlm_workers.celery_app import get_app
    from rlm_workers.config import reset_settings

    monkeypatch.setenv("RLM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RLM_BROKER_URL", "redis://127.0.0.1:1/0")  # configuring connects to nothing
    monkeypatch.delenv("RLM_RESULT_BACKEND", raising=False)
    reset_settings()
    try:
        assert get_app().conf.broker_url == "redis://127.0.0.1:1/0"
        monkeypatch.delenv("RLM_BROKER_URL")
        reset_settings()
        get_app()  # the app for the embedded broker is built; only sending a task would start the broker
        assert not (tmp_path / services.VALKEY_DIRNAME).exists()
    finally:
        monkeypatch.undo()
        reset_settings()


def test_a_settings_switch_reaches_the_senders_but_never_the_workers_app(tmp_path, monkeypatch):
    """The workers' app keeps the configuration (and a worker's -Q choice) it started with; what sends tasks
    follows the settings."""
    from rlm_workers.celery_app import app, build_app, get_app
    from rlm_workers.config import get_settings, reset_settings

    monkeypatch.setenv("RLM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RLM_BROKER_URL", "redis://127.0.0.1:1/0")
    reset_settings()
    try:
        first = get_app()
        assert first.conf.broker_url == "redis://127.0.0.1:1/0"
        monkeypatch.setenv("RLM_BROKER_URL", "redis://127.0.0.1:2/0")
        reset_settings()
        assert get_app().conf.broker_url == "redis://127.0.0.1:2/0"
        assert get_app() is get_app()  # one app per configuration, not one per send
        if first is app:  # the workers' app was configured here: it stays as it was
            assert app.conf.broker_url == "redis://127.0.0.1:1/0"
        other = build_app(get_settings())
        assert other is not app and other.conf.broker_url == "redis://127.0.0.1:2/0"
        other.loader.import_default_modules()
        assert "rlm.analyst" in other.tasks  # a new app has the shared tasks too
    finally:
        monkeypatch.undo()
        reset_settings()


# --------------------------------------------------------------------------- crash safety, no /proc, races


@pytest.fixture
def no_proc(monkeypatch):
    """The host as macOS shows it: /proc does not exist (pathlib reads of it fail; psutil has its own way)."""
    import pathlib

    def blocked(original):
        def wrapper(self, *args, **kwargs):
            if str(self) == "/proc" or str(self).startswith("/proc/"):
                raise FileNotFoundError(2, "No such file or directory", str(self))
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("read_bytes", "read_text", "iterdir", "open", "exists", "is_dir"):
        monkeypatch.setattr(pathlib.Path, name, blocked(getattr(pathlib.Path, name)))


def _wait_gone(pid: int) -> None:
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} did not exit")


@pytest.mark.parametrize("platform", ["linux", "no-proc"])
def test_a_crashed_postgres_keeps_its_pid_file_while_a_backend_lives(tmp_path, monkeypatch, request, platform):
    """Removing postmaster.pid beside a live orphaned backend would let a second server corrupt the data dir."""
    from rlm_workers.errors import ServiceUnavailable

    url = services.embedded_postgres_url(tmp_path)
    pgdata = tmp_path / "pg"
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    conn = psycopg.connect(url)
    backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    os.kill(backend, signal.SIGSTOP)  # an orphan that has not yet noticed its postmaster died
    try:
        os.kill(postmaster, signal.SIGKILL)
        _wait_gone(postmaster)
        if platform == "no-proc":
            request.getfixturevalue("no_proc")
        monkeypatch.setattr(services, "ORPHAN_WAIT_SECONDS", 1.0, raising=False)
        with pytest.raises(ServiceUnavailable) as info:
            services._clear_stale_postmaster(pgdata)
        assert str(backend) in info.value.message and "\n" not in info.value.message
        assert (pgdata / "postmaster.pid").exists()  # PostgreSQL's interlock is left in place
        assert services._orphans(pgdata) == [backend]
        os.kill(backend, signal.SIGCONT)
        _wait_gone(backend)  # it notices the dead postmaster and exits
        services._clear_stale_postmaster(pgdata)
        assert not (pgdata / "postmaster.pid").exists()
        monkeypatch.undo()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(backend, signal.SIGCONT)
        with contextlib.suppress(psycopg.Error):
            conn.close()
        services.stop_embedded_postgres(tmp_path)
    # with the orphan gone the next process starts the server again
    url2 = _in_subprocess(
        f"from pathlib import Path; from rlm_workers.runtime import local_servers as services; "
        f"print(services.embedded_postgres_url(Path({str(tmp_path)!r})))"
    )
    try:
        with psycopg.connect(url2) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
    finally:
        services.stop_embedded_postgres(tmp_path)


def test_valkey_is_reused_without_proc(tmp_path, no_proc):
    """Without /proc (macOS) every process used to start its own Valkey on the same AOF dir."""
    first = services.embedded_valkey_url(tmp_path)
    pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
    try:
        assert services.is_valkey(pid)
        assert services.embedded_valkey_url(tmp_path) == first
        assert json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"] == pid
    finally:
        services.stop_embedded_valkey(tmp_path)
        for leftover in {pid, json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGTERM)


def test_threads_of_a_new_worker_start_one_postgres(tmp_path):
    import threading

    from rlm_workers.config import Settings

    settings = Settings(_env_file=None, data_dir=tmp_path, database_url=None)
    n = 6
    barrier = threading.Barrier(n)
    urls: list[str] = []
    errors: list[BaseException] = []

    def resolve() -> None:
        barrier.wait()
        try:
            urls.append(services.database_url(settings))
        except BaseException as exc:  # collected: the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert errors == [] and len(urls) == n and len(set(urls)) == 1
        with psycopg.connect(urls[0]) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        import psutil

        attached = set(services._orphans(tmp_path / "pg"))
        assert len([p for p in attached if psutil.Process(p).ppid() not in attached]) == 1  # one postmaster
    finally:
        services.stop_embedded_postgres(tmp_path)


# --------------------------------------------------------------------------- the embedded Valkey's password


def test_embedded_valkey_refuses_clients_without_its_password(tmp_path):
    import stat
    from urllib.parse import urlsplit

    import redis

    url = services.embedded_valkey_url(tmp_path)
    try:
        parts = urlsplit(url)
        assert parts.password
        with pytest.raises(redis.RedisError, match="(?i)auth"):
            redis.Redis(port=parts.port).set("rlm:probe", "x")  # any local user, no password
        assert redis.Redis.from_url(url).ping()
        for name in (services.PASSWORD_FILE, "valkey.conf"):
            assert stat.S_IMODE((tmp_path / "valkey" / name).stat().st_mode) == 0o600
        assert (tmp_path / "valkey" / services.PASSWORD_FILE).read_text().strip() == parts.password
        pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
        assert parts.password.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
        # another process gets the same authenticated URL
        assert (
            _in_subprocess(
                f"from pathlib import Path; from rlm_workers.runtime import local_servers as services; "
                f"print(services.embedded_valkey_url(Path({str(tmp_path)!r})))"
            )
            == url
        )
    finally:
        services.stop_embedded_valkey(tmp_path)


def test_an_open_valkey_from_an_older_data_dir_is_secured_in_place(tmp_path):
    from urllib.parse import urlsplit

    import redis

    url = services.embedded_valkey_url(tmp_path)
    pid = json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"]
    try:
        # what a data dir from before passwords looks like: a running Valkey without one, no password file
        redis.Redis.from_url(url).config_set("requirepass", "")
        (tmp_path / "valkey" / services.PASSWORD_FILE).unlink()
        redis.Redis(port=urlsplit(url).port).set("rlm:kept", "yes")
        upgraded = services.embedded_valkey_url(tmp_path)
        assert json.loads((tmp_path / "valkey" / "server.json").read_text())["pid"] == pid  # no twin
        new_password = urlsplit(upgraded).password
        assert new_password and new_password != urlsplit(url).password
        with pytest.raises(redis.RedisError, match="(?i)auth"):
            redis.Redis(port=urlsplit(url).port).get("rlm:kept")
        assert redis.Redis.from_url(upgraded).get("rlm:kept") == b"yes"  # nothing stored is lost
        assert f"requirepass {new_password}" in (tmp_path / "valkey" / "valkey.conf").read_text()
    finally:
        services.stop_embedded_valkey(tmp_path)


# --------------------------------------------------------------------------- MissingExtension on a real server


def _as_role(url: str, role: str, database: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{role}:@{host}", "/" + database, parts.query, parts.fragment))


@pytest.fixture(scope="module")
def without_pgvector(test_services):
    """Roles on the test server (no plain PostgreSQL needed) that cannot have pgvector.

    ``noext`` may not CREATE EXTENSION (pgvector is not a trusted extension); ``novec`` sees no pgvector at
    all: its extension_control_path (PostgreSQL 18) points at a directory without control files.
    """
    import uuid

    with psycopg.connect(test_services.admin_url, autocommit=True) as c:
        if not c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]:
            pytest.skip("the test PostgreSQL's admin role is not a superuser")
        new_path = int(c.execute("SHOW server_version_num").fetchone()[0]) >= 180000
        data_dir = c.execute("SHOW data_directory").fetchone()[0]
        suffix = uuid.uuid4().hex[:8]
        urls = {}
        for kind in ("noext", "novec"):
            role = f"rlm_{kind}_{suffix}"
            c.execute(f'CREATE ROLE "{role}" LOGIN')
            c.execute(f'CREATE DATABASE "{role}" OWNER "{role}"')
            if kind == "novec" and new_path:
                c.execute(f"ALTER ROLE \"{role}\" SET extension_control_path = '{data_dir}'")
            if kind == "noext" or new_path:
                urls[kind] = _as_role(test_services.admin_url, role, role)
    return urls


def test_a_role_that_may_not_create_pgvector_gets_one_line(without_pgvector, tmp_path):
    env = {**os.environ, "RLM_DATABASE_URL": without_pgvector["noext"], "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "may not CREATE EXTENSION vector" in lines[0], proc.stderr


def test_a_server_without_pgvector_gets_one_line(without_pgvector, tmp_path):
    from rlm_workers.config import Settings
    from rlm_workers.runtime.doctor import check_database

    if "novec" not in without_pgvector:
        pytest.skip("hiding pgvector needs PostgreSQL 18 (extension_control_path)")
    url = without_pgvector["novec"]
    with psycopg.connect(url, autocommit=True) as c, pytest.raises(MissingExtension) as info:
        services.ensure_pgvector(c)
    assert "has no pgvector" in info.value.message and "\n" not in info.value.message
    env = {**os.environ, "RLM_DATABASE_URL": url, "RLM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", "buffers"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no pgvector" in lines[0], proc.stderr
    by_name = {c.name: c for c in check_database(Settings(_env_file=None), url)}
    assert not by_name["pgvector"].ok and "pgvector/pgvector" in by_name["pgvector"].detail


def test_a_pid_file_naming_another_clusters_postmaster_is_stale(test_services, tmp_path):
    """After a reboot the recorded pid can belong to another PostgreSQL: not ours, so the file is stale."""
    if not test_services.embedded_pg:
        pytest.skip("needs the embedded test PostgreSQL as the other cluster")
    other = (test_services.data_dir / "pg" / "postmaster.pid").read_text()
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    (pgdata / "postmaster.pid").write_text(other)
    services._clear_stale_postmaster(pgdata)
    assert not (pgdata / "postmaster.pid").exists()
    assert (test_services.data_dir / "pg" / "postmaster.pid").read_text() == other  # the other one untouched


# --------------------------------------------------------------------------- the watcher beside each server


def _until(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _running(kind: str, data_dir) -> bool:
    status = services.postgres_status if kind == "postgres" else services.valkey_status
    return status(data_dir) is not None


@pytest.mark.parametrize("kind", ["postgres", "valkey"])
def test_an_embedded_server_stops_once_idle_and_a_connected_client_keeps_it(tmp_path, kind):
    idle = 1.0
    if kind == "postgres":
        client = psycopg.connect(services.embedded_postgres_url(tmp_path, idle_seconds=idle))
        pid = services.postgres_status(tmp_path)["pid"]
    else:
        client = redis.Redis.from_url(services.embedded_valkey_url(tmp_path, idle_seconds=idle))
        client.ping()
        pid = services.valkey_status(tmp_path).pid
    try:
        assert services._watched(tmp_path, kind, pid)
        # many idle times pass while the client stays connected; the watcher keeps looking meanwhile
        time.sleep(idle * 8)
        assert _running(kind, tmp_path) and services._watched(tmp_path, kind, pid)
        client.close()
        _until(lambda: not _running(kind, tmp_path), f"the idle {kind} did not stop")
        _until(lambda: not services._watched(tmp_path, kind, pid), "its watcher did not exit")
        if kind == "postgres":
            # this process handed the stopped server out before: the next use starts it again
            with psycopg.connect(services.embedded_postgres_url(tmp_path, idle_seconds=0)) as c:
                assert c.execute("SELECT 1").fetchone() == (1,)
    finally:
        client.close()
        services.stop_embedded_postgres(tmp_path)
        services.stop_embedded_valkey(tmp_path)


def test_the_test_services_stop_once_their_data_dir_is_removed():
    """A killed test run left its servers running on removed temp dirs; they never stop for being idle."""
    if os.environ.get("RLM_TEST_DATABASE_URL") or os.environ.get("RLM_TEST_BROKER_URL"):
        pytest.skip("the suite uses configured servers")
    data_dir = Path(tempfile.mkdtemp(prefix="rlm-test-"))  # as the session's services are
    start_services(data_dir)
    pg_pid, valkey_pid = services.postgres_status(data_dir)["pid"], services.valkey_status(data_dir).pid
    try:
        shutil.rmtree(data_dir)  # what a temp cleaner does after the run was killed
        _until(lambda: not services.is_postgres(pg_pid), "the PostgreSQL of a removed data dir still runs")
        _until(lambda: not services.is_valkey(valkey_pid), "the Valkey of a removed data dir still runs")
        _until(lambda: services._orphans(data_dir / "pg") == [], "backends of a removed data dir still run")
    finally:
        for pid, ours in ((pg_pid, services.is_postgres), (valkey_pid, services.is_valkey)):
            if ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
