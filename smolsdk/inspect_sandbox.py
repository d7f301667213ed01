"""Inspect AI sandbox provider "smol": each sample's sandbox is a smol microVM, destroyed at sample cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import posixpath
import re
import shlex
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    sandboxenv,
)
from inspect_ai.util._sandbox.compose import (
    COMPOSE_FILES,
    ComposeConfig,
    is_compose_yaml,
    is_dockerfile,
    parse_compose_yaml,
)
from pydantic import BaseModel

from .aio import AsyncClient
from .client import Client
from .errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SmolError,
    UnavailableError,
)
from .types import Exit, Stderr, Stdout

NAME_PREFIX = "inspect-"
_CONCURRENCY: dict[str, int] = {}   # default_concurrency per $SMOL_SOCKET, asked once
CAPACITY_WAIT_S = 1800.0   # how long a sample waits for smold's limits to leave room for its machine
DEFAULT_WORKDIR = "/"

# Machines created by this process and not yet destroyed: (socket, machine id). task_cleanup destroys them.
_LIVE: set[tuple[str, str]] = set()

# One exec that reports what a path is: "none", or its raw st_mode in hex (the `stat -L -c %f` format).
_PROBE = 'stat -L -c %f -- "$1" 2>/dev/null || echo none'


class SmolSandboxConfig(BaseModel, frozen=True):
    """The provider's configuration: a Smolfile, the working directory, smold's socket."""

    smolfile: str | None = None   # path to a Smolfile.toml (or a directory holding one); None: the empty one
    workdir: str | None = DEFAULT_WORKDIR  # relative paths in exec(cwd=), read_file and write_file are under
                                           # it; None: the image's working directory (as Docker)
    socket: str | None = None     # smold's Unix socket; None: $SMOL_SOCKET, else /run/smold/smold.sock
    toml: str | None = None       # Smolfile text instead of a path (a compose.yaml becomes one)
    user: str | None = None       # who runs commands that name no user; None: root


def _config(config: SandboxEnvironmentConfigType | None) -> SmolSandboxConfig:
    """The provider's config from what Inspect passes: nothing, a Smolfile path, a compose.yaml path or a parsed
    ComposeConfig (the provider is Docker-compatible), a Dockerfile path (refused until smold builds
    Dockerfiles), or a SmolSandboxConfig."""
    if config is None:
        return SmolSandboxConfig()
    if isinstance(config, SmolSandboxConfig):
        return config
    if isinstance(config, ComposeConfig):
        return compose_config(config)
    if isinstance(config, str):
        if is_dockerfile(config):
            raise ValueError(f"smol sandbox: {config}: Dockerfile configs are not supported yet (smold does not "
                             "build Dockerfiles); use a compose.yaml whose service names a registry image")
        if is_compose_yaml(config):
            return compose_config(parse_compose_yaml(config), source=config)
        return SmolSandboxConfig(smolfile=config)
    raise ValueError(f"smol sandbox: config must be a Smolfile path, a compose.yaml or SmolSandboxConfig, "
                     f"got {type(config)}")


# Compose service fields the translation reads; command/entrypoint only as a keep-alive (a microVM needs none).
_COMPOSE_FIELDS = {"image", "working_dir", "environment", "network_mode", "user", "cpus", "mem_limit", "deploy",
                   "command", "entrypoint", "init", "x_default"}
_KEEP_ALIVE = {("tail", "-f", "/dev/null"), ("sleep", "infinity"), ("sleep", "inf")}
_DOCKER_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def compose_config(compose: ComposeConfig, *, source: str = "compose config") -> SmolSandboxConfig:
    """A single-service Docker Compose config as a smol machine, as Inspect's Docker provider would run it:
    the service's ``image`` (pulled through smold's OCI store), ``working_dir`` (else the image's),
    ``environment`` (a name without a value takes the caller's), ``user``, ``cpus``/``mem_limit`` or
    ``deploy.resources.limits``, and ``network_mode`` (``none``: no network; unset or ``bridge``: Docker's
    default, the internet, which smold gives as public egress). Anything else, a ``build``, or a second
    service is refused with the fields named, never dropped."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"smol sandbox: {source}: {why}")

    if len(compose.services) != 1:
        raise refuse(f"smol runs one service per sample, found {len(compose.services)}: "
                     f"{', '.join(compose.services)}")
    if compose.volumes or compose.networks:
        raise refuse("top-level volumes and networks are not supported")
    (name, svc), = compose.services.items()
    used = {k for k in svc.model_fields_set if getattr(svc, k) is not None} | set(svc.extensions)
    unsupported = sorted(k for k in used - _COMPOSE_FIELDS if not k.startswith("x-"))
    if svc.build is not None:
        raise refuse(f"service {name!r}: build is not supported yet (smold does not build Dockerfiles); "
                     "name a registry image")
    if unsupported:
        raise refuse(f"service {name!r}: not supported: {', '.join(unsupported)}")
    if not svc.image:
        raise refuse(f"service {name!r} names no image")
    for field in ("command", "entrypoint"):
        value = getattr(svc, field)
        argv = tuple(value.split() if isinstance(value, str) else value or ())
        if argv and argv not in _KEEP_ALIVE:
            raise refuse(f"service {name!r}: {field} {value!r}: smol runs no service command (a machine stays "
                         "up by itself); only a keep-alive such as 'tail -f /dev/null' is accepted")
    lines = [f"image = {json.dumps(svc.image, ensure_ascii=False)}"]
    limits = svc.deploy.resources.limits if svc.deploy and svc.deploy.resources else None
    if svc.deploy is not None and (svc.deploy.resources is None or svc.deploy.resources.reservations
                                   or set(svc.deploy.model_fields_set) - {"resources"}):
        raise refuse(f"service {name!r}: of deploy, only resources.limits (cpus, memory) is supported")
    cpus = svc.cpus if svc.cpus is not None else (float(limits.cpus) if limits and limits.cpus else None)
    if cpus is not None:
        lines.append(f"cpus = {max(1, math.ceil(cpus))}")
    memory = svc.mem_limit or (limits.memory if limits else None)
    if memory is not None:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", str(memory).strip().lower())
        if m is None:
            raise refuse(f"service {name!r}: memory {memory!r} is not a Docker size (e.g. 512m, 2g)")
        lines.append(f"memory = {max(1, math.ceil(float(m[1]) * _DOCKER_UNITS[m[2]] / (1 << 20)))}")
    mode = svc.network_mode
    if mode in (None, "bridge", "default"):
        lines.append('network = "public"')
    elif mode != "none":
        raise refuse(f"service {name!r}: network_mode {mode!r} is not supported (none, or bridge: the internet)")
    env: dict[str, str] = {}
    items = svc.environment.items() if isinstance(svc.environment, dict) else (
        tuple(e.split("=", 1)) if "=" in e else (e, None) for e in svc.environment or ())
    for key, value in items:
        if value is None:
            value = os.environ.get(key)
        if value is not None:
            env[key] = str(value)
    if env:
        lines.append("[env]")
        lines.extend(f"{json.dumps(k, ensure_ascii=False)} = {json.dumps(v, ensure_ascii=False)}" for k, v in env.items())
    return SmolSandboxConfig(toml="\n".join(lines) + "\n", workdir=svc.working_dir, user=svc.user)


@sandboxenv(name="smol")
class SmolSandboxEnvironment(SandboxEnvironment):
    """A smol microVM as an Inspect sandbox. Commands run as root unless ``user`` is given."""

    def __init__(self, client: AsyncClient, machine_id: str, workdir: str, user: str | None = None) -> None:
        super().__init__()
        self.client = client
        self.machine_id = machine_id
        self.workdir = workdir
        self.user = user   # who runs a command that names no user (a compose service's user); None: root

    # --- lifecycle --------------------------------------------------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        """Found in a task's directory in this order. The compose files make the provider Docker-compatible (an
        eval written for Docker keeps its config under ``--sandbox smol``); a Dockerfile is found so that it is
        refused with a reason, not ignored."""
        return ["Smolfile.toml", *COMPOSE_FILES, "Dockerfile"]

    @classmethod
    def default_concurrency(cls) -> int | None:
        """As many samples at once as smold's limits hold machines of the default size (GetDaemonInfo, from
        $SMOL_SOCKET's daemon); None (no maximum) when it cannot be asked. A create refused for capacity
        anyway (other clients' machines) waits for room: see sample_init."""
        socket = os.environ.get("SMOL_SOCKET", "")
        if socket not in _CONCURRENCY:   # Inspect asks once per sample, on its event loop: ask smold once
            try:
                with Client(timeout=10) as client:
                    _CONCURRENCY[socket] = client.info().machines_that_fit
            except SmolError:
                return None
        return _CONCURRENCY[socket]

    def default_polling_interval(self) -> float:
        return 0.2   # an exec round trip is milliseconds on KVM: poll as Inspect's Docker provider does

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SmolSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        cfg = _config(config)   # a compose.yaml or Dockerfile smol cannot run is refused here, before any sample
        if cfg.smolfile is not None and not Path(cfg.smolfile).exists():
            raise FileNotFoundError(errno.ENOENT, "Smolfile not found", cfg.smolfile)

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = _config(config)
        client = AsyncClient(cfg.socket)
        name = f"{NAME_PREFIX}{uuid.uuid4().hex[:16]}"
        _LIVE.add((client.socket, name))
        try:
            machine = await _create_when_room(client, cfg, name)
        except BaseException:
            _LIVE.discard((client.socket, name))
            await client.close()
            raise
        env = cls(client, machine.id, cfg.workdir or "/", cfg.user)
        _LIVE.discard((client.socket, name))
        _LIVE.add((client.socket, machine.id))
        if cfg.workdir is None:   # the image's working directory: where a command that names none runs
            env.workdir = (await env._exec_checked(["pwd"])).strip() or "/"
        elif cfg.workdir != "/":
            await env._exec_checked(["mkdir", "-p", "--", cfg.workdir])
        return {"default": env}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for env in environments.values():
            if isinstance(env, SmolSandboxEnvironment):
                await env.destroy()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        if not cleanup:
            return
        for socket, machine_id in list(_LIVE):
            client = AsyncClient(socket)
            try:
                with contextlib.suppress(SmolError):
                    await client.destroy(machine_id)
            finally:
                await client.close()
            _LIVE.discard((socket, machine_id))

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """Destroy machine ``id``, or every machine this provider made (named inspect-...)."""
        client = AsyncClient()
        try:
            if id is not None:
                await client.destroy(id)
                return
            for m in await client.list():
                if m.name.startswith(NAME_PREFIX):
                    with contextlib.suppress(SmolError):
                        await client.destroy(m.id)
        finally:
            await client.close()

    async def destroy(self) -> None:
        try:
            await self.client._destroy_shielded(self.machine_id)
        finally:
            _LIVE.discard((self.client.socket, self.machine_id))
            await self.client.close()

    # --- paths ------------------------------------------------------------------------------------------------
    def _path(self, file: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, file)).replace("//", "/")

    async def _exec_checked(self, argv: list[str]) -> str:
        res = await self.client.exec(self.machine_id, argv)
        if res.exit_code != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed in machine {self.machine_id}: "
                               f"{res.stderr.decode(errors='replace').strip()}")
        return res.stdout.decode(errors="replace")

    async def _mode(self, path: str) -> int | None:
        """The path's st_mode (following links), or None if it does not exist."""
        out = (await self._exec_checked(["sh", "-c", _PROBE, "sh", path])).strip()
        return None if out == "none" else int(out, 16)

    # --- exec -------------------------------------------------------------------------------------------------
    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        """As Inspect's Docker provider: each stream keeps its last MAX_EXEC_OUTPUT_SIZE bytes (the command
        runs to its end), output is decoded with undecodable bytes replaced, and a machine that is gone or
        unreachable raises SandboxUnavailableError (a missing executable is exit 127, as in a shell)."""
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        out, err = _Tail(limit), _Tail(limit)
        done: Exit | None = None
        user = user or self.user
        stream = self.client.exec_stream(self.machine_id, cmd, env=env, cwd=self._path(cwd or "."), user=user,
                                         stdin=input, timeout=timeout)
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if isinstance(event, Stdout):
                        out.add(event.data)
                    elif isinstance(event, Stderr):
                        err.add(event.data)
                    else:
                        done = event
        except PermissionDeniedError as e:
            raise PermissionError(errno.EACCES, f"cannot run {cmd[0]!r}: {e.details}", cmd[0]) from None
        except NotFoundError as e:
            if e.guest_code is None:   # the machine itself is gone
                raise SandboxUnavailableError(f"the smol machine {self.machine_id} is gone: {e.details}") from None
            return ExecResult(False, 127, "", f"{cmd[0]}: {e.details}")  # no such executable or working directory
        except (UnavailableError, FailedPreconditionError) as e:
            if e.guest_code is not None:   # the guest refused this command (a cwd that is a file, say)
                return ExecResult(False, 126 if e.guest_code in ("ENOTDIR", "EISDIR") else 1, "",
                                  f"{cmd[0]}: {e.details}")
            # the machine itself: stopped, failed, destroyed, its agent unreachable
            raise SandboxUnavailableError(f"the smol machine {self.machine_id} cannot run commands: "
                                          f"{e.details}") from None
        except InvalidArgumentError as e:
            if user and "unknown user" in e.details:  # an Inspect convention: a failed result naming the user
                return ExecResult(False, 1, "", f"unknown user: {user} ({e.details})")
            raise
        if done is None:
            raise SandboxUnavailableError(f"exec in machine {self.machine_id}: the stream ended without an exit "
                                          "status")
        stdout, stderr = out.text(), err.text()
        if done.timed_out:
            timeout_error = TimeoutError(f"Command timed out after {timeout} seconds")
            if stdout or stderr:
                timeout_error.truncated_output = stdout + stderr  # type: ignore[attr-defined]
            raise timeout_error
        return ExecResult(done.returncode == 0, done.returncode, stdout, stderr)

    # --- files ------------------------------------------------------------------------------------------------
    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        mode = await self._mode(path)
        if mode is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if mode is not None and not mode & stat.S_IWUSR:  # as Docker: a file its owner cannot write
            raise PermissionError(errno.EACCES, "Permission denied", file)
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        try:
            await self.client.copy_in(self.machine_id, path, data, mkdirs=True,
                                      mode=stat.S_IMODE(mode) if mode is not None else None)
        except SmolError as e:
            raise _os_error(e, file) from None

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        path = self._path(file)
        mode = await self._mode(path)
        if mode is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if not mode & stat.S_IRUSR:  # as Docker: a file its owner cannot read
            raise PermissionError(errno.EACCES, "Permission denied", file)
        try:
            data = await self.client.copy_out(self.machine_id, path,
                                               max_size=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE)
        except ResourceExhaustedError:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None) from None
        except SmolError as e:
            raise _os_error(e, file) from None
        return data.decode("utf-8") if text else data


