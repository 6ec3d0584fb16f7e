"""deploy/: the Dockerfile, docker-compose and Kubernetes files agree with the code they run.

Fast and offline: no Docker, no cluster.  Every ``rlm …`` command is parsed by the real Typer CLI, every
``celery …`` command by Celery's, every environment variable set for our image must be a ``Settings``
field (or on a short allow-list), every image is pinned.  When ``kubectl`` is installed, the kustomize
base and overlay are rendered too and the rendered objects are checked again.
"""

from __future__ import annotations

import base64
import fnmatch
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import click
import pytest
import typer.main
import yaml
from pydantic import AliasChoices
from typer.testing import CliRunner

from rlm_api.cli import app as rlm_app
from rlm_workers.config import Settings
from rlm_workers.constants import ALL_QUEUES, QUEUE_ANALYST

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = DEPLOY / "Dockerfile"

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
OUR_IMAGE = "rlm-pipeline"
POOLS = ("threads", "prefork", "solo")
#: celery_app.py sets worker_soft_shutdown_timeout = 10 s; every grace period must exceed it
SOFT_SHUTDOWN_SECONDS = 10.0

#: Variables that are legitimately not Settings, per image.  Keep these short: anything RLM_* must be a field.
IMAGE_ENV_ALLOW = {
    "pgvector/pgvector": {"POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD"},
    "redis": {"REDISCLI_AUTH"},
    OUR_IMAGE: set(),
}
#: set by the Dockerfile for the runtime (offline model loading, Python, pip in the build stage)
DOCKERFILE_ENV_ALLOW = {
    "PATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "PIP_NO_CACHE_DIR",
    "PIP_DISABLE_PIP_VERSION_CHECK",
}
#: deploy/.env.example may also hold compose-only interpolation variables
COMPOSE_ONLY_VARS = {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "API_PORT", "FLOWER_PORT"}
SECRET_NAME = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|AUTH", re.I)
PLACEHOLDER = re.compile(r"change-me|REPLACE_ME|\.\.\.", re.I)
REAL_KEY = re.compile(r"sk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----")


# --------------------------------------------------------------------------- helpers


def settings_env_names() -> set[str]:
    names: set[str] = set()
    for field, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {str(c).upper() for c in alias.choices}
        elif isinstance(alias, str):
            names.add(alias.upper())
        else:
            names.add(f"RLM_{field.upper()}")
    return names


SETTINGS_ENV = settings_env_names()


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml"))


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in k8s_files() for d in load_docs(p)]


def parse_env_file(path: Path, *, include_commented: bool = False) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if include_commented and line.startswith("#"):
            line = line.lstrip("#").strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
            out[name.strip()] = value.strip()
    return out


def image_base(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name.rsplit(":", 1)[0] if ":" in last else name


def image_tag(image: str) -> str | None:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else None


def assert_pinned(image: str, where: str) -> None:
    tag = image_tag(image)
    if "@sha256:" in image:
        return
    assert tag, f"{where}: image {image!r} has no tag"
    assert tag != "latest", f"{where}: image {image!r} uses latest"
    # a version number, not a floating alias such as "pg17", "7-alpine" or "stable"
    assert re.search(r"\d+\.\d+", tag), f"{where}: image {image!r} is not pinned to a version"
    if image_base(image).endswith(OUR_IMAGE):
        assert tag == VERSION, f"{where}: our image is tagged {tag}, the project is {VERSION}"


def allowed_env(image: str) -> set[str]:
    base = image_base(image)
    for prefix, names in IMAGE_ENV_ALLOW.items():
        if base == prefix or base.endswith("/" + prefix) or base.endswith(prefix):
            return names
    raise AssertionError(f"no env allow-list for image {image!r}: add one to IMAGE_ENV_ALLOW")


def check_env_names(names, image: str, where: str) -> None:
    extra = set(names) - SETTINGS_ENV - allowed_env(image)
    assert not extra, f"{where}: {sorted(extra)} are neither Settings env names nor allowed for {image}"


def settings_from(env: dict[str, str], monkeypatch) -> Settings:
    """Validate values through Settings exactly as a process would read them from its environment."""
    import os

    for name in list(os.environ):
        if name.startswith("RLM_") or name in SETTINGS_ENV:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLM_DATA_DIR", "/tmp/rlm-deploy-test")  # never resolve the user data dir
    for name, value in env.items():
        if name in SETTINGS_ENV:
            monkeypatch.setenv(name, str(value))
    return Settings()


def duration_seconds(text) -> float:
    if isinstance(text, int | float):
        return float(text)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text)):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


