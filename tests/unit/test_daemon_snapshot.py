"""Daemon Snapshot, Fork and CreateMachine.from_checkpoint with the host-agent launcher (no VM).

The VMM side of a snapshot is the real control socket server (smold.vmm.control.ControlServer) in front of
test_snapshot_control's FakeMachine, made to write the two files a snapshot consists of; restores start a
fresh host agent, so these tests cover the daemon's bookkeeping (names, phases, limits, checkpoint store,
fork base lifetime), not guest state (tests/integration/test_daemon_fork_vm.py does that).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from daemon_support import (
    HostAgentLauncher,
    fake_images,
    processes_mentioning,
    run_smolctl,
    start_daemon_task,
)
from test_snapshot_control import FakeMachine
from test_snapshot_format import sample_snapshot
from tmpfs_support import tiny_tmpfs

from smold.api import convert
from smold.api.machine import CheckpointInfo
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import Daemon, DaemonConfig
from smold.daemon.controller import CHECKPOINT_NAME_RE
from smold.daemon.images import Image
from smold.daemon.launcher import LaunchSpec, VmmLauncher
from smold.daemon.record import MachineRecord
from smold.memory import GuestMemory
from smold.snapshot.store import write_snapshot
from smold.vmm.control import ControlServer
from smold.vmm.machine import SnapshotResult

pytestmark = pytest.mark.timeout(120)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


class WritingMachine(FakeMachine):
    """FakeMachine whose snapshot writes a state file and a sparse memory file, as the VMM does."""

    async def snapshot(self, directory: Path, *, resume: bool = True, digest: bool = False) -> SnapshotResult:
        result = await super().snapshot(directory, resume=resume, digest=digest)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "snapshot.state").write_bytes(b"S" * 8192)
        with open(directory / "memory.raw", "wb") as f:
            f.truncate(512 << 20)
            f.write(b"M" * 4096)
        return result


@dataclass
class Env:
    daemon: Daemon
    stub: pb_grpc.SmolStub
    dir: Path
    servers: list[ControlServer]

    @property
    def state(self) -> Path:
        return self.daemon.config.state_dir

    async def serve_control(self, machine_id: str) -> WritingMachine:
        """A control socket in the machine's state directory, where the daemon looks for the VMM's."""
        fake = WritingMachine()
        server = ControlServer(fake, self.state / "machines" / machine_id / "control.sock")  # type: ignore[arg-type]
        await server.start()
        self.servers.append(server)
        return fake


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sds-", dir="/tmp"))  # short: AF_UNIX paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def env(workdir: Path) -> AsyncIterator[Env]:
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=6,
                          max_memory_mib=8192, destroy_grace_s=5.0)
    daemon, task = await start_daemon_task(config, fake_images(workdir))
    e = Env(daemon, None, workdir, [])  # type: ignore[arg-type]
    async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
        e.stub = pb_grpc.SmolStub(channel)
        yield e
    for s in e.servers:
        await s.close()
    daemon.stop()
    await asyncio.wait_for(task, 30)
    assert processes_mentioning(str(workdir / "state")) == [], "the daemon left VM processes behind"


def spec() -> pb.Smolfile:
    return pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=256, cpus=1))


async def create(e: Env, name: str = "") -> pb.Machine:
    return (await e.stub.CreateMachine(pb.CreateMachineRequest(name=name, smolfile=spec()))).machine


async def expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    for f in fragments:
        assert f in (info.value.details() or ""), info.value.details()


# --- names, phases, bounds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,ok", [
    ("a", True), ("base-1.2_x", True), ("0", True), ("x" * 63, True), ("x" * 64, False), ("", False),
    ("Upper", False), ("-lead", False), (".hidden", False), ("a/b", False), ("a b", False), ("..", False),
])
def test_checkpoint_names(name: str, ok: bool) -> None:
    assert bool(CHECKPOINT_NAME_RE.fullmatch(name)) is ok


async def test_snapshot_refuses_bad_names_unknown_and_not_running_machines(env: Env) -> None:
    s = env.stub
    m = await create(env, "one")
    for bad in ("", "Bad", "../x", ".tmp-x", "x" * 64):
        await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id=m.id, name=bad)), INVALID, "checkpoint name")
    await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id="nope", name="c")), grpc.StatusCode.NOT_FOUND)
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id=m.id, name="c")),
                       grpc.StatusCode.FAILED_PRECONDITION, "destroyed")
    await expect_error(s.Fork(pb.ForkRequest(machine_id=m.id, count=1)), grpc.StatusCode.FAILED_PRECONDITION)
    assert list((env.state / "checkpoints").iterdir()) == []


async def test_snapshot_without_a_control_socket_fails_and_leaves_nothing(env: Env) -> None:
    m = await create(env)
    await expect_error(env.stub.Snapshot(pb.SnapshotRequest(machine_id=m.id, name="c")), grpc.StatusCode.INTERNAL,
                       "no control socket")
    assert list((env.state / "checkpoints").iterdir()) == []
    await expect_error(env.stub.Fork(pb.ForkRequest(machine_id=m.id, count=2)), grpc.StatusCode.INTERNAL,
                       "no control socket")
    assert list((env.state / "forks").iterdir()) == []
    assert len((await env.stub.ListMachines(pb.ListMachinesRequest())).machines) == 1


@pytest.mark.parametrize("count", [0, 17, 1000])
async def test_fork_count_bounds(env: Env, count: int) -> None:
    m = await create(env)
    await expect_error(env.stub.Fork(pb.ForkRequest(machine_id=m.id, count=count)), INVALID, "count: must be 1 to 16")


async def test_fork_over_the_machine_limit_is_refused_before_snapshotting(env: Env) -> None:
    m = await create(env)
    fake = await env.serve_control(m.id)
    await expect_error(env.stub.Fork(pb.ForkRequest(machine_id=m.id, count=6)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "machine limit")
    assert fake.calls == []


# --- snapshot and create from a checkpoint ------------------------------------------------------------------
async def test_snapshot_writes_a_named_checkpoint_and_create_restores_it(env: Env) -> None:
    s = env.stub
    m = await create(env, "src")
    fake = await env.serve_control(m.id)
    before = datetime.now(UTC)
    c = (await s.Snapshot(pb.SnapshotRequest(machine_id="src", name="base-1"))).checkpoint
    path = env.state / "checkpoints" / "base-1"
    assert (c.name, c.path, c.machine_id) == ("base-1", str(path), m.id)
    assert fake.calls == [("snapshot", (path.parent / fake.calls[0][1][0].name, True, False))]
    assert fake.calls[0][1][0].name.startswith(".tmp-")  # written aside, then renamed into place
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.json", "memory.raw", "snapshot.state"]
    assert 8192 + 4096 <= c.size_bytes < 1 << 20  # disk use: the memory file is sparse
    assert c.created_at.ToDatetime(tzinfo=UTC) >= before.replace(microsecond=0)
    meta = json.loads((path / "checkpoint.json").read_text())
    assert meta["machine_id"] == m.id and meta["smolfile"]["memory"] == 256

    await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id="src", name="base-1")),
                       grpc.StatusCode.ALREADY_EXISTS, "'base-1' already exists")
    assert len(fake.calls) == 1

    await expect_error(s.CreateMachine(pb.CreateMachineRequest(from_checkpoint="nope")), grpc.StatusCode.NOT_FOUND,
                       "no checkpoint 'nope'")
    await expect_error(s.CreateMachine(pb.CreateMachineRequest(from_checkpoint="Bad/")), INVALID)
    await expect_error(s.CreateMachine(pb.CreateMachineRequest(from_checkpoint="base-1", smolfile=spec())), INVALID,
                       "must be unset with from_checkpoint")
    r = (await s.CreateMachine(pb.CreateMachineRequest(name="copy", from_checkpoint="base-1"))).machine
    assert r.state == pb.MACHINE_STATE_RUNNING and r.memory_mib == 256 and r.image_digest == m.image_digest
    rec = MachineRecord.load(env.state / "records" / r.id, env.daemon.controller.record_key)
    assert rec.checkpoint == str(path)
    # A named checkpoint outlives the machines restored from it.
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id="copy"))
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id="src"))
    assert path.is_dir()


class DiskFillingMachine(FakeMachine):
    """FakeMachine that writes its snapshot with the VMM's own writer (smold.snapshot.store.write_snapshot):
    4 MiB of incompressible guest memory and a full state file, so a small disk really fills up."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp

    async def snapshot(self, directory: Path, *, resume: bool = True, digest: bool = False) -> SnapshotResult:
        await self.pause()
        try:
            with GuestMemory([(0, 4 << 20)]) as mem:
                mem.write(0, os.urandom(4 << 20))
                size, written = write_snapshot(directory, mem, sample_snapshot(self.tmp), digest=digest)
        finally:
            if resume:
                self.resume()
        return SnapshotResult(directory, size, 4 << 20, written.bytes_written, {"total": 0.0})


