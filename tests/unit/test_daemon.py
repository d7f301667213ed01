"""smold over gRPC, in-process, with the real guest agent on the host as each machine's "VM process".

A real grpc.aio server on a temp Unix socket, the real controller and servicer, a real agent per machine:
create/exec/copy/verify/destroy/Run, limits, failures and bad input, asserted through the API and on the
host (/proc, sockets, files).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from daemon_support import (
    CrashingLauncher,
    HostAgentLauncher,
    NeverReadyLauncher,
    SilentConsoleLauncher,
    fake_images,
    files_under,
    pid_alive,
    processes_mentioning,
    start_daemon_task,
    unix_sockets_under,
)

from smold.api.machine import MachineState
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.authrecord import KEY_FILE, RecordKey
from smold.daemon import Controller, Daemon, DaemonConfig
from smold.daemon.controller import Machine
from smold.daemon.errors import CreateFailedError, Status
from smold.daemon.launcher import Launcher, LaunchSpec
from smold.smolfile import digest, parse_smolfile

pytestmark = pytest.mark.timeout(120)

COPY_CAP = 256 * 1024


@dataclass
class Env:
    daemon: Daemon
    stub: pb_grpc.SmolStub
    dir: Path      # short temp dir: socket, state, and the "guest" paths of this test
    guest: Path    # where the test's guest paths live (the host agent runs on the host)

    @property
    def machines_dir(self) -> Path:
        return self.daemon.config.machines_dir


@pytest.fixture
def workdir() -> AsyncIterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smd-", dir="/tmp"))  # short: AF_UNIX paths are limited to 108 bytes
    yield d  # type: ignore[misc]
    shutil.rmtree(d, ignore_errors=True)


async def start_daemon(d: Path, launcher: Launcher | None = None, **overrides: object) -> tuple[Daemon, asyncio.Task]:
    config = replace(DaemonConfig(socket_path=d / "smold.sock", state_dir=d / "state", max_machines=8,
                                  max_memory_mib=8192, copy_cap_bytes=COPY_CAP, destroy_grace_s=5.0),
                     **overrides)
    return await start_daemon_task(config, fake_images(d), launcher)


@pytest.fixture
async def env(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    overrides = getattr(request, "param", {})
    daemon, task = await start_daemon(workdir, **overrides)
    guest = workdir / "g"
    guest.mkdir()
    async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
        yield Env(daemon, pb_grpc.SmolStub(channel), workdir, guest)
    daemon.stop()
    await asyncio.wait_for(task, 30)
    assert processes_mentioning(str(workdir / "state")) == [], "the daemon left VM processes behind"


def toml(text: str, base: Path | None = None, filename: str = "Smolfile.toml") -> pb.Smolfile:
    return pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(base) if base else "", filename=filename))


def spec(**kw: object) -> pb.Smolfile:
    kw.setdefault("memory_mib", 256)
    kw.setdefault("cpus", 1)
    return pb.Smolfile(spec=pb.SmolfileSpec(**kw))  # type: ignore[arg-type]


async def create(env: Env, smolfile: pb.Smolfile | None = None, name: str = "") -> pb.Machine:
    resp = await env.stub.CreateMachine(pb.CreateMachineRequest(name=name, smolfile=smolfile or spec()))
    return resp.machine


async def run_exec(e: Env, mid: str, argv: list[str], **kw: object) -> tuple[bytes, bytes, pb.ExecExit, list[str]]:
    out, err, kinds = b"", b"", []
    exit_msg = None
    async for msg in e.stub.Exec(pb.ExecRequest(machine_id=mid, argv=argv, **kw)):  # type: ignore[arg-type]
        which = msg.WhichOneof("event")
        kinds.append(which)
        if which == "stdout":
            out += msg.stdout
        elif which == "stderr":
            err += msg.stderr
        else:
            exit_msg = msg.exit
    assert exit_msg is not None and kinds[-1] == "exit" and kinds.count("exit") == 1
    return out, err, exit_msg, kinds


async def expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await call  # type: ignore[misc]
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
    err = info.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for f in fragments:
        assert f in (err.details() or ""), err.details()
    return err.details() or ""


async def expect_exec_error(env: Env, req: pb.ExecRequest, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in env.stub.Exec(req):
            pass
    assert info.value.code() == code, info.value.details()
    for f in fragments:
        assert f in (info.value.details() or ""), info.value.details()


def machine_traces(env: Env, mid: str, pid: int) -> dict[str, list]:
    """Everything of one machine visible on the host: processes, bound sockets, files."""
    d = env.machines_dir / mid
    procs = sorted(set(processes_mentioning(str(d))) | ({pid} if pid_alive(pid) else set()))
    return {"processes": procs, "sockets": unix_sockets_under(d), "files": files_under(d)}


async def wait_for(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- the life cycle -----------------------------------------------------------------------------------------
async def test_create_exec_copy_verify_destroy_leaves_nothing(env: Env) -> None:
    g = env.guest
    checks = [pb.Check(file_matches=pb.FileMatchesCheck(path=f"{g}/answer", content="42\n")),
              pb.Check(command=pb.CommandCheck(shell=f"test -s {g}/answer"))]
    m = await create(env, spec(checks=checks, env={"GREETING": "hi"}), name="web")
    assert m.state == pb.MACHINE_STATE_RUNNING and m.name == "web" and m.id.startswith("m-")
    assert m.memory_mib == 256 and m.cpus == 1 and m.image == "default"
    assert m.image_digest.startswith("sha256:") and m.smolfile_digest.startswith("sha256:")
    assert m.vmm_pid > 0 and pid_alive(m.vmm_pid)

    # Exec: stdout and stderr chunks, Smolfile env merged with the request's, then one exit.
    out, err, ex, _ = await run_exec(env, "web", ["sh", "-c", 'echo "$GREETING $X"; echo oops >&2; exit 3'],
                                     env={"X": "there"})
    assert (out, err, ex.exit_code, ex.HasField("signal"), ex.timed_out) == (b"hi there\n", b"oops\n", 3, False, False)

    # Verify fails before the file exists, passes after a CopyIn, with the machine's digests.
    res = (await env.stub.Verify(pb.VerifyRequest(machine_id=m.id))).result
    assert not res.passed and [c.passed for c in res.checks] == [False, False]
    size = (await env.stub.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/answer", content=b"42\n",
                                                   mode=0o600))).size_bytes
    assert size == 3 and os.stat(g / "answer").st_mode & 0o777 == 0o600
    res = (await env.stub.Verify(pb.VerifyRequest(machine_id=m.id))).result
    assert res.passed and res.smolfile_digest == m.smolfile_digest and res.image_digest == m.image_digest
    out_resp = await env.stub.CopyOut(pb.CopyOutRequest(machine_id=m.id, path=f"{g}/answer"))
    assert (out_resp.content, out_resp.size_bytes) == (b"42\n", 3)

    # A command still running at destroy time dies with the machine; its stream ends with an error.
    call = env.stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["sh", "-c", "echo $$; exec sleep 300"]))
    sleeper = int((await call.read()).stdout)
    assert pid_alive(sleeper)

    before = machine_traces(env, m.id, m.vmm_pid)
    assert m.vmm_pid in before["processes"]
    assert any(s.endswith("agent.sock") for s in before["sockets"])
    assert {"ready.json", "vmm.log", "agent.sock"} <= set(before["files"])
    records = env.machines_dir.parent / "records" / m.id      # the daemon's own, out of the VMM's reach
    assert (records / "machine.json").is_file() and "machine.json" not in before["files"]

    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    assert machine_traces(env, m.id, m.vmm_pid) == {"processes": [], "sockets": [], "files": []}
    assert not records.exists()
    assert not (env.machines_dir / m.id).exists() and not pid_alive(sleeper)
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    # After destroy: Get says NOT_FOUND, Exec FAILED_PRECONDITION, Destroy is idempotent.
    await expect_error(env.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id)), grpc.StatusCode.NOT_FOUND,
                       "was destroyed")
    await expect_exec_error(env, pb.ExecRequest(machine_id=m.id, argv=["true"]),
                            grpc.StatusCode.FAILED_PRECONDITION, f"machine {m.id} was destroyed")
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))


async def test_exec_stdin_binary_output_and_large_streams(env: Env) -> None:
    m = await create(env)
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value, not UTF-8
    out, err, ex, kinds = await run_exec(env, m.id, ["cat"], stdin=data)
    assert out == data and err == b"" and ex.exit_code == 0
    assert kinds.count("stdout") >= 4  # streamed in chunks, not one message
    out, _, _, _ = await run_exec(env, m.id, ["printf", "\\377\\376\\000tail"])
    assert out == b"\xff\xfe\x00tail"
    out, _, ex, _ = await run_exec(env, m.id, ["sh", "-c", "read x; echo got:$x"], stdin=b"")
    assert out == b"got:\n" and ex.exit_code == 0  # empty stdin: EOF at once


async def test_exec_timeout_kills_the_command(env: Env) -> None:
    m = await create(env)
    t0 = time.monotonic()
    _, _, ex, _ = await run_exec(env, m.id, ["sleep", "30"], timeout_seconds=0.3)
    assert ex.timed_out and not ex.HasField("exit_code") and ex.signal == signal.SIGKILL
    assert time.monotonic() - t0 < 10


async def test_client_disconnect_mid_exec_kills_the_command_and_daemon_keeps_serving(env: Env) -> None:
    m = await create(env)
    pidfile = env.guest / "pid"
    call = env.stub.Exec(pb.ExecRequest(machine_id=m.id, argv=[
        "sh", "-c", f"echo $$ > {pidfile}; echo started; exec sleep 300"]))
    first = await call.read()
    assert first.stdout == b"started\n"
    pid = int(pidfile.read_text())
    assert pid_alive(pid)
    call.cancel()
    await wait_for(lambda: not pid_alive(pid))
    out, _, ex, _ = await run_exec(env, m.id, ["echo", "still here"])
    assert out == b"still here\n" and ex.exit_code == 0


async def test_four_machines_at_once(env: Env) -> None:
    ms = await asyncio.gather(*(create(env, name=f"vm{i}") for i in range(4)))
    assert len({m.id for m in ms}) == 4 and len({m.vmm_pid for m in ms}) == 4
    results = await asyncio.gather(*(run_exec(env, m.id, ["sh", "-c", f"sleep 0.2; echo {m.name}; echo $PPID"])
                                     for m in ms))
    for m, (out, _, ex, _) in zip(ms, results, strict=True):
        name, ppid = out.decode().split()
        assert ex.exit_code == 0 and name == m.name and int(ppid) == m.vmm_pid  # ran by its own agent
    listed = (await env.stub.ListMachines(pb.ListMachinesRequest())).machines
    assert sorted(x.name for x in listed) == ["vm0", "vm1", "vm2", "vm3"]
    assert all(x.state == pb.MACHINE_STATE_RUNNING for x in listed)
    await asyncio.gather(*(env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id)) for m in ms))
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []
    assert list(env.machines_dir.iterdir()) == []
    assert not any(pid_alive(m.vmm_pid) for m in ms)


async def test_kill_9_of_one_vm_process_marks_it_failed_and_others_keep_working(env: Env) -> None:
    a, b, c = await asyncio.gather(*(create(env, name=n) for n in ("a", "b", "c")))
    os.kill(b.vmm_pid, signal.SIGKILL)

    async def state_of(ref: str) -> pb.Machine:
        return (await env.stub.GetMachine(pb.GetMachineRequest(machine_id=ref))).machine

    deadline = time.monotonic() + 10
    while (await state_of("b")).state != pb.MACHINE_STATE_FAILED:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    failed = await state_of("b")
    assert f"VM process {b.vmm_pid} killed by SIGKILL" in failed.failure_reason
    assert failed.vmm_pid == 0 and failed.console_tail is not None
    assert not (env.machines_dir / b.id / "agent.sock").exists()
    listed = {m.name: m.state for m in (await env.stub.ListMachines(pb.ListMachinesRequest())).machines}
    assert listed == {"a": pb.MACHINE_STATE_RUNNING, "b": pb.MACHINE_STATE_FAILED, "c": pb.MACHINE_STATE_RUNNING}
    for m in (a, c):
        out, _, ex, _ = await run_exec(env, m.id, ["echo", m.name])
        assert out == f"{m.name}\n".encode() and ex.exit_code == 0
    await expect_exec_error(env, pb.ExecRequest(machine_id="b", argv=["true"]), grpc.StatusCode.FAILED_PRECONDITION,
                            "is failed", "SIGKILL")
    d = await create(env, name="d")  # the daemon still creates machines; b's memory was released
    assert d.state == pb.MACHINE_STATE_RUNNING
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id="b"))
    assert not (env.machines_dir / b.id).exists()


async def test_exec_during_vm_death_reports_the_failure(env: Env) -> None:
    m = await create(env)
    call = env.stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["sh", "-c", "echo go; exec sleep 300"]))
    assert (await call.read()).stdout == b"go\n"
    os.kill(m.vmm_pid, signal.SIGKILL)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"machine {m.id} failed" in (info.value.details() or "")


# --- Run --------------------------------------------------------------------------------------------------
def task_dir(env: Env, task_cmd: str, *, setup: str = "true") -> Path:
    """A Smolfile directory whose guest paths live under env.guest."""
    g = env.guest
    d = env.dir / "task"
    (d / "files").mkdir(parents=True, exist_ok=True)
    # the suite writes the reward, as a Harbor task's tests do (one the task wrote is removed before the checks)
    (d / "files" / "check.sh").write_text(f"#!/bin/sh\nif grep -qx 42 {g}/work/answer; then echo 1 > {g}/logs/reward.txt; "
                                          f"else echo 0 > {g}/logs/reward.txt; exit 1; fi\n")
    (d / "files" / "check.sh").chmod(0o755)
    (d / "Smolfile.toml").write_text(f"""