# --------------------------------------------------------------------------- the commands


CLI = typer.main.get_command(rlm_app)
RUNNER = CliRunner()


def check_rlm(args: list[str], where: str):  # a Typer (vendored click) command
    """Resolve ``rlm args…`` to its command, parse its options with the real parser, and run --help.

    Typer vendors its own click, so groups are recognised by their ``commands`` and parse errors by type.
    """
    cmd = CLI
    path: list[str] = []
    rest = list(args)
    if rest == ["--help"]:
        result = RUNNER.invoke(rlm_app, ["--help"])
        assert result.exit_code == 0, f"{where}: `rlm --help` failed: {result.output}"
        return cmd
    while isinstance(getattr(cmd, "commands", None), dict):
        assert rest, f"{where}: `rlm {' '.join(args)}` names a group, not a command"
        name = rest.pop(0)
        sub = cmd.commands.get(name)
        assert sub is not None, f"{where}: `rlm {' '.join(path + [name])}` does not exist"
        path.append(name)
        cmd = sub
    # make_context parses and converts every option (types, required ones) without running the command
    try:
        cmd.make_context(" ".join(["rlm", *path]), list(rest))
    except Exception as exc:  # any parse error (typer's vendored click) fails the check
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        raise AssertionError(f"{where}: `rlm {' '.join(args)}`: {message}") from None
    result = RUNNER.invoke(rlm_app, [*path, "--help"])
    assert result.exit_code == 0, f"{where}: `rlm {' '.join(path)} --help` failed: {result.output}"
    if path == ["worker"]:
        check_worker_args(rest, where)
    return cmd


def option_values(args: list[str], *names: str) -> list[str]:
    out = []
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                out.append(args[i + 1])
            elif n.startswith("--") and a.startswith(n + "="):
                out.append(a.split("=", 1)[1])
    return out


def check_worker_args(args: list[str], where: str) -> None:
    queues = option_values(args, "-Q", "--queues")
    assert queues, f"{where}: a deployed worker must name its queue (-Q)"
    for q in ",".join(queues).split(","):
        assert q in ALL_QUEUES, f"{where}: unknown queue {q!r}"
    pools = option_values(args, "-P", "--pool")
    assert pools, f"{where}: a deployed worker must name its pool (-P)"
    assert pools[0] in POOLS, f"{where}: unknown pool {pools[0]!r}"
    names = option_values(args, "-n", "--hostname")
    assert names and "@" in names[0], f"{where}: give each worker a node name (-n name@%h)"


def check_celery(args: list[str], where: str) -> None:
    from celery.bin.celery import celery as celery_cli
    from celery.worker.control import Panel

    rest = list(args)
    assert rest[:2] in (["-A", "rlm_workers"], ["--app", "rlm_workers"]), f"{where}: celery without -A rlm_workers"
    import rlm_workers

    assert rlm_workers.app is not None
    rest = rest[2:]
    sub_name = rest.pop(0)
    sub = celery_cli.commands.get(sub_name)
    assert sub is not None, f"{where}: `celery {sub_name}` does not exist"
    try:
        ctx = sub.make_context(f"celery {sub_name}", list(rest))
    except click.ClickException as exc:
        raise AssertionError(f"{where}: `celery {' '.join(args)}`: {exc.format_message()}") from None
    if sub_name in ("inspect", "control"):
        action = ctx.params["action"] if "action" in ctx.params else ctx.params.get("command")
        meta = Panel.meta.get(action)
        assert meta is not None and meta.type == sub_name, f"{where}: `celery {sub_name} {action}` is no such command"