async def test_snapshot_on_a_full_disk_fails_cleanly_and_the_machine_runs_on(env: Env) -> None:
    """The checkpoint store is a 1 MiB file system: the Snapshot RPC answers RESOURCE_EXHAUSTED naming
    the full disk, leaves nothing in the store, and the machine is resumed and still runs commands."""
    s = env.stub
    m = await create(env, "src")
    fake = DiskFillingMachine(env.dir)
    server = ControlServer(fake, env.state / "machines" / m.id / "control.sock")  # type: ignore[arg-type]
    await server.start()
    env.servers.append(server)
    store = env.state / "checkpoints"
    with tiny_tmpfs("1m", at=store):
        await expect_error(s.Snapshot(pb.SnapshotRequest(machine_id="src", name="full")),
                           grpc.StatusCode.RESOURCE_EXHAUSTED, "host disk is full", "No space left on device")
        assert list(store.iterdir()) == []
        assert not fake.paused and [c for c, _ in fake.calls] == ["pause", "resume"]
        got = (await s.GetMachine(pb.GetMachineRequest(machine_id="src"))).machine
        assert got.state == pb.MACHINE_STATE_RUNNING
        out = b""
        async for msg in s.Exec(pb.ExecRequest(machine_id="src", argv=["echo", "still here"])):
            out += msg.stdout
        assert out == b"still here\n"
    # With room again the same name works.
    c = (await s.Snapshot(pb.SnapshotRequest(machine_id="src", name="full"))).checkpoint
    assert sorted(p.name for p in Path(c.path).iterdir()) == ["checkpoint.json", "memory.raw", "snapshot.state"]


