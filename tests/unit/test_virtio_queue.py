"""Hostile split virtqueues (virtio 1.2 §2.7) driven through the real transport, blk and rng."""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from virtio_driver import DriverQueue, VirtioDriver

from smold.devices.block import Block, FileBackend
from smold.devices.block.request import RequestType, Status
from smold.devices.irq import CountingIrq
from smold.devices.rng import Rng
from smold.devices.virtio.device import (
    INT_CONFIG_CHANGE,
    STATUS_DEVICE_NEEDS_RESET,
    VirtioDevice,
)
from smold.devices.virtio.mmio import MAGIC_VALUE, MmioTransport, Reg
from smold.devices.virtio.queue import (
    VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
)
from smold.memory import GuestMemory

RAM = 1 << 20
NEXT, WRITE = VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
BUF = 0x80000  # scratch area the tests hand-place buffers in (above the driver's rings)


@pytest.fixture(scope="module")
def image() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "disk.img"
        p.write_bytes(bytes(range(256)) * 64)  # 32 sectors
        yield p


def make_rng(_: Path) -> VirtioDevice:
    return Rng()


def make_blk(image: Path) -> VirtioDevice:
    return Block(FileBackend(image))


DEVICES: dict[str, Callable[[Path], VirtioDevice]] = {"rng": make_rng, "blk": make_blk}


class Rig:
    def __init__(self, device: VirtioDevice, mem: GuestMemory, size: int | None = None) -> None:
        self.irq = CountingIrq()
        self.mem = mem
        self.transport = MmioTransport(device, mem, self.irq)
        self.drv = VirtioDriver(self.transport, mem, alloc_end=BUF)
        (self.q,) = self.drv.negotiate(sizes={0: size} if size else None)

    def raw(self, descs: list[tuple[int, int, int, int]], head: int = 0) -> None:
        """Write descriptors 0..n-1 as given (addr, len, flags, next) and make ``head`` available."""
        for i, (addr, length, flags, nxt) in enumerate(descs):
            self.q.write_desc(i, addr, length, flags, nxt)
        self.q.put_avail(head)
        self.q.pending.clear()

    def good_request(self) -> None:
        """A well-formed request for either device still works (the device was not broken)."""
        if isinstance(self.transport.device, Block):
            used, data = self.drv.request(0, [struct.pack("<IIQ", RequestType.IN, 0, 1)], [512, 1])
            assert used.length == 513 and data[-1] == Status.OK
        else:
            used, _ = self.drv.request(0, writable=[8])
            assert used.length == 8

    def check_alive(self) -> None:
        assert self.drv.read32(Reg.MAGIC_VALUE) == MAGIC_VALUE
        assert self.transport.internal_errors == 0


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, RAM)]) as m:
        yield m


@pytest.fixture(params=sorted(DEVICES))
def rig(request: pytest.FixtureRequest, image: Path, mem: GuestMemory) -> Iterator[Rig]:
    r = Rig(DEVICES[request.param](image), mem)
    yield r
    close_device(r.transport.device)


def hdr_at(mem: GuestMemory, addr: int) -> int:
    mem.write(addr, struct.pack("<IIQ", RequestType.IN, 0, 0))
    return addr


# Malformed chains: the request fails with used length 0 and the queue goes on (§2.7.5.3).
CHAIN_ERRORS: dict[str, list[tuple[int, int, int, int]]] = {
    "loop": [(BUF, 16, NEXT, 1), (BUF + 16, 16, NEXT | WRITE, 0)],
    "self_loop": [(BUF, 16, NEXT | WRITE, 0)],
    "next_out_of_range": [(BUF, 16, NEXT, 300)],
    "buffer_outside_ram": [(BUF, 16, NEXT, 1), (RAM + 0x1000, 513, WRITE, 0)],
    "buffer_crosses_end_of_ram": [(BUF, 16, NEXT, 1), (RAM - 8, 16, WRITE, 0)],
    "oversized_length": [(BUF, 16, NEXT, 1), (BUF + 16, 0xFFFFFFFF, WRITE, 0)],
    "length_wraps_2_64": [(BUF, 16, NEXT, 1), (2**64 - 0x100, 0x200, WRITE, 0)],
    "readable_after_writable": [(BUF + 16, 513, NEXT | WRITE, 1), (BUF, 16, 0, 0)],
    "indirect_not_negotiated": [(BUF, 16, VIRTQ_DESC_F_INDIRECT | WRITE, 0)],
}