cpus = 1
memory = 256
setup = [{setup!r}, "mkdir -p {g}/work {g}/logs"]
task = {{ run = {task_cmd!r}, cwd = "{g}/work" }}
[mounts]
"files" = "{g}/files"
[[verifier.checks]]
name = "suite"
kind = "command"
run = ["{g}/files/check.sh"]
[[verifier.checks]]
kind = "file_matches"
path = "{g}/work/answer"
regex = '^42$'
[[verifier.checks]]
kind = "reward"
path = "{g}/logs/reward.txt"
""")
    return d


def smolfile_of(d: Path) -> pb.Smolfile:
    return toml((d / "Smolfile.toml").read_text(), d, str(d / "Smolfile.toml"))


async def test_run_pass_returns_result_and_steps_and_destroys(env: Env) -> None:
    d = task_dir(env, f"echo 42 > answer && echo 1 > {env.guest}/logs/reward.txt && echo done")
    resp = await env.stub.Run(pb.RunRequest(smolfile=smolfile_of(d), name="r1"))
    assert resp.result.passed and not resp.error
    assert [s.name for s in resp.steps] == ["boot", "mount[0]", "setup[0]", "setup[1]", "task"]
    assert all(s.ok for s in resp.steps)
    task = resp.steps[-1]
    assert task.evidence.exit_code == 0 and task.evidence.output_tail == "done\n"
    assert [(c.kind, c.passed) for c in resp.result.checks] == [("command", True), ("file_matches", True),
                                                               ("reward", True)]
    sf = parse_smolfile((d / "Smolfile.toml").read_text(), base_dir=str(d))
    assert resp.result.smolfile_digest == digest(sf) and resp.result.image_digest.startswith("sha256:")
    assert resp.machine_id and resp.duration_ms > 0
    assert resp.outcome == resp.result.outcome == pb.OUTCOME_PASS
    assert not (env.machines_dir / resp.machine_id).exists()
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []


async def test_run_fail_gives_the_failing_checks_evidence(env: Env) -> None:
    d = task_dir(env, f"echo 41 > answer; echo 0 > {env.guest}/logs/reward.txt; echo wrong answer >&2; exit 1")
    resp = await env.stub.Run(pb.RunRequest(smolfile=smolfile_of(d)))
    assert not resp.result.passed and not resp.error
    assert resp.outcome == resp.result.outcome == pb.OUTCOME_FAIL and "3 of 3 checks failed" in resp.outcome_detail
    task = resp.steps[-1]
    assert task.name == "task" and not task.ok and task.evidence.exit_code == 1
    assert "wrong answer" in task.evidence.output_tail
    suite, match, reward = resp.result.checks
    assert not suite.passed and suite.evidence.exit_code == 1 and "expected exit 0, got exit 1" in suite.evidence.detail
    assert not match.passed and "no match" in match.evidence.detail and "41" in match.evidence.output_tail
    assert not reward.passed and "reward 0 < threshold 1" in reward.evidence.detail
    assert not (env.machines_dir / resp.machine_id).exists()


async def test_run_stops_at_a_failed_setup_step_and_still_destroys(env: Env) -> None:
    d = task_dir(env, "echo never", setup="echo setting up; exit 7")
    resp = await env.stub.Run(pb.RunRequest(smolfile=smolfile_of(d)))
    assert not resp.result.passed and list(resp.result.checks) == []
    assert "setup[0] failed" in resp.error and "exit 7" in resp.error
    # no verdict on the agent's work: smol could not run the attempt (docs/verifier.md, "Outcomes")
    assert resp.outcome == pb.OUTCOME_INFRA_ERROR and resp.outcome_detail == resp.error
    assert [s.name for s in resp.steps] == ["boot", "mount[0]", "setup[0]"]
    assert resp.steps[-1].evidence.exit_code == 7 and "setting up" in resp.steps[-1].evidence.output_tail
    assert not (env.machines_dir / resp.machine_id).exists()
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []


async def test_create_with_failing_setup_keeps_a_failed_machine(env: Env) -> None:
    d = task_dir(env, "true", setup="echo bad >&2; exit 4")
    details = await expect_error(env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=smolfile_of(d))),
                                 grpc.StatusCode.ABORTED, "setup[0] failed", "exit 4")
    (m,) = (await env.stub.ListMachines(pb.ListMachinesRequest())).machines
    assert m.state == pb.MACHINE_STATE_FAILED and "setup[0] failed" in m.failure_reason and m.id in details
    assert m.vmm_pid == 0
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    assert list(env.machines_dir.iterdir()) == []


async def test_calls_while_creating_are_refused_and_destroy_cancels_the_create(env: Env) -> None:
    marker = env.guest / "setup-started"
    create_call = env.stub.CreateMachine(pb.CreateMachineRequest(name="slow", smolfile=spec(
        setup=[pb.Command(shell=f"touch {marker}; sleep 30")])))
    await wait_for(marker.exists)
    (m,) = (await env.stub.ListMachines(pb.ListMachinesRequest())).machines
    assert m.state == pb.MACHINE_STATE_CREATING
    await expect_exec_error(env, pb.ExecRequest(machine_id="slow", argv=["true"]),
                            grpc.StatusCode.FAILED_PRECONDITION, "is creating")
    await expect_error(env.stub.Verify(pb.VerifyRequest(machine_id="slow")), grpc.StatusCode.FAILED_PRECONDITION)
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id="slow"))
    await expect_error(create_call, grpc.StatusCode.ABORTED, "destroyed while being created")
    assert list(env.machines_dir.iterdir()) == [] and not pid_alive(m.vmm_pid)


async def test_create_cancelled_by_the_client_destroys_the_machine(env: Env) -> None:
    marker = env.guest / "setup-started"
    call = env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=spec(
        setup=[pb.Command(shell=f"touch {marker}; sleep 30")])))
    await wait_for(marker.exists)
    call.cancel()
    await wait_for(lambda: list(env.machines_dir.iterdir()) == [])
    # The directory goes before the table entry (the machine is STOPPING meanwhile): wait for both.
    deadline = time.monotonic() + 10
    while (listed := (await env.stub.ListMachines(pb.ListMachinesRequest())).machines):
        assert all(m.state == pb.MACHINE_STATE_STOPPING for m in listed) and time.monotonic() < deadline, listed
        await asyncio.sleep(0.02)


# --- copies -----------------------------------------------------------------------------------------------
async def test_copy_tar_round_trip_and_mounts(env: Env) -> None:
    src = env.dir / "proj"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "sub" / "run.sh").chmod(0o755)
    (src / "Smolfile.toml").write_text(f'memory = 256\ncpus = 1\n[mounts]\n"sub" = "{env.guest}/mnt"\n')
    m = await create(env, smolfile_of(src))
    out, _, ex, _ = await run_exec(env, m.id, [f"{env.guest}/mnt/run.sh"])  # mount kept the exec bit
    assert out == b"ran\n" and ex.exit_code == 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=".")
    await env.stub.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{env.guest}/unpacked", content=buf.getvalue(),
                                           format=pb.COPY_FORMAT_TAR))
    assert (env.guest / "unpacked" / "sub" / "run.sh").read_text() == "#!/bin/sh\necho ran\n"
    back = await env.stub.CopyOut(pb.CopyOutRequest(machine_id=m.id, path=f"{env.guest}/unpacked",
                                                    format=pb.COPY_FORMAT_TAR))
    with tarfile.open(fileobj=io.BytesIO(back.content)) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    assert {"a.txt", "sub/run.sh", "Smolfile.toml"} <= names
    await expect_error(env.stub.CopyOut(pb.CopyOutRequest(machine_id=m.id, path=f"{env.guest}/unpacked/a.txt",
                                                          format=pb.COPY_FORMAT_TAR)),
                       grpc.StatusCode.INVALID_ARGUMENT, "is a file")


# --- bad input ----------------------------------------------------------------------------------------------
async def test_bad_input_gets_the_right_status_and_the_daemon_keeps_serving(env: Env) -> None:
    s = env.stub
    cm = s.CreateMachine
    CreateReq = pb.CreateMachineRequest
    INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    await expect_error(cm(CreateReq(smolfile=toml("cpus = = 2", filename="bad.toml"))), INVALID,
                       "bad.toml: invalid TOML")
    await expect_error(cm(CreateReq(smolfile=toml("[timeouts]\nboto = 3"))), INVALID,
                       "Smolfile.toml: [timeouts].boto: unknown key (did you mean 'boot'?)")
    await expect_error(cm(CreateReq(smolfile=toml('image = "nope"'))), NOT_FOUND, "unknown image 'nope'",
                       "default")
    await expect_error(cm(CreateReq(smolfile=spec(memory_mib=0))), INVALID,
                       "<inline spec>: memory: must be at least 128 MiB")
    await expect_error(cm(CreateReq(smolfile=spec(memory_mib=1 << 30))), INVALID, "memory", "at most 8192")
    await expect_error(cm(CreateReq()), INVALID, "no Smolfile given")
    await expect_error(cm(CreateReq(smolfile=toml('[mounts]\n"missing" = "/x"', env.dir))), INVALID,
                       '[mounts].missing: host path', "does not exist")
    await expect_error(cm(CreateReq(smolfile=spec(), name="bad name!")), INVALID, "not a valid machine name")
    m = await create(env, name="one")
    await expect_error(cm(CreateReq(smolfile=spec(), name="one")), grpc.StatusCode.ALREADY_EXISTS, "'one'")

    await expect_exec_error(env, pb.ExecRequest(machine_id="ghost", argv=["true"]), NOT_FOUND, "no machine 'ghost'")
    await expect_exec_error(env, pb.ExecRequest(machine_id=m.id), INVALID, "argv")
    await expect_exec_error(env, pb.ExecRequest(machine_id=m.id, argv=["no-such-program-xyz"]), NOT_FOUND,
                            "executable not found")
    await expect_exec_error(env, pb.ExecRequest(machine_id=m.id, argv=["true"], cwd="rel"), INVALID, "cwd")
    await expect_exec_error(env, pb.ExecRequest(machine_id=m.id, argv=["true"], timeout_seconds=-1), INVALID,
                            "timeout_seconds")

    g = env.guest
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path="rel/path", content=b"x")), INVALID,
                       "absolute")
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/a\0b", content=b"x")), INVALID, "NUL")
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/../x", content=b"x")), INVALID,
                       "normalized")
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/big", content=b"x" * (COPY_CAP + 1))),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, f"copy cap of {COPY_CAP} bytes")
    assert not (g / "big").exists()
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/t", content=b"not a tar" * 100,
                                                 format=pb.COPY_FORMAT_TAR)), INVALID, "not a readable tar")
    await expect_error(s.CopyIn(pb.CopyInRequest(machine_id=m.id, path=f"{g}/no/dir/f", content=b"x")), NOT_FOUND)
    await expect_error(s.CopyOut(pb.CopyOutRequest(machine_id=m.id, path=f"{g}/missing")), NOT_FOUND, "ENOENT")
    (g / "eight").write_bytes(b"12345678")
    await expect_error(s.CopyOut(pb.CopyOutRequest(machine_id=m.id, path=f"{g}/eight", max_size_bytes=4)),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than 4 bytes")
    await expect_error(s.Verify(pb.VerifyRequest(machine_id=m.id, checks=[pb.Check(file_exists=pb.FileExistsCheck(
        path="relative"))])), INVALID, "<request checks>: [verifier.checks[0]].path")
    await expect_error(s.GetMachine(pb.GetMachineRequest()), INVALID, "machine_id")
    await expect_error(s.Fork(pb.ForkRequest(machine_id=m.id)), INVALID, "count")
    await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id=m.id)), INVALID, "checkpoint name")

    # Still serving, and the machine still works.
    out, _, ex, _ = await run_exec(env, "one", ["echo", "ok"])
    assert out == b"ok\n" and ex.exit_code == 0
    assert [x.name for x in (await s.ListMachines(pb.ListMachinesRequest())).machines] == ["one"]


@pytest.mark.parametrize("env", [{"max_machines": 2, "max_memory_mib": 1024}], indirect=True)
async def test_machine_and_memory_limits_give_resource_exhausted(env: Env) -> None:
    a = await create(env, spec(memory_mib=512))
    await expect_error(env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=spec(memory_mib=768))),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "memory limit reached: 768 MiB requested, 512 of 1024")
    await create(env, spec(memory_mib=256))
    await expect_error(env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=spec(memory_mib=128))),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "machine limit reached: 2 of 2")
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=a.id))
    await create(env, spec(memory_mib=768))  # capacity came back
    assert len((await env.stub.ListMachines(pb.ListMachinesRequest())).machines) == 2


# --- boot failures (controller with failing launchers) ------------------------------------------------------
async def test_a_failed_vm_process_leaves_its_log_in_the_daemons_log(workdir: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # A restored guest's console is empty: what the VMM logged is the only evidence of why it ended.
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.5)
    ctl = Controller(config, SilentConsoleLauncher(), fake_images(workdir))
    await ctl.start()
    with caplog.at_level(logging.WARNING, logger="smold.controller"), pytest.raises(CreateFailedError):
        await ctl.create(parse_smolfile("memory = 256", base_dir=None))
    assert "vmm.log tail:\nvcpu1 ended 0.2 s after the vCPUs started: reset triple fault" in caplog.text
    await ctl.shutdown(leave=False)


async def test_vm_process_that_dies_during_boot_fails_the_create(workdir: Path) -> None:
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.5)
    ctl = Controller(config, CrashingLauncher(), fake_images(workdir))
    await ctl.start()
    sf = parse_smolfile("memory = 256", base_dir=None)
    with pytest.raises(CreateFailedError) as info:
        await ctl.create(sf)
    assert info.value.status is Status.INTERNAL and "exited with status 3" in str(info.value)
    (m,) = ctl.list_machines()
    assert m.failure_reason.endswith("exited with status 3") and "vmm: boom" in ctl.get(m.id).console_tail
    await ctl.shutdown(leave=False)
    assert list(config.machines_dir.iterdir()) == []


class HostileExitLauncher(CrashingLauncher):
    """A "VM process" that leaves exit.json as a link to a host file, or as 1 MB of detail, and exits 3."""

    kind = "hostile-exit"

    def __init__(self, how: str, secret: Path) -> None:
        self.how, self.secret = how, secret

    def command(self, spec: LaunchSpec) -> list[str]:
        exit_json = spec.state_dir / "exit.json"
        if self.how == "link":
            code = f"import os; os.symlink({str(self.secret)!r}, {str(exit_json)!r}); raise SystemExit(3)"
        else:
            code = (f"import json; open({str(exit_json)!r}, 'w').write(json.dumps("
                    "{'kind': 'error', 'detail': 'x' * 1000000})); raise SystemExit(3)")
        return [sys.executable, "-c", code]


@pytest.mark.parametrize("how", ["link", "huge"])
async def test_exit_json_is_the_vm_process_s_words_never_a_link_and_bounded(workdir: Path, how: str) -> None:
    """#19 finding 6: exit.json is written by the VMM. Before, the daemon followed a link there (a host file's
    JSON in the failure reason) and copied any length into it."""
    secret = workdir / "host-secret.json"
    secret.write_text(json.dumps({"kind": "error", "detail": "HOST-SECRET"}))
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.5)
    ctl = Controller(config, HostileExitLauncher(how, secret), fake_images(workdir))
    await ctl.start()
    with pytest.raises(CreateFailedError):
        await ctl.create(parse_smolfile("memory = 256", base_dir=None))
    (m,) = ctl.list_machines()
    assert "exited with status 3" in m.failure_reason and "HOST-SECRET" not in m.failure_reason
    assert len(m.failure_reason) < 2000
    await ctl.shutdown(leave=False)


async def test_run_whose_vm_cannot_boot_is_an_error_and_leaves_nothing(workdir: Path) -> None:
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.5)
    ctl = Controller(config, CrashingLauncher(), fake_images(workdir))
    await ctl.start()
    with pytest.raises(CreateFailedError, match="boot failed: VM process .* exited with status 3"):
        await ctl.run(parse_smolfile('memory = 256\ntask = "true"', base_dir=None))
    assert ctl.list_machines() == [] and list(config.machines_dir.iterdir()) == []
    await ctl.shutdown(leave=False)


async def test_boot_timeout_kills_the_vm_process(workdir: Path) -> None:
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.2,
                          destroy_grace_s=0.5)
    ctl = Controller(config, NeverReadyLauncher(), fake_images(workdir))
    await ctl.start()
    sf = parse_smolfile("memory = 256\n[timeouts]\nboot = 0.3", base_dir=None)
    t0 = time.monotonic()
    with pytest.raises(CreateFailedError) as info:
        await ctl.create(sf)
    assert info.value.status is Status.DEADLINE_EXCEEDED and "boot timed out" in str(info.value)
    assert time.monotonic() - t0 < 5
    (m,) = ctl.list_machines()
    assert processes_mentioning(str(config.machines_dir / m.id)) == []
    await ctl.destroy(m.id)
    assert ctl.list_machines() == []
    await ctl.shutdown(leave=False)


async def test_failed_machines_beyond_keep_failed_are_removed(workdir: Path) -> None:
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", keep_failed=1)
    ctl = Controller(config, CrashingLauncher(), fake_images(workdir))
    await ctl.start()
    sf = parse_smolfile("memory = 256", base_dir=None)
    for _ in range(3):
        with pytest.raises(CreateFailedError):
            await ctl.create(sf)
    await wait_for(lambda: len(ctl.list_machines()) == 1)
    await wait_for(lambda: len(list(config.machines_dir.iterdir())) == 1)
    await ctl.shutdown(leave=False)


async def test_restart_never_kills_a_process_that_is_not_the_recorded_vm(workdir: Path) -> None:
    """A record whose pid now belongs to another program (pid reuse) is cleaned up without killing it."""
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state")
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = config.machines_dir / "m-0123456789ab"
        d.mkdir(parents=True)
        sf = parse_smolfile("memory = 256", base_dir=None)
        rec = Machine(id=d.name, name="", smolfile=sf, image="default", image_digest="", smolfile_digest="",
                      state_dir=d, created_at=datetime.now(UTC), launcher="host-agent",
                      phase=MachineState.RUNNING).record()
        rec.pid, rec.argv, rec.started = stranger.pid, [sys.executable, "-m", "smol_agent"], None
        rec.save(d, RecordKey.load_or_create(config.state_dir / KEY_FILE))   # authentic: the daemon's own key
        (d / "ready.json").write_text(json.dumps({"agent_socket": str(d / "agent.sock")}))
        ctl = Controller(config, HostAgentLauncher(), fake_images(workdir))
        await ctl.start()
        assert ctl.list_machines() == [] and not d.exists()
        assert stranger.poll() is None  # not killed: it is not the VM process the record names
    finally:
        stranger.kill()
        stranger.wait()


async def test_one_machine_dir_that_breaks_adoption_never_stops_the_daemon(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    config = DaemonConfig(socket_path=workdir / "s", state_dir=workdir / "state", boot_grace_s=0.5)
    config.machines_dir.mkdir(parents=True)
    for name in ("m-000000000001", "m-000000000002"):
        (config.machines_dir / name).mkdir()
    ctl = Controller(config, CrashingLauncher(), fake_images(workdir))
    seen: list[str] = []
    original = Controller._adopt_or_clean

    async def adopt(self: Controller, d: Path) -> None:
        seen.append(d.name)
        if d.name.endswith("1"):
            raise PermissionError(13, "Permission denied", str(d))   # whatever one leftover does
        await original(self, d)

    monkeypatch.setattr(Controller, "_adopt_or_clean", adopt)
    with caplog.at_level(logging.ERROR, logger="smold.controller"):
        await ctl.start()
    assert seen == ["m-000000000001", "m-000000000002"]
    assert "m-000000000001: adopting or cleaning it up failed" in caplog.text
    assert not (config.machines_dir / "m-000000000002").exists()      # the next one was still cleaned up
    await ctl.shutdown(leave=False)
