"""A Harbor/Terminal-Bench task directory: task.toml settings and the Dockerfile subset smol can honour."""

from __future__ import annotations

import math
import os
import posixpath
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_AGENT_TIMEOUT = 600.0
DEFAULT_VERIFIER_TIMEOUT = 600.0
DEFAULT_BUILD_TIMEOUT = 600.0
# Instructions that only matter to a long-running container; a one-shot task run ignores them.
IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL"}
# Harbor's env templates (harbor.utils.env.resolve_env_vars): a whole value "${VAR}" or "${VAR:-default}" is
# taken from the host's environment (here: smolctl's).
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


class TaskError(Exception):
    """The task directory cannot be run by smol (missing file, bad task.toml, unsupported Dockerfile)."""


@dataclass(frozen=True)
class Step:
    """One Dockerfile instruction smol runs: COPY (host source under environment/, guest dest) or RUN."""

    kind: str            # "copy" or "run"
    args: tuple[str, ...]
    workdir: str
    env: tuple[tuple[str, str], ...]
    line: int


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step task ([[steps]], Harbor 0.26): steps/<name>/ holds its instruction, solution,
    tests and an optional workdir/ (with setup.sh) staged into the working directory before the step runs."""

    name: str
    agent_timeout: float
    verifier_timeout: float
    agent_user: str
    verifier_user: str
    min_reward: dict[str, float] | None   # stop after this step unless every named reward reaches its value


# Harbor's step names (harbor.models.task.config.validate_step_name): a portable directory name.
_STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
REWARD_STRATEGIES = ("mean", "final")


@dataclass
class Task:
    path: Path
    name: str
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT
    verifier_timeout: float = DEFAULT_VERIFIER_TIMEOUT
    build_timeout: float = DEFAULT_BUILD_TIMEOUT
    verifier_env: dict[str, str] = field(default_factory=dict)
    cpus: int | None = None
    memory_mib: int | None = None
    image: str = "default"
    steps: list[Step] = field(default_factory=list)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)      # the Dockerfile's ENV, then [environment.env]
    solution_env: dict[str, str] = field(default_factory=dict)
    agent_user: str = ""                                    # "" : root (the image's default user)
    verifier_user: str = ""
    network_mode: str = "public"                            # Harbor's [environment] network_mode (its default)
    allowed_hosts: list[str] = field(default_factory=list)  # with network_mode = "allowlist"
    # [agent] / [verifier] network_mode and allowed_hosts where they differ from the environment's (else None)
    agent_network: tuple[str, list[str]] | None = None
    verifier_network: tuple[str, list[str]] | None = None
    task_steps: list[TaskStep] = field(default_factory=list)   # a multi-step task's [[steps]], in order
    reward_strategy: str = "mean"          # multi_step_reward_strategy: "mean" per key over steps, or "final"


def _env(table: dict[str, Any], where: str) -> dict[str, str]:
    """An ``env`` table of strings, with Harbor's ``${VAR}`` / ``${VAR:-default}`` templates resolved."""
    raw = table.get("env", {})
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: env must be a table of strings")
    out = {}
    for key, value in raw.items():
        if not isinstance(value, str):
            raise TaskError(f"{where}: env {key!r} must be a string (got {value!r})")
        m = _TEMPLATE.fullmatch(value)
        if m is None:
            out[str(key)] = value
        elif m.group(1) in os.environ:
            out[str(key)] = os.environ[m.group(1)]
        elif m.group(2) is not None:
            out[str(key)] = m.group(2)
        else:
            raise TaskError(f"{where}: env {key!r} is {value!r}, but {m.group(1)} is not set in smolctl's "
                            "environment (set it, or give a default: ${VAR:-default})")
    return out


def _user(table: dict[str, Any], where: str) -> str:
    value = table.get("user")
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int) or str(value) == "":
        raise TaskError(f"{where}: user must be a user name or a numeric uid (got {value!r})")
    return str(value)


