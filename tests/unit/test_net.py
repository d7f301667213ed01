"""virtio-net through the real transport with a fake backend (virtio 1.2 §5.1): config, TX, RX, hostile chains."""

from __future__ import annotations

import dataclasses
import errno
import struct
from collections import deque
from collections.abc import Iterator

import pytest
from virtio_driver import Pending, VirtioDriver, assert_plain_state

from smold.devices.irq import CountingIrq
from smold.devices.net import Net, NetState, parse_mac
from smold.devices.net import backend as netbackend
from smold.devices.net.backend import NetBackendError, check_tap_name, open_tap
from smold.devices.net.device import (
    RX_QUEUE,
    TX_QUEUE,
    VIRTIO_NET_F_MAC,
    VIRTIO_NET_F_STATUS,
    NetError,
    format_mac,
)
from smold.devices.net.request import (
    MAX_FRAME_LEN,
    NET_HDR_SIZE,
    RX_HEADER,
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
    NetHeader,
)
from smold.devices.virtio.device import (
    INT_CONFIG_CHANGE,
    STATUS_DEVICE_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
    VIRTIO_ID_NET,
)
from smold.devices.virtio.mmio import MmioTransport, Reg
from smold.devices.virtio.persist import PersistError
from smold.devices.virtio.queue import VIRTQ_DESC_F_NEXT
from smold.memory import GuestMemory
from smold.snapshot import codec

MAC = "06:00:ac:10:00:02"
RX_BUF = NET_HDR_SIZE + 1518  # what Linux posts without mergeable buffers (hdr + GOOD_PACKET_LEN)
TX_HDR = NetHeader().pack()


def frame(n: int = 60, fill: int = 0x42) -> bytes:
    """An Ethernet frame of ``n`` bytes: broadcast destination, our source, IPv4 ethertype, payload."""
    head = b"\xff" * 6 + parse_mac(MAC) + b"\x08\x00"
    return head + bytes([fill]) * (n - len(head))


class FakeBackend:
    def __init__(self) -> None:
        self.frames: deque[bytes] = deque()
        self.sent: list[bytes] = []
        self.wanted = False
        self.want_calls: list[bool] = []
        self.send_error: int | None = None

    def recv(self) -> bytes | None:
        return self.frames.popleft() if self.frames else None

    def send(self, data: bytes) -> None:
        if self.send_error is not None:
            raise OSError(self.send_error, "fake send failure")
        self.sent.append(bytes(data))

    def want_rx(self, on: bool) -> None:
        self.wanted = on
        self.want_calls.append(on)


class Rig:
    def __init__(self, mem: GuestMemory, backend: FakeBackend | None = None) -> None:
        self.mem = mem
        self.backend = backend or FakeBackend()
        self.dev = Net(MAC, self.backend)
        self.irq = CountingIrq()
        self.transport = MmioTransport(self.dev, mem, self.irq)
        self.drv = VirtioDriver(self.transport, mem)
        self.rxq, self.txq = self.drv.negotiate()

    def post_rx(self, *sizes: int, kick: bool = True) -> list[Pending]:
        out = [self.rxq.add(writable=[s]) for s in sizes]
        if kick:
            self.drv.kick(RX_QUEUE)
        return out

    def send(self, *parts: bytes) -> int:
        p = self.txq.add(readable=list(parts))
        self.drv.kick(TX_QUEUE)
        done = self.txq.used()
        assert [u.head for u in done] == [p.head]
        self.txq.release(p)
        return done[0].length

    def received(self, pendings: list[Pending]) -> list[bytes | None]:
        """Frames the guest got in ``pendings`` (None: completed with used length 0), header checked."""
        by_head = {u.head: u.length for u in self.rxq.used()}
        out: list[bytes | None] = []
        for p in pendings:
            if p.head not in by_head:
                continue
            n = by_head[p.head]
            if n == 0:
                out.append(None)
                continue
            data = p.written(self.mem, n)
            assert data[:NET_HDR_SIZE] == RX_HEADER
            out.append(data[NET_HDR_SIZE:])
        return out


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 1 << 20)]) as m:
        yield m


@pytest.fixture
def rig(mem: GuestMemory) -> Rig:
    return Rig(mem)


