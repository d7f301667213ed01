"""Generic snapshot round trip for every virtio device behind the mmio transport (DEVELOPERS.md rule 6).

To cover a new device, append a ``DeviceCase`` to ``SNAPSHOT_CASES``: ``make`` builds a fresh device
over the same host resources, ``exercise`` does some I/O through the driver and asserts it worked.
The device must offer ``save() -> FrozenState`` and ``restore(state)`` (before transport restore).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from virtio_driver import DeviceCase, VirtioDriver, assert_plain_state

from smold.devices.block import Block, FileBackend
from smold.devices.block.request import RequestType, Status
from smold.devices.irq import CountingIrq
from smold.devices.net import Net
from smold.devices.rng import Rng
from smold.devices.virtio.device import STATUS_DRIVER_OK, VirtioDevice
from smold.devices.virtio.mmio import MmioTransport
from smold.devices.virtio.persist import PersistError
from smold.memory import GuestMemory


# -- block ------------------------------------------------------------------------------------------
def make_block(ctx: dict[str, Any]) -> VirtioDevice:
    path = ctx["tmp_path"] / "snap.img"
    if not path.exists():
        path.write_bytes(bytes(64 * 512))
    backend = FileBackend(path)
    ctx.setdefault("cleanup", []).append(backend.close)
    return Block(backend, serial="snap-disk")


def exercise_block(drv: VirtioDriver, dev: VirtioDevice) -> None:
    sector = int.from_bytes(os.urandom(1), "little") % 60
    payload = os.urandom(1024)
    used, data = drv.request(0, [struct.pack("<IIQ", RequestType.OUT, 0, sector), payload], [1])
    assert (used.length, data) == (1, bytes([Status.OK]))
    used, data = drv.request(0, [struct.pack("<IIQ", RequestType.IN, 0, sector)], [1024, 1])
    assert data == payload + bytes([Status.OK])
    used, data = drv.request(0, [struct.pack("<IIQ", RequestType.GET_ID, 0, 0)], [20, 1])
    assert data[:9] == b"snap-disk" and data[20] == Status.OK
    used, data = drv.request(0, [struct.pack("<IIQ", RequestType.FLUSH, 0, 0)], [1])
    assert data == bytes([Status.OK])


# -- rng --------------------------------------------------------------------------------------------
def make_rng(ctx: dict[str, Any]) -> VirtioDevice:
    return Rng(max_request_bytes=4096)


def exercise_rng(drv: VirtioDriver, dev: VirtioDevice) -> None:
    used, a = drv.request(0, writable=[5000])
    assert used.length == 4096  # the cap survived the snapshot
    used, b = drv.request(0, writable=[64])
    assert used.length == 64 and a[:64] != b


# -- net --------------------------------------------------------------------------------------------
class LoopbackTap:
    """A backend that hands every transmitted frame straight back as received (a reflecting host)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def recv(self) -> bytes | None:
        return self.frames.pop(0) if self.frames else None

    def send(self, frame: bytes) -> None:
        self.frames.append(bytes(frame))

    def want_rx(self, on: bool) -> None:
        pass


def make_net(ctx: dict[str, Any]) -> VirtioDevice:
    return Net("06:00:ac:10:00:07", ctx.setdefault("tap", LoopbackTap()))


def exercise_net(drv: VirtioDriver, dev: VirtioDevice) -> None:
    assert drv.read_config(0, 6) == bytes.fromhex("0600ac100007")  # the MAC survived the snapshot
    frame = b"\xff" * 6 + bytes.fromhex("0600ac100007") + b"\x08\x00" + os.urandom(64)
    rx, tx = drv.queues[0], drv.queues[1]
    p = rx.add(writable=[12 + 1518])
    drv.kick(0)
    used, _ = drv.request(1, [bytes(12) + frame])
    assert used.length == 0
    assert isinstance(dev, Net)
    dev.backend_readable()
    done = rx.used()
    assert [(u.head, u.length) for u in done] == [(p.head, 12 + len(frame))]
    assert p.written(drv.mem, 12 + len(frame))[12:] == frame
    rx.release(p)
    del tx


SNAPSHOT_CASES: list[DeviceCase] = [
    DeviceCase("blk", make_block, exercise_block),
    DeviceCase("rng", make_rng, exercise_rng),
    DeviceCase("net", make_net, exercise_net),
]


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[dict[str, Any]]:
    c: dict[str, Any] = {"tmp_path": tmp_path}
    yield c
    for fn in c.get("cleanup", []):
        fn()


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 1 << 20)]) as m:
        yield m


def save(dev: VirtioDevice) -> Any:
    return dev.save()  # type: ignore[attr-defined]