def _number(table: dict[str, Any], key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TaskError(f"{where}: {key} must be a positive number (got {value!r})")
    return float(value)


NETWORK_MODES = ("public", "no-network", "allowlist")


def _network(env: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """Harbor's network policy of the task's environment: [environment] network_mode (default "public") and
    allowed_hosts, or the deprecated allow_internet."""
    legacy = env.get("allow_internet")
    if legacy is not None and not isinstance(legacy, bool):
        raise TaskError(f"{where}: [environment] allow_internet must be true or false (got {legacy!r})")
    mode = env.get("network_mode")
    if mode is None:
        mode = "no-network" if legacy is False else "public"
    elif mode not in NETWORK_MODES:
        raise TaskError(f"{where}: [environment] network_mode must be one of {', '.join(NETWORK_MODES)} "
                        f"(got {mode!r})")
    elif legacy is not None and legacy != (mode == "public"):
        raise TaskError(f"{where}: [environment] allow_internet = {str(legacy).lower()} contradicts "
                        f"network_mode = {mode!r}; drop allow_internet (deprecated)")
    return mode, _hosts(env, mode, f"{where}: [environment]")


def _phase_network(table: dict[str, Any], phase: str, baseline: tuple[str, list[str]],
                   where: str) -> tuple[str, list[str]] | None:
    """An [agent] or [verifier] network policy (Harbor's phase override), or None when it has none or it is
    the environment's."""
    if "network_mode" not in table and "allowed_hosts" not in table:
        return None
    mode = table.get("network_mode")
    if mode not in NETWORK_MODES:
        raise TaskError(f"{where}: [{phase}] network_mode must be one of {', '.join(NETWORK_MODES)} (got {mode!r})")
    policy = (mode, _hosts(table, mode, f"{where}: [{phase}]"))
    return None if policy == baseline else policy


def _hosts(table: dict[str, Any], mode: str, where: str) -> list[str]:
    hosts = table.get("allowed_hosts")
    if hosts is None:
        return []
    if mode != "allowlist":
        raise TaskError(f"{where} allowed_hosts is only valid when network_mode = \"allowlist\"")
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise TaskError(f"{where} allowed_hosts must be an array of strings")
    return list(hosts)


def load(path: Path) -> Task:
    """Read and check a task directory; TaskError says what smol cannot do with it."""
    if not path.is_dir():
        raise TaskError(f"{path}: not a directory")
    task = Task(path=path, name=path.resolve().name)
    toml_path = path / "task.toml"
    doc: dict[str, Any] = {}
    if toml_path.exists():
        try:
            doc = tomllib.loads(toml_path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TaskError(f"{toml_path}: {e}") from None
    if "steps" not in doc:
        for need in ("tests/test.sh", "solution/solve.sh"):
            if not (path / need).is_file():
                raise TaskError(f"{path}: {need} is missing")
    if toml_path.exists():
        where = str(toml_path)
        agent, verifier, env = doc.get("agent", {}), doc.get("verifier", {}), doc.get("environment", {})
        task.agent_timeout = _number(agent, "timeout_sec", DEFAULT_AGENT_TIMEOUT, f"{where}: [agent]")
        task.verifier_timeout = _number(verifier, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT, f"{where}: [verifier]")
        task.build_timeout = _number(env, "build_timeout_sec", DEFAULT_BUILD_TIMEOUT, f"{where}: [environment]")
        task.verifier_env = _env(verifier, f"{where}: [verifier]")
        environment_env = _env(env, f"{where}: [environment]")
        task.solution_env = _env(doc.get("solution", {}), f"{where}: [solution]")
        task.agent_user = _user(agent, f"{where}: [agent]")
        task.verifier_user = _user(verifier, f"{where}: [verifier]")
        workdir = env.get("workdir")
        if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
            raise TaskError(f"{where}: [environment] workdir must be an absolute path (got {workdir!r})")
        task.network_mode, task.allowed_hosts = _network(env, where)
        task.agent_network = _phase_network(agent, "agent", (task.network_mode, task.allowed_hosts), where)
        task.verifier_network = _phase_network(verifier, "verifier", (task.network_mode, task.allowed_hosts), where)
        if "cpus" in env:  # a fraction of a CPU (Docker's --cpus) rounds up: a machine has whole vCPUs
            task.cpus = math.ceil(_number(env, "cpus", 1, f"{where}: [environment]"))
        if "memory_mb" in env:
            task.memory_mib = int(_number(env, "memory_mb", 1024, f"{where}: [environment]"))
        docker_image = env.get("docker_image")
        if docker_image is not None:
            if not isinstance(docker_image, str) or not docker_image or docker_image != docker_image.strip():
                raise TaskError(f"{where}: [environment] docker_image must be an image reference "
                                f"(got {docker_image!r})")
            # A pre-built image: smold pulls it into its OCI store (docs/images.md) and boots it, and the
            # Dockerfile is not used (Harbor: should_use_prebuilt_docker_image). A bare name means :latest.
            task.image = docker_image if any(c in docker_image for c in "/:@") else f"{docker_image}:latest"
            task.workdir = ""  # the image's WorkingDir
    else:
        environment_env, workdir = {}, None
    dockerfile = path / "environment" / "Dockerfile"
    if dockerfile.exists() and task.image == "default":
        _parse_dockerfile(task, dockerfile)
    task.env.update(environment_env)  # [environment.env] over the Dockerfile's ENV (Harbor: the container's env)
    if workdir is not None:
        task.workdir = posixpath.normpath(workdir)  # [environment] workdir overrides WORKDIR
    if "steps" in doc:
        task.task_steps = _steps(task, doc, str(toml_path))
        strategy = doc.get("multi_step_reward_strategy", "mean")
        if strategy not in REWARD_STRATEGIES:
            raise TaskError(f"{toml_path}: multi_step_reward_strategy must be one of {', '.join(REWARD_STRATEGIES)} "
                            f"(got {strategy!r})")
        task.reward_strategy = strategy
    return task


def _steps(task: Task, doc: dict[str, Any], where: str) -> list[TaskStep]:
    """A multi-step task's [[steps]]: each a portable, unique name with steps/<name>/solution/solve.sh and
    steps/<name>/tests/test.sh; its [steps.agent] / [steps.verifier] timeout_sec and user override the
    task's; min_reward a number (the "reward" key) or a table of numbers."""
    raw = doc["steps"]
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise TaskError(f"{where}: steps must be a non-empty array of tables ([[steps]])")
    out: list[TaskStep] = []
    seen: set[str] = set()
    for i, table in enumerate(raw):
        at = f"{where}: steps[{i}]"
        name = table.get("name")
        if not isinstance(name, str) or not _STEP_NAME.fullmatch(name) or ".." in name:
            raise TaskError(f"{at}: name must be a portable directory name (letters, digits, '._-'; got {name!r})")
        if name.lower() in seen:
            raise TaskError(f"{at}: step name {name!r} is used twice")
        seen.add(name.lower())
        for need in ("solution/solve.sh", "tests/test.sh"):
            if not (task.path / "steps" / name / need).is_file():
                raise TaskError(f"{task.path}: steps/{name}/{need} is missing")
        agent, verifier = table.get("agent", {}), table.get("verifier", {})
        if not isinstance(agent, dict) or not isinstance(verifier, dict):
            raise TaskError(f"{at}: agent and verifier must be tables")
        for phase, t in (("agent", agent), ("verifier", verifier)):
            if "network_mode" in t or "allowed_hosts" in t:
                raise TaskError(f"{at}.{phase}: a step's own network policy is not supported by smol run-task yet "
                                "(the task-level [agent]/[verifier] network_mode is)")
        min_reward = table.get("min_reward")
        if min_reward is not None:
            pairs = min_reward.items() if isinstance(min_reward, dict) else [("reward", min_reward)]
            if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for _, v in pairs):
                raise TaskError(f"{at}: min_reward must be a number or a table of numbers (got {min_reward!r})")
            min_reward = {str(k): float(v) for k, v in pairs}
        out.append(TaskStep(
            name=name,
            agent_timeout=_number(agent, "timeout_sec", task.agent_timeout, f"{at}.agent"),
            verifier_timeout=_number(verifier, "timeout_sec", task.verifier_timeout, f"{at}.verifier"),
            agent_user=_user(agent, f"{at}.agent") or task.agent_user,
            verifier_user=_user(verifier, f"{at}.verifier") or task.verifier_user,
            min_reward=min_reward))
    return out


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _parse_dockerfile(task: Task, dockerfile: Path) -> None:
    """WORKDIR, ENV, COPY (from environment/) and RUN become steps; anything else is refused."""
    context = dockerfile.parent
    workdir, env = "/", dict[str, str]()
    for n, line in _logical_lines(dockerfile.read_text(encoding="utf-8")):
        where = f"{dockerfile}:{n}"
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            continue  # the machine runs smol's default image; RUN steps that need other packages fail visibly
        if op in IGNORED:
            continue
        if op == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir.rstrip('/')}/{rest}"
            task.steps.append(Step("run", ("mkdir", "-p", workdir), "/", (), n))
        elif op == "ENV":
            words = shlex.split(rest)
            if words and "=" not in words[0]:
                env[words[0]] = " ".join(words[1:])
            else:
                for w in words:
                    k, sep, v = w.partition("=")
                    if not sep:
                        raise TaskError(f"{where}: ENV wants NAME=VALUE")
                    env[k] = v
        elif op == "COPY":
            words = shlex.split(rest)
            if any(w.startswith("--") for w in words):
                raise TaskError(f"{where}: COPY options ({rest}) are not supported")
            if len(words) < 2:
                raise TaskError(f"{where}: COPY wants SRC... DEST")
            for src in words[:-1]:
                host = (context / src).resolve()
                if not host.is_relative_to(context.resolve()) or not host.exists():
                    raise TaskError(f"{where}: COPY source {src!r} is not a file or directory under environment/")
            raw = words[-1] if words[-1].startswith("/") else f"{workdir.rstrip('/')}/{words[-1]}"
            as_dir = raw.endswith(("/", "/.")) or len(words) > 2  # Docker: then DEST is a directory
            dest = posixpath.normpath(raw).replace("//", "/") + ("/" if as_dir else "")
            task.steps.append(Step("copy", (*words[:-1], dest), workdir, tuple(env.items()), n))
        elif op == "RUN":
            if rest.startswith("["):
                raise TaskError(f"{where}: RUN in exec (JSON) form is not supported; use the shell form")
            task.steps.append(Step("run", ("sh", "-c", rest), workdir, tuple(env.items()), n))
        else:
            raise TaskError(f"{where}: {op} is not supported by smol run-task "
                            "(supported: FROM, WORKDIR, ENV, COPY, RUN)")
    task.workdir, task.env = workdir, env
