"""Pre-baked images and checkpoint listing/deletion through the real daemon with the host-agent launcher.

The launcher's ``snapshot`` writes a real, checked snapshot directory (state file with its sha256 and the
memory file's recorded digest, as the VMM does with ``digest``); restoring it starts a fresh host agent, so
these tests cover the bake store, keys, lookup, refusal of corrupted bakes and the RPCs, not guest state
(tests/integration/test_daemon_bake_vm.py does that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_support import (
    HostAgentLauncher,
    fake_images,
    processes_mentioning,
    run_smolctl,
    start_daemon_task,
)
from test_daemon_snapshot import WritingMachine
from test_snapshot_format import _vcpu, sample_snapshot

from smold.api import convert
from smold.api.machine import BakeInfo
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import Daemon, DaemonConfig
from smold.daemon.bakes import BakeCorruptError, BakeStore, bake_key, mounts_digest
from smold.daemon.record import MachineRecord
from smold.smolfile import parse_smolfile
from smold.snapshot import store
from smold.snapshot.state import DiskRef, MemoryRegionState, MemoryState
from smold.vmm.control import ControlServer

pytestmark = pytest.mark.timeout(120)
MEM_MIB = 128


class BakingLauncher(HostAgentLauncher):
    """Host agents as VMs; ``snapshot`` writes a valid snapshot directory of a 1-vCPU, 128 MiB machine."""

    def __init__(self, rootfs: Path) -> None:
        self.rootfs = rootfs
        self.calls: list[tuple[Path, bool]] = []
        self.gate: asyncio.Event | None = None

    async def snapshot(self, state_dir: Path, directory: Path, timeout: float = 300.0, *,
                       digest: bool = False) -> dict[str, Any]:
        self.calls.append((directory, digest))
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.to_thread(write_snapshot, directory, self.rootfs, digest)
        return {}


def write_snapshot(directory: Path, rootfs: Path, digest: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    mem = directory / "memory.raw"
    with open(mem, "wb") as f:
        f.truncate(MEM_MIB << 20)
        f.write(b"M" * 4096)
        f.seek(64 << 20)
        f.write(os.urandom(8192))
    scratch = directory.parent / f".scratch-{directory.name}"
    scratch.mkdir(exist_ok=True)
    snap = sample_snapshot(scratch)
    st = rootfs.stat()
    snap = dataclasses.replace(
        snap, spec=dataclasses.replace(snap.spec, cpus=1, memory_mib=MEM_MIB, rootfs=DiskRef(
            path=str(rootfs.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns, read_only=True)),
        vcpus=(_vcpu(0),),
        memory=MemoryState(file="memory.raw", size=MEM_MIB << 20, regions=(MemoryRegionState(0, MEM_MIB << 20, 0),),
                           sha256=store.file_sha256(mem) if digest else None))
    shutil.rmtree(scratch, ignore_errors=True)
    store.write_state(directory, snap)


@dataclasses.dataclass
class Env:
    daemon: Daemon
    stub: pb_grpc.SmolStub
    dir: Path
    launcher: BakingLauncher

    @property
    def state(self) -> Path:
        return self.daemon.config.state_dir

    @property
    def sock(self) -> Path:
        return self.dir / "smold.sock"


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sdb-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def env(workdir: Path) -> AsyncIterator[Env]:
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=6,
                          max_memory_mib=8192, destroy_grace_s=5.0)
    images = fake_images(workdir)
    launcher = BakingLauncher(workdir / "rootfs.ext4")
    daemon, task = await start_daemon_task(config, images, launcher)
    async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
        yield Env(daemon, pb_grpc.SmolStub(channel), workdir, launcher)
    daemon.stop()
    await asyncio.wait_for(task, 30)
    assert processes_mentioning(str(workdir / "state")) == [], "the daemon left VM processes behind"


def smolfile_text(env: Env, *, env_value: str = "1", extra: str = "") -> str:
    return f"""