def restore(dev: VirtioDevice, state: Any) -> None:
    dev.restore(state)  # type: ignore[attr-defined]


def bring_up(case: DeviceCase, ctx: dict[str, Any], mem: GuestMemory) -> tuple[MmioTransport, VirtioDriver]:
    t = MmioTransport(case.make(ctx), mem, CountingIrq())
    drv = VirtioDriver(t, mem)
    drv.negotiate(queues=case.queues)
    return t, drv


@pytest.mark.parametrize("case", SNAPSHOT_CASES, ids=lambda c: c.name)
def test_round_trip_continues_working(case: DeviceCase, ctx: dict[str, Any], mem: GuestMemory) -> None:
    t, drv = bring_up(case, ctx, mem)
    case.exercise(drv, t.device)
    case.exercise(drv, t.device)
    t_state, d_state = t.save(), save(t.device)
    assert_plain_state(t_state)
    assert_plain_state(d_state)
    assert dataclasses.replace(t_state) == t_state  # comparable by value

    dev2 = case.make(ctx)
    restore(dev2, d_state)
    irq2 = CountingIrq()
    t2 = MmioTransport(dev2, mem, irq2)
    t2.restore(t_state)
    assert dev2.activated and dev2.acked_features == t.device.acked_features
    assert t2.save() == t_state and save(dev2) == d_state
    drv.rebind(t2)
    case.exercise(drv, dev2)
    assert irq2.count > 0
    assert any(q2.next_used != qs.next_used for q2, qs in zip(t2.queues, t_state.queues, strict=True))
    assert not t2.needs_reset and t2.internal_errors == 0


@pytest.mark.parametrize("case", SNAPSHOT_CASES, ids=lambda c: c.name)
def test_round_trip_mid_negotiation(case: DeviceCase, ctx: dict[str, Any], mem: GuestMemory) -> None:
    t = MmioTransport(case.make(ctx), mem, CountingIrq())
    drv = VirtioDriver(t, mem)
    drv.negotiate_features()
    for i in case.queues or range(len(t.queues)):
        drv.setup_queue(i)
    t_state, d_state = t.save(), save(t.device)
    dev2 = case.make(ctx)
    restore(dev2, d_state)
    t2 = MmioTransport(dev2, mem, CountingIrq())
    t2.restore(t_state)
    assert not dev2.activated
    drv.rebind(t2)
    drv.add_status(STATUS_DRIVER_OK)
    assert dev2.activated
    case.exercise(drv, dev2)


@pytest.mark.parametrize("case", SNAPSHOT_CASES, ids=lambda c: c.name)
def test_broken_device_stays_broken(case: DeviceCase, ctx: dict[str, Any], mem: GuestMemory) -> None:
    t, drv = bring_up(case, ctx, mem)
    drv.queues[0].set_avail_idx(0x8000)
    drv.kick(0)
    assert t.needs_reset
    t_state, d_state = t.save(), save(t.device)
    dev2 = case.make(ctx)
    restore(dev2, d_state)
    t2 = MmioTransport(dev2, mem, CountingIrq())
    t2.restore(t_state)
    assert t2.needs_reset
    drv.rebind(t2)
    drv.negotiate(queues=case.queues)  # reset and bring up again
    case.exercise(drv, dev2)


@pytest.mark.parametrize("case", SNAPSHOT_CASES, ids=lambda c: c.name)
def test_restore_rejects_other_device(case: DeviceCase, ctx: dict[str, Any], mem: GuestMemory) -> None:
    t, _ = bring_up(case, ctx, mem)
    state = dataclasses.replace(t.save(), device_type=t.device.device_type + 100)
    with pytest.raises(PersistError):
        MmioTransport(case.make(ctx), mem, CountingIrq()).restore(state)
    state = dataclasses.replace(t.save(), queues=t.save().queues + t.save().queues[:1])
    with pytest.raises(PersistError):
        MmioTransport(case.make(ctx), mem, CountingIrq()).restore(state)
    with pytest.raises(PersistError):
        restore(t.device, save(t.device))  # into an active device


def test_block_restore_checks_disk(ctx: dict[str, Any], mem: GuestMemory, tmp_path: Path) -> None:
    dev = make_block(ctx)
    state = save(dev)
    other = tmp_path / "other.img"
    other.write_bytes(bytes(8 * 512))
    with FileBackend(other) as be:
        with pytest.raises(PersistError):
            Block(be, serial="snap-disk").restore(state)
    with FileBackend(tmp_path / "snap.img", read_only=True) as be, pytest.raises(PersistError):
        Block(be, read_only=True).restore(state)
