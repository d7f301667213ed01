"""Snapshot state file: generic round trip of every state class, and rejection of damaged files."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import struct
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from virtio_driver import VirtioDriver, assert_plain_state

from smold.devices.block import Block, FileBackend
from smold.devices.irq import CountingIrq
from smold.devices.net import Net
from smold.devices.rng import Rng
from smold.devices.serial import Serial
from smold.devices.virtio.mmio import MmioTransport
from smold.devices.vsock.device import Vsock
from smold.kvm import structs as s
from smold.memory import GuestMemory
from smold.snapshot import codec, format, store
from smold.snapshot.errors import (
    SnapshotChecksumError,
    SnapshotError,
    SnapshotFormatError,
    SnapshotTooLargeError,
    SnapshotTruncatedError,
    SnapshotVersionError,
)
from smold.snapshot.kvmstate import check_vcpu_state
from smold.snapshot.state import (
    STATE_KIND,
    CmosState,
    CpuidEntry,
    DevicesState,
    DiskRef,
    HostInfo,
    I8042State,
    MachineSpec,
    MemoryRegionState,
    MemoryState,
    MsrValue,
    Regs,
    VcpuState,
    VirtioSlotState,
    VmSnapshot,
    VmState,
)


def _blob(n: int, seed: int) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n)


def _live_virtio(tmp_path: Path) -> tuple[VirtioSlotState, ...]:
    """Real transport + device states: each device negotiated by a driver and, where simple, used."""
    mem = GuestMemory([(0, 1 << 20)])
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(64 * 512))
    backend = FileBackend(disk, read_only=True)
    devices = [Block(backend, read_only=True, serial=b"smol-root"), Vsock(guest_cid=7), Rng(), Net()]
    slots = []
    for i, dev in enumerate(devices):
        t = MmioTransport(dev, mem, CountingIrq())
        drv = VirtioDriver(t, mem)
        drv.negotiate()
        if isinstance(dev, Rng):
            drv.request(0, writable=[32])
        slots.append(VirtioSlotState(slot=i, mmio=t.save(), device=dev.save()))
    backend.close()
    return tuple(slots)


def _vcpu(index: int) -> VcpuState:
    return VcpuState(
        index=index,
        cpuid=(CpuidEntry(0, 0, 0, 0xD, 0x68747541, 0x444D4163, 0x69746E65),
               CpuidEntry(7, 0, 1, 0, 1 << 9, 0, 0)),
        sregs=_blob(ctypes.sizeof(s.KvmSregs), 1), regs=Regs(*range(100, 118)),
        fpu=_blob(ctypes.sizeof(s.KvmFpu), 2), xcrs=_blob(ctypes.sizeof(s.KvmXcrs), 3), xsave=None,
        msrs=(MsrValue(0x10, 2**63 + 5), MsrValue(0xC0000080, 0xD01)),
        lapic=_blob(1024, 4), vcpu_events=_blob(64, 5), mp_state=0, tsc_khz=2_596_096)


def sample_snapshot(tmp_path: Path) -> VmSnapshot:
    serial = Serial(CountingIrq(), lambda b: None)
    serial.write(1, b"\x03")
    serial.queue_input(b"typed\x00\xff")
    return VmSnapshot(
        kind=STATE_KIND,
        spec=MachineSpec(cpus=2, memory_mib=512, cpu_template="compat", vsock_cid=3, hostname="smol",
                         kernel_cmdline="console=ttyS0 quiet",
                         rootfs=DiskRef(path="/x/rootfs.ext4", size=1 << 30, mtime_ns=1, read_only=True)),
        host=HostInfo(pvm=True, kernel="6.18", tsc_khz=2_596_096),
        created_unix_ns=1_790_000_000_000_000_000,
        vm=VmState(pic_master=_blob(512, 6), pic_slave=_blob(512, 7), ioapic=_blob(512, 8),
                   pit2=_blob(112, 9), clock=123456789, clock_flags=0),
        vcpus=(_vcpu(0), _vcpu(1)),
        devices=DevicesState(serial=serial.save(), cmos=CmosState(index=0x0F, nvram=_blob(128, 10)),
                             i8042=I8042State(resets=0), virtio=_live_virtio(tmp_path)),
        memory=MemoryState(file="memory.raw", size=512 << 20,
                           regions=(MemoryRegionState(0, 512 << 20, 0),), sha256=None))


def _state_classes(tp: Any, seen: set[type]) -> set[type]:
    """Every dataclass reachable from ``tp`` through field annotations."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp in seen:
            return seen
        seen.add(tp)
        for ftype in typing.get_type_hints(tp).values():
            _state_classes(ftype, seen)
    elif typing.get_origin(tp) in (typing.Union, types.UnionType, tuple):
        for arg in typing.get_args(tp):
            if arg is not Ellipsis:
                _state_classes(arg, seen)
    return seen


