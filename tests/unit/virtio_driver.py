"""A mock virtio guest driver for unit tests: split virtqueues in GuestMemory, virtio-mmio registers.

Reusable for any device behind ``MmioTransport`` (block, rng, vsock, ...)::

    mem = GuestMemory([(0, 1 << 20)])
    transport = MmioTransport(device, mem, CountingIrq())
    drv = VirtioDriver(transport, mem)
    queues = drv.negotiate()                       # §3.1.1 init sequence through the registers
    used, data = drv.request(0, readable=[hdr], writable=[513])   # post, kick, wait for one used

Lower-level pieces: ``DriverQueue.add`` (post without kicking), ``DriverQueue.used`` (collect
completions), ``DriverQueue.write_desc``/``put_avail``/``set_avail_idx`` (hand-craft hostile rings),
and ``Allocator`` (guest-physical buffer allocation).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from smold.devices.bus import BusDevice
from smold.devices.virtio.device import (
    STATUS_ACKNOWLEDGE,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
    VirtioDevice,
)
from smold.devices.virtio.mmio import CONFIG_OFFSET, Reg
from smold.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE
from smold.memory import GuestMemory


class DriverError(Exception):
    """The mock driver could not do what the test asked (device refused, queue full, no completion)."""


class Allocator:
    """First-fit allocator over a guest-physical range, with free and coalescing."""

    def __init__(self, base: int, end: int) -> None:
        self._free: list[tuple[int, int]] = [(base, end - base)]

    def alloc(self, size: int, align: int = 16) -> int:
        size = max(size, 1)
        for i, (start, length) in enumerate(self._free):
            addr = -(-start // align) * align
            pad = addr - start
            if length - pad >= size:
                rest: list[tuple[int, int]] = []
                if pad:
                    rest.append((start, pad))
                if length - pad - size:
                    rest.append((addr + size, length - pad - size))
                self._free[i:i + 1] = rest
                return addr
        raise DriverError(f"guest allocator exhausted ({size} bytes)")

    def free(self, addr: int, size: int) -> None:
        size = max(size, 1)
        self._free.append((addr, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


@dataclass(frozen=True)
class Used:
    head: int
    length: int


@dataclass
class Pending:
    """A chain the driver made available: its descriptors and the buffers behind them."""

    head: int
    desc_indices: list[int]
    readable: list[tuple[int, int]]
    writable: list[tuple[int, int]]
    owned: list[tuple[int, int]] = field(default_factory=list)  # buffers the driver allocated

    def written(self, mem: GuestMemory, length: int | None = None) -> bytes:
        """Gather the first ``length`` bytes (default all) of the device-writable buffers."""
        out = b"".join(mem.read(a, n) for a, n in self.writable)
        return out if length is None else out[:length]


class DriverQueue:
    """The driver side of one split virtqueue (§2.7): descriptor table, available and used rings."""

    def __init__(self, mem: GuestMemory, index: int, size: int, desc_addr: int, avail_addr: int,
                 used_addr: int, alloc: Allocator) -> None:
        self.mem = mem
        self.index = index
        self.size = size
        self.desc_addr = desc_addr
        self.avail_addr = avail_addr
        self.used_addr = used_addr
        self.alloc = alloc
        self.avail_idx = 0
        self.last_used = 0
        self.free_desc = list(range(size))
        self.pending: dict[int, Pending] = {}

    # -- raw ring access (for hostile tests) ----------------------------------------------------------
    def write_desc(self, i: int, addr: int, length: int, flags: int = 0, next_: int = 0) -> None:
        self.mem.write(self.desc_addr + 16 * i, struct.pack("<QIHH", addr & (2**64 - 1),
                                                            length & 0xFFFFFFFF, flags, next_ & 0xFFFF))

    def put_avail(self, head: int) -> None:
        """Place ``head`` in the next available slot and publish it (§2.7.13)."""
        self.mem.write_u16(self.avail_addr + 4 + 2 * (self.avail_idx % self.size), head & 0xFFFF)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        self.mem.write_u16(self.avail_addr + 2, self.avail_idx)

    def set_avail_idx(self, value: int) -> None:
        self.avail_idx = value & 0xFFFF
        self.mem.write_u16(self.avail_addr + 2, self.avail_idx)

    def set_avail_flags(self, flags: int) -> None:
        self.mem.write_u16(self.avail_addr, flags)

    def used_idx(self) -> int:
        return self.mem.read_u16(self.used_addr + 2)

    def used_flags(self) -> int:
        return self.mem.read_u16(self.used_addr)

    # -- normal operation ---------------------------------------------------------------------------
    def add_chain(self, buffers: Sequence[tuple[int, int, bool]]) -> Pending:
        """Build a chain over caller-provided (addr, len, device_writable) buffers and publish it."""
        if not buffers:
            raise DriverError("a chain needs at least one buffer")
        if len(buffers) > len(self.free_desc):
            raise DriverError("queue full")
        idx = [self.free_desc.pop(0) for _ in buffers]
        for n, (addr, length, write) in enumerate(buffers):
            last = n == len(buffers) - 1
            flags = (VIRTQ_DESC_F_WRITE if write else 0) | (0 if last else VIRTQ_DESC_F_NEXT)
            self.write_desc(idx[n], addr, length, flags, 0 if last else idx[n + 1])
        p = Pending(idx[0], idx, [(a, n) for a, n, w in buffers if not w],
                    [(a, n) for a, n, w in buffers if w])
        self.pending[p.head] = p
        self.put_avail(p.head)
        return p

    def add(self, readable: Sequence[bytes] = (), writable: Sequence[int] = ()) -> Pending:
        """Allocate guest buffers holding ``readable`` and of sizes ``writable``, then publish a chain."""
        owned: list[tuple[int, int]] = []
        bufs: list[tuple[int, int, bool]] = []
        for data in readable:
            addr = self.alloc.alloc(len(data))
            self.mem.write(addr, data)
            owned.append((addr, len(data)))
            bufs.append((addr, len(data), False))
        for size in writable:
            addr = self.alloc.alloc(size)
            self.mem.fill(addr, size, 0xA5)  # poison: tests see what the device really wrote
            owned.append((addr, size))
            bufs.append((addr, size, True))
        p = self.add_chain(bufs)
        p.owned = owned
        return p

    def used(self) -> list[Used]:
        """Collect used elements published since the last call; frees their descriptors and buffers."""
        out: list[Used] = []
        end = self.used_idx()
        while self.last_used != end:
            slot = self.last_used % self.size
            head, length = struct.unpack("<II", self.mem.read(self.used_addr + 4 + 8 * slot, 8))
            out.append(Used(head, length))
            self.last_used = (self.last_used + 1) & 0xFFFF
            p = self.pending.get(head)
            if p is not None:
                self.free_desc.extend(p.desc_indices)
        return out

    def release(self, p: Pending) -> None:
        """Return a completed chain's driver-allocated buffers to the allocator."""
        self.pending.pop(p.head, None)
        for addr, size in p.owned:
            self.alloc.free(addr, size)
        p.owned = []


