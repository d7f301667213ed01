"""smolsdk.harbor_env.SmolEnvironment driven the way Harbor drives an environment for an oracle trial."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir
from test_run_task import write_task

import smolsdk
from smolsdk.harbor_env import SmolEnvironment

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="the task launcher needs root and unshare(1)")]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("harb-", "--net-pool", "10.214.12.0/24", launcher="sandbox_launcher:TaskLauncher") as proc:
        yield proc


def env_config(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(**{"cpus": 1, "memory_mb": 512, "gpus": 0, "allow_internet": False,
                              "build_timeout_sec": 60.0, "env": {}, **kw})


def make_env(daemon: DaemonProcess, task: Path, **kw: object) -> SmolEnvironment:
    return SmolEnvironment(task / "environment", task.name, f"{task.name}__1", None, env_config(**kw),
                           socket=str(daemon.socket))


async def oracle_trial(daemon: DaemonProcess, task: Path, out: Path) -> float | None:
    """Harbor's trial with the oracle agent: start, upload and run solve.sh, upload and run test.sh, reward."""
    env = make_env(daemon, task)
    await env.start(force_build=False)
    try:
        await env.upload_dir(task / "solution", "/solution")
        await env.exec("bash /solution/solve.sh > /logs/agent/oracle.txt 2>&1", timeout_sec=30)
        await env.upload_dir(task / "tests", "/tests")
        await env.exec("bash /tests/test.sh", timeout_sec=30)
        await env.download_dir("/logs", out / "logs")
        reward = out / "logs" / "verifier" / "reward.txt"
        return float(reward.read_text()) if reward.exists() else None
    finally:
        await env.stop(delete=True)


async def test_passing_and_failing_oracles(daemon: DaemonProcess, tmp_path: Path) -> None:
    good = write_task(tmp_path, "good", "echo $EXPECTED > answer.txt\n")
    bad = write_task(tmp_path, "bad", "echo 41 > answer.txt\n")
    assert await oracle_trial(daemon, good, tmp_path / "o1") == 1.0
    assert await oracle_trial(daemon, bad, tmp_path / "o2") == 0.0
    async with smolsdk.AsyncClient(daemon.socket) as c:
        assert await c.list() == []


async def test_network_is_off(daemon: DaemonProcess, tmp_path: Path) -> None:
    solve = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)\" "
             "&& echo $EXPECTED > answer.txt\n")
    task = write_task(tmp_path, "net", solve)
    assert await oracle_trial(daemon, task, tmp_path / "o") == 0.0
    assert "Network is unreachable" in (tmp_path / "o" / "logs" / "agent" / "oracle.txt").read_text()


async def test_exec_files_and_capabilities(daemon: DaemonProcess, tmp_path: Path) -> None:
    task = write_task(tmp_path, "files", "true\n", dockerfile="FROM debian\nWORKDIR /app\nENV A=1\n")
    env = make_env(daemon, task)
    caps = env.capabilities
    assert (caps.disable_internet, caps.network_allowlist, caps.gpus, caps.mounted) == (True, True, False, False)
    assert env.type().value == "smold"   # not "smol": Harbor's built-in environment of smolmachines
    await env.start(force_build=True)
    try:
        r = await env.exec('echo "$A$B $(pwd)"; echo e >&2; exit 3', env={"B": "2"})
        assert (r.stdout, r.stderr, r.return_code) == ("12 /app\n", "e\n", 3)
        with pytest.raises(RuntimeError, match="Command timed out after 1 seconds"):   # as Harbor's Docker env
            await env.exec("sleep 5", timeout_sec=1)
        src = tmp_path / "x.bin"
        src.write_bytes(b"\x00\x01")
        await env.upload_file(src, "/app/sub/x.bin")
        assert await env.is_file("/app/sub/x.bin") and not await env.is_file("/app/nope")
        assert await env.is_dir("/app/sub")
        await env.download_file("/app/sub/x.bin", tmp_path / "back" / "x.bin")
        assert (tmp_path / "back" / "x.bin").read_bytes() == b"\x00\x01"
    finally:
        await env.stop(delete=True)


def test_internet_is_public_unless_refused_and_unsupported_dockerfiles_are_refused(daemon: DaemonProcess,
                                                                                  tmp_path: Path) -> None:
    task = write_task(tmp_path, "inet", "true\n")
    assert 'network = "public"' in make_env(daemon, task, allow_internet=True).smolfile_toml()
    assert "network" not in make_env(daemon, task).smolfile_toml()
    with pytest.raises(ValueError, match="network_mode='public' is refused by this run"):
        SmolEnvironment(task / "environment", task.name, f"{task.name}__1", None, env_config(allow_internet=True),
                        socket=str(daemon.socket), public_network="refuse")
    with pytest.raises(ValueError, match="public_network must be one of on, refuse, off"):
        SmolEnvironment(task / "environment", task.name, f"{task.name}__1", None, env_config(),
                        socket=str(daemon.socket), public_network="yes")
    bad = write_task(tmp_path, "add", "true\n", dockerfile="FROM debian\nADD http://x/y /y\n")
    with pytest.raises(ValueError, match="ADD is not supported"):
        make_env(daemon, bad)
