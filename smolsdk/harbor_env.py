"""A Harbor environment backed by a smol microVM: ``--environment-import-path smolsdk.harbor_env:SmolEnvironment``.

Harbor (harbor.environments.base.BaseEnvironment) needs Python >= 3.12; where it is not installed this module
defines a stand-in base with the same constructor and helpers, so the class can be used and tested without it.
"""

from __future__ import annotations

import enum
import io
import json
import logging
import math
import shlex
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from smolctl import taskdir

from .aio import AsyncClient
from .errors import NotFoundError
from .untar import extract

try:  # pragma: no cover - depends on whether Harbor is installed
    from harbor.environments.base import BaseEnvironment as _Base  # type: ignore[import-not-found]
    from harbor.environments.base import ExecResult  # type: ignore[import-not-found]
    from harbor.environments.capabilities import (  # type: ignore[import-not-found]
        EnvironmentCapabilities,
        EnvironmentResourceCapabilities,
    )
    from harbor.environments.options import EnvironmentOptions  # type: ignore[import-not-found]
    HAVE_HARBOR = True
except ImportError:
    HAVE_HARBOR = False
    from dataclasses import dataclass

    @dataclass
    class ExecResult:  # type: ignore[no-redef]
        """Harbor's ExecResult: stdout, stderr, return_code."""

        return_code: int
        stdout: str | None = None
        stderr: str | None = None

    @dataclass(frozen=True)
    class EnvironmentCapabilities:  # type: ignore[no-redef]
        """The fields of Harbor's EnvironmentCapabilities that SmolEnvironment sets (all others are False)."""

        disable_internet: bool = False
        network_allowlist: bool = False
        network_allowlist_hostnames: bool = False
        network_allowlist_ipv4_addresses: bool = False
        network_allowlist_ipv4_cidrs: bool = False
        dynamic_network_policy: bool = False
        gpus: bool = False
        mounted: bool = False

    @dataclass(frozen=True)
    class EnvironmentResourceCapabilities:  # type: ignore[no-redef]
        """The fields of Harbor's EnvironmentResourceCapabilities that SmolEnvironment sets."""

        cpu_limit: bool = False
        memory_limit: bool = False

    class _Base:  # type: ignore[no-redef]
        """The part of Harbor's BaseEnvironment constructor and helpers SmolEnvironment relies on."""

        def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                     task_env_config: Any, logger: logging.Logger | None = None, *args: Any,
                     persistent_env: dict[str, str] | None = None, network_policy: Any = None,
                     **kwargs: Any) -> None:
            self.environment_dir = Path(environment_dir)
            self.environment_name = environment_name
            self.session_id = session_id
            self.trial_paths = trial_paths
            self.task_env_config = task_env_config
            self.default_user: str | int | None = None
            self._persistent_env = dict(persistent_env or {})
            self._network_policy = network_policy
            self.logger = logger or logging.getLogger(__name__)
            self._validate_definition()
            self._validate_network_policy_support()

        def _resolve_user(self, user: str | int | None) -> str | int | None:
            return user if user is not None else self.default_user

        def _merge_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
            merged = {**self._persistent_env, **(env or {})}
            return merged or None

        def _validate_definition(self) -> None: ...

        def _validate_network_policy_support(self) -> None: ...

        @property
        def _effective_cpus(self) -> int | float | None:
            return getattr(self.task_env_config, "cpus", None)

        @property
        def _effective_memory_mb(self) -> int | None:
            return getattr(self.task_env_config, "memory_mb", None)



class SmolEnvironmentType(enum.StrEnum):
    """Harbor's EnvironmentType has no member for smold; this carries the same ``.value`` protocol. Not "smol":
    that is Harbor's built-in environment for the Smol Machines engine (PyPI's smolmachines)."""

    SMOLD = "smold"


if HAVE_HARBOR:
    class SmolEnvironmentOptions(EnvironmentOptions):  # type: ignore[misc,valid-type]
        """The --environment-kwarg options of the smol environment, validated by Harbor before any trial is
        queued (an unknown or misspelt option is an error there, not a surprise in the first trial)."""

        socket: str | None = None                               # smold's socket (else $SMOL_SOCKET)
        public_network: Literal["on", "refuse", "off"] = "on"   # what network_mode = "public" becomes