class VirtioDriver:
    """Drives a virtio-mmio register window the way Linux's virtio_mmio + virtio core do."""

    def __init__(self, transport: BusDevice, mem: GuestMemory, *, alloc_base: int = 0x1000,
                 alloc_end: int | None = None) -> None:
        self.transport = transport
        self.mem = mem
        region = mem.regions[0]
        self.alloc = Allocator(max(alloc_base, region.guest_addr), alloc_end or region.end)
        self.queues: dict[int, DriverQueue] = {}

    def rebind(self, transport: BusDevice) -> None:
        """Point at a different register window (e.g. a transport restored from a snapshot)."""
        self.transport = transport

    # -- registers ----------------------------------------------------------------------------------
    def read32(self, reg: int) -> int:
        return int.from_bytes(self.transport.read(reg, 4), "little")

    def write32(self, reg: int, value: int) -> None:
        self.transport.write(reg, (value & 0xFFFFFFFF).to_bytes(4, "little"))

    @property
    def status(self) -> int:
        return self.read32(Reg.STATUS)

    def add_status(self, bits: int) -> None:
        self.write32(Reg.STATUS, self.status | bits)  # like Linux virtio_add_status

    def reset(self) -> None:
        self.write32(Reg.STATUS, 0)
        self.queues.clear()

    def device_features(self) -> int:
        self.write32(Reg.DEVICE_FEATURES_SEL, 0)
        lo = self.read32(Reg.DEVICE_FEATURES)
        self.write32(Reg.DEVICE_FEATURES_SEL, 1)
        return lo | self.read32(Reg.DEVICE_FEATURES) << 32

    def write_driver_features(self, features: int) -> None:
        self.write32(Reg.DRIVER_FEATURES_SEL, 0)
        self.write32(Reg.DRIVER_FEATURES, features & 0xFFFFFFFF)
        self.write32(Reg.DRIVER_FEATURES_SEL, 1)
        self.write32(Reg.DRIVER_FEATURES, (features >> 32) & 0xFFFFFFFF)

    def read_config(self, offset: int, size: int) -> bytes:
        return self.transport.read(CONFIG_OFFSET + offset, size)

    def write_config(self, offset: int, data: bytes) -> None:
        self.transport.write(CONFIG_OFFSET + offset, data)

    def interrupt_status(self) -> int:
        return self.read32(Reg.INTERRUPT_STATUS)

    def ack_interrupts(self) -> int:
        """What an interrupt handler does: read InterruptStatus, write it to InterruptACK."""
        pending = self.interrupt_status()
        if pending:
            self.write32(Reg.INTERRUPT_ACK, pending)
        return pending

    # -- initialisation (§3.1.1) --------------------------------------------------------------------
    def negotiate_features(self, features: int | None = None, *, check: bool = True) -> bool:
        """Reset, ACKNOWLEDGE, DRIVER, write features (default: all offered), FEATURES_OK, re-read."""
        self.reset()
        self.add_status(STATUS_ACKNOWLEDGE)
        self.add_status(STATUS_DRIVER)
        offered = self.device_features()
        self.write_driver_features(offered if features is None else features)
        self.add_status(STATUS_FEATURES_OK)
        ok = bool(self.status & STATUS_FEATURES_OK)
        if check and not ok:
            raise DriverError("device refused the features (FEATURES_OK not latched)")
        return ok

    def setup_queue(self, index: int, size: int | None = None, *, ready: bool = True) -> DriverQueue:
        """§4.2.3.2: select, check QueueReady is 0, read QueueNumMax, lay out rings, write addresses."""
        self.write32(Reg.QUEUE_SEL, index)
        if self.read32(Reg.QUEUE_READY):
            raise DriverError(f"queue {index} already ready")
        num_max = self.read32(Reg.QUEUE_NUM_MAX)
        if num_max == 0:
            raise DriverError(f"queue {index} not available")
        size = num_max if size is None else size
        desc = self.alloc.alloc(16 * size, 16)
        avail = self.alloc.alloc(6 + 2 * size, 2)
        used = self.alloc.alloc(6 + 8 * size, 4)
        for addr, n in ((desc, 16 * size), (avail, 6 + 2 * size), (used, 6 + 8 * size)):
            self.mem.fill(addr, n, 0)
        self.write32(Reg.QUEUE_NUM, size)
        for low, addr in ((Reg.QUEUE_DESC_LOW, desc), (Reg.QUEUE_DRIVER_LOW, avail),
                          (Reg.QUEUE_DEVICE_LOW, used)):
            self.write32(low, addr & 0xFFFFFFFF)
            self.write32(low + 4, addr >> 32)
        if ready:
            self.write32(Reg.QUEUE_READY, 1)
        q = DriverQueue(self.mem, index, size, desc, avail, used, self.alloc)
        self.queues[index] = q
        return q

    def negotiate(self, features: int | None = None, *, queues: Sequence[int] | None = None,
                  sizes: dict[int, int] | None = None) -> list[DriverQueue]:
        """The whole §3.1.1 sequence; sets up ``queues`` (default: every queue the device has)."""
        self.negotiate_features(features)
        if queues is None:
            queues = []
            while True:
                self.write32(Reg.QUEUE_SEL, len(queues))
                if not self.read32(Reg.QUEUE_NUM_MAX):
                    break
                queues.append(len(queues))
        out = [self.setup_queue(i, (sizes or {}).get(i)) for i in queues]
        self.add_status(STATUS_DRIVER_OK)
        if not self.status & STATUS_DRIVER_OK:
            raise DriverError("DRIVER_OK not latched")
        return out

    # -- I/O ------------------------------------------------------------------------------------------
    def kick(self, index: int, *, ioeventfd: bool = False) -> None:
        """Notify the device: a QueueNotify write, or the VMM's ioeventfd path (``transport.notify``)."""
        if ioeventfd:
            notify: Callable[[int], None] = getattr(self.transport, "notify")  # noqa: B009
            notify(index)
        else:
            self.write32(Reg.QUEUE_NOTIFY, index)

    def request(self, index: int, readable: Sequence[bytes] = (), writable: Sequence[int] = (), *,
                ioeventfd: bool = False) -> tuple[Used, bytes]:
        """Post one chain, kick, and return its used element and the whole writable area.

        Bytes the device did not write keep the 0xA5 poison; slice with ``used.length`` for devices
        that fill from the front (rng), or read a trailing status byte (blk) from the end.
        """
        q = self.queues[index]
        p = q.add(readable, writable)
        self.kick(index, ioeventfd=ioeventfd)
        done = q.used()
        if len(done) != 1 or done[0].head != p.head:
            raise DriverError(f"expected one completion of {p.head}, got {done}")
        data = p.written(self.mem)
        q.release(p)
        return done[0], data