# -- identity, features, config space ------------------------------------------------------------------
def test_identity_features_and_config(rig: Rig) -> None:
    assert rig.drv.read32(Reg.DEVICE_ID) == VIRTIO_ID_NET
    assert rig.drv.device_features() == VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS
    assert len(rig.transport.queues) == 2
    assert rig.drv.read_config(0, 6) == bytes.fromhex("0600ac100002")
    assert rig.drv.read_config(6, 2) == struct.pack("<H", 1)  # VIRTIO_NET_S_LINK_UP
    assert rig.drv.read_config(8, 4) == bytes(4)  # nothing else is offered


def test_config_writes_ignored(rig: Rig) -> None:
    rig.drv.write_config(0, b"\x02\x00\x00\x00\x00\x01")
    assert rig.drv.read_config(0, 6) == bytes.fromhex("0600ac100002")


def test_link_change_notifies(rig: Rig) -> None:
    rig.drv.ack_interrupts()
    rig.dev.set_link(False)
    assert rig.drv.read_config(6, 2) == bytes(2)
    assert rig.drv.interrupt_status() & INT_CONFIG_CHANGE
    before = rig.irq.count
    rig.dev.set_link(False)  # no change, no interrupt
    assert rig.irq.count == before


def test_header_layout() -> None:
    assert NET_HDR_SIZE == 12
    assert RX_HEADER == bytes(10) + b"\x01\x00"  # §5.1.6.4: num_buffers 1 without MRG_RXBUF
    h = NetHeader(1, 2, 3, 4, 5, 6, 7)
    assert NetHeader.unpack(h.pack()) == h


@pytest.mark.parametrize("text, raw", [("06:00:ac:10:00:02", bytes.fromhex("0600ac100002")),
                                       ("02:AB:cd:00:00:ff", bytes.fromhex("02abcd0000ff"))])
def test_parse_mac(text: str, raw: bytes) -> None:
    assert parse_mac(text) == raw
    assert format_mac(raw) == text.lower()


@pytest.mark.parametrize("bad", ["", "06:00:ac:10:00", "06:00:ac:10:00:02:03", "0600ac100002", "06:00:ac:10:00:zz",
                                 "01:00:5e:00:00:01", "00:00:00:00:00:00", "6:0:ac:10:0:2", b"\x06\x00"])
def test_parse_mac_rejects(bad: str | bytes) -> None:
    with pytest.raises(NetError):
        parse_mac(bad)


# -- TX ---------------------------------------------------------------------------------------------------
def test_tx_frame_reaches_backend_byte_identical(rig: Rig) -> None:
    f = frame(1514, 0x17)
    assert rig.send(TX_HDR + f) == 0  # nothing written into a transmit chain
    assert rig.backend.sent == [f]
    assert rig.dev.stats.tx_frames == 1 and rig.dev.stats.tx_bytes == 1514
    assert rig.irq.count >= 1


def test_tx_header_and_frame_split_over_descriptors(rig: Rig) -> None:
    f = frame(300)
    rig.send(TX_HDR[:5], TX_HDR[5:] + f[:7], f[7:100], f[100:])
    assert rig.backend.sent == [f]


def test_tx_many_frames_one_kick(rig: Rig) -> None:
    frames = [frame(60 + i, i) for i in range(40)]
    pend = [rig.txq.add(readable=[TX_HDR + f]) for f in frames]
    rig.drv.kick(TX_QUEUE)
    assert sorted(u.head for u in rig.txq.used()) == sorted(p.head for p in pend)
    assert rig.backend.sent == frames


@pytest.mark.parametrize("parts, why", [
    ([TX_HDR], "header only"),
    ([TX_HDR + b"\x00" * 13], "shorter than an Ethernet header"),
    ([b"\x00" * 11], "shorter than the header"),
    ([NetHeader(flags=VIRTIO_NET_HDR_F_NEEDS_CSUM).pack() + frame()], "checksum offload not negotiated"),
    ([NetHeader(gso_type=1).pack() + frame()], "TSO not negotiated"),
    ([TX_HDR + b"\x00" * (MAX_FRAME_LEN + 1)], "too long"),
])
def test_tx_malformed_fails_only_that_request(rig: Rig, parts: list[bytes], why: str) -> None:
    assert rig.send(*parts) == 0
    assert rig.backend.sent == [], why
    assert rig.dev.stats.tx_errors == 1
    rig.send(TX_HDR + frame())
    assert rig.backend.sent == [frame()]
    assert not rig.transport.needs_reset


