"""Pre-baked images and checkpoint listing/deletion through the real daemon with the host-agent launcher.

The launcher's ``snapshot`` writes a real, checked snapshot directory (state file with its sha256 and the
memory file's recorded digest, as the VMM does with ``digest``); restoring it starts a fresh host agent, so
these tests cover the bake store, keys, lookup, refusal of corrupted bakes and the RPCs, not guest state
(tests/integration/test_daemon_bake_vm.py does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
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
from smold.authrecord import RecordKey
from smold.daemon import Daemon, DaemonConfig
from smold.daemon.bakes import (
    BakeCorruptError,
    BakeMeta,
    BakeStore,
    bake_key,
    base_smolfile,
    key_hex,
    mounts_digest,
)
from smold.daemon.controller import _finish_bake
from smold.daemon.errors import LaunchError
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
        return self.daemon.config.socket_path


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sdb-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def running_daemon(workdir: Path, *, auto_bake: bool, name: str = "state",
                         bakes: Path | None = None) -> AsyncIterator[Env]:
    config = DaemonConfig(socket_path=workdir / f"{name}.sock", state_dir=workdir / name, max_machines=6,
                          max_memory_mib=8192, destroy_grace_s=5.0, auto_bake=auto_bake, bakes_path=bakes)
    images = fake_images(workdir)
    launcher = BakingLauncher(workdir / "rootfs.ext4")
    daemon, task = await start_daemon_task(config, images, launcher)
    async with grpc.aio.insecure_channel(f"unix:{config.socket_path}") as channel:
        yield Env(daemon, pb_grpc.SmolStub(channel), workdir, launcher)
    daemon.stop()
    await asyncio.wait_for(task, 30)
    assert processes_mentioning(str(workdir / name)) == [], "the daemon left VM processes behind"


@pytest.fixture
async def env(workdir: Path) -> AsyncIterator[Env]:
    """A daemon that bakes only when asked (BakeImage): the explicit bake store."""
    async with running_daemon(workdir, auto_bake=False) as e:
        yield e


@pytest.fixture
async def auto_env(workdir: Path) -> AsyncIterator[Env]:
    """A daemon as it runs by default: a machine that had to boot is baked as its base."""
    async with running_daemon(workdir, auto_bake=True) as e:
        yield e


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
    assert MachineRecord.load(env.state / "records" / m.id, env.daemon.controller.record_key).checkpoint == str(path)
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


# --- base bakes: a machine that had to boot is baked before its mounts and setup ----------------------------------
async def base_key(env: Env, text: str) -> str:
    sf = base_smolfile(parse_smolfile(text.encode(), base_dir=str(env.dir)))
    return bake_key(sf, (await env.daemon.controller.images.resolve("default")).digest, mounts_digest(sf))


async def test_a_booted_machine_is_baked_as_its_base_and_later_creates_restore_it_then_run_setup(
        auto_env: Env) -> None:
    env, s = auto_env, auto_env.stub
    text = smolfile_text(env)
    key = await base_key(env, text)
    assert key != bake_key(parse_smolfile(text.encode(), base_dir=str(env.dir)), "x", "y")
    a = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, text)))).machine
    assert a.restored_from == "" and setup_runs(env) == 1          # booted, then its setup ran
    assert len(env.launcher.calls) == 1 and env.launcher.calls[0][1]  # baked (memory digest) before the setup
    bakes = (await s.ListBakes(pb.ListBakesRequest())).bakes
    assert [b.key for b in bakes] == [key] and not bakes[0].error
    meta = json.loads((env.state / "bakes" / key_hex(key) / "bake.json").read_text())
    assert meta["boot_state"]["setup"] == [] and meta["boot_state"]["env"] == {}

    # Another env and setup: no bake of its own, so the base is restored and its setup runs after it.
    other = smolfile_text(env, env_value="2")
    run = await s.Run(pb.RunRequest(smolfile=request(env, other + VERIFIER)))
    assert run.result.passed, run
    assert [st.name for st in run.steps] == ["boot", "setup[0]"], run.steps
    assert f"restored base bake {key[:19]} (then mounts and setup)" in run.steps[0].evidence.detail
    assert setup_runs(env) == 2 and len(env.launcher.calls) == 1    # nothing baked again
    b = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, other)))).machine
    assert b.restored_from == f"bake:{key}" and setup_runs(env) == 3

    # A Smolfile with nothing to provision is its own base: restored as it is.
    plain = f"cpus = 1\nmemory = {MEM_MIB}\n"
    assert await base_key(env, plain) == key
    c = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, plain)))).machine
    assert c.restored_from == f"bake:{key}" and setup_runs(env) == 3

    # BakeImage starts from the base too: one snapshot (the bake's own), the setup once more.
    baked = (await s.BakeImage(pb.BakeImageRequest(smolfile=request(env, text)))).bake
    assert len(env.launcher.calls) == 2 and setup_runs(env) == 4
    assert sorted(b.key for b in (await s.ListBakes(pb.ListBakesRequest())).bakes) == sorted([key, baked.key])

    # Another size has no base yet: it boots and becomes one.
    big = smolfile_text(env).replace(f"memory = {MEM_MIB}", f"memory = {2 * MEM_MIB}")
    d = (await s.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, big)))).machine
    assert d.restored_from == "" and len(env.launcher.calls) == 3
    # BakingLauncher writes a 128 MiB snapshot whatever the size: the store refuses that base, so the next
    # machine boots, says why, and bakes the base again in its place.
    big_key = await base_key(env, big)
    first = (env.state / "bakes" / key_hex(big_key) / "bake.json").stat().st_ino
    run = await s.Run(pb.RunRequest(smolfile=request(env, big + VERIFIER)))
    assert run.result.passed and f"base bake {big_key[:19]} refused" in run.steps[0].evidence.detail, run.steps[0]
    assert "booted instead" in run.steps[0].evidence.detail and len(env.launcher.calls) == 4
    assert (env.state / "bakes" / key_hex(big_key) / "bake.json").stat().st_ino != first


async def test_without_auto_bake_nothing_is_baked_unasked(env: Env) -> None:
    assert not env.daemon.config.auto_bake
    m = (await env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, smolfile_text(env))))).machine
    assert m.restored_from == "" and env.launcher.calls == []
    assert (await env.stub.ListBakes(pb.ListBakesRequest())).bakes == []


async def test_a_failed_base_bake_leaves_the_machine_running_and_nothing_in_the_store(auto_env: Env) -> None:
    env = auto_env

    async def refuse(*args: object, **kw: object) -> dict[str, Any]:
        raise LaunchError("the VMM refused the snapshot: no space", no_space=True)

    env.launcher.snapshot = refuse  # type: ignore[method-assign]
    m = (await env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=request(env, smolfile_text(env))))).machine
    assert m.state == pb.MACHINE_STATE_RUNNING and setup_runs(env) == 1
    assert (await env.stub.ListBakes(pb.ListBakesRequest())).bakes == []
    assert [p.name for p in (env.state / "bakes").iterdir()] == []   # no half-written directory either


async def test_daemons_sharing_a_bake_store_restore_each_others_base(workdir: Path) -> None:
    shared = workdir / "shared-bakes"
    async with running_daemon(workdir, auto_bake=True, name="one", bakes=shared) as one:
        text = smolfile_text(one)
        m = (await one.stub.CreateMachine(pb.CreateMachineRequest(smolfile=request(one, text)))).machine
        assert m.restored_from == "" and len(one.launcher.calls) == 1
        async with running_daemon(workdir, auto_bake=True, name="two", bakes=shared) as two:
            n = (await two.stub.CreateMachine(pb.CreateMachineRequest(smolfile=request(two, text)))).machine
            assert n.restored_from.startswith("bake:sha256:") and two.launcher.calls == []
            assert (shared / n.restored_from.removeprefix("bake:sha256:")).is_dir()
            assert not (workdir / "two" / "bakes").exists()
    assert setup_runs(one) == 2


def test_an_automatic_bake_keeps_the_one_already_in_place(tmp_path: Path) -> None:
    key = RecordKey.generate()
    hexkey = "ab" * 32
    final = tmp_path / hexkey
    final.mkdir()
    (final / "bake.json").write_text("first")
    tmp = tmp_path / ".tmp-1-x"
    tmp.mkdir()
    (tmp / "memory.raw").write_bytes(b"m")
    (tmp / "snapshot.state").write_bytes(b"s")
    meta = _meta(f"sha256:{hexkey}")
    assert _finish_bake(tmp, final, meta, key, replace=False) is False
    assert (final / "bake.json").read_text() == "first"
    assert _finish_bake(tmp, final, meta, key) is True            # BakeImage(replace=True) replaces it
    assert BakeMeta.load(final, key) == meta and not tmp.exists()
    assert [p.name for p in tmp_path.iterdir()] == [hexkey]       # the old one removed


def _meta(key: str, **changes: Any) -> BakeMeta:
    return BakeMeta(**{"key": key, "image": "default", "image_digest": "sha256:i", "mounts_digest": "sha256:m",
                       "smolfile_digest": "sha256:s", "boot_state": {}, "cpus": 1, "memory_mib": MEM_MIB,
                       "created_at": datetime.now(UTC).isoformat(), "bake_seconds": 1.0, **changes})


def test_a_bake_the_store_key_did_not_authenticate_is_refused(tmp_path: Path) -> None:
    """#19 finding 8: bakes were checksummed, not authenticated, in a store other daemons may write. Now a bake
    restores only with a MAC under the store's key over its description and its state file."""
    rootfs = tmp_path / "rootfs"
    rootfs.write_bytes(b"r")
    bakes = BakeStore(tmp_path / "bakes")
    key = "sha256:" + "ef" * 32
    d = bakes.path(key)
    write_snapshot(d, rootfs, digest=True)
    meta = _meta(key)
    (d / "bake.json").write_text(json.dumps(meta.__dict__))
    with pytest.raises(BakeCorruptError, match="no MAC"):      # consistent checksums, written by another
        bakes.verify(key)
    meta.write(d, RecordKey.generate())                         # another store key's MAC
    with pytest.raises(BakeCorruptError, match="does not verify"):
        bakes.verify(key)
    meta.write(d, bakes.key)
    bakes.verify(key)
    _flip(d / "snapshot.state", 200)                            # another state file under the same bake.json
    bakes.forget(key)
    with pytest.raises(BakeCorruptError, match="is not the one bake.json authenticates"):
        bakes.verify(key)


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
    (lambda d: (d / "snapshot.state").unlink(), "snapshot.state: No such file"),
    (lambda d: (d / "bake.json").write_text('{"version": 1}'), "bake.json"),
    (lambda d: (d / "bake.json").write_text(
        (d / "bake.json").read_text().replace('"key": "sha256:', '"key": "sha256:0')), "does not verify"),
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
    _meta(key).write(d, bakes.key)
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
    _meta(key).write(d, bakes.key)
    with pytest.raises(BakeCorruptError, match="no memory digest"):
        bakes.verify(key)
    write_snapshot(d, rootfs, digest=True)
    _meta(key, memory_mib=256).write(d, bakes.key)
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
    gone = subprocess.Popen(["true"])
    gone.wait()
    (bakes / f".tmp-{gone.pid}-0a1b2c").mkdir()        # its writer is gone
    alive = f".tmp-{os.getppid()}-0a1b2c"               # another live daemon sharing the store is writing it
    (bakes / alive).mkdir()
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state")
    daemon = Daemon(config, launcher=HostAgentLauncher(), images=fake_images(workdir))
    await daemon.controller.start()
    assert sorted(p.name for p in bakes.iterdir()) == sorted(["ab", alive])


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