def _instances(obj: Any, out: dict[type, list[Any]]) -> dict[type, list[Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out.setdefault(type(obj), []).append(obj)
        for f in dataclasses.fields(obj):
            _instances(getattr(obj, f.name), out)
    elif isinstance(obj, tuple):
        for v in obj:
            _instances(v, out)
    return out


def test_every_state_class_round_trips(tmp_path: Path) -> None:
    snap = sample_snapshot(tmp_path)
    assert_plain_state(snap)
    found = _instances(snap, {})
    # The sample holds an instance of every state class the snapshot can contain (device states
    # included: serial, cmos, i8042, virtio-mmio transport + queues, block, vsock, rng, vCPU, VM).
    assert set(found) == _state_classes(VmSnapshot, set())
    for cls, objs in found.items():
        for obj in objs:
            assert format.unpack_state(cls, format.pack_state(obj)) == obj, cls.__name__
    back = format.unpack_state(VmSnapshot, format.pack_state(snap))
    assert back == snap
    assert isinstance(back.devices.virtio[0].device, type(snap.devices.virtio[0].device))
    assert back.devices.serial.rx == b"typed\x00\xff"
    assert back.vcpus[0].msrs[0].value == 2**63 + 5


def test_state_file_is_json_after_a_64_byte_header(tmp_path: Path) -> None:
    data = format.pack_state(sample_snapshot(tmp_path))
    magic, version, hsize, length = struct.unpack_from("<8sIIQ", data)
    assert (magic, version, hsize, length) == (b"SMOLSNAP", format.FORMAT_VERSION, 64, len(data) - 64)
    body = json.loads(data[64:])
    assert body["$type"] == "VmSnapshot" and body["kind"] == STATE_KIND
    assert b"pickle" not in data and data[64:65] == b"{"


@pytest.fixture
def packed(tmp_path: Path) -> bytes:
    return format.pack_state(sample_snapshot(tmp_path))


def _reseal(data: bytes) -> bytes:
    """Recompute the digest so only the deliberate change is wrong."""
    blank = data[:24] + bytes(32) + data[56:64]
    h = hashlib.sha256(blank + data[64:]).digest()
    return data[:24] + h + data[56:]


@pytest.mark.parametrize("where", [64, 100, -2, 30])
def test_any_flipped_byte_is_refused(packed: bytes, where: int) -> None:
    bad = bytearray(packed)
    bad[where] ^= 0x01
    with pytest.raises(SnapshotChecksumError, match="sha256 mismatch"):
        format.unpack_state(VmSnapshot, bytes(bad))


@pytest.mark.parametrize("cut", [0, 5, 40, 64, 65, 1000, -1])
def test_truncated_file_is_refused(packed: bytes, cut: int) -> None:
    with pytest.raises(SnapshotFormatError) as e:
        format.unpack_state(VmSnapshot, packed[:cut])
    if 8 <= (cut % len(packed)):
        assert isinstance(e.value, SnapshotTruncatedError), e.value
        assert "truncated" in str(e.value)


def test_wrong_version_is_refused_even_with_a_valid_checksum(packed: bytes) -> None:
    bad = _reseal(packed[:8] + struct.pack("<I", format.FORMAT_VERSION + 1) + packed[12:])
    with pytest.raises(SnapshotVersionError, match=f"format version {format.FORMAT_VERSION + 1}"):
        format.unpack_state(VmSnapshot, bad)


def test_bad_magic_and_trailing_data_are_refused(packed: bytes) -> None:
    with pytest.raises(SnapshotFormatError, match="bad magic"):
        format.unpack_state(VmSnapshot, b"NOTSNAPS" + packed[8:])
    with pytest.raises(SnapshotFormatError, match="trailing data"):
        format.unpack_state(VmSnapshot, packed + b"\x00")


def test_oversized_state_is_refused_before_reading(packed: bytes, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    huge = _reseal(packed[:16] + struct.pack("<Q", format.MAX_STATE_BYTES + 1) + packed[24:])
    with pytest.raises(SnapshotTooLargeError, match="exceeds the cap"):
        format.unpack_state(VmSnapshot, huge)
    # A file far beyond the cap is read only up to cap + header + 1 bytes.
    path = tmp_path / "big.state"
    with open(path, "wb") as f:
        f.write(huge[:64])
        f.truncate(64 + format.MAX_STATE_BYTES * 4)
    with pytest.raises(SnapshotTooLargeError):
        format.read_state_file(path, VmSnapshot)
    monkeypatch.setattr(format, "MAX_STATE_BYTES", 1024)
    with pytest.raises(SnapshotTooLargeError):
        format.pack_state(sample_snapshot(tmp_path))


def _resealed_json(packed: bytes, edit: Any) -> bytes:
    body = json.loads(packed[64:])
    edit(body)
    raw = json.dumps(body).encode()
    header = packed[:16] + struct.pack("<Q", len(raw)) + packed[24:64]
    return _reseal(header + raw)


@pytest.mark.parametrize("edit,message", [
    (lambda b: b["vcpus"][0].__setitem__("mp_state", True), "expected an integer"),
    (lambda b: b["vcpus"][0].__setitem__("extra", 1), "unknown field"),
    (lambda b: b["vcpus"][0].pop("lapic"), "missing field 'lapic'"),
    (lambda b: b["vcpus"][0].__setitem__("lapic", "%%%"), "bad base64"),
    (lambda b: b["devices"]["virtio"][0]["device"].__setitem__("$type", "Exploit"), "is not one of"),
    (lambda b: b["vm"].__setitem__("$type", "VcpuState"), "expected a VmState"),
    (lambda b: b.__setitem__("vcpus", {"0": 1}), "expected a list"),
])
def test_well_sealed_but_ill_typed_state_is_refused(packed: bytes, edit: Any, message: str) -> None:
    with pytest.raises(SnapshotFormatError, match=message):
        format.unpack_state(VmSnapshot, _resealed_json(packed, edit))


def test_sealed_garbage_and_nan_are_refused(packed: bytes) -> None:
    header = packed[:16] + struct.pack("<Q", 5) + packed[24:64]
    with pytest.raises(SnapshotFormatError, match="not valid JSON"):
        format.unpack_state(VmSnapshot, _reseal(header + b"{nope"))
    header = packed[:16] + struct.pack("<Q", 3) + packed[24:64]
    with pytest.raises(SnapshotFormatError, match="non-JSON constant"):
        format.unpack_state(VmSnapshot, _reseal(header + b"NaN"))


def test_codec_refuses_what_is_not_plain_frozen_state() -> None:
    @dataclasses.dataclass
    class Mutable:
        x: int

    with pytest.raises(codec.CodecError, match="not a frozen dataclass"):
        codec.encode(Mutable(1))
    with pytest.raises(codec.CodecError, match="cannot encode"):
        codec.encode(MsrValue(1, object()))  # type: ignore[arg-type]
    with pytest.raises(codec.CodecError, match="NaN"):
        codec.encode(MsrValue(1, float("nan")))  # type: ignore[arg-type]


def test_vcpu_blobs_must_have_kvm_struct_sizes() -> None:
    check_vcpu_state(_vcpu(0))
    with pytest.raises(SnapshotFormatError, match="lapic is 1023 bytes"):
        check_vcpu_state(dataclasses.replace(_vcpu(0), lapic=bytes(1023)))


# -- the snapshot directory -------------------------------------------------------------------------------
def _dir_with(tmp_path: Path, snap: VmSnapshot, mem_size: int) -> Path:
    d = tmp_path / "snap"
    d.mkdir()
    with open(d / store.MEMORY_FILE, "wb") as f:
        f.truncate(mem_size)
    store.write_state(d, snap)
    return d


def test_snapshot_directory_checks_its_memory_file(tmp_path: Path) -> None:
    snap = sample_snapshot(tmp_path)
    d = _dir_with(tmp_path, snap, snap.memory.size)
    assert store.read_snapshot(d) == snap
    with open(d / store.MEMORY_FILE, "r+b") as f:
        f.truncate(snap.memory.size - 4096)
    with pytest.raises(SnapshotTruncatedError, match="memory file"):
        store.read_snapshot(d)
    (d / store.MEMORY_FILE).unlink()
    with pytest.raises(SnapshotError, match="memory file"):
        store.read_snapshot(d)
    with pytest.raises(SnapshotError, match="not a snapshot directory"):
        store.read_snapshot(tmp_path)


def test_memory_file_name_and_layout_are_checked(tmp_path: Path) -> None:
    snap = sample_snapshot(tmp_path)
    bad_name = dataclasses.replace(snap, memory=dataclasses.replace(snap.memory, file="../../etc/passwd"))
    d = _dir_with(tmp_path, bad_name, snap.memory.size)
    with pytest.raises(SnapshotFormatError, match="plain file name"):
        store.read_snapshot(d)
    gap = dataclasses.replace(snap.memory, regions=(MemoryRegionState(0, 4096, 4096),))
    with pytest.raises(SnapshotFormatError, match="file offset"):
        store.check_memory_layout(gap)


def test_memory_dump_is_sparse_and_restores_copy_on_write(tmp_path: Path) -> None:
    regions = [(0, 8 << 20), (16 << 20, 4 << 20)]
    with GuestMemory(regions) as mem:
        mem.write(0x1000, b"low")
        mem.write((16 << 20) + (3 << 20), b"high" * 1000)
        result = store.write_memory(tmp_path, mem, digest=True)
    path = tmp_path / store.MEMORY_FILE
    st = path.stat()
    assert st.st_size == 12 << 20 and result.bytes_written <= 2 * 256 * 1024
    assert st.st_blocks * 512 < 1 << 20, "untouched RAM must stay a hole in the memory file"
    assert result.state.sha256 == store.file_sha256(path)

    a = GuestMemory.from_file(path, regions)
    b = GuestMemory.from_file(path, regions)
    try:
        assert a.private and a.read(0x1000, 3) == b"low" and a.read((19 << 20), 4) == b"high"
        a.write(0x1000, b"AAA")
        assert b.read(0x1000, 3) == b"low", "a write in one restored copy is invisible to another"
        assert path.read_bytes()[0x1000:0x1003] == b"low", "and never reaches the shared file"
        # A restored (private) memory dumps its own copies plus the file's data.
        again = tmp_path / "again"
        again.mkdir()
        store.write_memory(again, a)
        data = (again / store.MEMORY_FILE).read_bytes()
        assert data[0x1000:0x1003] == b"AAA" and data[11 << 20:(11 << 20) + 4] == b"high"
    finally:
        a.close()
        b.close()


def test_tampered_memory_is_found_by_verify(tmp_path: Path) -> None:
    snap = sample_snapshot(tmp_path)
    with GuestMemory([(0, 1 << 20)]) as mem:
        mem.write(0, b"x" * 100)
        mw = store.write_memory(tmp_path, mem, digest=True)
    snap = dataclasses.replace(snap, memory=mw.state)
    store.verify_memory(tmp_path, snap)
    with open(tmp_path / store.MEMORY_FILE, "r+b") as f:
        f.seek(50)
        f.write(b"y")
    with pytest.raises(SnapshotChecksumError):
        store.verify_memory(tmp_path, snap)
    os.unlink(tmp_path / store.MEMORY_FILE)


def test_restore_configuration_comes_from_the_snapshot(tmp_path: Path) -> None:
    from smold.vmm.__main__ import main
    from smold.vmm.machine import MachineConfig, MachineError

    snap = sample_snapshot(tmp_path)
    disk = tmp_path / "rootfs.ext4"
    disk.write_bytes(b"")
    cfg = MachineConfig.for_restore(tmp_path / "snap", tmp_path / "state", snap, rootfs=disk, hostname="kid-1")
    assert (cfg.cpus, cfg.memory_mib, cfg.cpu_template, cfg.vsock_cid) == (2, 512, "compat", 3)
    assert cfg.hostname == "kid-1" and cfg.kernel is None and cfg.rootfs_read_only
    cfg.validate()   # no kernel needed to restore
    with pytest.raises(MachineError, match="kernel is needed"):
        MachineConfig(kernel=None, state_dir=tmp_path).validate()
    # The CLI refuses a configuration that contradicts the snapshot, before any KVM work.
    d = _dir_with(tmp_path, snap, snap.memory.size)
    with pytest.raises(SystemExit, match="--cpus 4 differs from the snapshot's 2"):
        main(["--restore", str(d), "--cpus", "4"])
    with pytest.raises(SystemExit, match="--kernel cannot be combined"):
        main(["--restore", str(d), "--kernel", str(disk)])
