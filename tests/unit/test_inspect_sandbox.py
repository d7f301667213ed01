"""The Inspect AI sandbox provider "smol" against a real smold (host-agent launcher): Inspect's own self-check.

Every check of ``inspect_ai.util._sandbox.self_check`` runs against SmolSandboxEnvironment; the agent of
each machine gets private /etc and /home (sandbox_launcher) so the add-user check does not touch the host.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import tempfile
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from daemon_support import DaemonProcess
from inspect_ai.util._sandbox.registry import registry_find_sandboxenv
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

import smolsdk
from smolsdk.inspect_sandbox import SmolSandboxConfig, SmolSandboxEnvironment

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="the private-/etc launcher needs root and unshare(1)")]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = Path(tempfile.mkdtemp(prefix="insp-", dir="/tmp"))
    d.chmod(0o755)  # the exec-as-user check runs commands as a new user in a working directory under it
    proc = DaemonProcess(d, "--max-copy-bytes", str(128 << 20), launcher="sandbox_launcher:PrivateEtcLauncher")
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()
        shutil.rmtree(d, ignore_errors=True)


def _config(daemon: DaemonProcess, name: str) -> SmolSandboxConfig:
    work = daemon.workdir / "work" / name
    return SmolSandboxConfig(workdir=str(work), socket=str(daemon.socket))


@pytest.fixture
async def sandbox_env(daemon: DaemonProcess, request: pytest.FixtureRequest) -> AsyncIterator[SmolSandboxEnvironment]:
    config = _config(daemon, request.node.name)
    envs = await SmolSandboxEnvironment.sample_init("self-check", config, {})
    env = envs["default"]
    assert isinstance(env, SmolSandboxEnvironment)
    try:
        yield env
    finally:
        await SmolSandboxEnvironment.sample_cleanup("self-check", config, envs, False)


async def _machines(daemon: DaemonProcess) -> list[smolsdk.MachineInfo]:
    async with smolsdk.AsyncClient(daemon.socket) as c:
        return await c.list()


def test_registered_through_entry_point() -> None:
    """pyproject's inspect_ai entry point names the module whose import registers the "smol" sandbox."""
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module = project["project"]["entry-points"]["inspect_ai"]["smol"]
    assert importlib.import_module(module).SmolSandboxEnvironment is SmolSandboxEnvironment
    assert registry_find_sandboxenv("smol") is SmolSandboxEnvironment


async def test_sample_cleanup_destroys_machine(daemon: DaemonProcess) -> None:
    config = _config(daemon, "cleanup")
    envs = await SmolSandboxEnvironment.sample_init("t", config, {})
    env = envs["default"]
    assert isinstance(env, SmolSandboxEnvironment)
    assert [m.id for m in await _machines(daemon)] == [env.machine_id]
    assert (await env.exec(["pwd"])).stdout.strip() == config.workdir
    await SmolSandboxEnvironment.sample_cleanup("t", config, envs, True)
    assert await _machines(daemon) == []


async def test_task_cleanup_destroys_what_sample_cleanup_missed(daemon: DaemonProcess) -> None:
    config = _config(daemon, "task-cleanup")
    await SmolSandboxEnvironment.sample_init("t", config, {})
    await SmolSandboxEnvironment.sample_init("t", config, {})
    assert len(await _machines(daemon)) == 2
    await SmolSandboxEnvironment.task_cleanup("t", config, cleanup=True)
    assert await _machines(daemon) == []


