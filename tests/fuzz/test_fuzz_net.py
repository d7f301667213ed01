"""Fuzz: virtio-net transmit chains and receive buffers from a hostile driver, through the real MMIO transport.

Every TX chain the fuzzer posts must be completed (used length 0) with either one well-formed frame handed
to the backend or none; every RX buffer gets a whole frame behind the §5.1.6 header, or used length 0.
Nothing may raise out of the queue handlers (the transport's ``internal_errors`` stays 0, the host-driven
``backend_readable`` never raises), the device holds at most one frame, and afterwards a well-formed frame
still goes through both ways unless the device asked for a reset.
"""

from __future__ import annotations

import struct
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st
from virtio_driver import DriverQueue, VirtioDriver

from smold.devices.irq import CountingIrq
from smold.devices.net import Net
from smold.devices.net.device import RX_QUEUE, TX_QUEUE
from smold.devices.net.request import (
    ETH_HLEN,
    MAX_FRAME_LEN,
    NET_HDR_SIZE,
    RX_HEADER,
    FrameError,
    NetHeader,
    parse_tx,
    rx_room,
)
from smold.devices.virtio.mmio import MmioTransport
from smold.devices.virtio.queue import (
    VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
    ChainError,
    Descriptor,
    DescriptorChain,
)
from smold.memory import GuestMemory

pytestmark = pytest.mark.timeout(300)

RAM = 1 << 20
BUF = 0x80000          # hostile buffers live above the driver's allocator (rings, good buffers)
MAC = "06:00:ac:10:00:02"
GOOD_FRAME = b"\xff" * 6 + bytes.fromhex("0600ac100002") + b"\x08\x00" + b"\x42" * 46


class FloodBackend:
    """A backend that hands out the frames it is given and records what the guest sent; it may fail."""

    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.sent: list[bytes] = []
        self.wanted = False
        self.fail_send = False
        self.fail_recv = False

    def recv(self) -> bytes | None:
        if self.fail_recv:
            raise OSError(5, "fake receive failure")
        return self.frames.popleft() if self.frames else None

    def send(self, frame: bytes) -> None:
        if self.fail_send:
            raise OSError(105, "fake send failure")
        self.sent.append(bytes(frame))

    def want_rx(self, on: bool) -> None:
        self.wanted = on


# -- building blocks: hostile descriptors ----------------------------------------------------------------
addr_st = st.one_of(st.integers(BUF, RAM - 1), st.integers(0, 2**64 - 1), st.just(RAM - 8), st.just(BUF))
len_st = st.one_of(st.integers(0, 2048), st.sampled_from([NET_HDR_SIZE, NET_HDR_SIZE + ETH_HLEN, 0xFFFFFFFF,
                                                          2**31, NET_HDR_SIZE + MAX_FRAME_LEN + 1]))
desc_st = st.tuples(addr_st, len_st, st.booleans())
net_hdr_st = st.builds(lambda f, g, rest: struct.pack("<BBHHHHH", f, g, *rest),
                       st.one_of(st.just(0), st.integers(0, 255)), st.one_of(st.just(0), st.integers(0, 255)),
                       st.tuples(*[st.integers(0, 0xFFFF)] * 5))
# A chain: its descriptors, optional 'next' overrides (loops, out-of-table links), and the bytes at BUF.
chain_st = st.tuples(st.lists(desc_st, min_size=1, max_size=6), st.lists(st.integers(0, 300), max_size=6),
                     net_hdr_st, st.binary(max_size=64))


def post_raw(mem: GuestMemory, q: DriverQueue, descs: list[tuple[int, int, bool]], nexts: list[int],
             base: int) -> None:
    """Write ``descs`` into descriptor slots ``base..`` (hostile flags and links) and publish the head."""
    for i, (addr, length, write) in enumerate(descs):
        last = i == len(descs) - 1
        flags = (VIRTQ_DESC_F_WRITE if write else 0) | (0 if last else VIRTQ_DESC_F_NEXT)
        nxt = nexts[i] if i < len(nexts) else base + i + 1
        q.write_desc((base + i) % q.size, addr, length, flags, nxt)
    q.put_avail(base % q.size)


def make_rig(mem: GuestMemory) -> tuple[Net, FloodBackend, MmioTransport, VirtioDriver]:
    backend = FloodBackend()
    dev = Net(MAC, backend)
    t = MmioTransport(dev, mem, CountingIrq())
    drv = VirtioDriver(t, mem, alloc_end=BUF)
    drv.negotiate()
    return dev, backend, t, drv


def check_sent(frames: list[bytes]) -> None:
    for f in frames:
        assert ETH_HLEN <= len(f) <= MAX_FRAME_LEN