@pytest.mark.parametrize("case", sorted(CHAIN_ERRORS))
def test_malformed_chain_fails_request(rig: Rig, case: str) -> None:
    hdr_at(rig.mem, BUF)
    rig.mem.fill(BUF + 16, 513, 0xA5)
    rig.raw(CHAIN_ERRORS[case])
    rig.drv.kick(0)
    done = rig.q.used()
    assert [(u.head, u.length) for u in done] == [(0, 0)]
    assert rig.mem.read(BUF + 16, 513) == b"\xa5" * 513  # nothing written
    assert not rig.transport.needs_reset
    assert rig.irq.count == 1
    rig.q.free_desc = list(range(rig.q.size))
    rig.good_request()
    rig.check_alive()


def test_chain_of_exactly_queue_size_is_fine(image: Path, mem: GuestMemory) -> None:
    r = Rig(make_rng(image), mem, size=8)
    r.raw([(BUF + 8 * i, 8, WRITE | (NEXT if i < 7 else 0), i + 1) for i in range(8)])
    r.drv.kick(0)
    assert [u.length for u in r.q.used()] == [64]
    r.raw([(BUF + 8 * i, 8, WRITE | NEXT, (i + 1) % 8) for i in range(8)])  # loop through all 8
    r.drv.kick(0)
    assert [u.length for u in r.q.used()] == [0]


def test_blk_total_size_cap(image: Path, mem: GuestMemory) -> None:
    with FileBackend(image, size=1 << 30) as be:  # capacity is not the limit here; the request cap is
        r = Rig(Block(be), mem)
        hdr_at(mem, BUF)
        # 254 data descriptors of 68 KiB (aliasing the same RAM) = 17 MiB > MAX_REQUEST_BYTES (16 MiB).
        descs = [(BUF, 16, NEXT, 1)] + [(0x10000, 0x11000, NEXT | WRITE, i + 2) for i in range(254)]
        descs.append((BUF + 16, 1, WRITE, 0))
        mem.fill(0x10000, 0x11000, 0xA5)
        r.raw(descs)
        r.drv.kick(0)
        (u,) = r.q.used()
        assert u.length == 1 and mem.read_u8(BUF + 16) == Status.IOERR
        assert mem.read(0x10000, 0x11000) == b"\xa5" * 0x11000
        # The same shape at 64 KiB each (15.9 MiB) is within the cap and is served.
        r.raw([(BUF, 16, NEXT, 1)] + [(0x10000, 0x10000, NEXT | WRITE, i + 2) for i in range(254)]
              + [(BUF + 16, 1, WRITE, 0)])
        r.drv.kick(0)
        (u,) = r.q.used()
        assert u.length == 254 * 0x10000 + 1 and mem.read_u8(BUF + 16) == Status.OK
        r.check_alive()


def test_avail_index_too_far_ahead_breaks_ring(rig: Rig) -> None:
    rig.q.set_avail_idx(rig.q.size + 1)
    rig.drv.kick(0)
    assert rig.drv.status & STATUS_DEVICE_NEEDS_RESET
    assert rig.drv.interrupt_status() & INT_CONFIG_CHANGE
    # The transport keeps answering; further kicks are ignored; a reset recovers the device.
    rig.drv.kick(0)
    rig.check_alive()
    assert rig.drv.read_config(0, 4) is not None
    (rig.q,) = rig.drv.negotiate()
    rig.good_request()


def test_out_of_range_head_breaks_ring(rig: Rig) -> None:
    rig.q.put_avail(rig.q.size)
    rig.drv.kick(0)
    assert rig.transport.needs_reset
    rig.check_alive()


def test_overlapping_rings_never_raise(image: Path, mem: GuestMemory) -> None:
    # Rings may overlap each other: a hostile layout must not raise either.
    r = Rig(make_rng(image), mem)
    r.drv.reset()
    r.drv.negotiate_features()
    r.drv.write32(Reg.QUEUE_SEL, 0)
    r.drv.write32(Reg.QUEUE_NUM, 4)
    for reg in (Reg.QUEUE_DESC_LOW, Reg.QUEUE_DRIVER_LOW, Reg.QUEUE_DEVICE_LOW):
        r.drv.write32(reg, 0x4000)
    r.drv.write32(Reg.QUEUE_READY, 1)
    r.drv.add_status(4)
    for _ in range(5):
        r.drv.kick(0)
    r.check_alive()


