"""A VM process killed (SIGKILL, the OOM killer through the jail) or never ready (boot timeout), through the
daemon's gRPC API with host-agent launchers: the machine ends FAILED with a reason that says why, and no
process, bound socket or file of it outlives its destruction."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_support import (
    AGENT_SOCKET,
    HostAgentLauncher,
    NeverReadyLauncher,
    fake_images,
    files_under,
    pid_alive,
    processes_mentioning,
    start_daemon_task,
    unix_sockets_under,
)

from smold.agent import AgentClient, AgentConnectError
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import DaemonConfig
from smold.daemon.launcher import Launcher, LaunchSpec

pytestmark = pytest.mark.timeout(120)

OOM_MARK = "oom-next"   # the stand-in jailer reports an OOM kill when this file exists

# Like smold.jail.jailer.run_jailed: the "VMM" (here the host agent) is a forked child in the jailer's process
# group, with a helper of its own (a vCPU-like thread would die with it; a helper process must be reaped by the
# group kill). When the child dies of SIGKILL and the cgroup counted an OOM kill, the jailer writes exit.json
# with the same function the real one uses and exits 128 + 9.
JAILER = r"""
import os, signal, subprocess, sys
from pathlib import Path
from smold.jail.jailer import _write_oom_exit
state = Path(sys.argv[1])
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", str(state / "helper")])
vmm = subprocess.Popen([sys.executable, "-m", "smol_agent", "--listen", "unix:" + str(state / "agent.sock")])
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: (vmm.send_signal(n), helper.kill()))
code = vmm.wait()
if code == -signal.SIGKILL and (state / "oom-next").exists():
    _write_oom_exit(state, 96 << 20)
sys.exit(128 - code if code < 0 else code)
"""


class JailStandInLauncher(HostAgentLauncher):
    kind = "jail-stand-in"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-c", JAILER, str(spec.state_dir)]


class StubbornNeverReadyLauncher(NeverReadyLauncher):
    """Never ready, and deaf to SIGTERM (a VMM stuck in an ioctl): only SIGKILL ends it."""

    kind = "stubborn"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(3600)", str(spec.state_dir)]


async def start(workdir: Path, launcher: Launcher, **kw: float) -> tuple[pb_grpc.SmolStub, Callable, Path]:
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=4,
                          max_memory_mib=4096, **kw)  # type: ignore[arg-type]
    daemon, task = await start_daemon_task(config, fake_images(workdir), launcher)
    channel = grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}")

    async def stop() -> None:
        await channel.close()
        daemon.stop()
        await asyncio.wait_for(task, 30)

    return pb_grpc.SmolStub(channel), stop, config.machines_dir


@pytest.fixture
def workdir() -> AsyncIterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smk-", dir="/tmp"))  # short: AF_UNIX paths
    yield d  # type: ignore[misc]
    for pid in processes_mentioning(str(d)):   # never leave processes behind, whatever failed
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def traces(d: Path) -> dict[str, list]:
    return {"processes": processes_mentioning(str(d)), "sockets": unix_sockets_under(d), "files": files_under(d)}


async def settled(d: Path, timeout: float = 10.0) -> None:
    """Wait until no process mentions ``d`` (the group was sent SIGKILL; a process under load takes a moment to
    end), at most ``timeout`` seconds; the caller's assertion then says what is left."""
    deadline = time.monotonic() + timeout
    while processes_mentioning(str(d)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def wait_state(stub: pb_grpc.SmolStub, mid: str, state: int, timeout: float = 15.0) -> pb.Machine:
    deadline = time.monotonic() + timeout
    while True:
        m = (await stub.GetMachine(pb.GetMachineRequest(machine_id=mid))).machine
        if m.state == state:
            return m
        assert time.monotonic() < deadline, f"machine {mid} is {m.state}, not {state}"
        await asyncio.sleep(0.02)


def agent_pid(d: Path) -> int:
    (pid,) = processes_mentioning(str(d / AGENT_SOCKET))
    return pid


def spec() -> pb.Smolfile:
    return pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=256, cpus=1))