SHELL_OPERATORS = {"|", "||", "&&", ";", "&"}
SHELL_REDIRECTS = {">", ">>", "<", ">&", "&>", "<&"}


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a one-line shell script: split at | && ; with redirections and VAR=x dropped."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    skip = False
    for tok in lexer:
        if skip:
            skip = False
        elif tok in SHELL_OPERATORS:
            out.append([])
        elif tok in SHELL_REDIRECTS:
            skip = True  # its target
        elif not out[-1] and (tok in ("exec", "!") or re.fullmatch(r"[A-Za-z_]\w*=.*", tok)):
            continue  # `exec cmd`, `VAR=value cmd`
        else:
            out[-1].append(tok)
    return [c for c in out if c]


def api_paths() -> set[str]:
    from rlm_api.routes.health import router

    return {r.path for r in router.routes}


def check_argv(argv: list[str], where: str, seen: dict[str, int]) -> None:
    """Check one command we run; ``sh -c`` scripts are split into their simple commands."""
    if not argv:
        return
    prog = Path(argv[0]).name
    if prog in ("sh", "bash") and len(argv) >= 3 and argv[1] == "-c":
        for cmd in shell_commands(argv[2]):
            check_argv(cmd, where, seen)
        return
    if prog == "rlm":
        check_rlm(argv[1:], where)
        seen["rlm"] = seen.get("rlm", 0) + 1
    elif prog == "celery":
        check_celery(argv[1:], where)
        seen["celery"] = seen.get("celery", 0) + 1
    elif prog.startswith("python") and "-c" in argv:
        # healthchecks that fetch one of our own URLs: the path must be a route the API (or Flower) serves
        code = argv[argv.index("-c") + 1]
        for port, path in re.findall(r"http://127\.0\.0\.1:(\d+)(/[A-Za-z0-9_/.-]*)", code):
            if port == "8000":
                assert path in api_paths(), f"{where}: the API has no route {path}"
            elif port == "5555":
                assert path == "/healthcheck", f"{where}: Flower healthcheck on {path}"


def compose_healthcheck_argv(test) -> list[list[str]]:
    if isinstance(test, str):
        return shell_commands(test)
    kind, *rest = test
    if kind == "CMD":
        return [rest]
    if kind == "CMD-SHELL":
        return shell_commands(rest[0])
    return []


# --------------------------------------------------------------------------- parse everything


def test_every_deploy_file_parses():
    assert COMPOSE_FILE.is_file() and DOCKERFILE.is_file() and ENV_EXAMPLE.is_file()
    assert (DEPLOY / "README.md").is_file()
    assert isinstance(yaml.safe_load(COMPOSE_FILE.read_text()), dict)
    files = k8s_files()
    assert len(files) >= 10
    for path in files:
        for doc in load_docs(path):
            assert isinstance(doc, dict), f"{path}: not a mapping"
            assert doc.get("kind") and doc.get("apiVersion"), f"{path}: a document without kind/apiVersion"


def git_ignored(path: Path) -> bool:
    """deploy/.gitignore's patterns (the local secret files a developer may have filled in)."""
    patterns = [p for p in (DEPLOY / ".gitignore").read_text().split() if not p.startswith("#")]
    rel = path.relative_to(DEPLOY).as_posix()
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def test_no_secret_is_committed_anywhere_under_deploy():
    for path in DEPLOY.rglob("*"):
        if not path.is_file() or git_ignored(path):
            continue
        text = path.read_text(errors="replace")
        assert not REAL_KEY.search(text), f"{path}: looks like a real key"
    for path, doc in k8s_docs():
        if doc["kind"] == "Secret":
            for key, value in object_values(doc).items():
                assert PLACEHOLDER.search(str(value)), f"{path}: Secret key {key} holds a value, not a placeholder"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env(rest: str) -> dict[str, str]:
    pairs = shlex.split(rest)
    if len(pairs) == 2 and "=" not in pairs[0]:
        return {pairs[0]: pairs[1]}
    return dict(p.split("=", 1) for p in pairs)