class SmolEnvironment(_Base):
    """A Harbor trial's environment in a fresh smol microVM, built from the task's environment/Dockerfile.

    The Dockerfile subset is smolctl run-task's (FROM is ignored, WORKDIR/ENV/COPY/RUN run on smol's
    default image, anything else is refused).

    Network policies (Harbor's [environment] network_mode) are enforced, not approximated: ``no-network``
    gives a machine with no NIC; ``allowlist`` becomes the Smolfile's ``network = { allow = [...] }``
    (host names, IPv4 addresses and CIDRs; the guest has no IPv6 and smol's resolver has no wildcards, so
    those entries are refused by Harbor's own check against ``capabilities``); ``public`` (Harbor's
    default) becomes ``network = "public"``: the internet, never the host, its neighbours, link-local
    (cloud metadata) or private ranges (docs/networking.md, "Public egress"). An operator who wants no
    internet passes ``--environment-kwarg public_network=refuse`` (such tasks are refused) or ``=off``
    (they run with no network at all). Phase policies (an offline agent, online tests) are switched in place
    (``dynamic_network_policy``; smold's SetNetworkPolicy).
    """

    PUBLIC_NETWORK = ("on", "refuse", "off")
    if HAVE_HARBOR:
        options_model = SmolEnvironmentOptions

    def __init__(self, *args: Any, socket: str | None = None, public_network: str = "on",
                 **kwargs: Any) -> None:
        if public_network not in self.PUBLIC_NETWORK:
            raise ValueError(f"smol environment: public_network must be one of {', '.join(self.PUBLIC_NETWORK)}, "
                             f"not {public_network!r}")
        self._socket = socket
        self._public_network = public_network
        self._task: taskdir.Task | None = None
        super().__init__(*args, **kwargs)
        self.client = AsyncClient(socket)
        self.machine_id: str | None = None
        self._has_nic = False

    @staticmethod
    def type() -> Any:
        return SmolEnvironmentType.SMOLD

    @property
    def capabilities(self) -> Any:
        """What smol enforces (Harbor checks each task's network policy and GPUs against this)."""
        return EnvironmentCapabilities(disable_internet=True, network_allowlist=True,
                                       network_allowlist_hostnames=True, network_allowlist_ipv4_addresses=True,
                                       network_allowlist_ipv4_cidrs=True, dynamic_network_policy=True)

    @classmethod
    def resource_capabilities(cls) -> Any:
        """vCPUs and guest RAM are hard ceilings; a machine gets exactly what it asks for, nothing is shared."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True)

    def _validate_definition(self) -> None:
        dockerfile = Path(self.environment_dir) / "Dockerfile"
        task = taskdir.Task(path=Path(self.environment_dir).parent, name=self.environment_name)
        if dockerfile.exists():
            try:
                taskdir._parse_dockerfile(task, dockerfile)
            except taskdir.TaskError as e:
                raise ValueError(f"smol environment: {e}") from None
        self._task = task

    def _policies(self) -> list[tuple[str, list[str]]]:
        """(mode, allowed hosts) of the startup policy and every phase policy. Without Harbor's policies
        (older Harbor, the stand-in base) the task's allow_internet decides between public and no-network."""
        policies = [getattr(self, "_network_policy", None), *getattr(self, "_phase_network_policies", [])]
        out: list[tuple[str, list[str]]] = []
        for p in policies:
            if p is None:
                public = getattr(self.task_env_config, "allow_internet", False)
                out.append(("public" if public else "no-network", []))
            else:
                mode = p.network_mode
                out.append((str(getattr(mode, "value", mode)), list(p.allowed_hosts or [])))
        return out

    def _validate_network_policy_support(self) -> None:
        super()._validate_network_policy_support()
        if self._public_network != "refuse":
            return
        for mode, _ in self._policies():
            if mode == "public":
                raise ValueError("network_mode='public' is refused by this run (--environment-kwarg "
                                 "public_network=refuse). Set network_mode = \"no-network\" or an \"allowlist\" "
                                 "with allowed_hosts in task.toml's [environment], or pass public_network=off to "
                                 "run such tasks with no network at all")

    def _smol_policy(self, mode: str, hosts: list[str]) -> tuple[list[str], bool]:
        """Harbor's (mode, allowed hosts) as smol's (allow entries, public); neither: no network."""
        if mode == "allowlist":
            return hosts, False
        return [], mode == "public" and self._public_network == "on"

    def smolfile_toml(self) -> str:
        """The Smolfile the machine is created from: the task's CPUs, memory and startup network policy; when
        that has no network but a phase's policy has, ``network = "closed"`` (a NIC with nothing allowed, opened
        by set_network_policy in that phase)."""
        lines = []
        cpus, memory = self._effective_cpus, self._effective_memory_mb
        if cpus:
            lines.append(f"cpus = {max(1, math.ceil(float(cpus)))}")
        if memory:
            lines.append(f'memory = "{int(memory)}M"')
        policies = [self._smol_policy(mode, hosts) for mode, hosts in self._policies()]
        allow, public = policies[0]
        if allow:
            lines.append(f"network = {{ allow = [{', '.join(json.dumps(h) for h in allow)}] }}")
        elif public:
            lines.append('network = "public"')
        elif any(a or p for a, p in policies[1:]):
            lines.append('network = "closed"')
        return "\n".join([*lines, "[timeouts]", "boot = 900", ""])

    async def _apply_network_policy(self, network_policy: Any) -> None:
        """Harbor switches policies between phases (dynamic_network_policy): the machine's policy is changed in
        place (smold's SetNetworkPolicy: atomic, connections the new one does not allow are cut)."""
        mode = network_policy.network_mode
        allow, public = self._smol_policy(str(getattr(mode, "value", mode)), list(network_policy.allowed_hosts or []))
        if self.machine_id is None:   # not started yet: start() creates the machine with the policy in force
            return
        if self._has_nic:
            await self.client.set_network_policy(self.machine_id, allow=allow, public=public)
        elif allow or public:
            raise RuntimeError("smol environment: the machine was created without a network and cannot get one; "
                               "this phase's network policy cannot be applied")

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self, force_build: bool = False) -> None:
        assert self._task is not None
        name = f"harbor-{uuid.uuid4().hex[:12]}"
        toml = self.smolfile_toml()
        machine = await self.client.create(toml=toml, base_dir=self.environment_dir, name=name)
        self.machine_id = machine.id
        self._has_nic = "\nnetwork = " in f"\n{toml}"
        try:
            await self._build(self._task, time.monotonic() + float(getattr(self.task_env_config, "build_timeout_sec",
                                                                            taskdir.DEFAULT_BUILD_TIMEOUT)))
        except BaseException:
            await self.stop(delete=True)
            raise

    async def _build(self, task: taskdir.Task, deadline: float) -> None:
        for step in task.steps:
            if step.kind == "copy":
                *sources, dest = step.args
                for src in sources:
                    host = Path(self.environment_dir) / src
                    if host.is_dir():
                        await self.upload_dir(host, dest.rstrip("/") or "/")
                    elif dest.endswith("/") or len(sources) > 1:
                        await self.upload_file(host, f"{dest.rstrip('/')}/{host.name}")
                    else:
                        await self.upload_file(host, dest)
                continue
            res = await self.client.exec(self._id, list(step.args), cwd=step.workdir, env=dict(step.env),
                                         timeout=max(deadline - time.monotonic(), 0.001))
            if res.exit_code != 0:
                raise RuntimeError(f"smol environment: Dockerfile line {step.line} failed "
                                   f"({'timed out' if res.timed_out else f'exit {res.returncode}'}): "
                                   f"{(res.stdout + res.stderr).decode(errors='replace')[-2000:]}")
        self._persistent_env: dict[str, str] = {**task.env, **self._persistent_env}
        res = await self.client.exec(self._id, ["mkdir", "-p", "/logs/agent", "/logs/verifier", "/logs/artifacts"])
        if res.exit_code != 0:
            raise RuntimeError(f"smol environment: mkdir /logs failed: {res.stderr.decode(errors='replace')}")

    async def stop(self, delete: bool = True) -> None:
        """Destroy the machine (a smol machine cannot be stopped and kept)."""
        if self.machine_id is not None:
            await self.client._destroy_shielded(self.machine_id)
            self.machine_id = None
        await self.client.close()

    @property
    def _id(self) -> str:
        if self.machine_id is None:
            raise RuntimeError("smol environment: not started")
        return self.machine_id

    # --- commands ---------------------------------------------------------------------------------------------
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        user = self._resolve_user(user)
        workdir = cwd or (self._task.workdir if self._task else "/")
        res = await self.client.exec(self._id, ["bash", "-c", command], cwd=workdir, env=self._merge_env(env),
                                     user=None if user is None else str(user), timeout=timeout_sec)
        stdout, stderr = res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")
        if res.timed_out:   # as Harbor's Docker environment (the command and its children are killed first)
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=stdout, stderr=stderr, return_code=res.returncode)

    # --- files ------------------------------------------------------------------------------------------------
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        await self.client.copy_in(self._id, target_path, src.read_bytes(), mode=src.stat().st_mode & 0o7777,
                                  mkdirs=True)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(Path(source_dir), arcname=".", recursive=True)
        await self.client.copy_in(self._id, target_dir, buf.getvalue(), tar=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self.client.copy_out(self._id, source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        archive = await self.client.copy_out(self._id, source_dir, tar=True)
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        extract(archive, target)   # the guest is untrusted: nothing lands outside target, no link is followed

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return (await self.exec(f"test -d {shlex.quote(path)}", timeout_sec=60, user=user)).return_code == 0

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        try:
            await self.client.copy_out(self._id, path, max_size=1)
            return True
        except NotFoundError:
            return False
        except Exception:
            return (await self.exec(f"test -f {shlex.quote(path)}", timeout_sec=60, user=user)).return_code == 0


__all__ = ["HAVE_HARBOR", "ExecResult", "SmolEnvironment"]