# --- fork -------------------------------------------------------------------------------------------------------
async def test_fork_children_are_machines_and_the_base_goes_with_the_last(env: Env) -> None:
    s = env.stub
    parent = await create(env, "p")
    fake = await env.serve_control(parent.id)
    kids = list((await s.Fork(pb.ForkRequest(machine_id="p", count=3))).machines)
    assert len({k.id for k in kids}) == 3 and all(k.state == pb.MACHINE_STATE_RUNNING for k in kids)
    assert all(k.name == "" and k.memory_mib == parent.memory_mib for k in kids)
    bases = list((env.state / "forks").iterdir())
    assert len(bases) == 1 and bases[0].name.startswith(parent.id)
    assert fake.calls[0][1][0] == bases[0] and fake.calls[0][1][1] is True  # the parent resumes
    assert list((env.state / "checkpoints").iterdir()) == []
    for k in kids:
        assert MachineRecord.load(env.state / "records" / k.id, env.daemon.controller.record_key).checkpoint == str(bases[0])
        out = b""
        async for msg in s.Exec(pb.ExecRequest(machine_id=k.id, argv=["echo", k.id])):
            out += msg.stdout
        assert out == f"{k.id}\n".encode()
    names = {m.id for m in (await s.ListMachines(pb.ListMachinesRequest())).machines}
    assert names == {parent.id, *(k.id for k in kids)}

    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id="p"))
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id=kids[0].id))
    assert bases[0].is_dir()
    v = await s.Verify(pb.VerifyRequest(machine_id=kids[1].id, checks=[pb.Check(file_exists=pb.FileExistsCheck(
        path=str(bases[0] / "memory.raw")))]))
    assert v.result.passed
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id=kids[1].id))
    await s.DestroyMachine(pb.DestroyMachineRequest(machine_id=kids[2].id))
    assert not bases[0].exists()


async def test_unused_fork_bases_are_removed_at_start(workdir: Path) -> None:
    forks = workdir / "state" / "forks"
    (forks / "m-000000000000-dead").mkdir(parents=True)
    (workdir / "state" / "checkpoints" / ".tmp-half").mkdir(parents=True)
    (workdir / "state" / "checkpoints" / "kept").mkdir()
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state")
    daemon = Daemon(config, launcher=HostAgentLauncher(), images=fake_images(workdir))
    await daemon.controller.start()
    assert list(forks.iterdir()) == []
    assert [p.name for p in (workdir / "state" / "checkpoints").iterdir()] == ["kept"]