def test_tx_chain_with_writable_descriptor_refused(rig: Rig) -> None:
    p = rig.txq.add(readable=[TX_HDR + frame()], writable=[16])
    rig.drv.kick(TX_QUEUE)
    assert [(u.head, u.length) for u in rig.txq.used()] == [(p.head, 0)]
    assert rig.backend.sent == [] and rig.dev.stats.tx_errors == 1


def test_tx_buffer_outside_ram_and_loop(rig: Rig, mem: GuestMemory) -> None:
    q = rig.txq
    q.write_desc(0, mem.size - 8, 64)  # runs off the end of guest RAM
    q.put_avail(0)
    q.write_desc(1, 0x2000, 16, VIRTQ_DESC_F_NEXT, 2)
    q.write_desc(2, 0x2000, 16, VIRTQ_DESC_F_NEXT, 1)  # a loop
    q.put_avail(1)
    rig.drv.kick(TX_QUEUE)
    assert [(u.head, u.length) for u in q.used()] == [(0, 0), (1, 0)]
    assert rig.backend.sent == []
    assert not rig.transport.needs_reset


def test_tx_backend_failure_drops_frame(rig: Rig) -> None:
    rig.backend.send_error = errno.ENOBUFS
    assert rig.send(TX_HDR + frame()) == 0
    assert rig.dev.stats.tx_dropped == 1
    rig.backend.send_error = None
    rig.send(TX_HDR + frame(70))
    assert rig.backend.sent == [frame(70)]


def test_tx_without_backend_drops(mem: GuestMemory) -> None:
    r = Rig(mem)
    r.dev.attach_backend(None)
    assert r.send(TX_HDR + frame()) == 0
    assert r.dev.stats.tx_dropped == 1


# -- RX ---------------------------------------------------------------------------------------------------
def test_rx_wanted_only_with_buffers(rig: Rig) -> None:
    assert not rig.backend.wanted  # activated with an empty receive queue
    rig.post_rx(RX_BUF)
    assert rig.backend.wanted and rig.dev.rx_wanted


def test_rx_frames_delivered_with_header(rig: Rig) -> None:
    bufs = rig.post_rx(RX_BUF, RX_BUF, RX_BUF)
    frames = [frame(60), frame(1514, 7), frame(98, 3)]
    rig.backend.frames.extend(frames)
    before = rig.irq.count
    rig.dev.backend_readable()
    assert rig.received(bufs) == frames
    assert rig.irq.count == before + 1  # one interrupt for the batch
    assert rig.dev.stats.rx_frames == 3 and rig.dev.stats.rx_bytes == 60 + 1514 + 98
    assert not rig.backend.wanted  # every buffer used: stop reading


def test_rx_into_split_buffers(rig: Rig) -> None:
    p = rig.rxq.add(writable=[NET_HDR_SIZE, 100, 2000])  # header in its own descriptor, like some drivers
    rig.drv.kick(RX_QUEUE)
    f = frame(1200, 9)
    rig.backend.frames.append(f)
    rig.dev.backend_readable()
    assert rig.received([p]) == [f]


def test_rx_buffer_exhaustion_stops_reading_and_resumes(rig: Rig) -> None:
    frames = [frame(60 + i, i) for i in range(5)]
    rig.backend.frames.extend(frames)
    first = rig.post_rx(RX_BUF)  # the kick delivers straight away
    assert rig.received(first) == frames[:1]
    assert not rig.backend.wanted
    rig.dev.backend_readable()  # a stale readiness callback: nothing to fill, nothing lost
    assert len(rig.backend.frames) == 4
    more = rig.post_rx(RX_BUF, RX_BUF)
    assert rig.received(more) == frames[1:3]
    assert len(rig.backend.frames) == 2  # the rest waits in the host's queue, not in the device
    assert not rig.backend.wanted and not rig.dev.pending_frame
    last = rig.post_rx(RX_BUF, RX_BUF, RX_BUF)
    assert rig.received(last) == frames[3:]
    assert rig.backend.wanted  # a buffer is left: wait for the next frame


