"""Fuzz: virtio-blk requests and virtio-vsock packets from a hostile driver, through the real MMIO transport.

Every chain the fuzzer posts must complete (used ring) or be refused with a typed error inside the device;
an unexpected exception is counted by the transport as ``internal_errors`` and fails the test. After the
storm a well-formed request must still work (the device was not wedged).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from virtio_driver import DriverQueue, Used, VirtioDriver

from smold.devices.block import Block, FileBackend
from smold.devices.block.request import RequestError, RequestType, Status, parse_request
from smold.devices.irq import CountingIrq
from smold.devices.virtio.mmio import CONFIG_OFFSET, MmioTransport, Reg
from smold.devices.virtio.queue import VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, Descriptor, DescriptorChain
from smold.devices.vsock.device import Vsock, VsockConnection, VsockError, VsockHost
from smold.devices.vsock.packet import HEADER_SIZE, Header, Op, PacketError, parse_tx
from smold.memory import GuestMemory

pytestmark = pytest.mark.timeout(300)

RAM = 1 << 20
BUF = 0x80000
SECTORS = 64
GUEST_CID, HOST_CID = 3, 2


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    p = tmp_path_factory.mktemp("fuzz") / "disk.img"
    p.write_bytes(bytes(range(256)) * 2 * SECTORS)
    yield p


# -- building blocks: hostile descriptors ----------------------------------------------------------------
addr_st = st.one_of(st.integers(BUF, RAM - 1), st.integers(0, 2**64 - 1), st.just(RAM - 8))
len_st = st.one_of(st.integers(0, 2048), st.sampled_from([16, 512, 513, 0xFFFFFFFF, 2**31]))
desc_st = st.tuples(addr_st, len_st, st.booleans())
header_st = st.builds(lambda t, r, s: struct.pack("<IIQ", t, r, s),
                      st.one_of(st.sampled_from([0, 1, 4, 8, 11, 13]), st.integers(0, 2**32 - 1)),
                      st.integers(0, 2**32 - 1),
                      st.one_of(st.integers(0, SECTORS + 2), st.integers(0, 2**64 - 1)))


def chain_of(descs: list[tuple[int, int, bool]]) -> DescriptorChain:
    readable = tuple(Descriptor(a, n, False) for a, n, w in descs if not w)
    writable = tuple(Descriptor(a, n, True) for a, n, w in descs if w)
    return DescriptorChain(0, readable, writable)


@given(descs=st.lists(desc_st, max_size=6), header=header_st, read_only=st.booleans())
def test_block_request_parser(descs: list[tuple[int, int, bool]], header: bytes, read_only: bool) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        mem.write(BUF, header)
        descs = [(a, n, w) for a, n, w in descs if n == 0 or mem.contains(a, n)]   # as Queue.pop guarantees
        try:
            req = parse_request(mem, chain_of(descs), capacity=SECTORS, read_only=read_only, max_bytes=1 << 20)
        except RequestError as e:
            assert e.status in (Status.IOERR, Status.UNSUPP)
            return
        if req.type in (RequestType.IN, RequestType.OUT):
            assert req.sector + req.data_len // 512 <= SECTORS and req.data_len % 512 == 0
            assert not (read_only and req.type is RequestType.OUT)


class Chains:
    """Post raw descriptor chains (possibly malformed) on a driver queue and kick."""

    def __init__(self, drv: VirtioDriver, queue: int) -> None:
        self.drv, self.q, self.index = drv, drv.queues[queue], queue

    def post(self, descs: list[tuple[int, int, bool]], next_: list[int] | None = None) -> None:
        for i, (addr, length, write) in enumerate(descs):
            last = i == len(descs) - 1
            flags = (VIRTQ_DESC_F_WRITE if write else 0) | (0 if last else VIRTQ_DESC_F_NEXT)
            nxt = next_[i] if next_ is not None and i < len(next_) else i + 1
            self.q.write_desc(i, addr & (2**64 - 1), length & 0xFFFFFFFF, flags, nxt & 0xFFFF)
        self.q.put_avail(0)
        self.drv.kick(self.index)


@given(requests=st.lists(st.tuples(st.lists(desc_st, min_size=1, max_size=5), header_st,
                                   st.lists(st.integers(0, 300), max_size=5)), min_size=1, max_size=8))
def test_block_device_survives_hostile_requests(disk: Path, requests: list) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        backend = FileBackend(disk, read_only=True)
        try:
            t = MmioTransport(Block(backend, read_only=True), mem, CountingIrq())
            drv = VirtioDriver(t, mem, alloc_end=BUF)
            drv.negotiate()
            rig = Chains(drv, 0)
            for descs, header, nexts in requests:
                mem.write(BUF, header)
                rig.post(descs, nexts)
                assert t.internal_errors == 0
                if t.needs_reset:
                    return   # a ring the device refused: it asked for a reset, as §2.1.2 allows
                release(drv.queues[0], drv.queues[0].used())
            used, data = drv.request(0, [struct.pack("<IIQ", RequestType.IN, 0, 1)], [512, 1])
            assert used.length == 513 and data[-1] == Status.OK
            assert t.internal_errors == 0
        finally:
            backend.close()


# -- vsock -----------------------------------------------------------------------------------------------
class AcceptingHost(VsockHost):
    """Accepts every guest connection and drains data at once, like the real backend with a fast peer."""

    def __init__(self) -> None:
        self.device: Vsock | None = None
        self.changes = 0

    def on_guest_connect(self, conn: VsockConnection) -> None:
        assert self.device is not None
        if conn.host_port % 2:
            self.device.accept_connection(conn)
        else:
            self.device.reset_connection(conn)

    def on_change(self, conn: VsockConnection) -> None:
        self.changes += 1


packet_st = st.builds(
    Header,
    src_cid=st.one_of(st.just(GUEST_CID), st.integers(0, 2**64 - 1)),
    dst_cid=st.one_of(st.just(HOST_CID), st.integers(0, 2**64 - 1)),
    src_port=st.one_of(st.integers(1000, 1003), st.integers(0, 2**32 - 1)),
    dst_port=st.one_of(st.integers(1023, 1025), st.integers(0, 2**32 - 1)),
    len=st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)),
    type=st.one_of(st.just(1), st.integers(0, 0xFFFF)),
    op=st.one_of(st.sampled_from(list(Op)), st.integers(0, 0xFFFF)),
    flags=st.integers(0, 2**32 - 1),
    buf_alloc=st.one_of(st.integers(0, 1 << 16), st.integers(0, 2**32 - 1)),
    fwd_cnt=st.integers(0, 2**32 - 1),
)


def release(q: DriverQueue, done: list[Used]) -> list[Used]:
    for u in done:
        p = q.pending.get(u.head)
        if p is not None:
            q.release(p)
    return done


@given(packets=st.lists(st.tuples(packet_st, st.binary(max_size=96), st.integers(1, 4)), min_size=1, max_size=12),
       host_ops=st.lists(st.tuples(st.sampled_from(["connect", "send", "recv", "shutdown"]), st.integers(0, 7),
                                   st.binary(max_size=64)), max_size=6))
def test_vsock_device_survives_hostile_packets(packets: list, host_ops: list) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        host = AcceptingHost()
        dev = Vsock(guest_cid=GUEST_CID, host=host, buf_alloc=256, to_guest_cap=512, max_connections=4)
        host.device = dev
        t = MmioTransport(dev, mem, CountingIrq())
        drv = VirtioDriver(t, mem, alloc_end=BUF)
        rxq, _txq, _evq = drv.negotiate()
        for _ in range(8):
            rxq.add(writable=[HEADER_SIZE + 128])
        drv.kick(0)
        for i, (hdr, payload, pieces) in enumerate(packets):
            raw = hdr.pack() + payload
            cut = max(1, len(raw) // pieces)
            txq = drv.queues[1]
            txq.add(readable=[raw[k:k + cut] for k in range(0, len(raw), cut)])
            drv.kick(1)
            release(txq, txq.used())
            if i < len(host_ops):
                op, n, data = host_ops[i]
                conns = dev.connections
                if op == "connect" and len(conns) < 4:
                    dev.connect_to_guest(1024 + n)
                elif op == "connect":   # full: refused to the host caller (the backend closes its client)
                    with pytest.raises(VsockError, match="too many vsock connections"):
                        dev.connect_to_guest(1024 + n)
                elif conns:
                    conn = conns[n % len(conns)]
                    if op == "send" and not conn.closed:
                        dev.send_to_guest(conn, data)
                    elif op == "recv":
                        dev.recv_from_guest(conn, 64)
                    elif op == "shutdown" and not conn.closed:
                        dev.shutdown_connection(conn)
            for _ in release(rxq, rxq.used()):   # the guest consumes what the device wrote
                rxq.add(writable=[HEADER_SIZE + 128])
            drv.kick(0)
            assert t.internal_errors == 0
            assert len(dev.connections) <= 4
            for conn in dev.connections:
                assert dev.pending_from_guest(conn) <= 256      # the guest cannot overrun our buffer
                assert len(conn.to_guest) <= 512


@given(descs=st.lists(desc_st, max_size=5), header=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE + 64))
def test_vsock_tx_parser(descs: list[tuple[int, int, bool]], header: bytes) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        mem.write(BUF, header)
        descs = [(a, n, w) for a, n, w in descs if n == 0 or mem.contains(a, n)]
        try:
            pkt = parse_tx(mem, chain_of(descs), max_payload=4096)
        except PacketError:
            return
        assert len(pkt.payload) == pkt.header.len <= 4096


@given(writes=st.lists(st.tuples(st.integers(0, 0x200), st.binary(min_size=0, max_size=8)), max_size=40))
def test_mmio_register_and_config_writes(disk: Path, writes: list[tuple[int, bytes]]) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        backend = FileBackend(disk, read_only=True)
        try:
            for dev in (Block(backend, read_only=True), Vsock(guest_cid=GUEST_CID)):
                t = MmioTransport(dev, mem, CountingIrq())
                for offset, data in writes:
                    t.write(offset, data)
                    t.read(offset, len(data) or 4)
                    if offset == Reg.QUEUE_NOTIFY and len(data) == 4:
                        t.notify(int.from_bytes(data, "little") & 3)
                assert t.internal_errors == 0
                assert len(t.read(CONFIG_OFFSET, 8)) == 8
        finally:
            backend.close()