def test_dockerfile_multi_stage_pinned_non_root_and_without_secrets():
    ins = dockerfile_instructions()
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        if word in ("ARG", "ENV"):
            names = [rest.split("=", 1)[0]] if word == "ARG" else list(dockerfile_env(rest))
            for name in names:
                assert not SECRET_NAME.search(name), f"Dockerfile {word} {name}: secrets never go in a layer"
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2, "the Dockerfile must be multi-stage"
    stages: set[str] = set()
    for rest in froms:
        parts = rest.split()
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
        if image not in stages:
            assert_pinned(image, f"Dockerfile FROM {parts[0]}")
            assert image_base(image) == "python" and image_tag(image).startswith("3.11."), image
        if len(parts) == 3 and parts[1].upper() == "AS":
            stages.add(parts[2])
    # the last stage runs as an unprivileged user
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    users = [rest for w, rest in ins[last_from:] if w == "USER"]
    assert users, "the runtime stage has no USER"
    assert users[-1].split(":")[0] not in ("root", "0"), "the runtime stage runs as root"
    # CPU torch, the same pin as pyproject.toml
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert re.search(rf"pip install {re.escape(torch_pin)} --index-url https://download\.pytorch\.org/whl/cpu", runs)
    # the runtime loads the model offline
    envs: dict[str, str] = {}
    for w, rest in ins:
        if w == "ENV":
            envs.update(dockerfile_env(rest))
    assert envs.get("HF_HUB_OFFLINE") == "1"
    extra = set(envs) - SETTINGS_ENV - DOCKERFILE_ENV_ALLOW
    assert not extra, f"Dockerfile ENV {sorted(extra)} are neither Settings nor allowed"
    text = DOCKERFILE.read_text()
    assert "OPENAI_API_KEY" not in text and "sk-" not in text


def test_dockerfile_copies_what_exists_and_the_package_carries_its_prompts():
    ins = dockerfile_instructions()
    copies = [shlex.split(rest) for w, rest in ins if w == "COPY" and "--from" not in rest]
    assert copies
    for parts in copies:
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"Dockerfile COPY {src}: no such file in the repository"
    # the prompts are package data: copying rlm_workers/ and `pip install .` is all it takes
    assert any(parts[0] == "rlm_workers" for parts in copies)
    assert all(parts[0] != "prompts" for parts in copies)
    assert any("load_prompt" in rest for w, rest in ins if w == "RUN"), "the build checks the prompts load"
    assert any("python -m venv /opt/venv" in rest for w, rest in ins if w == "RUN")
    # the build context keeps everything but the sources out (BuildKit reads Dockerfile.dockerignore)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "**" in ignore and "!rlm_workers/**" in ignore


def test_dockerfile_rlm_commands_exist():
    seen: dict[str, int] = {}
    for word, rest in dockerfile_instructions():
        if word in ("CMD", "ENTRYPOINT") and rest.startswith("["):
            check_argv(yaml.safe_load(rest), f"Dockerfile {word}", seen)
        elif word == "RUN":
            for cmd in shell_commands(rest):
                if cmd[0] == "rlm":
                    check_argv(cmd, "Dockerfile RUN", seen)
    assert seen.get("rlm", 0) >= 2