# -- property tests ---------------------------------------------------------------------------------
ADDRS = st.one_of(st.sampled_from([0, BUF, BUF + 16, RAM - 16, RAM - 1, RAM, 2**64 - 8, 2**64 - 1]),
                  st.integers(0, RAM), st.integers(0, 2**64 - 1))
LENS = st.one_of(st.sampled_from([0, 1, 15, 16, 17, 512, 513, 0xFFFFFFFF]), st.integers(0, 4096),
                 st.integers(0, 2**32 - 1))
DESC = st.tuples(ADDRS, LENS, st.integers(0, 7), st.integers(0, 20))


def run_hostile(device: VirtioDevice, size: int, descs: list[tuple[int, int, int, int]],
                heads: list[int], idx_delta: int, avail_flags: int,
                regs: list[tuple[int, int, int]]) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        r = Rig(device, mem, size=size)
        q: DriverQueue = r.q
        for i in range(0x40):  # a few plausible blk headers in the scratch area
            mem.write(BUF + 16 * i, struct.pack("<IIQ", i % 10, 0, i * 3))
        for i, (addr, length, flags, nxt) in enumerate(descs[:size]):
            q.write_desc(i, addr, length, flags, nxt)
        for h in heads:
            q.put_avail(h)
        q.set_avail_idx(q.avail_idx + idx_delta)
        q.set_avail_flags(avail_flags)
        r.transport.notify(0)
        r.drv.kick(0)
        for off, width, value in regs:
            if value < 0:
                r.transport.read(off, width)
            else:
                r.transport.write(off, value.to_bytes(8, "little")[:width])
            r.transport.notify(value & 3)
        r.transport.notify(0)
        assert r.drv.read32(Reg.MAGIC_VALUE) == MAGIC_VALUE
        assert r.transport.internal_errors == 0
        q2 = r.transport.queues[0]
        if not r.transport.needs_reset and q2.ready:
            assert 0 <= ((q2.next_avail - q2.next_used) & 0xFFFF) <= size  # nothing popped twice
    close_device(device)


def close_device(device: VirtioDevice) -> None:
    if isinstance(device, Block) and isinstance(device.backend, FileBackend):
        device.backend.close()


REGS = st.lists(st.tuples(st.integers(0, 0x1FF), st.sampled_from([0, 1, 2, 3, 4, 8]),
                          st.one_of(st.integers(-1, 0xFF), st.integers(0, 2**32 - 1))), max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(DEVICES)), size=st.sampled_from([1, 2, 4, 8, 16]),
       descs=st.lists(DESC, max_size=16), heads=st.lists(st.integers(0, 20), max_size=20),
       idx_delta=st.sampled_from([0, 0, 0, 1, 17, 0x8000, 0xFFFF]), avail_flags=st.integers(0, 3),
       regs=REGS)
def test_random_rings_never_raise(image: Path, kind: str, size: int,
                                  descs: list[tuple[int, int, int, int]], heads: list[int],
                                  idx_delta: int, avail_flags: int,
                                  regs: list[tuple[int, int, int]]) -> None:
    run_hostile(DEVICES[kind](image), size, descs, heads, idx_delta, avail_flags, regs)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(DEVICES)),
       ops=st.lists(st.tuples(st.integers(0, 0x1FF), st.sampled_from([1, 2, 4, 8]),
                              st.integers(-1, 2**32 - 1)), max_size=40))
def test_random_register_traffic_never_raises(image: Path, kind: str,
                                              ops: list[tuple[int, int, int]]) -> None:
    with GuestMemory([(0, 1 << 16)]) as mem:
        t = MmioTransport(DEVICES[kind](image), mem, CountingIrq())
        for off, width, value in ops:
            if value < 0:
                assert len(t.read(off, width)) == width
            else:
                t.write(off, value.to_bytes(8, "little")[:width])
        assert t.read(0, 4) == b"virt"
        assert t.internal_errors == 0
        close_device(t.device)