async def test_vmm_oom_killed_in_its_jail_fails_the_machine_and_leaves_nothing(workdir: Path) -> None:
    stub, stop, machines = await start(workdir, JailStandInLauncher(), destroy_grace_s=2.0)
    try:
        victim = (await stub.CreateMachine(pb.CreateMachineRequest(name="victim", smolfile=spec()))).machine
        other = (await stub.CreateMachine(pb.CreateMachineRequest(name="other", smolfile=spec()))).machine
        d = machines / victim.id
        assert len(processes_mentioning(str(d))) == 3   # jailer, VMM, helper
        (d / OOM_MARK).touch()
        os.kill(agent_pid(d), signal.SIGKILL)   # what the OOM killer does to the VMM in its cgroup
        failed = await wait_state(stub, victim.id, pb.MACHINE_STATE_FAILED)
        reason = failed.failure_reason
        assert f"VM process {victim.vmm_pid} exited with status 137" in reason, reason
        assert "out of memory" in reason and "OOM killer" in reason and "96 MiB" in reason, reason
        # Nothing of it runs or listens; its directory keeps only what explains the failure. The daemon has sent
        # SIGKILL to the group by now; the kernel ends a starved process a moment later (seen under load).
        await settled(d)
        assert traces(d)["processes"] == [] and traces(d)["sockets"] == []
        assert AGENT_SOCKET not in traces(d)["files"] and "exit.json" in traces(d)["files"]
        # The neighbour is untouched.
        async for msg in stub.Exec(pb.ExecRequest(machine_id="other", argv=["echo", "ok"])):
            if msg.HasField("exit"):
                assert msg.exit.exit_code == 0
        assert (await stub.GetMachine(pb.GetMachineRequest(machine_id=other.id))).machine.state == \
            pb.MACHINE_STATE_RUNNING
        await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=victim.id))
        assert not d.exists() and traces(d) == {"processes": [], "sockets": [], "files": []}
    finally:
        await stop()
    assert processes_mentioning(str(workdir / "state")) == []


async def test_vmm_sigkilled_takes_its_process_group_with_it(workdir: Path) -> None:
    """SIGKILL of the VM process itself (the jailer, or an unjailed VMM): its helper is reaped too."""
    stub, stop, machines = await start(workdir, JailStandInLauncher(), destroy_grace_s=2.0)
    try:
        m = (await stub.CreateMachine(pb.CreateMachineRequest(smolfile=spec()))).machine
        d = machines / m.id
        helper = processes_mentioning(str(d / "helper"))
        assert len(helper) == 1
        os.kill(m.vmm_pid, signal.SIGKILL)
        failed = await wait_state(stub, m.id, pb.MACHINE_STATE_FAILED)
        assert f"VM process {m.vmm_pid} killed by SIGKILL" in failed.failure_reason
        assert failed.vmm_pid == 0
        deadline = time.monotonic() + 5
        while traces(d)["processes"] or traces(d)["sockets"]:
            assert time.monotonic() < deadline, traces(d)
            await asyncio.sleep(0.02)
        assert not pid_alive(helper[0]) and not pid_alive(m.vmm_pid)
        await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
        assert traces(d) == {"processes": [], "sockets": [], "files": []}
    finally:
        await stop()


@pytest.mark.parametrize("launcher", [NeverReadyLauncher(), StubbornNeverReadyLauncher()],
                         ids=["never-ready", "ignores-sigterm"])