async def test_cli_cleanup_destroys_only_inspect_machines(daemon: DaemonProcess,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOL_SOCKET", str(daemon.socket))
    config = _config(daemon, "cli-cleanup")
    await SmolSandboxEnvironment.sample_init("t", config, {})
    async with smolsdk.AsyncClient(daemon.socket) as c:
        other = await c.create(name="not-inspect")
        await SmolSandboxEnvironment.cli_cleanup(None)
        assert [m.id for m in await c.list()] == [other.id]
        await SmolSandboxEnvironment.cli_cleanup(other.id)
        assert await c.list() == []
    await SmolSandboxEnvironment.task_cleanup("t", config, cleanup=True)


async def test_exec_output_over_the_limit_keeps_each_streams_tail(sandbox_env: SmolSandboxEnvironment,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As Inspect's Docker provider: the command runs to its end, each stream keeps its last bytes."""
    from inspect_ai.util._sandbox.limits import SandboxEnvironmentLimits
    monkeypatch.setattr(SandboxEnvironmentLimits, "MAX_EXEC_OUTPUT_SIZE", 1000)
    script = ("i=0; while [ $i -lt 300 ]; do printf 'out%04d\\n' $i; printf 'err%04d\\n' $i >&2; i=$((i+1)); done; "
              "echo done > ran-to-the-end")
    r = await sandbox_env.exec(["sh", "-c", script])
    assert r.success
    assert len(r.stdout) == 1000 and r.stdout.endswith("out0298\nout0299\n") and "out0000" not in r.stdout
    assert len(r.stderr) == 1000 and r.stderr.endswith("err0299\n")
    assert (await sandbox_env.read_file("ran-to-the-end")).strip() == "done"


async def test_exec_undecodable_output_is_replaced(sandbox_env: SmolSandboxEnvironment) -> None:
    r = await sandbox_env.exec(["sh", "-c", "printf '\\303\\050'; printf 'ok\\377' >&2"])
    assert (r.stdout, r.stderr) == ("\ufffd(", "ok\ufffd")


async def test_exec_on_a_machine_that_is_gone_raises_sandbox_unavailable(daemon: DaemonProcess) -> None:
    from inspect_ai.util import SandboxUnavailableError
    config = _config(daemon, "gone")
    envs = await SmolSandboxEnvironment.sample_init("gone", config, {})
    env = envs["default"]
    assert isinstance(env, SmolSandboxEnvironment)
    assert (await env.exec(["no-such-program"])).returncode == 127   # a missing executable is not the machine
    await SmolSandboxEnvironment.sample_cleanup("gone", config, envs, False)
    with pytest.raises(SandboxUnavailableError, match=f"the smol machine {env.machine_id}"):
        await env.exec(["true"])


async def test_exec_refused_by_the_guest_is_a_failed_command_not_an_unavailable_sandbox(
        sandbox_env: SmolSandboxEnvironment) -> None:
    await sandbox_env.write_file("a-file", "x")
    r = await sandbox_env.exec(["true"], cwd="a-file")    # a working directory that is a file
    assert not r.success and r.returncode != 0, r


# --- Docker compatibility: compose.yaml configs -------------------------------------------------------------------
def _compose(tmp_path: Path, text: str, name: str = "compose.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_compose_service_becomes_a_smolfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smolsdk.inspect_sandbox import _config
    monkeypatch.setenv("FROM_CALLER", "passed")
    monkeypatch.delenv("UNSET_HERE", raising=False)
    cfg = _config(_compose(tmp_path, """
services:
  default:
    image: registry.local:5000/team/env:v2
    x-local: true
    init: true
    command: tail -f /dev/null
    working_dir: /app
    user: agent
    environment: ["A=1", "FROM_CALLER", "UNSET_HERE"]
    cpus: 1.5
    mem_limit: 1536m
"""))
    assert (cfg.workdir, cfg.user, cfg.smolfile) == ("/app", "agent", None)
    assert tomllib.loads(cfg.toml or "") == {"image": "registry.local:5000/team/env:v2", "cpus": 2, "memory": 1536,
                                             "network": "public", "env": {"A": "1", "FROM_CALLER": "passed"}}
    cfg = _config(_compose(tmp_path, """
services:
  box:
    image: python:3.12-slim
    network_mode: none
    environment: {B: "two", FROM_CALLER: null}
    deploy: {resources: {limits: {cpus: "0.5", memory: 2g}}}
"""))
    assert cfg.workdir is None and cfg.user is None   # the image's working directory, root
    assert tomllib.loads(cfg.toml or "") == {"image": "python:3.12-slim", "cpus": 1, "memory": 2048,
                                             "env": {"B": "two", "FROM_CALLER": "passed"}}   # no network


@pytest.mark.parametrize("text, why", [
    ("services:\n  a: {image: x}\n  b: {image: y}\n", "one service per sample, found 2: a, b"),
    ("services:\n  default: {build: .}\n", "build is not supported yet"),
    ("services:\n  default: {image: x, ports: ['80:80'], privileged: true}\n", "not supported: ports, privileged"),
    ("services:\n  default: {image: x, network_mode: host}\n", "network_mode 'host' is not supported"),
    ("services:\n  default: {image: x, command: python3 -m http.server}\n", "smol runs no service command"),
    ("services:\n  default: {image: x, mem_limit: lots}\n", "'lots' is not a Docker size"),
    ("services:\n  default: {working_dir: /app}\n", "names no image"),
    ("services:\n  default: {image: x}\nvolumes: {data: {}}\n", "top-level volumes and networks"),
])
def test_what_smol_cannot_run_from_a_compose_file_is_refused_not_dropped(tmp_path: Path, text: str, why: str) -> None:
    from smolsdk.inspect_sandbox import _config
    with pytest.raises(ValueError, match=re.escape(why)):
        _config(_compose(tmp_path, text))


async def test_a_dockerfile_config_is_refused_at_task_init(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM debian\n")
    with pytest.raises(ValueError, match="Dockerfile configs are not supported yet"):
        await SmolSandboxEnvironment.task_init("t", str(tmp_path / "Dockerfile"))


def test_the_provider_is_docker_compatible() -> None:
    """Inspect keeps a Docker eval's compose.yaml when --sandbox smol replaces docker only for Docker-compatible
    providers, and parses a serialized compose config for them."""
    from inspect_ai.util._sandbox.environment import deserialize_sandbox_specific_config
    assert SmolSandboxEnvironment.is_docker_compatible()
    parsed = deserialize_sandbox_specific_config("smol", {"services": {"default": {"image": "alpine:3"}}})
    from smolsdk.inspect_sandbox import _config
    assert tomllib.loads(_config(parsed).toml or "")["image"] == "alpine:3"   # type: ignore[arg-type]


async def test_a_compose_config_runs_as_its_service_would(daemon: DaemonProcess, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOL_SOCKET", str(daemon.socket))
    work = daemon.workdir / "work" / "compose"
    path = _compose(tmp_path, f"""
services:
  default:
    image: default
    command: ["sleep", "infinity"]
    working_dir: {work}
    network_mode: none
    user: nobody
    environment: {{GREETING: hello}}
""")
    await SmolSandboxEnvironment.task_init("t", path)
    envs = await SmolSandboxEnvironment.sample_init("t", path, {})
    env = envs["default"]
    try:
        assert isinstance(env, SmolSandboxEnvironment)
        r = await env.exec(["sh", "-c", 'echo "$GREETING $(pwd) $(id -un)"'])
        assert r.stdout.split() == ["hello", str(work), "nobody"], r
        assert (await env.exec(["id", "-un"], user="root")).stdout.strip() == "root"   # a named user wins
    finally:
        await SmolSandboxEnvironment.sample_cleanup("t", path, envs, True)


async def test_concurrency_follows_the_daemons_limits_and_a_sample_waits_for_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """default_concurrency is what smold's limits hold (GetDaemonInfo); a sample whose create smold refuses for
    its limits (another client's machines) waits until a machine goes, instead of failing."""
    import asyncio
    d = Path(tempfile.mkdtemp(prefix="insp2-", dir="/tmp"))
    proc = DaemonProcess(d, "--max-machines", "2", "--max-memory", "8192",
                         launcher="sandbox_launcher:PrivateEtcLauncher").start()
    try:
        monkeypatch.setenv("SMOL_SOCKET", str(proc.socket))
        assert SmolSandboxEnvironment.default_concurrency() == 2
        async with smolsdk.AsyncClient(proc.socket) as c:
            info = await c.info()
            assert (info.max_machines, info.max_memory_mib, info.live_machines, info.public_network) == (2, 8192, 0,
                                                                                                          True)
            assert info.machines_that_fit == min(2, 8192 // info.default_memory_mib)
            first, second = await c.create(name="other-1"), await c.create(name="other-2")
            assert (await c.info()).live_machines == 2
            sample = asyncio.create_task(SmolSandboxEnvironment.sample_init("t", None, {}))
            await asyncio.sleep(2)
            assert not sample.done()                       # refused for the machine limit: waiting, not failed
            await c.destroy(first.id)
            envs = await asyncio.wait_for(sample, 60)       # room: the sample's machine is made
            assert len(await c.list()) == 2
            await SmolSandboxEnvironment.sample_cleanup("t", None, envs, False)
            await c.destroy(second.id)
        monkeypatch.setenv("SMOL_SOCKET", str(d / "no-daemon.sock"))
        assert SmolSandboxEnvironment.default_concurrency() is None   # no daemon to ask: no maximum
    finally:
        proc.kill()
        shutil.rmtree(d, ignore_errors=True)