cpus = 1
memory = {MEM_MIB}
setup = ["echo ran >> {env.dir}/setup.log"]
[env]
E = "{env_value}"
{extra}
"""


def request(env: Env, text: str) -> pb.Smolfile:
    return pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(env.dir), filename="Smolfile.toml"))


def setup_runs(env: Env) -> int:
    try:
        return len((env.dir / "setup.log").read_text().splitlines())
    except FileNotFoundError:
        return 0


async def expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    for f in fragments:
        assert f in (info.value.details() or ""), info.value.details()


VERIFIER = '[[verifier.checks]]\nkind = "file_exists"\npath = "/"\n[timeouts]\nsetup = 100'


# --- keys ------------------------------------------------------------------------------------------------------
def test_bake_key_covers_the_boot_state_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "a.txt").write_text("one")

    def key(text: str, image: str = "sha256:img") -> str:
        sf = parse_smolfile(text.encode(), base_dir=str(tmp_path))
        return bake_key(sf, image, mounts_digest(sf))

    base = 'cpus = 1\nmemory = 256\nsetup = ["true"]\n[env]\nA = "1"\n[mounts]\n"task" = "/task"\n'
    k = key(base)
    assert k.startswith("sha256:") and len(k) == 71
    # Timeouts, task and verifier do not change the booted state.
    assert key(base + '[timeouts]\nboot = 5\n[task]\nrun = "x"\n[[verifier.checks]]\nkind = "file_exists"\n'
               'path = "/x"\n') == k
    assert key("memory = 256\n" + base.replace("memory = 256\n", "")) == k  # key order
    changed = [base.replace("cpus = 1", "cpus = 2"), base.replace("256", "512"), base.replace('"1"', '"2"'),
               base.replace('["true"]', '["false"]'), base.replace('"/task"', '"/other"')]
    assert len({key(t) for t in changed} | {k}) == len(changed) + 1
    assert key(base, image="sha256:other") != k
    (tmp_path / "task" / "a.txt").write_text("two")  # mount contents count
    k2 = key(base)
    assert k2 != k
    os.chmod(tmp_path / "task" / "a.txt", 0o600)
    assert key(base) != k2
    (tmp_path / "task" / "b").symlink_to("a.txt")
    assert key(base) not in (k, k2)


# --- bake, create, run -------------------------------------------------------------------------------------------
async def test_bake_then_create_and_run_restore_it(env: Env) -> None:
    s = env.stub
    text = smolfile_text(env)
    bake = (await s.BakeImage(pb.BakeImageRequest(smolfile=request(env, text)))).bake
    path = env.state / "bakes" / bake.key.removeprefix("sha256:")
    assert bake.path == str(path) and bake.cpus == 1 and bake.memory_mib == MEM_MIB and not bake.error
    assert {"snapshot.state", "memory.raw", "bake.json"} <= {p.name for p in path.iterdir()}
    assert env.launcher.calls == [(env.launcher.calls[0][0], True)]  # with the memory digest
    assert env.launcher.calls[0][0].name.startswith(".tmp-")           # written aside, renamed into place
    assert setup_runs(env) == 1
    assert (await s.ListMachines(pb.ListMachinesRequest())).machines == []  # the baking machine is gone
    assert 8192 <= bake.size_bytes < 1 << 20 and bake.bake_seconds > 0
    assert json.loads((path / "bake.json").read_text())["key"] == bake.key

    # Same boot state with a verifier and other timeouts: restored, setup not run again.
    m = (await s.CreateMachine(pb.CreateMachineRequest(name="a", smolfile=request(env, text + VERIFIER)))).machine
    assert m.state == pb.MACHINE_STATE_RUNNING and m.restored_from == f"bake:{bake.key}"
    assert MachineRecord.load(env.state / "machines" / m.id).checkpoint == str(path)
    assert setup_runs(env) == 1
    assert (await s.Verify(pb.VerifyRequest(machine_id="a"))).result.passed
    listed = (await s.ListBakes(pb.ListBakesRequest())).bakes
    assert [b.key for b in listed] == [bake.key] and list(listed[0].machine_ids) == [m.id]

    run = await s.Run(pb.RunRequest(smolfile=request(env, text + VERIFIER)))
    assert run.result.passed and run.steps[0].name == "boot" and "restored bake" in run.steps[0].evidence.detail
    assert setup_runs(env) == 1

    # Another env: another key, booted as before (setup runs).
    other = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, smolfile_text(env, env_value="2")))))
    assert other.machine.restored_from == "" and setup_runs(env) == 2

    await expect_error(s.BakeImage(pb.BakeImageRequest(smolfile=request(env, text))), grpc.StatusCode.ALREADY_EXISTS,
                       "already exists")
    again = (await s.BakeImage(pb.BakeImageRequest(smolfile=request(env, text), replace=True))).bake
    assert again.key == bake.key and setup_runs(env) == 3
    assert again.created_at.ToDatetime() >= bake.created_at.ToDatetime()
    await expect_error(s.BakeImage(pb.BakeImageRequest()), grpc.StatusCode.INVALID_ARGUMENT, "smolfile")

    # Deleting a bake leaves the machines restored from it running.
    await s.DeleteBake(pb.DeleteBakeRequest(key=bake.key.removeprefix("sha256:")[:8]))
    assert not path.exists() and (await s.ListBakes(pb.ListBakesRequest())).bakes == []
    out = b""
    async for msg in s.Exec(pb.ExecRequest(machine_id="a", argv=["echo", "still"])):
        out += msg.stdout
    assert out == b"still\n"
    await expect_error(s.DeleteBake(pb.DeleteBakeRequest(key=bake.key)), grpc.StatusCode.NOT_FOUND, "no bake")
    await expect_error(s.DeleteBake(pb.DeleteBakeRequest(key="zz")), grpc.StatusCode.INVALID_ARGUMENT, "not a bake key")
    m2 = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, text)))).machine
    assert m2.restored_from == "" and setup_runs(env) == 4


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,message", [
    (lambda d: _flip(d / "memory.raw", 100), "does not match the recorded"),
    (lambda d: _flip(d / "memory.raw", (64 << 20) + 5), "does not match the recorded"),
    (lambda d: _flip(d / "snapshot.state", 200), "sha256"),
    (lambda d: os.truncate(d / "memory.raw", 4096), "has 4096 bytes"),
    (lambda d: (d / "snapshot.state").unlink(), "not a snapshot directory"),
    (lambda d: (d / "bake.json").write_text('{"version": 1}'), "bake.json"),
    (lambda d: (d / "bake.json").write_text(
        (d / "bake.json").read_text().replace('"key": "sha256:', '"key": "sha256:0')), "names key"),
])
async def test_a_damaged_bake_is_refused_and_the_machine_boots_instead(env: Env, damage: Any, message: str) -> None:
    s = env.stub
    text = smolfile_text(env)
    bake = (await s.BakeImage(pb.BakeImageRequest(smolfile=request(env, text)))).bake
    path = Path(bake.path)
    damage(path)
    run = await s.Run(pb.RunRequest(smolfile=request(env, text + VERIFIER)))
    detail = run.steps[0].evidence.detail
    assert run.result.passed and "refused" in detail and message in detail and "booted instead" in detail, detail
    assert setup_runs(env) == 2
    m = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, text)))).machine
    assert m.restored_from == "" and setup_runs(env) == 3
    listed = (await s.ListBakes(pb.ListBakesRequest())).bakes
    assert len(listed) == 1 and listed[0].error, listed  # reported, kept for the operator to look at
    await s.DeleteBake(pb.DeleteBakeRequest(key=bake.key))


def test_memory_is_hashed_once_per_file_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.write_bytes(b"r")
    bakes = BakeStore(tmp_path / "bakes")
    key = "sha256:" + "ab" * 32
    d = bakes.path(key)
    write_snapshot(d, rootfs, digest=True)
    (d / "bake.json").write_text(json.dumps({
        "key": key, "image": "default", "image_digest": "sha256:i", "mounts_digest": "sha256:m",
        "smolfile_digest": "sha256:s", "boot_state": {}, "cpus": 1, "memory_mib": MEM_MIB,
        "created_at": datetime.now(UTC).isoformat(), "bake_seconds": 1.0, "version": 1}))
    calls = []
    real = store.verify_memory
    monkeypatch.setattr("smold.daemon.bakes.verify_memory", lambda *a: (calls.append(1), real(*a)))
    bakes.verify(key)
    bakes.verify(key)
    bakes.verify(key, hash_memory=False)
    assert len(calls) == 1
    assert bakes.resolve("abababab") == key and bakes.keys() == [key]
    _flip(d / "memory.raw", 10)  # a write changes mtime/ctime: checked again
    with pytest.raises(BakeCorruptError, match="does not match"):
        bakes.verify(key)
    assert len(calls) == 2
    for hash_memory in (True, False):  # the verdict is remembered while the files stay the same
        with pytest.raises(BakeCorruptError, match="does not match"):
            bakes.verify(key, hash_memory=hash_memory)
    assert len(calls) == 2
    bakes.remove(key)
    assert bakes.keys() == [] and not d.exists()


def test_a_bake_without_a_memory_digest_or_of_another_disk_is_refused(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.write_bytes(b"r")
    bakes = BakeStore(tmp_path / "bakes")
    key = "sha256:" + "cd" * 32
    d = bakes.path(key)
    write_snapshot(d, rootfs, digest=False)
    meta = {"key": key, "image": "default", "image_digest": "sha256:i", "mounts_digest": "sha256:m",
            "smolfile_digest": "sha256:s", "boot_state": {}, "cpus": 1, "memory_mib": MEM_MIB,
            "created_at": datetime.now(UTC).isoformat(), "bake_seconds": 1.0, "version": 1}
    (d / "bake.json").write_text(json.dumps(meta))
    with pytest.raises(BakeCorruptError, match="no memory digest"):
        bakes.verify(key)
    write_snapshot(d, rootfs, digest=True)
    (d / "bake.json").write_text(json.dumps({**meta, "memory_mib": 256}))
    with pytest.raises(BakeCorruptError, match="bake.json says"):
        bakes.verify(key)


async def test_a_bake_being_written_cannot_be_deleted_or_baked_twice(env: Env) -> None:
    s = env.stub
    env.launcher.gate = asyncio.Event()
    first = asyncio.ensure_future(s.BakeImage(pb.BakeImageRequest(smolfile=request(env, smolfile_text(env)))))
    while not env.launcher.calls:
        await asyncio.sleep(0.01)
    await expect_error(s.BakeImage(pb.BakeImageRequest(smolfile=request(env, smolfile_text(env)), replace=True)),
                       grpc.StatusCode.ALREADY_EXISTS, "being baked")
    env.launcher.gate.set()
    key = (await first).bake.key
    env.launcher.gate = asyncio.Event()
    second = asyncio.ensure_future(s.BakeImage(pb.BakeImageRequest(smolfile=request(env, smolfile_text(env)),
                                                                   replace=True)))
    while len(env.launcher.calls) < 2:
        await asyncio.sleep(0.01)
    await expect_error(s.DeleteBake(pb.DeleteBakeRequest(key=key)), grpc.StatusCode.FAILED_PRECONDITION,
                       "being baked")
    env.launcher.gate.set()
    await second
    await s.DeleteBake(pb.DeleteBakeRequest(key=key))


async def test_half_written_bakes_are_removed_at_start(workdir: Path) -> None:
    bakes = workdir / "state" / "bakes"
    (bakes / ".tmp-half").mkdir(parents=True)
    (bakes / "ab").mkdir()
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state")
    daemon = Daemon(config, launcher=HostAgentLauncher(), images=fake_images(workdir))
    await daemon.controller.start()
    assert [p.name for p in bakes.iterdir()] == ["ab"]


# --- checkpoints: list and delete -----------------------------------------------------------------------------------
async def test_checkpoints_are_listed_and_deleted(env: Env) -> None:
    s = env.stub
    assert (await s.ListCheckpoints(pb.ListCheckpointsRequest())).checkpoints == []
    src = (await s.CreateMachine(pb.CreateMachineRequest(name="src", smolfile=request(env, smolfile_text(env))))).machine
    server = ControlServer(WritingMachine(), env.state / "machines" / src.id / "control.sock")  # type: ignore[arg-type]
    await server.start()
    try:
        for name in ("b", "a"):
            await s.Snapshot(pb.SnapshotRequest(machine_id="src", name=name))
    finally:
        await server.close()
    c = (await s.CreateMachine(pb.CreateMachineRequest(name="copy", from_checkpoint="a"))).machine
    assert c.restored_from == "checkpoint:a"
    cps = (await s.ListCheckpoints(pb.ListCheckpointsRequest())).checkpoints
    assert [(x.name, x.machine_id, list(x.machine_ids)) for x in cps] == [("a", src.id, [c.id]), ("b", src.id, [])]

    await expect_error(s.DeleteCheckpoint(pb.DeleteCheckpointRequest(name="nope")), grpc.StatusCode.NOT_FOUND,
                       "no checkpoint 'nope'")
    await expect_error(s.DeleteCheckpoint(pb.DeleteCheckpointRequest(name="../x")), grpc.StatusCode.INVALID_ARGUMENT)
    ctl = env.daemon.controller
    path = env.state / "checkpoints" / "a"
    ctl._restoring[path] += 1  # a create is mapping it right now
    await expect_error(s.DeleteCheckpoint(pb.DeleteCheckpointRequest(name="a")), grpc.StatusCode.FAILED_PRECONDITION,
                       "in use")
    ctl._unpin(path)
    await s.DeleteCheckpoint(pb.DeleteCheckpointRequest(name="a"))
    assert not path.exists() and [x.name for x in (await s.ListCheckpoints(pb.ListCheckpointsRequest())).checkpoints] \
        == ["b"]
    out = b""
    async for msg in s.Exec(pb.ExecRequest(machine_id="copy", argv=["echo", "ok"])):
        out += msg.stdout
    assert out == b"ok\n"
    await expect_error(s.CreateMachine(pb.CreateMachineRequest(from_checkpoint="a")), grpc.StatusCode.NOT_FOUND)

    # smolctl checkpoint ls / rm
    r = await asyncio.to_thread(run_smolctl, env.sock, "checkpoint", "ls")
    assert r.returncode == 0 and r.stdout.decode().splitlines()[1].split()[:2] == ["b", src.id], r.stdout
    r = await asyncio.to_thread(run_smolctl, env.sock, "checkpoint", "rm", "b", "nope")
    assert r.returncode == 2 and r.stdout == b"b\n" and b"no checkpoint 'nope'" in r.stderr
    r = await asyncio.to_thread(run_smolctl, env.sock, "checkpoint", "ls", "-q")
    assert r.returncode == 0 and r.stdout == b""


async def test_smolctl_image_bake_ls_rm(env: Env) -> None:
    (env.dir / "Smolfile.toml").write_text(smolfile_text(env))
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "bake", str(env.dir))
    assert r.returncode == 0, r.stderr
    key = r.stdout.decode().strip()
    assert key.startswith("sha256:")
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "bake", str(env.dir))
    assert r.returncode == 2 and b"already exists" in r.stderr
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "bakes")
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and lines[0].startswith("KEY") and lines[1].split()[:4] == [
        key[7:19], "default", "1", f"{MEM_MIB}M"], lines
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "bakes", "--json")
    assert [b["key"] for b in json.loads(r.stdout)] == [key]
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "unbake", key[7:15])
    assert r.returncode == 0 and r.stdout.decode().strip() == key[7:15]
    r = await asyncio.to_thread(run_smolctl, env.sock, "image", "bakes", "-q")
    assert r.returncode == 0 and r.stdout == b""


def test_bake_conversion_round_trip() -> None:
    b = BakeInfo("sha256:ab", "/s/bakes/ab", "default", "sha256:i", 1, 512, 4096,
                 datetime(2026, 1, 2, tzinfo=UTC), 12.5, "sha256:s", "", ("m-1",))
    assert convert.bake_from_proto(convert.bake_to_proto(b)) == b
    with pytest.raises(convert.ConversionError):
        convert.bake_from_proto(pb.Bake(key="k"))