async def test_boot_timeout_through_the_api_fails_the_machine_and_leaves_nothing(workdir: Path,
                                                                                 launcher: Launcher) -> None:
    stub, stop, machines = await start(workdir, launcher, boot_grace_s=0.2, destroy_grace_s=0.5)
    try:
        toml = pb.Smolfile(toml=pb.SmolfileToml(text="memory = 256\n[timeouts]\nboot = 0.3\n"))
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateMachine(pb.CreateMachineRequest(name="slow", smolfile=toml))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "boot timed out" in (info.value.details() or "")
        assert time.monotonic() - t0 < 10
        (m,) = (await stub.ListMachines(pb.ListMachinesRequest())).machines
        assert m.state == pb.MACHINE_STATE_FAILED and "boot timed out" in m.failure_reason
        d = machines / m.id
        await settled(d)
        assert traces(d)["processes"] == [] and traces(d)["sockets"] == []
        await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
        assert traces(d) == {"processes": [], "sockets": [], "files": []}
        assert (await stub.ListMachines(pb.ListMachinesRequest())).machines == []
    finally:
        await stop()


async def test_a_busy_agent_is_waited_for_up_to_the_connect_timeout(workdir: Path) -> None:
    """A guest agent that answers late (a guest busy starting commands, an emulated kernel) delays a request
    up to --agent-connect-timeout; past it the request fails UNAVAILABLE and says so."""
    async def exec_echo(stub: pb_grpc.SmolStub) -> bytes:
        out = b""
        async for msg in stub.Exec(pb.ExecRequest(machine_id="busy", argv=["echo", "late"])):
            out += msg.stdout
        return out

    for timeout, resume_after in ((1.0, None), (30.0, 3.0)):
        stub, stop, machines = await start(workdir, HostAgentLauncher(), agent_connect_timeout_s=timeout)
        try:
            m = (await stub.CreateMachine(pb.CreateMachineRequest(name="busy", smolfile=spec()))).machine
            pid = agent_pid(machines / m.id)
            os.kill(pid, signal.SIGSTOP)   # accepts connections (the kernel's backlog), answers nothing
            if resume_after is not None:
                asyncio.get_running_loop().call_later(resume_after, os.kill, pid, signal.SIGCONT)
            t0 = time.monotonic()
            try:
                if resume_after is None:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await exec_echo(stub)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "cannot reach the guest agent: agent did not answer HELLO" in (e.value.details() or "")
                    assert timeout <= time.monotonic() - t0 < timeout + 5
                else:
                    assert await exec_echo(stub) == b"late\n"
                    assert time.monotonic() - t0 >= resume_after
            finally:
                os.kill(pid, signal.SIGCONT)
            await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
        finally:
            await stop()


class RefusingLauncher(HostAgentLauncher):
    """Connects are refused like the VMM's vsock socket refuses them when the guest kernel answered a
    REQUEST too late or reset it (its agent's accept queue full): ``refusals`` times, once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0
        self.attempts = 0

    async def connect(self, state_dir: Path, ready: dict[str, Any], timeout: float = 10.0) -> AgentClient:
        self.attempts += 1
        if self.attempts <= self.refusals:
            raise AgentConnectError(f"vsock handshake with {state_dir}/vsock.sock port 1024 refused: b''")
        return await super().connect(state_dir, ready, timeout)


async def test_a_refused_agent_connect_is_retried_up_to_the_connect_timeout(workdir: Path) -> None:
    """Refusals are transient on a busy guest: the request connects once the guest answers, within
    --agent-connect-timeout; a guest that keeps refusing fails UNAVAILABLE at that deadline, with the refusal."""
    for timeout, refusals in ((30.0, 6), (1.5, 10**9)):
        launcher = RefusingLauncher()
        stub, stop, _machines = await start(workdir, launcher, agent_connect_timeout_s=timeout)
        try:
            m = (await stub.CreateMachine(pb.CreateMachineRequest(name="refusing", smolfile=spec()))).machine
            launcher.refusals, launcher.attempts = refusals, 0
            t0 = time.monotonic()
            if refusals < 100:
                out = b""
                async for msg in stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["echo", "through"])):
                    out += msg.stdout
                assert out == b"through\n" and launcher.attempts == refusals + 1
            else:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["true"])):
                        pass
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "cannot reach the guest agent: vsock handshake" in (e.value.details() or "")
                assert "refused" in (e.value.details() or "")
                assert timeout - 1.1 <= time.monotonic() - t0 < timeout + 5 and launcher.attempts > 3
            await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
        finally:
            await stop()