def still_works(dev: Net, backend: FloodBackend, t: MmioTransport, drv: VirtioDriver) -> None:
    """After the storm: one good frame out and one in, through fresh driver-built chains."""
    backend.fail_send = backend.fail_recv = False
    txq, rxq = drv.queues[TX_QUEUE], drv.queues[RX_QUEUE]
    for q in (txq, rxq):   # the hostile chains used descriptor slots the driver thinks are free: start over
        q.free_desc = list(range(q.size // 2, q.size))
        q.used()
    backend.sent.clear()
    p = txq.add(readable=[NetHeader().pack() + GOOD_FRAME])
    drv.kick(TX_QUEUE)
    assert [u.head for u in txq.used()] == [p.head]
    assert backend.sent == [GOOD_FRAME]
    # Hostile buffers still posted take filler frames (or are skipped) until the ring is drained.
    for _ in range(4):
        backend.frames.extend([GOOD_FRAME[:ETH_HLEN] + b"filler"] * rxq.size)
        dev.backend_readable()
    backend.frames.clear()
    rxq.used()
    assert t.internal_errors == 0
    if t.needs_reset:
        return   # a hostile buffer overlapped the guest's own rings and broke them: reset requested
    good = [rxq.add(writable=[NET_HDR_SIZE + 1518]) for _ in range(2)]   # one may take a frame still held
    drv.kick(RX_QUEUE)
    backend.frames.append(GOOD_FRAME)
    dev.backend_readable()
    used = {u.head: u.length for u in rxq.used()}
    got = [g.written(drv.mem, used[g.head]) for g in good if used.get(g.head)]
    assert got and got[-1] == RX_HEADER + GOOD_FRAME
    assert not backend.frames and not dev.pending_frame
    assert t.internal_errors == 0


@given(chains=st.lists(chain_st, min_size=1, max_size=10), fail_send=st.booleans())
def test_net_tx_survives_hostile_chains(chains: list, fail_send: bool) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        dev, backend, t, drv = make_rig(mem)
        backend.fail_send = fail_send
        txq = drv.queues[TX_QUEUE]
        for n, (descs, nexts, header, body) in enumerate(chains):
            mem.write(BUF, header + body)
            before = txq.used_idx()
            post_raw(mem, txq, descs, nexts, base=(n * 8) % txq.size)
            drv.kick(TX_QUEUE)
            assert t.internal_errors == 0
            if t.needs_reset:
                return   # a ring the device refused: it asked for a reset, as §2.1.2 allows
            assert (txq.used_idx() - before) & 0xFFFF == 1   # that chain completed, nothing else
            assert all(u.length == 0 for u in txq.used())   # transmit buffers are never written
        check_sent(backend.sent)
        assert len(backend.sent) == dev.stats.tx_frames   # (chains outside RAM fail in the queue, uncounted)
        assert dev.stats.tx_frames + dev.stats.tx_errors + dev.stats.tx_dropped <= len(chains)
        still_works(dev, backend, t, drv)


@given(buffers=st.lists(chain_st, min_size=1, max_size=10),
       frames=st.lists(st.one_of(st.integers(0, 1600), st.just(MAX_FRAME_LEN)), max_size=12),
       host_ops=st.lists(st.sampled_from(["readable", "kick", "link", "detach", "fail_recv", "reset_avail"]),
                         max_size=8))
def test_net_rx_survives_hostile_buffers(buffers: list, frames: list[int], host_ops: list[str]) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        dev, backend, t, drv = make_rig(mem)
        rxq = drv.queues[RX_QUEUE]
        offered = [bytes([i & 0xFF]) * n for i, n in enumerate(frames)]
        backend.frames.extend(offered)
        for n, (descs, nexts, _header, _body) in enumerate(buffers):
            post_raw(mem, rxq, descs, nexts, base=(n * 8) % rxq.size)
            op = host_ops[n] if n < len(host_ops) else "readable"
            if op == "kick":
                drv.kick(RX_QUEUE)
            elif op == "link":
                dev.set_link(not dev.link_up)
            elif op == "detach":
                dev.attach_backend(None if dev.backend is not None else backend)
            elif op == "fail_recv":
                backend.fail_recv = not backend.fail_recv
            elif op == "reset_avail":
                rxq.set_avail_idx(rxq.avail_idx + 0x7000)   # claims far more buffers than the ring holds
            dev.backend_readable()   # host-driven: must never raise
            assert t.internal_errors == 0
            for u in rxq.used():
                assert u.length == 0 or NET_HDR_SIZE <= u.length <= NET_HDR_SIZE + MAX_FRAME_LEN
            if t.needs_reset:
                assert not backend.wanted   # a broken ring stops reading from the host
                return
        # Frames leave the backend in order; each was delivered, dropped, or is the one still held.
        taken = len(offered) - len(backend.frames)
        assert dev.stats.rx_frames + dev.stats.rx_dropped + (1 if dev.pending_frame else 0) == taken
        if dev.backend is None:
            dev.attach_backend(backend)
        still_works(dev, backend, t, drv)


@given(descs=st.lists(desc_st, max_size=6), header=net_hdr_st, body=st.binary(max_size=64))
def test_net_tx_parser(descs: list[tuple[int, int, bool]], header: bytes, body: bytes) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        mem.write(BUF, header + body)
        descs = [(a, n, w) for a, n, w in descs if n == 0 or mem.contains(a, n)]   # as Queue.pop guarantees
        readable = tuple(Descriptor(a, n, False) for a, n, w in descs if not w)
        writable = tuple(Descriptor(a, n, True) for a, n, w in descs if w)
        chain = DescriptorChain(0, readable, writable)
        try:
            tx = parse_tx(mem, chain)
        except (FrameError, ChainError):
            return
        assert not writable
        assert ETH_HLEN <= len(tx.frame) <= MAX_FRAME_LEN
        assert tx.header.flags == 0 and tx.header.gso_type == 0
        assert len(tx.frame) + NET_HDR_SIZE == chain.readable_len
        assert rx_room(chain) == -1   # a transmit chain is never a receive buffer