def test_rx_without_frames_keeps_buffers(rig: Rig) -> None:
    bufs = rig.post_rx(RX_BUF, RX_BUF)
    rig.dev.backend_readable()
    assert rig.rxq.used() == [] and rig.backend.wanted
    rig.backend.frames.append(frame())
    rig.dev.backend_readable()
    assert rig.received(bufs) == [frame()]


def test_rx_frame_too_big_for_buffer_dropped(rig: Rig) -> None:
    small, big = rig.post_rx(NET_HDR_SIZE + 100, RX_BUF)
    rig.backend.frames.extend([frame(500, 1), frame(500, 2)])
    rig.dev.backend_readable()
    assert rig.received([small, big]) == [None, frame(500, 2)]
    assert rig.dev.stats.rx_dropped == 1


def test_rx_chain_with_readable_descriptor_is_skipped(rig: Rig) -> None:
    bad = rig.rxq.add(readable=[b"x" * 16], writable=[RX_BUF])
    tiny = rig.rxq.add(writable=[4])  # cannot even hold the header
    good = rig.rxq.add(writable=[RX_BUF])
    rig.drv.kick(RX_QUEUE)
    rig.backend.frames.append(frame(77))
    rig.dev.backend_readable()
    assert rig.received([bad, tiny, good]) == [None, None, frame(77)]
    assert rig.dev.stats.rx_dropped == 0  # the frame waited for a usable buffer


def test_rx_malformed_chain_then_good(rig: Rig, mem: GuestMemory) -> None:
    q = rig.rxq
    q.write_desc(0, mem.size - 4, 4096, 2)  # writable, outside RAM
    q.put_avail(0)
    q.free_desc.remove(0)
    good = q.add(writable=[RX_BUF])
    rig.drv.kick(RX_QUEUE)
    rig.backend.frames.append(frame(64))
    rig.dev.backend_readable()
    used = {u.head: u.length for u in q.used()}
    assert used[0] == 0 and used[good.head] == NET_HDR_SIZE + 64
    assert not rig.transport.needs_reset


def test_rx_broken_ring_needs_reset(rig: Rig) -> None:
    rig.post_rx(RX_BUF)
    rig.rxq.set_avail_idx(0x8000)  # claims far more buffers than the ring holds
    rig.backend.frames.append(frame())
    rig.dev.backend_readable()
    assert rig.drv.status & STATUS_DEVICE_NEEDS_RESET
    assert not rig.backend.wanted


def test_rx_many_frames_fill_exactly_the_buffers(mem: GuestMemory) -> None:
    r = Rig(mem)
    size = r.rxq.size
    r.backend.frames.extend(frame(60) for _ in range(size + 5))
    bufs = r.post_rx(*([NET_HDR_SIZE + 60] * 64), kick=False)
    r.dev.backend_readable()
    assert len(r.received(bufs)) == 64
    assert len(r.backend.frames) == size + 5 - 64


def test_reset_stops_rx_and_drops_pending(rig: Rig) -> None:
    rig.post_rx(RX_BUF)
    assert rig.backend.wanted
    rig.drv.reset()
    assert not rig.backend.wanted and not rig.dev.activated
    rig.backend.frames.append(frame())
    rig.dev.backend_readable()  # a late callback after reset does nothing
    assert len(rig.backend.frames) == 1


# -- snapshot state ---------------------------------------------------------------------------------------
def test_persist_round_trip(rig: Rig, mem: GuestMemory) -> None:
    rig.dev.set_link(False)
    state = rig.dev.save()
    assert_plain_state(state)
    assert state == NetState(mac=bytes.fromhex("0600ac100002"), link_up=False,
                             acked_features=rig.dev.acked_features)
    assert codec.decode(NetState, codec.encode(state)) == state
    other = Net("02:00:00:00:00:09", FakeBackend())
    other.restore(state)
    assert other.mac == state.mac and other.link_up is False and other.acked_features == state.acked_features
    t2 = MmioTransport(other, mem, CountingIrq())
    t2.restore(rig.transport.save())
    assert other.activated and t2.read(0x100, 6) == state.mac


