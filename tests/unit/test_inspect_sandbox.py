"""The Inspect AI sandbox provider "smol" against a real smold (host-agent launcher): Inspect's own self-check.

Every check of ``inspect_ai.util._sandbox.self_check`` runs against SmolSandboxEnvironment; the agent of
each machine gets private /etc and /home (sandbox_launcher) so the add-user check does not touch the host.
"""

from __future__ import annotations

import importlib
import os
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
