"""Split virtqueues (virtio 1.2 section 2.7), read from hostile guest memory with validation."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from smold.memory import GuestMemory, GuestMemoryError

# virtio 1.2 §2.7.5: descriptor flags.
VIRTQ_DESC_F_NEXT = 1
VIRTQ_DESC_F_WRITE = 2
VIRTQ_DESC_F_INDIRECT = 4
# §2.7.6 / §2.7.8: ring flags.
VIRTQ_AVAIL_F_NO_INTERRUPT = 1
VIRTQ_USED_F_NO_NOTIFY = 1

MAX_QUEUE_SIZE = 1024
DESC_SIZE = 16


class QueueError(Exception):
    """The queue itself is unusable (bad layout or a driver that broke the ring protocol)."""


class ChainError(Exception):
    """One descriptor chain is malformed: that request fails, the queue goes on."""

    def __init__(self, head: int, reason: str) -> None:
        super().__init__(f"descriptor chain {head}: {reason}")
        self.head = head
        self.reason = reason


@dataclass(frozen=True)
class Descriptor:
    addr: int
    length: int
    write: bool


@dataclass(frozen=True)
class DescriptorChain:
    """A validated chain: device-readable descriptors first, then device-writable ones (§2.7.4.2)."""

    head: int
    readable: tuple[Descriptor, ...]
    writable: tuple[Descriptor, ...]

    @property
    def readable_len(self) -> int:
        return sum(d.length for d in self.readable)

    @property
    def writable_len(self) -> int:
        return sum(d.length for d in self.writable)

    def read_all(self, mem: GuestMemory, limit: int) -> bytes:
        """Gather all device-readable bytes; ChainError if they exceed ``limit``."""
        if self.readable_len > limit:
            raise ChainError(self.head, f"readable length {self.readable_len} exceeds {limit}")
        try:
            return b"".join(mem.read(d.addr, d.length) for d in self.readable)
        except GuestMemoryError as e:
            raise ChainError(self.head, str(e)) from e

    def write_all(self, mem: GuestMemory, data: bytes, offset: int = 0) -> int:
        """Scatter ``data`` into the writable descriptors starting at byte ``offset``; returns bytes written."""
        written = 0
        pos = 0
        view = memoryview(data)
        for d in self.writable:
            if written >= len(data):
                break
            if offset >= pos + d.length:
                pos += d.length
                continue
            start = max(0, offset - pos)
            n = min(d.length - start, len(data) - written)
            try:
                mem.write(d.addr + start, view[written:written + n])
            except GuestMemoryError as e:
                raise ChainError(self.head, str(e)) from e
            written += n
            pos += d.length
        return written


@dataclass(frozen=True)
class QueueState:
    """Snapshot state of one queue: plain values only."""

    size: int
    ready: bool
    desc_addr: int
    avail_addr: int
    used_addr: int
    next_avail: int
    next_used: int


class Queue:
    """The device side of one split virtqueue.

    The driver programs size and ring addresses through the transport, then sets ready.
    ``pop`` returns the next available chain (or None), ``add_used`` publishes a completion.
    """

    def __init__(self, max_size: int = 256) -> None:
        if max_size <= 0 or max_size > MAX_QUEUE_SIZE or max_size & (max_size - 1):
            raise QueueError(f"queue max size {max_size} must be a power of two <= {MAX_QUEUE_SIZE}")
        self.max_size = max_size
        self.reset()

    def reset(self) -> None:
        self.size = self.max_size
        self.ready = False
        self.desc_addr = 0
        self.avail_addr = 0
        self.used_addr = 0
        self.next_avail = 0
        self.next_used = 0
        self.broken = False

    # -- validation ---------------------------------------------------------------------------------
    def validate(self, mem: GuestMemory) -> None:
        """Check the ring layout once the driver marks the queue ready (§2.7: alignment and sizes)."""
        s = self.size
        if s == 0 or s > self.max_size or s & (s - 1):
            raise QueueError(f"queue size {s} invalid (max {self.max_size}, power of two)")
        if self.desc_addr % 16 or self.avail_addr % 2 or self.used_addr % 4:
            raise QueueError("queue ring addresses are misaligned")
        for name, addr, length in (("descriptor table", self.desc_addr, DESC_SIZE * s),
                                   ("available ring", self.avail_addr, 6 + 2 * s),
                                   ("used ring", self.used_addr, 6 + 8 * s)):
            if not mem.contains(addr, length):
                raise QueueError(f"{name} at {addr:#x}+{length:#x} is outside guest RAM")

    # -- driver -> device -----------------------------------------------------------------------------
    def avail_idx(self, mem: GuestMemory) -> int:
        return mem.read_u16(self.avail_addr + 2)

    def avail_flags(self, mem: GuestMemory) -> int:
        return mem.read_u16(self.avail_addr)

    def has_available(self, mem: GuestMemory) -> bool:
        return self.ready and not self.broken and self.avail_idx(mem) != self.next_avail

    def pop(self, mem: GuestMemory) -> DescriptorChain | None:
        """Take the next available chain.

        Raises ChainError for a malformed chain (the caller completes it with used length 0) and
        QueueError when the ring itself is inconsistent (the caller marks the device broken).
        """
        if not self.ready or self.broken:
            return None
        try:
            avail = self.avail_idx(mem)
            pending = (avail - self.next_avail) & 0xFFFF
            if pending == 0:
                return None
            if pending > self.size:
                self.broken = True
                raise QueueError(f"available index {avail} is {pending} ahead of {self.next_avail} "
                                 f"(queue size {self.size})")
            slot = self.next_avail % self.size
            head = mem.read_u16(self.avail_addr + 4 + 2 * slot)
        except GuestMemoryError as e:
            self.broken = True
            raise QueueError(str(e)) from e
        self.next_avail = (self.next_avail + 1) & 0xFFFF
        if head >= self.size:
            self.broken = True
            raise QueueError(f"available ring names descriptor {head}, queue size {self.size}")
        return self._walk(mem, head)

    def _walk(self, mem: GuestMemory, head: int) -> DescriptorChain:
        readable: list[Descriptor] = []
        writable: list[Descriptor] = []
        index = head
        # A chain longer than the queue must contain a loop (§2.7.5.3.1: bounded by queue size).
        for _ in range(self.size):
            try:
                raw = mem.read(self.desc_addr + DESC_SIZE * index, DESC_SIZE)
            except GuestMemoryError as e:
                raise ChainError(head, str(e)) from e
            addr, length, flags, nxt = struct.unpack("<QIHH", raw)
            if flags & VIRTQ_DESC_F_INDIRECT:
                raise ChainError(head, "indirect descriptors were not negotiated")
            if length and not mem.contains(addr, length):
                raise ChainError(head, f"buffer {addr:#x}+{length:#x} is outside guest RAM")
            desc = Descriptor(addr, length, bool(flags & VIRTQ_DESC_F_WRITE))
            if desc.write:
                writable.append(desc)
            elif writable:
                raise ChainError(head, "device-readable descriptor after a device-writable one")
            else:
                readable.append(desc)
            if not flags & VIRTQ_DESC_F_NEXT:
                return DescriptorChain(head, tuple(readable), tuple(writable))
            if nxt >= self.size:
                raise ChainError(head, f"next index {nxt} beyond queue size {self.size}")
            index = nxt
        raise ChainError(head, f"chain longer than queue size {self.size} (loop)")

    # -- device -> driver ---------------------------------------------------------------------------
    def add_used(self, mem: GuestMemory, head: int, length: int) -> None:
        """Publish a used element (§2.7.8) and bump used.idx."""
        if head >= self.size:
            raise QueueError(f"used element for descriptor {head} beyond queue size {self.size}")
        slot = self.next_used % self.size
        try:
            mem.write(self.used_addr + 4 + 8 * slot, struct.pack("<II", head, length & 0xFFFFFFFF))
            self.next_used = (self.next_used + 1) & 0xFFFF
            mem.write_u16(self.used_addr + 2, self.next_used)
        except GuestMemoryError as e:
            self.broken = True
            raise QueueError(str(e)) from e

    def needs_interrupt(self, mem: GuestMemory) -> bool:
        """Honour VIRTQ_AVAIL_F_NO_INTERRUPT (EVENT_IDX is not offered)."""
        try:
            return not self.avail_flags(mem) & VIRTQ_AVAIL_F_NO_INTERRUPT
        except GuestMemoryError:
            return True

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> QueueState:
        return QueueState(self.size, self.ready, self.desc_addr, self.avail_addr, self.used_addr,
                          self.next_avail, self.next_used)

    def restore(self, state: QueueState) -> None:
        self.size = state.size
        self.ready = state.ready
        self.desc_addr = state.desc_addr
        self.avail_addr = state.avail_addr
        self.used_addr = state.used_addr
        self.next_avail = state.next_avail
        self.next_used = state.next_used
        self.broken = False