def test_persist_rejects(rig: Rig) -> None:
    with pytest.raises(PersistError):
        rig.dev.restore(rig.dev.save())  # into an active device
    with pytest.raises(PersistError):
        Net().restore(dataclasses.replace(rig.dev.save(), mac=b"\x06\x00"))


# -- TAP backend pieces that need no TAP -----------------------------------------------------------------
def test_tun_ioctl_numbers() -> None:
    # The values <linux/if_tun.h> yields on x86-64: computed from the _IOW/_IOR encoding, checked here.
    assert netbackend.TUNSETIFF == 0x400454CA
    assert netbackend.TUNSETOFFLOAD == 0x400454D0
    assert netbackend.TUNGETIFF == 0x800454D2
    assert netbackend.TUNSETVNETHDRSZ == 0x400454D8


@pytest.mark.parametrize("name", ["", "x" * 16, "a/b", "a b", "a:1", ".."])
def test_bad_tap_names(name: str) -> None:
    with pytest.raises(NetBackendError):
        check_tap_name(name)


def test_missing_tap_refused() -> None:
    with pytest.raises(NetBackendError, match="no network interface"):
        open_tap("smolnosuchtap0")


def test_rx_kick_with_broken_ring_needs_reset_without_frames(rig: Rig) -> None:
    rig.rxq.set_avail_idx(0x8000)
    rig.drv.kick(RX_QUEUE)
    assert rig.transport.needs_reset
    assert not rig.backend.wanted


def test_tap_backend_readiness_follows_want_rx() -> None:
    """``want_rx`` adds/removes the loop reader, also when called from another thread (a vCPU)."""
    import asyncio
    import os
    import socket
    import threading

    from smold.devices.net.backend import TapBackend

    async def go() -> list[str]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # keeps frame boundaries, like a TAP
        a.setblocking(False)
        r, w = a.detach(), b.detach()
        tap = TapBackend("fake0", fd=r)
        seen: list[str] = []
        fired = asyncio.Event()

        def readable() -> None:
            seen.append("readable")
            fired.set()
            tap.want_rx(False)  # like the device once the guest's buffers are used up

        tap.want_rx(True)  # before start: remembered
        tap.start(asyncio.get_running_loop(), readable)
        os.write(w, NetHeader().pack() + frame(60))
        await asyncio.wait_for(fired.wait(), 5)
        await asyncio.sleep(0.05)
        assert seen == ["readable"]  # not watching any more although the data is still there
        assert tap.recv() == frame(60) and tap.recv() is None
        fired.clear()
        t = threading.Thread(target=tap.want_rx, args=(True,))
        t.start()
        t.join()
        os.write(w, NetHeader().pack() + frame(61))
        await asyncio.wait_for(fired.wait(), 5)
        assert seen == ["readable", "readable"]
        assert tap.recv() == frame(61)
        os.write(w, NetHeader(gso_type=4).pack() + frame(62))  # offload metadata we never asked for: skipped
        os.write(w, b"\x00" * 5)                               # shorter than the header: skipped
        os.write(w, NetHeader().pack() + frame(63))
        assert tap.recv() == frame(63) and tap.bad_frames == 2
        tap.close()
        os.close(w)
        return seen

    assert asyncio.run(go()) == ["readable", "readable"]


def test_held_frame_dropped_on_detach_is_counted(rig: Rig) -> None:
    """The one frame the device holds for the next buffer is counted as dropped when it is let go."""
    first = rig.post_rx(NET_HDR_SIZE)       # a buffer that takes a frame of 0 bytes only
    rig.backend.frames.append(frame(60))
    rig.dev.backend_readable()
    assert rig.received(first) == [None] and rig.dev.stats.rx_dropped == 1
    rig.rxq.add(readable=[b"x" * 16])      # not a receive buffer: the next frame is taken and held
    rig.drv.kick(RX_QUEUE)
    rig.backend.frames.append(frame(61))
    rig.dev.backend_readable()
    assert rig.dev.pending_frame
    rig.dev.attach_backend(FakeBackend())
    assert not rig.dev.pending_frame and rig.dev.stats.rx_dropped == 2