async def _create_when_room(client: AsyncClient, cfg: SmolSandboxConfig, name: str) -> Any:
    """Create the sample's machine (destroyed by name if interrupted); while smold refuses it for its machine or
    memory limit (other samples' or clients' machines), wait for room, up to CAPACITY_WAIT_S."""
    deadline, delay = time.monotonic() + CAPACITY_WAIT_S, 0.5
    while True:
        try:
            return await client.create(cfg.smolfile, toml=cfg.toml, name=name)
        except ResourceExhaustedError:
            if time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)


class _Tail:
    """The last ``limit`` bytes of a stream (older bytes are dropped, as Inspect's subprocess does)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.buf = limit, bytearray()

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > 2 * self.limit:   # trimmed in batches: amortized O(1) per byte
            del self.buf[:-self.limit]

    def text(self) -> str:
        return bytes(self.buf[-self.limit:]).decode("utf-8", errors="replace")


def _os_error(e: SmolError, file: str) -> Exception:
    """The OSError Inspect expects for a failed guest file operation."""
    code = e.guest_code
    if code == "ENOENT":
        return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
    if code in ("EACCES", "EPERM"):
        return PermissionError(errno.EACCES, "Permission denied", file)
    if code == "EISDIR":
        return IsADirectoryError(errno.EISDIR, "Is a directory", file)
    if code == "ENOTDIR":
        return NotADirectoryError(errno.ENOTDIR, "Not a directory", file)
    return OSError(errno.EIO, e.details, file)


__all__ = ["SmolSandboxConfig", "SmolSandboxEnvironment"]