# --- launcher, conversion, smolctl -------------------------------------------------------------------------------
def test_vmm_launcher_restores_instead_of_booting(tmp_path: Path) -> None:
    image = Image("default", tmp_path / "k", tmp_path / "i", tmp_path / "r", "sha256:x")
    boot = LaunchSpec("m-1", tmp_path / "m", image, 1, 512, "h", 60.0)
    argv = VmmLauncher("py").command(boot)
    assert "--kernel" in argv and "--restore" not in argv
    restore = LaunchSpec("m-1", tmp_path / "m", image, 1, 512, "child", 60.0, restore_from=tmp_path / "cp")
    argv = VmmLauncher("py").command(restore)
    assert argv[:6] == ["py", "-P", "-m", "smold.vmm", "--restore", str(tmp_path / "cp")]
    assert argv[argv.index("--hostname") + 1] == "child" and argv[-1] == "--new-identity"
    assert not {"--kernel", "--initramfs", "--cpus", "--memory"} & set(argv)


def test_checkpoint_conversion_round_trip() -> None:
    c = CheckpointInfo("base", "/s/checkpoints/base", 12345, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "m-1")
    assert convert.checkpoint_from_proto(convert.checkpoint_to_proto(c)) == c
    with pytest.raises(convert.ConversionError):
        convert.checkpoint_to_proto(CheckpointInfo("b", "/p", 1, datetime(2026, 1, 1)))
    with pytest.raises(convert.ConversionError):
        convert.checkpoint_from_proto(pb.Checkpoint(name="b"))


@pytest.mark.parametrize("args,message", [
    (["fork", "m", "-n", "0"], "-n: must be 1 to 16 (got 0)"),
    (["fork", "m", "-n", "17"], "-n: must be 1 to 16 (got 17)"),
    (["create"], "a SMOLFILE (or --from-checkpoint NAME) is required"),
    (["create", "dir", "--from-checkpoint", "c"], "give a SMOLFILE or --from-checkpoint, not both"),
])
def test_smolctl_argument_errors(workdir: Path, args: list[str], message: str) -> None:
    r = run_smolctl(workdir / "absent.sock", *args)
    assert r.returncode == 2 and r.stderr.decode() == f"smolctl: error: {message}\n" and r.stdout == b""


def test_smolctl_snapshot_fork_and_create_from_checkpoint_reach_the_daemon(workdir: Path) -> None:
    sock = workdir / "absent.sock"
    for args in (["snapshot", "m", "c"], ["fork", "m", "-n", "2"], ["create", "--from-checkpoint", "c"]):
        r = run_smolctl(sock, *args)
        assert r.returncode == 2 and b"cannot reach smold" in r.stderr, (args, r.stderr)
    r = run_smolctl(sock, "snapshot", "m")
    assert r.returncode == 2 and b"required: name" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"), reason="networked machines need root and nft")
async def test_fork_children_get_the_network_policy_in_force_not_the_created_one(workdir: Path) -> None:
    from smold.net import nft
    from smold.net.manager import host_if_name, namespace_name, network_leftovers
    from smold.net.rules import HOST_TABLE, SET_PUBLIC_UPLINKS
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=4,
                          max_memory_mib=4096, destroy_grace_s=5.0, net_pool="10.214.18.0/24")
    daemon, task = await start_daemon_task(config, fake_images(workdir))
    e = Env(daemon, None, workdir, [])  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
            e.stub = s = pb_grpc.SmolStub(channel)
            closed = pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=256, cpus=1, network=pb.NetworkPolicy(closed=True)))
            parent = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=closed))).machine
            await e.serve_control(parent.id)
            await s.SetNetworkPolicy(pb.SetNetworkPolicyRequest(machine_id=parent.id,
                                                                policy=pb.NetworkPolicy(public=True)))
            (kid,) = (await s.Fork(pb.ForkRequest(machine_id=parent.id, count=1))).machines
            # public, as its parent is now (it was created closed)
            assert host_if_name(kid.id) in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
            for mid in (kid.id, parent.id):
                await s.DestroyMachine(pb.DestroyMachineRequest(machine_id=mid))
                assert network_leftovers(namespace_name(mid), host_if_name(mid)) == []
    finally:
        for srv in e.servers:
            await srv.close()
        daemon.stop()
        await asyncio.wait_for(task, 30)
