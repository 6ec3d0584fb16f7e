"""Keys stay out of logs and argv: `rlm up` shows the whole local key once, `rlm keys revoke -` reads stdin."""

from __future__ import annotations

import os
import subprocess
import sys


def _rlm(env, *args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "rlm_api.cli", *args],
        env={**os.environ, **env},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_up_prints_the_whole_local_key_only_when_it_creates_it(conn, tmp_path):
    from rlm_api.cli_up import key_banner, local_api_key

    key_file = tmp_path / "local-api-key"
    key, created = local_api_key(conn, key_file)
    conn.commit()
    assert created and key in key_banner(key, created, key_file)
    again, created_again = local_api_key(conn, key_file)
    conn.commit()
    assert again == key and not created_again
    line = key_banner(again, created_again, key_file)
    assert key not in line and key[:10] in line  # the prefix `rlm keys list` shows
    assert "rlm keys create" in line


def test_keys_revoke_reads_the_key_from_stdin(rlm_env, conn):
    from rlm_api.auth import create_key, tenant_for_key

    key, _ = create_key(conn, tenant="local", name="stdin-revoke")
    conn.commit()
    proc = _rlm(rlm_env, "keys", "revoke", "-", stdin=key + "\n")
    assert proc.returncode == 0, proc.stderr
    assert key not in proc.stdout + proc.stderr
    assert tenant_for_key(conn, key) is None
    conn.commit()


def test_keys_revoke_with_nothing_on_stdin_is_one_line_exit_2(rlm_env):
    proc = _rlm(rlm_env, "keys", "revoke", "-", stdin="")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no key on stdin" in lines[0], proc.stderr


def test_keys_revoke_warns_when_the_whole_key_is_in_argv(rlm_env, conn):
    from rlm_api.auth import create_key, tenant_for_key

    key, _ = create_key(conn, tenant="local", name="argv-revoke")
    conn.commit()
    proc = _rlm(rlm_env, "keys", "revoke", key)
    assert proc.returncode == 0 and "use - next time" in proc.stderr
    assert tenant_for_key(conn, key) is None
    conn.commit()