# --------------------------------------------------------------------------- docker compose


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_resolve(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ against deploy/.env.example."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op in (":-", "-"):
            return arg or ""
        raise AssertionError(f"compose needs {name}, which deploy/.env.example does not set")

    value = re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", sub, str(value))
    return value.replace("$$", "$")


def test_compose_services_commands_and_healthchecks_use_real_commands():
    seen: dict[str, int] = {}
    for name, svc in compose()["services"].items():
        for key in ("entrypoint", "command"):
            cmd = svc.get(key)
            if cmd is not None:
                check_argv(shlex.split(cmd) if isinstance(cmd, str) else cmd, f"compose {name}.{key}", seen)
        test = (svc.get("healthcheck") or {}).get("test")
        if test:
            for argv in compose_healthcheck_argv(test):
                check_argv(argv, f"compose {name}.healthcheck", seen)
    assert seen.get("rlm", 0) >= 5 and seen.get("celery", 0) >= 3


def test_compose_env_vars_are_settings_and_values_validate(monkeypatch):
    env_example = parse_env_file(ENV_EXAMPLE)
    for name, svc in compose()["services"].items():
        image = svc["image"]
        environment = svc.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(e.split("=", 1) if "=" in e else (e, None) for e in environment)
        check_env_names(environment, image, f"compose {name}")
        for key, value in environment.items():
            if value is not None and SECRET_NAME.search(key):
                assert "${" in str(value), f"compose {name}: {key} is written into the file, not taken from .env"
        if image_base(image) == OUR_IMAGE:
            resolved = {k: compose_resolve(v, env_example) for k, v in environment.items() if v is not None}
            resolved.update({k: env_example[k] for k, v in environment.items() if v is None and k in env_example})
            s = settings_from(resolved, monkeypatch)
            assert s.broker_url, f"compose {name}: no broker"
            if name != "flower":
                assert s.database_url, f"compose {name}: no database"
                assert s.job_timeout < s.visibility_timeout


def test_env_example_names_placeholders_and_interpolations():
    declared = parse_env_file(ENV_EXAMPLE, include_commented=True)
    extra = set(declared) - SETTINGS_ENV - COMPOSE_ONLY_VARS
    assert not extra, f".env.example: {sorted(extra)} are neither Settings env names nor compose variables"
    for name, value in parse_env_file(ENV_EXAMPLE).items():
        if SECRET_NAME.search(name):
            assert PLACEHOLDER.search(value), f".env.example: {name} must hold a placeholder"
    # every variable compose interpolates is documented in .env.example or has a default
    text = COMPOSE_FILE.read_text().replace("$$", "")
    for name, op in re.findall(r"\$\{(\w+)(:?[-?])?", text):
        if op not in (":-", "-"):
            assert name in declared, f"compose uses ${{{name}}} but .env.example does not mention it"
        if name.startswith(("RLM_", "OPENAI_")):
            assert name in SETTINGS_ENV, f"compose interpolates {name}, which is not a Settings env name"
    ignored = (DEPLOY / ".gitignore").read_text().split()
    assert ".env" in ignored


def test_compose_healthchecks_images_volumes_and_stop_grace():
    c = compose()
    services = c["services"]
    for name in ("postgres", "redis", "api"):
        assert (services[name].get("healthcheck") or {}).get("test"), f"compose {name} has no healthcheck"
    for name, svc in services.items():
        assert_pinned(svc["image"], f"compose {name}")
    assert image_base(services["postgres"]["image"]) == "pgvector/pgvector"
    assert image_base(services["redis"]["image"]) in ("redis", "valkey/valkey")
    for dep in ("postgres", "redis"):
        assert services["api"]["depends_on"][dep]["condition"] == "service_healthy"
    named = set(c.get("volumes") or {})
    assert {"pgdata", "redisdata"} <= named
    for name in ("postgres", "redis"):
        mounts = [v.split(":", 1)[0] for v in services[name]["volumes"]]
        assert any(m in named for m in mounts), f"compose {name}: data is not on a named volume"
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["rlm", "worker"]:
            assert duration_seconds(svc.get("stop_grace_period", "10s")) > SOFT_SHUTDOWN_SECONDS, name


def test_compose_runs_one_pool_per_queue_and_flower_stays_on_loopback_with_auth():
    from rlm_api.cli_up import flower_argv

    services = compose()["services"]
    queues: dict[str, str] = {}
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["rlm", "worker"]:
            for q in option_values(cmd, "-Q")[0].split(","):
                assert q not in queues, f"{q} is consumed by {queues.get(q)} and {name}"
                queues[q] = option_values(cmd, "-P")[0]
    assert set(queues) == set(ALL_QUEUES)
    assert queues[QUEUE_ANALYST] == "threads" and queues["rlm.ingest"] == "prefork"
    flower = services["flower"]
    assert flower["command"][:2] == ["rlm", "flower"]
    assert flower["environment"].get("RLM_FLOWER_BASIC_AUTH")
    host = option_values(flower["command"], "--host")[0]
    flower_argv(host, 5555, "user:password")  # accepted: a non-loopback bind with basic auth
    for port in flower.get("ports") or []:
        assert str(port).startswith("127.0.0.1:"), f"Flower is published beyond loopback: {port}"


# --------------------------------------------------------------------------- Kubernetes


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def test_kustomizations_list_files_that_exist_and_secret_files_are_ignored():
    ks = kustomizations()
    assert K8S / "base" / "kustomization.yaml" in ks and len(ks) >= 2
    ignore_patterns = [p for p in (DEPLOY / ".gitignore").read_text().split() if not p.startswith("#")]
    for k in ks:
        doc = yaml.safe_load(k.read_text())
        assert doc["kind"] == "Kustomization"
        for res in doc.get("resources") or []:
            target = (k.parent / res).resolve()
            assert target.exists(), f"{k}: resource {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{k}: {res} is no kustomization"
        for patch in doc.get("patches") or []:
            if "path" in patch:
                assert (k.parent / patch["path"]).is_file(), f"{k}: patch {patch['path']} does not exist"
        for gen in doc.get("secretGenerator") or []:
            for env_file in gen.get("envs") or []:
                example = k.parent / f"{env_file}.example"
                assert example.is_file(), f"{k}: {env_file} has no committed {example.name}"
                rel = (k.parent / env_file).relative_to(DEPLOY).as_posix()
                assert any(fnmatch.fnmatch(rel, p) for p in ignore_patterns), f"{rel} is not git-ignored"
                for key, value in parse_env_file(example).items():
                    if SECRET_NAME.search(key) or "://" in value:
                        assert "REPLACE_ME" in value, f"{example}: {key} must hold a REPLACE_ME placeholder"
        for img in doc.get("images") or []:
            if "digest" not in img:
                assert_pinned(f"{img.get('newName', img['name'])}:{img.get('newTag', '')}", f"{k} images")


def containers(doc: dict) -> list[dict]:
    spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def deployments(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Deployment"}


def object_values(doc: dict) -> dict[str, str]:
    """A ConfigMap's or Secret's keys and values (a Secret's ``data`` is base64)."""
    data = dict(doc.get("data") or {})
    if doc["kind"] == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
    return {**data, **(doc.get("stringData") or {})}


def generated_env(docs) -> dict[str, dict[str, str]]:
    """Secret/ConfigMap name → keys, from manifests and from kustomize generators' *.example env files."""
    out: dict[str, dict[str, str]] = {}
    for _path, doc in docs:
        if doc["kind"] in ("ConfigMap", "Secret"):
            out.setdefault(doc["metadata"]["name"], {}).update(object_values(doc))
    for k in kustomizations():
        doc = yaml.safe_load(k.read_text())
        for gen in (doc.get("secretGenerator") or []) + (doc.get("configMapGenerator") or []):
            for env_file in gen.get("envs") or []:
                out.setdefault(gen["name"], {}).update(parse_env_file(k.parent / f"{env_file}.example"))
            for lit in gen.get("literals") or []:
                key, _, value = lit.partition("=")
                out.setdefault(gen["name"], {})[key] = value
    return out


def check_k8s_objects(docs: list[tuple[Path, dict]], monkeypatch, *, rendered: bool) -> None:
    sources = (
        generated_env(docs)
        if not rendered
        else {d["metadata"]["name"]: object_values(d) for _, d in docs if d["kind"] in ("ConfigMap", "Secret")}
    )
    seen: dict[str, int] = {}
    deps = deployments(docs)
    for name, dep in deps.items():
        for ctr in containers(dep):
            where = f"Deployment {name}/{ctr['name']}"
            image = ctr["image"]
            if rendered:
                assert_pinned(image, where)
            check_argv(list(ctr.get("command") or []) + list(ctr.get("args") or []), where, seen)
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                exec_cmd = ((ctr.get(probe) or {}).get("exec") or {}).get("command")
                if exec_cmd:
                    check_argv(exec_cmd, f"{where} {probe}", seen)
            names = {e["name"] for e in ctr.get("env") or []}
            env_values: dict[str, str] = {}
            for ref in ctr.get("envFrom") or []:
                src = (ref.get("configMapRef") or ref.get("secretRef"))["name"]
                if rendered:
                    assert src in sources, f"{where}: envFrom {src} is not in the rendered output"
                else:
                    src = src if src in sources else None
                    assert src, f"{where}: envFrom names a ConfigMap/Secret nothing defines"
                names |= set(sources[src])
                env_values.update(sources[src])
            check_env_names(names, image, where)
            requests = (ctr.get("resources") or {}).get("requests") or {}
            assert "cpu" in requests and "memory" in requests, f"{where}: no resource requests"
            if image_base(image).endswith(OUR_IMAGE) and "RLM_VISIBILITY_TIMEOUT" in env_values:
                s = settings_from(env_values, monkeypatch)
                assert s.job_timeout < s.visibility_timeout, where
        cmd = containers(dep)[0].get("command") or []
        if cmd[:2] == ["rlm", "worker"]:
            grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            assert grace > SOFT_SHUTDOWN_SECONDS, f"{name}: grace period {grace}s"
    assert seen.get("rlm", 0) >= 5, seen


def test_k8s_commands_env_resources_and_grace_periods(monkeypatch):
    check_k8s_objects(k8s_docs(), monkeypatch, rendered=False)


def test_k8s_one_deployment_per_worker_pool():
    by_queue: dict[str, tuple[str, str]] = {}
    for name, dep in deployments(k8s_docs()).items():
        cmd = containers(dep)[0].get("command") or []
        if cmd[:2] == ["rlm", "worker"]:
            queues = option_values(cmd, "-Q")[0].split(",")
            assert len(queues) == 1, f"{name}: one pool per Deployment"
            assert queues[0] not in by_queue, f"{queues[0]} has two Deployments"
            by_queue[queues[0]] = (name, option_values(cmd, "-P")[0])
    assert set(by_queue) == set(ALL_QUEUES)
    assert by_queue[QUEUE_ANALYST][1] == "threads" and by_queue["rlm.ingest"][1] == "prefork"


def api_deployment(docs) -> dict:
    (dep,) = [d for d in deployments(docs).values() if (containers(d)[0].get("command") or [])[:2] == ["rlm", "api"]]
    return dep


def test_k8s_api_probes_hit_routes_that_exist():
    dep = api_deployment(k8s_docs())
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    paths = api_paths()
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz" in paths
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz" in paths
    port = int(option_values(ctr["command"], "--port")[0])
    assert port in [p["containerPort"] for p in ctr["ports"]]


def test_keda_scales_the_analyst_pool_on_its_redis_list():
    docs = k8s_docs()
    scaled = [d for _, d in docs if d["kind"] == "ScaledObject"]
    assert scaled, "no KEDA ScaledObject"
    auths = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "TriggerAuthentication"}
    deps = deployments(docs)
    for so in scaled:
        target = deps[so["spec"]["scaleTargetRef"]["name"]]
        assert option_values(containers(target)[0]["command"], "-Q") == [QUEUE_ANALYST]
        assert "replicas" not in target["spec"], "the autoscaler owns the analyst replica count"
        assert so["spec"]["minReplicaCount"] >= 1 and so["spec"]["maxReplicaCount"] > so["spec"]["minReplicaCount"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis"
        meta = trigger["metadata"]
        assert meta["listName"] == QUEUE_ANALYST and int(meta["listLength"]) > 0
        assert "password" not in meta and "address" not in meta, (
            "connection details belong to the TriggerAuthentication"
        )
        auth = auths[trigger["authenticationRef"]["name"]]
        params = {r["parameter"] for r in auth["spec"]["secretTargetRef"]}
        assert {"address", "password"} <= params


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_network_policies_keep_flower_and_metrics_internal():
    docs = k8s_docs()
    policies = [d for _, d in docs if d["kind"] == "NetworkPolicy"]
    assert any(
        p["spec"]["podSelector"] == {} and p["spec"].get("policyTypes") == ["Ingress"] and not p["spec"].get("ingress")
        for p in policies
    ), "no default-deny ingress policy"
    deps = deployments(docs)
    flower = next(d for d in deps.values() if (containers(d)[0].get("command") or [])[:2] == ["rlm", "flower"])
    for dep in (flower, api_deployment(docs)):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in policies if p["spec"]["podSelector"] and _matches(p["spec"]["podSelector"], labels)]
        assert covering, f"no NetworkPolicy selects {dep['metadata']['name']}"
        for p in covering:
            for rule in p["spec"].get("ingress") or []:
                assert rule.get("from"), f"{p['metadata']['name']}: a rule open to every source"
                for peer in rule["from"]:
                    assert "ipBlock" not in peer, f"{p['metadata']['name']}: ipBlock peer"
                    assert peer.get("podSelector") or peer.get("namespaceSelector"), "an empty peer admits all"
                    for sel in (peer.get("podSelector"), peer.get("namespaceSelector")):
                        assert sel is None or sel.get("matchLabels") or sel.get("matchExpressions"), (
                            f"{p['metadata']['name']}: an empty selector admits everything"
                        )
    # Services stay inside the cluster; the Ingress routes neither Flower nor /metrics
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    flower_labels = flower["spec"]["template"]["metadata"]["labels"]
    flower_svcs = {n for n, s in services.items() if _matches({"matchLabels": s["spec"]["selector"]}, flower_labels)}
    assert flower_svcs
    for s in services.values():
        assert s["spec"].get("type", "ClusterIP") == "ClusterIP", f"Service {s['metadata']['name']} is exposed"
    ingresses = [d for _, d in docs if d["kind"] == "Ingress"]
    assert ingresses
    for ing in ingresses:
        assert ing["spec"].get("defaultBackend") is None
        for rule in ing["spec"]["rules"]:
            for p in rule["http"]["paths"]:
                assert p["backend"]["service"]["name"] not in flower_svcs, "Flower must not be routed"
                path, kind = p["path"], p["pathType"]
                if kind == "Exact":
                    assert path != "/metrics"
                else:  # Prefix / ImplementationSpecific: a prefix of /metrics would expose it
                    prefix = path.rstrip("/")
                    assert prefix and "/metrics" != prefix and not "/metrics".startswith(prefix + "/"), (
                        f"Ingress path {path} reaches /metrics"
                    )


# --------------------------------------------------------------------------- rendered by kustomize


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (built-in kustomize) is not installed")
@pytest.mark.parametrize("target", ["base", "overlays/production"])
def test_kustomize_renders_and_the_rendered_objects_pass(target, tmp_path, monkeypatch):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    for example in tree.rglob("*.env.example"):  # the git-ignored secret files, from their placeholders
        shutil.copy(example, example.with_suffix(""))
    proc = subprocess.run(["kubectl", "kustomize", str(tree / target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [(tree / target, d) for d in yaml.safe_load_all(proc.stdout) if d]
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "Ingress", "NetworkPolicy", "ConfigMap"} <= kinds
    if target == "base":
        # the base expects its Secrets to exist; stand in for them with the overlay's placeholders
        docs += [
            (tree, {"kind": "Secret", "metadata": {"name": n}, "stringData": v}) for n, v in generated_env([]).items()
        ]
    else:
        assert {"Secret", "ScaledObject", "TriggerAuthentication", "Namespace"} <= kinds
        for _, d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace") == "rlm", d["metadata"]["name"]
    check_k8s_objects(docs, monkeypatch, rendered=True)