@dataclass(frozen=True)
class DeviceCase:
    """One device for the generic transport tests (snapshot round trip, hostile rings).

    ``make(ctx)`` builds a fresh device over the same host resources each call (``ctx`` is a
    per-test dict, e.g. holding ``tmp_path``); ``exercise(drv, device)`` performs some I/O through a
    negotiated driver and asserts it worked; it must be repeatable on a restored device.
    """

    name: str
    make: Callable[[dict[str, Any]], VirtioDevice]
    exercise: Callable[[VirtioDriver, VirtioDevice], None]
    queues: tuple[int, ...] | None = None


def assert_plain_state(state: object) -> None:
    """Rule 6: snapshot state is a frozen dataclass of plain values (no fds, memory or objects)."""
    assert dataclasses.is_dataclass(state) and not isinstance(state, type), f"{state!r} is not a dataclass"
    assert type(state).__dataclass_params__.frozen, f"{type(state).__name__} is not frozen"  # type: ignore[attr-defined]
    for f in dataclasses.fields(state):
        _assert_plain_value(getattr(state, f.name), f"{type(state).__name__}.{f.name}")


def _assert_plain_value(value: object, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            _assert_plain_value(v, f"{where}[{i}]")
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        assert_plain_state(value)
        return
    raise AssertionError(f"{where} = {value!r} is not a plain value")
