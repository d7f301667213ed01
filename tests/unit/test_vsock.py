"""virtio-vsock through the real transport (virtio 1.2 §5.10): a mock guest vsock driver, no KVM."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from virtio_driver import VirtioDriver, assert_plain_state

from smold.agent import AgentConnectError, connect_vsock_uds
from smold.daemon import guestops
from smold.devices.irq import CountingIrq
from smold.devices.virtio.device import VIRTIO_F_VERSION_1, VIRTIO_ID_VSOCK
from smold.devices.virtio.mmio import MmioTransport, Reg
from smold.devices.virtio.persist import PersistError
from smold.devices.virtio.queue import VIRTQ_DESC_F_NEXT
from smold.devices.vsock import (
    ConnState,
    Vsock,
    VsockBackend,
    VsockBackendError,
    VsockConnection,
    VsockError,
    VsockHost,
    VsockState,
)
from smold.devices.vsock.backend import parse_connect
from smold.devices.vsock.device import EPHEMERAL_PORT_BASE, MAX_PENDING_REPLIES
from smold.devices.vsock.packet import (
    HEADER_SIZE,
    HOST_CID,
    MAX_PAYLOAD,
    SHUTDOWN_BOTH,
    SHUTDOWN_RECEIVE,
    SHUTDOWN_SEND,
    TYPE_STREAM,
    Header,
    Op,
    is_guest_cid,
)
from smold.memory import GuestMemory

CID = 3
RX_BUF = HEADER_SIZE + 4096  # what Linux posts: a header and one page of payload


@dataclass
class Flow:
    """The guest's view of one connection, with its credit bookkeeping (§5.10.6.3)."""

    guest_port: int
    host_port: int
    buf_alloc: int
    established: bool = False
    closed: bool = False
    got_rst: bool = False
    peer_shutdown: int = 0
    # guest receive side
    rx_cnt: int = 0
    fwd_cnt: int = 0
    advertised_fwd: int = 0
    max_in_flight: int = 0
    inbox: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)
    # guest send side
    peer_buf_alloc: int = 0
    peer_fwd_cnt: int = 0
    tx_cnt: int = 0
    outbox: bytearray = field(default_factory=bytearray)

    @property
    def peer_free(self) -> int:
        return self.peer_buf_alloc - ((self.tx_cnt - self.peer_fwd_cnt) & 0xFFFFFFFF)


class Guest:
    """A guest vsock driver over the mock virtio driver: posts rx/event buffers, sends tx packets,
    answers REQUESTs on listening ports, and checks the device never exceeds its credit."""

    def __init__(self, vsock: Vsock, mem: GuestMemory, *, rx_buffers: int = 32,
                 rx_layout: Sequence[int] = (RX_BUF,), buf_alloc: int = 64 * 1024, auto_consume: bool = True,
                 echo: bool = False, answer_requests: bool = True) -> None:
        self.vsock = vsock
        self.mem = mem
        self.irq = CountingIrq()
        self.transport = MmioTransport(vsock, mem, self.irq)
        self.drv = VirtioDriver(self.transport, mem)
        self.rxq, self.txq, self.evq = self.drv.negotiate()
        self.rx_buffers = rx_buffers
        self.rx_layout = tuple(rx_layout)
        self.buf_alloc = buf_alloc
        self.auto_consume = auto_consume
        self.echo = echo
        self.answer_requests = answer_requests
        self.answer_shutdown = True
        self.listening: set[int] = set()
        self.flows: dict[tuple[int, int], Flow] = {}
        self.packets: list[tuple[Header, bytes]] = []
        self.events: list[bytes] = []
        self.next_port = 50000
        self.post_events(4)
        self.refill()

    # -- buffers ----------------------------------------------------------------------------------------
    def refill(self) -> None:
        for _ in range(self.rx_buffers - len(self.rxq.pending)):
            self.rxq.add(writable=list(self.rx_layout))
        self.drv.kick(0)

    def post_events(self, n: int) -> None:
        for _ in range(n):
            self.evq.add(writable=[4])
        self.drv.kick(2)

    def collect_events(self) -> list[bytes]:
        out = []
        for u in self.evq.used():
            p = self.evq.pending[u.head]
            out.append(p.written(self.mem, u.length))
            self.evq.release(p)
        self.events += out
        return out

    # -- tx ---------------------------------------------------------------------------------------------
    def send_chain(self, pieces: Sequence[bytes]) -> list[int]:
        """Post one tx chain of readable ``pieces``, kick, return the used lengths of completed chains."""
        p = self.txq.add(readable=list(pieces))
        self.drv.kick(1)
        lengths = [u.length for u in self.txq.used()]
        self.txq.release(p)
        return lengths

    def send(self, op: int, src_port: int, dst_port: int, payload: bytes = b"", *, flow: Flow | None = None,
             flags: int = 0, type_: int = TYPE_STREAM, src_cid: int | None = None, dst_cid: int = HOST_CID,
             length: int | None = None, buf_alloc: int | None = None, fwd_cnt: int | None = None,
             cuts: Sequence[int] = ()) -> list[int]:
        if flow is not None:
            buf_alloc, fwd_cnt = flow.buf_alloc, flow.fwd_cnt
            flow.advertised_fwd = flow.fwd_cnt
        raw = Header(CID if src_cid is None else src_cid, dst_cid, src_port, dst_port,
                     len(payload) if length is None else length, type_, op, flags,
                     self.buf_alloc if buf_alloc is None else buf_alloc, fwd_cnt or 0).pack() + payload
        bounds = [0, *cuts, len(raw)]
        return self.send_chain([raw[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a])

    def send_flow(self, flow: Flow, op: int, payload: bytes = b"", flags: int = 0) -> list[int]:
        return self.send(op, flow.guest_port, flow.host_port, payload, flow=flow, flags=flags)

    def connect(self, host_port: int) -> Flow:
        flow = Flow(self.next_port, host_port, self.buf_alloc)
        self.next_port += 1
        self.flows[(flow.guest_port, host_port)] = flow
        self.send_flow(flow, Op.REQUEST)
        return flow

    def write(self, flow: Flow, data: bytes) -> None:
        flow.outbox += data
        self.flush(flow)

    def flush(self, flow: Flow) -> None:
        while flow.outbox and not flow.closed and flow.established:
            n = min(len(flow.outbox), flow.peer_free, 4096)
            if n <= 0:
                return
            chunk = bytes(flow.outbox[:n])
            del flow.outbox[:n]
            flow.tx_cnt += n
            self.send_flow(flow, Op.RW, chunk)

    # -- rx ---------------------------------------------------------------------------------------------
    def poll(self) -> list[tuple[Header, bytes]]:
        """Take every used rx buffer, handle its packet, repost buffers. Returns the packets."""
        got: list[tuple[Header, bytes]] = []
        for _ in range(8):  # bounded: refilling lets the device write more at once
            used = self.rxq.used()
            if not used:
                break
            for u in used:
                p = self.rxq.pending[u.head]
                data = p.written(self.mem, u.length)
                self.rxq.release(p)
                if u.length == 0:
                    continue
                assert u.length >= HEADER_SIZE
                hdr = Header.unpack(data[:HEADER_SIZE])
                payload = data[HEADER_SIZE:]
                assert hdr.len == len(payload), (hdr, u.length)
                got.append((hdr, payload))
            self.refill()
        for hdr, payload in got:
            self._handle(hdr, payload)
        self.packets += got
        return got

    def _handle(self, hdr: Header, payload: bytes) -> None:
        assert (hdr.src_cid, hdr.dst_cid) == (HOST_CID, CID), hdr
        assert hdr.type == TYPE_STREAM or hdr.op == Op.RST, hdr  # an RST echoes a bad type
        key = (hdr.dst_port, hdr.src_port)
        flow = self.flows.get(key)
        if hdr.op == Op.REQUEST:
            assert flow is None or flow.closed
            if hdr.dst_port in self.listening and self.answer_requests:
                flow = Flow(hdr.dst_port, hdr.src_port, self.buf_alloc, established=True)
                flow.peer_buf_alloc, flow.peer_fwd_cnt = hdr.buf_alloc, hdr.fwd_cnt
                self.flows[key] = flow
                self.send_flow(flow, Op.RESPONSE)
            elif self.answer_requests:
                self.send(Op.RST, hdr.dst_port, hdr.src_port, buf_alloc=0, fwd_cnt=0)
            return
        if flow is None or flow.closed:
            return
        flow.peer_buf_alloc, flow.peer_fwd_cnt = hdr.buf_alloc, hdr.fwd_cnt
        if hdr.op == Op.RESPONSE:
            flow.established = True
        elif hdr.op == Op.RW:
            flow.rx_cnt += len(payload)
            in_flight = flow.rx_cnt - flow.advertised_fwd
            flow.max_in_flight = max(flow.max_in_flight, in_flight)
            assert in_flight <= flow.buf_alloc, f"device exceeded credit: {in_flight} > {flow.buf_alloc}"
            flow.inbox += payload
        elif hdr.op == Op.CREDIT_REQUEST:
            self.send_flow(flow, Op.CREDIT_UPDATE)
        elif hdr.op == Op.SHUTDOWN:
            flow.peer_shutdown |= hdr.flags
            if flow.peer_shutdown == SHUTDOWN_BOTH and not flow.inbox and self.answer_shutdown:
                flow.closed = True
                self.send_flow(flow, Op.RST)  # §5.10.6.5: clean disconnect ends with our RST
        elif hdr.op == Op.RST:
            flow.closed = flow.got_rst = True

    def consume(self, flow: Flow, n: int | None = None) -> bytes:
        n = len(flow.inbox) if n is None else min(n, len(flow.inbox))
        data = bytes(flow.inbox[:n])
        del flow.inbox[:n]
        flow.fwd_cnt += n
        flow.received += data
        if flow.fwd_cnt - flow.advertised_fwd >= flow.buf_alloc // 2 and not flow.closed:
            self.send_flow(flow, Op.CREDIT_UPDATE)
        return data

    def step(self) -> list[tuple[Header, bytes]]:
        got = self.poll()
        for flow in list(self.flows.values()):
            if self.auto_consume and flow.inbox:
                data = self.consume(flow)
                if self.echo:
                    flow.outbox += data
            self.flush(flow)
            if (flow.peer_shutdown == SHUTDOWN_BOTH and not flow.inbox and not flow.closed
                    and self.answer_shutdown):
                flow.closed = True
                self.send_flow(flow, Op.RST)
        self.collect_events()
        return got

    def flow(self, guest_port: int, host_port: int) -> Flow:
        return self.flows[(guest_port, host_port)]


class FakeHost(VsockHost):
    """Records the device's callbacks; tests act on them synchronously."""

    def __init__(self) -> None:
        self.connects: list[VsockConnection] = []
        self.changes: list[VsockConnection] = []

    def on_guest_connect(self, conn: VsockConnection) -> None:
        self.connects.append(conn)

    def on_change(self, conn: VsockConnection) -> None:
        self.changes.append(conn)


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 8 << 20)]) as m:
        yield m


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def dev(host: FakeHost) -> Vsock:
    return Vsock(guest_cid=CID, host=host)


@pytest.fixture
def guest(dev: Vsock, mem: GuestMemory) -> Guest:
    return Guest(dev, mem)


def open_host_conn(dev: Vsock, guest: Guest, port: int = 1024) -> tuple[VsockConnection, Flow]:
    guest.listening.add(port)
    conn = dev.connect_to_guest(port)
    guest.poll()
    assert conn.state is ConnState.ESTABLISHED
    return conn, guest.flow(port, conn.host_port)


def ops(packets: Sequence[tuple[Header, bytes]]) -> list[int]:
    return [h.op for h, _ in packets]


# -- identity -----------------------------------------------------------------------------------------
def test_identity_features_and_config(guest: Guest, dev: Vsock) -> None:
    assert guest.drv.read32(Reg.DEVICE_ID) == VIRTIO_ID_VSOCK == 19
    assert guest.drv.device_features() == VIRTIO_F_VERSION_1  # stream only: no SEQPACKET
    assert len(guest.transport.queues) == 3
    assert guest.drv.read_config(0, 8) == struct.pack("<Q", CID)
    assert guest.drv.read_config(0, 4) == struct.pack("<I", CID)
    assert guest.drv.read_config(4, 4) == bytes(4)  # §5.10.4: upper 32 bits zero
    guest.drv.write_config(0, b"\xff" * 8)  # read-only
    assert guest.drv.read_config(0, 8) == struct.pack("<Q", CID)
    big = Vsock(guest_cid=0xFFFFFFFE)
    assert big.config_space() == struct.pack("<Q", 0xFFFFFFFE)


@pytest.mark.parametrize("cid", [0, 1, 2, 0xFFFFFFFF, 1 << 32, -1])
def test_reserved_cids_rejected(cid: int) -> None:
    assert not is_guest_cid(cid)
    with pytest.raises(VsockError):
        Vsock(guest_cid=cid)


def test_bad_parameters() -> None:
    with pytest.raises(VsockError):
        Vsock(guest_cid=3, buf_alloc=0)
    with pytest.raises(VsockError):
        Vsock(guest_cid=3, max_connections=0)


def test_header_layout() -> None:
    h = Header(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    raw = h.pack()
    assert len(raw) == HEADER_SIZE == 44
    assert raw == struct.pack("<QQIIIHHIII", 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert Header.unpack(raw) == h
    with pytest.raises(ValueError):
        Header.unpack(raw[:-1])


# -- host-initiated connections -------------------------------------------------------------------------
def test_host_connect_request_and_response(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    guest.listening.add(1024)
    conn = dev.connect_to_guest(1024)
    assert conn.state is ConnState.CONNECTING
    got = guest.poll()
    req, _ = got[0]
    assert req.op == Op.REQUEST
    assert (req.src_cid, req.dst_cid) == (HOST_CID, CID)
    assert (req.src_port, req.dst_port) == (EPHEMERAL_PORT_BASE, 1024)
    assert req.buf_alloc == dev.buf_alloc and req.fwd_cnt == 0 and req.len == 0
    assert conn.state is ConnState.ESTABLISHED  # the guest answered RESPONSE
    assert conn in host.changes
    assert guest.irq.count > 0
    conn2 = dev.connect_to_guest(1024)
    assert conn2.host_port == EPHEMERAL_PORT_BASE + 1  # unique among live connections


def test_host_connect_refused_with_rst(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn = dev.connect_to_guest(7777)  # nobody listens
    guest.poll()
    assert conn.state is ConnState.CLOSED
    assert conn in host.changes
    assert dev.connections == ()


def test_connect_needs_a_running_device(host: FakeHost) -> None:
    dev = Vsock(guest_cid=CID, host=host)
    with pytest.raises(VsockError):
        dev.connect_to_guest(1024)


def test_connect_port_range(dev: Vsock, guest: Guest) -> None:
    for port in (-1, 1 << 32):
        with pytest.raises(VsockError):
            dev.connect_to_guest(port)


def test_response_before_request_is_reset(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_buffers=0)
    conn = dev.connect_to_guest(1024)  # REQUEST queued, not yet sent (no rx buffers)
    guest.send(Op.RESPONSE, 1024, conn.host_port)
    assert conn.state is ConnState.CLOSED


def test_request_waits_for_rx_buffers(dev: Vsock, mem: GuestMemory) -> None:
    g = Guest(dev, mem, rx_buffers=0)
    g.listening.add(5)
    conn = dev.connect_to_guest(5)
    assert g.poll() == []
    g.rx_buffers = 1
    g.refill()
    g.poll()
    assert conn.state is ConnState.ESTABLISHED


# -- data -----------------------------------------------------------------------------------------------
def test_data_both_ways_byte_identical(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    assert dev.send_to_guest(conn, b"hello guest") == 11
    guest.step()
    assert bytes(flow.received) == b"hello guest"
    guest.write(flow, b"hello host")
    assert dev.pending_from_guest(conn) == 10
    assert dev.recv_from_guest(conn, 4) == b"hell"
    assert dev.recv_from_guest(conn, 100) == b"o host"
    assert dev.recv_from_guest(conn, 100) == b""


def test_one_megabyte_host_to_guest_respects_credit(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, buf_alloc=32 * 1024, rx_buffers=8, auto_consume=False)
    conn, flow = open_host_conn(dev, guest)
    data = os.urandom(1 << 20)
    sent = 0
    credit_updates = 0
    for _ in range(10_000):
        if sent < len(data):
            sent += dev.send_to_guest(conn, data[sent:sent + 50_000])
        before = flow.advertised_fwd
        guest.poll()
        guest.consume(flow, 10_000)  # a slow reader: credit runs out regularly
        credit_updates += flow.advertised_fwd != before
        if len(flow.received) == len(data):
            break
    assert bytes(flow.received) == data
    assert flow.max_in_flight <= flow.buf_alloc
    assert credit_updates >= 20
    rw = [h for h, _ in guest.packets if h.op == Op.RW]
    assert max(h.len for h in rw) <= 4096  # split to the rx buffers


def test_one_megabyte_guest_to_host_with_credit_updates(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    assert flow.peer_buf_alloc == dev.buf_alloc
    data = os.urandom(1 << 20)
    guest.write(flow, data)
    out = bytearray()
    updates = 0
    for _ in range(10_000):
        out += dev.recv_from_guest(conn, 16 * 1024)
        got = guest.step()
        updates += sum(1 for h, _ in got if h.op == Op.CREDIT_UPDATE)
        if len(out) == len(data):
            break
    assert bytes(out) == data
    assert updates >= 4  # 1 MB through a 256 KiB window
    assert conn.state is ConnState.ESTABLISHED and not flow.got_rst


def test_guest_overrunning_credit_is_reset(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    chunk = b"x" * MAX_PAYLOAD
    for _ in range(dev.buf_alloc // MAX_PAYLOAD):
        guest.send_flow(flow, Op.RW, chunk)
    assert conn.state is ConnState.ESTABLISHED
    guest.send_flow(flow, Op.RW, b"one too many")
    assert conn.state is ConnState.CLOSED
    guest.poll()
    assert flow.got_rst


def test_payload_split_to_small_rx_buffers(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_layout=(HEADER_SIZE, 100))  # header and data in separate descriptors
    conn, flow = open_host_conn(dev, guest)
    data = os.urandom(1000)
    assert dev.send_to_guest(conn, data) == 1000
    for _ in range(50):
        guest.step()
    assert bytes(flow.received) == data
    assert all(h.len <= 100 for h, _ in guest.packets)


def test_header_only_rx_buffer_still_makes_progress(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_layout=(HEADER_SIZE,), rx_buffers=4)
    conn, flow = open_host_conn(dev, guest)
    dev.send_to_guest(conn, b"abc")
    guest.step()
    assert flow.received == b""  # no room for data, but nothing dropped
    guest.rx_layout = (RX_BUF,)
    guest.refill()
    for _ in range(3):
        guest.step()
    assert flow.received == b"abc"


def test_send_buffer_is_bounded(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_buffers=0)
    guest.listening.add(1)
    conn = dev.connect_to_guest(1)
    guest.rx_buffers = 1
    guest.refill()
    guest.rx_buffers = 0
    guest.poll()
    assert conn.state is ConnState.ESTABLISHED
    accepted = dev.send_to_guest(conn, bytes(1 << 20))
    assert accepted == dev.to_guest_cap
    assert dev.send_to_guest(conn, b"more") == 0
    assert dev.room_to_guest(conn) == 0


def test_credit_request_answered(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.write(flow, b"12345")
    dev.recv_from_guest(conn, 5)
    guest.send_flow(flow, Op.CREDIT_REQUEST)
    got = guest.poll()
    assert ops(got) == [Op.CREDIT_UPDATE]
    assert got[0][0].fwd_cnt == 5 and got[0][0].buf_alloc == dev.buf_alloc


def test_every_header_carries_credit(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.write(flow, b"abc")
    dev.recv_from_guest(conn, 3)
    dev.send_to_guest(conn, b"reply")
    (hdr, payload), = guest.poll()
    assert (hdr.op, payload, hdr.fwd_cnt, hdr.buf_alloc) == (Op.RW, b"reply", 3, dev.buf_alloc)


def test_host_waits_for_guest_credit(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, buf_alloc=1000, auto_consume=False)
    conn, flow = open_host_conn(dev, guest)
    dev.send_to_guest(conn, bytes(5000))
    guest.poll()
    assert flow.rx_cnt == 1000
    guest.consume(flow)  # fwd_cnt 1000 >= buf_alloc / 2: CREDIT_UPDATE
    guest.poll()
    assert flow.rx_cnt == 2000


# -- shutdown and reset ---------------------------------------------------------------------------------
def test_host_shutdown_sends_shutdown_then_guest_rst(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn, flow = open_host_conn(dev, guest)
    dev.send_to_guest(conn, b"last words")
    dev.shutdown_connection(conn)
    assert conn.state is ConnState.CLOSING
    got = guest.step()
    assert ops(got) == [Op.RW, Op.SHUTDOWN]  # data first
    assert got[1][0].flags == SHUTDOWN_BOTH
    assert flow.received == b"last words"
    assert conn.state is ConnState.CLOSED and dev.connections == ()


def test_host_shutdown_waits_for_data_credit(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, buf_alloc=10, auto_consume=False)
    conn, flow = open_host_conn(dev, guest)
    dev.send_to_guest(conn, b"0123456789abcdef")
    dev.shutdown_connection(conn)
    assert ops(guest.poll()) == [Op.RW]
    guest.consume(flow)
    assert ops(guest.poll()) == [Op.RW, Op.SHUTDOWN]
    guest.consume(flow)
    assert flow.received == b"0123456789abcdef"


def test_guest_shutdown_send_then_both(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.write(flow, b"tail")
    guest.send_flow(flow, Op.SHUTDOWN, flags=SHUTDOWN_SEND)
    assert conn.peer_shutdown == SHUTDOWN_SEND and conn.state is ConnState.ESTABLISHED
    guest.send_flow(flow, Op.RW, b"after shutdown")  # a violation: the flow is reset
    assert conn.state is ConnState.CLOSED
    assert dev.recv_from_guest(conn, 100) == b"tail"  # what arrived before is still delivered
    guest.poll()
    assert flow.got_rst


def test_guest_shutdown_both_waits_for_host_to_drain(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.write(flow, b"data")
    guest.send_flow(flow, Op.SHUTDOWN, flags=SHUTDOWN_BOTH)
    assert conn.state is ConnState.ESTABLISHED  # data not yet taken
    assert dev.recv_from_guest(conn, 100) == b"data"
    assert conn.state is ConnState.CLOSED
    guest.poll()
    assert flow.got_rst  # §5.10.6.5: our RST completes the clean disconnect


def test_guest_shutdown_receive_discards_host_data(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.send_flow(flow, Op.SHUTDOWN, flags=SHUTDOWN_RECEIVE)
    assert dev.send_to_guest(conn, b"dropped") == 7
    assert [h.op for h, _ in guest.poll()] == []


def test_guest_rst_closes(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn, flow = open_host_conn(dev, guest)
    host.changes.clear()
    guest.send_flow(flow, Op.RST)
    assert conn.state is ConnState.CLOSED and host.changes == [conn]
    assert dev.connections == ()
    assert guest.poll() == []  # an RST is never answered


def test_host_reset_sends_rst(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    dev.reset_connection(conn)
    guest.poll()
    assert flow.got_rst and dev.connections == ()


# -- guest-initiated connections ------------------------------------------------------------------------
def test_guest_connect_accept(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    flow = guest.connect(5000)
    (conn,) = host.connects
    assert (conn.host_port, conn.guest_port, conn.state) == (5000, flow.guest_port, ConnState.ACCEPTING)
    assert conn.peer_buf_alloc == guest.buf_alloc
    dev.accept_connection(conn)
    got = guest.poll()
    assert ops(got) == [Op.RESPONSE] and flow.established
    guest.write(flow, b"ping")
    assert dev.recv_from_guest(conn, 10) == b"ping"


def test_guest_connect_refused(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    flow = guest.connect(5001)
    dev.reset_connection(host.connects[0])
    guest.poll()
    assert flow.got_rst and not flow.established


def test_guest_connect_without_host_is_refused(mem: GuestMemory) -> None:
    dev = Vsock(guest_cid=CID)
    guest = Guest(dev, mem)
    flow = guest.connect(5000)
    guest.poll()
    assert flow.got_rst and dev.connections == ()


def test_connection_cap(mem: GuestMemory, host: FakeHost) -> None:
    dev = Vsock(guest_cid=CID, host=host, max_connections=2)
    guest = Guest(dev, mem)
    guest.listening.add(1)
    dev.connect_to_guest(1)
    guest.connect(5000)
    with pytest.raises(VsockError):
        dev.connect_to_guest(1)
    flow = guest.connect(5001)
    guest.poll()
    assert flow.got_rst and len(host.connects) == 1


# -- hostile guest --------------------------------------------------------------------------------------
def test_malformed_packets_do_not_break_the_device(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    g, hp = flow.guest_port, conn.host_port
    valid = Header(CID, HOST_CID, g, hp, 0, TYPE_STREAM, Op.CREDIT_UPDATE).pack()
    cases = [
        lambda: guest.send(Op.RW, 9, 5000, b"x", src_cid=99),  # spoofed source CID
        lambda: guest.send(Op.RW, 9, 5000, b"x", dst_cid=7),  # not for the host
        lambda: guest.send(Op.REQUEST, 9, 5000, src_cid=CID + (1 << 32)),  # CID with upper bits
        lambda: guest.send_chain([valid[:20]]),  # truncated header
        lambda: guest.send_chain([b""]),  # empty
        lambda: guest.send(Op.RW, 9, 5000, b"x" * 10, length=100),  # len beyond the chain
        lambda: guest.send(Op.RW, 9, 5000, b"x" * (MAX_PAYLOAD + 1)),  # oversized
        lambda: guest.send(Op.RW, 9, 5000, b"", length=0xFFFFFFFF),
        lambda: guest.send(99, 9, 5000),  # unknown op, no connection
        lambda: guest.send(Op.INVALID, 9, 5000),
    ]
    for case in cases:
        assert case() == [0]
    assert conn.state is ConnState.ESTABLISHED
    assert dev.bad_packets >= 7
    # A loop in the chain (§2.7.5.3.1): completed with used length 0.
    q = guest.txq
    a, b = q.free_desc.pop(0), q.free_desc.pop(0)
    buf = guest.drv.alloc.alloc(64)
    guest.mem.write(buf, valid)
    q.write_desc(a, buf, 44, VIRTQ_DESC_F_NEXT, b)
    q.write_desc(b, buf, 8, VIRTQ_DESC_F_NEXT, a)
    q.put_avail(a)
    guest.drv.kick(1)
    assert [u.length for u in q.used()] == [0]
    # A device-writable descriptor in a tx chain.
    p = q.add(readable=[valid], writable=[16])
    guest.drv.kick(1)
    assert [u.length for u in q.used()] == [0]
    q.release(p)
    assert not guest.transport.needs_reset
    # Still working: data flows, and the junk drew RSTs for the flows it named (bounded).
    got = guest.poll()
    assert all(h.op == Op.RST and h.dst_port == 9 for h, _ in got)
    assert dev.send_to_guest(conn, b"still alive") == 11
    guest.step()
    assert flow.received == b"still alive"
    guest.write(flow, b"me too")
    assert dev.recv_from_guest(conn, 100) == b"me too"


def test_bad_type_answered_with_rst(dev: Vsock, guest: Guest) -> None:
    guest.send(Op.REQUEST, 9, 5000, type_=2)  # SEQPACKET was not offered
    (hdr, _), = guest.poll()
    assert (hdr.op, hdr.dst_port, hdr.src_port, hdr.type) == (Op.RST, 9, 5000, 2)


def test_truncated_rw_on_live_flow_resets_it(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.send(Op.RW, flow.guest_port, conn.host_port, b"abc", length=50, flow=flow)
    assert conn.state is ConnState.CLOSED  # part of the stream is lost
    guest.poll()
    assert flow.got_rst


def test_unknown_op_on_live_flow_resets_it(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    guest.send_flow(flow, 42)
    assert conn.state is ConnState.CLOSED


def test_header_split_anywhere(dev: Vsock, guest: Guest) -> None:
    conn, flow = open_host_conn(dev, guest)
    for cuts in ([1], [10, 11, 43], [44], [20, 50], [3, 7, 44, 45, 46]):
        flow.tx_cnt += 6
        assert guest.send(Op.RW, flow.guest_port, conn.host_port, b"abcdef", flow=flow, cuts=cuts) == [0]
    assert dev.recv_from_guest(conn, 1000) == b"abcdef" * 5


def test_rst_replies_are_bounded(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_buffers=0)
    for port in range(MAX_PENDING_REPLIES * 3):
        guest.send(Op.RW, port, 5000, b"x")
    guest.rx_buffers = MAX_PENDING_REPLIES * 4
    guest.refill()
    assert len(guest.poll()) == MAX_PENDING_REPLIES


def test_bad_rx_buffers_are_skipped(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem, rx_buffers=0)
    guest.listening.add(1)
    conn = dev.connect_to_guest(1)
    tiny = guest.rxq.add(writable=[10])  # cannot hold a header
    readable = guest.rxq.add(readable=[b"x" * 64])  # rx buffers are device-writable only
    guest.drv.kick(0)
    used = {u.head: u.length for u in guest.rxq.used()}
    assert used == {tiny.head: 0, readable.head: 0}
    assert conn.state is ConnState.CONNECTING
    guest.rxq.release(tiny)
    guest.rxq.release(readable)
    guest.rx_buffers = 4
    guest.refill()
    guest.poll()
    assert conn.state is ConnState.ESTABLISHED


def test_broken_rx_ring_from_host_work_sets_needs_reset(dev: Vsock, guest: Guest) -> None:
    guest.listening.add(1)
    guest.rxq.set_avail_idx(guest.rxq.avail_idx + 1000)  # the driver broke the ring protocol
    dev.connect_to_guest(1)  # host-driven rx work finds it
    assert guest.transport.needs_reset


def test_duplicate_request_resets(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    flow = guest.connect(5000)
    dev.accept_connection(host.connects[0])
    guest.poll()
    guest.send_flow(flow, Op.REQUEST)
    assert host.connects[0].state is ConnState.CLOSED
    guest.poll()
    assert flow.got_rst


# -- events, device reset, snapshot ---------------------------------------------------------------------
def test_transport_reset_event(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn, _flow = open_host_conn(dev, guest)
    host.changes.clear()
    dev.send_transport_reset()
    assert guest.collect_events() == [struct.pack("<I", 0)]
    assert conn.state is ConnState.CLOSED and host.changes == [conn]
    assert dev.connections == ()
    assert guest.poll() == []  # no RSTs: the guest drops its connections itself (§5.10.6.7)


def test_transport_reset_waits_for_an_event_buffer(dev: Vsock, guest: Guest) -> None:
    for _ in range(4):  # the guest posted four event buffers
        dev.send_transport_reset()
    assert guest.collect_events() == [bytes(4)] * 4
    dev.send_transport_reset()
    assert guest.collect_events() == []  # pending until the driver posts a buffer
    guest.post_events(1)
    assert guest.collect_events() == [bytes(4)]
    guest.post_events(1)
    assert guest.collect_events() == []  # delivered once


def test_event_buffer_too_small_is_skipped(dev: Vsock, mem: GuestMemory) -> None:
    guest = Guest(dev, mem)
    for _ in range(4):
        dev.send_transport_reset()
    guest.collect_events()
    guest.evq.add(writable=[2])
    guest.evq.add(writable=[8])
    dev.send_transport_reset()
    assert guest.collect_events() == [b"", bytes(4)]


def test_device_reset_drops_connections(dev: Vsock, guest: Guest, host: FakeHost) -> None:
    conn, _flow = open_host_conn(dev, guest)
    host.changes.clear()
    guest.drv.reset()
    assert conn.state is ConnState.CLOSED and host.changes == [conn]
    assert dev.connections == () and not dev.activated
    with pytest.raises(VsockError):
        dev.connect_to_guest(1024)


def test_persist_round_trip(dev: Vsock, guest: Guest, mem: GuestMemory, host: FakeHost) -> None:
    conn, _flow = open_host_conn(dev, guest)
    state = dev.save()
    assert_plain_state(state)
    assert state == VsockState(guest_cid=CID, acked_features=VIRTIO_F_VERSION_1)
    mmio = guest.transport.save()
    guest.collect_events()

    fresh = Vsock(guest_cid=99, host=host)
    fresh.restore(state)
    assert fresh.guest_cid == CID and fresh.acked_features == VIRTIO_F_VERSION_1
    transport = MmioTransport(fresh, mem, CountingIrq())
    transport.restore(mmio)
    guest.drv.rebind(transport)
    guest.transport = transport
    assert fresh.activated
    # The restored device tells the guest its connections are gone (§5.10.6.7) ...
    assert guest.collect_events() == [bytes(4)]
    for f in guest.flows.values():
        f.closed = True
    # ... and works: a new connection carries data.
    conn2, flow2 = open_host_conn(fresh, guest, 2048)
    fresh.send_to_guest(conn2, b"after restore")
    guest.step()
    assert flow2.received == b"after restore"
    with pytest.raises(PersistError):
        fresh.restore(state)  # active
    with pytest.raises(PersistError):
        Vsock(guest_cid=CID).restore(VsockState(guest_cid=2, acked_features=0))


# == backend: real Unix sockets on a real event loop ===================================================
@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vsk-", dir="/tmp"))  # short: AF_UNIX paths are limited to 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Rig:
    """Device, mock guest and backend on the running loop. A task plays the guest: it polls the rings
    with the bus lock held, like the VMM's notification handlers do."""

    def __init__(self, sockdir: Path, mem: GuestMemory, *, connect_timeout: float = 5.0,
                 accept_timeout: float = 5.0, close_timeout: float = 5.0, app: Callable[[Guest], None] | None = None,
                 threaded: bool = False, **guest_kw: Any) -> None:
        self.lock = threading.RLock()
        self.dev = Vsock(guest_cid=CID)
        self.guest = Guest(self.dev, mem, **guest_kw)
        self.path = str(sockdir / "v.sock")
        self.backend = VsockBackend(self.dev, self.path, loop=asyncio.get_running_loop(), lock=self.lock,
                                    connect_timeout=connect_timeout, accept_timeout=accept_timeout,
                                    close_timeout=close_timeout)
        self.app = app
        self.paused = False
        self.threaded = threaded  # the guest runs on its own thread, like a vCPU
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    async def __aenter__(self) -> Rig:
        await self.backend.start()
        if self.threaded:
            self._thread = threading.Thread(target=self._thread_main, daemon=True)
            self._thread.start()
        else:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            if self._task.done() and not self._task.cancelled():
                self._error = self._error or self._task.exception()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            self._stop.set()
            await asyncio.to_thread(self._thread.join, 5)
        await self.backend.close()
        if self._error is not None:
            raise self._error

    def _step(self) -> None:
        if not self.paused:
            with self.lock:
                self.guest.step()
                if self.app is not None:
                    self.app(self.guest)

    async def _run(self) -> None:
        while True:
            self._step()
            await asyncio.sleep(0.001)

    def _thread_main(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
                time.sleep(0.0005)
        except BaseException as e:
            self._error = e

    async def until(self, pred: Callable[[], object], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._task is not None and self._task.done():
                self._task.result()  # the guest failed (e.g. the device exceeded its credit)
            if self._error is not None:
                raise self._error
            with self.lock:
                if pred():
                    return
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.002)

    async def open(self, port: int = 1024) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
        reader, writer = await asyncio.open_unix_connection(self.path)
        writer.write(f"CONNECT {port}\n".encode())
        line = await asyncio.wait_for(reader.readline(), 5)
        assert line.startswith(b"OK ") and line.endswith(b"\n"), line
        return reader, writer, int(line[3:])

    def flows(self) -> list[Flow]:
        return list(self.guest.flows.values())


async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), 10)


async def assert_eof(reader: asyncio.StreamReader) -> None:
    assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_backend_connect_and_echo_one_megabyte(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, echo=True, buf_alloc=32 * 1024) as rig:
        rig.guest.listening.add(1024)
        reader, writer, host_port = await rig.open(1024)
        assert host_port == EPHEMERAL_PORT_BASE
        (flow,) = rig.flows()
        assert (flow.guest_port, flow.host_port) == (1024, host_port)
        data = os.urandom(1 << 20)

        async def send() -> None:
            for i in range(0, len(data), 100_000):
                writer.write(data[i:i + 100_000])
                await writer.drain()

        sender = asyncio.create_task(send())
        echoed = await read_exactly(reader, len(data))
        await sender
        assert echoed == data
        assert flow.max_in_flight <= flow.buf_alloc  # the guest never got more than its credit
        # The guest's 1 MB went through our 256 KiB window: our fwd_cnt reached it in later headers.
        assert flow.tx_cnt == len(data) and flow.peer_fwd_cnt >= len(data) - rig.dev.buf_alloc
        writer.close()
        await rig.until(lambda: flow.closed and rig.dev.connections == ())
        assert [h.op for h, _ in rig.guest.packets][-1] == Op.SHUTDOWN


async def test_backend_guest_on_another_thread(sockdir: Path, mem: GuestMemory) -> None:
    """Device callbacks arrive on a vCPU thread: the backend must hop to its loop safely."""
    async with Rig(sockdir, mem, echo=True, buf_alloc=16 * 1024, threaded=True) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open(1024)
        data = os.urandom(256 * 1024)
        writer.write(data)
        assert await read_exactly(reader, len(data)) == data
        writer.close()
        await rig.until(lambda: rig.dev.connections == ())
        with rig.lock:
            flow = rig.guest.connect(5000)  # nobody at <path>_5000: refused from the loop
        await rig.until(lambda: flow.got_rst)


async def test_backend_guest_refuses(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        reader, writer = await asyncio.open_unix_connection(rig.path)
        writer.write(b"CONNECT 4444\n")  # nobody listens in the guest: RST
        await assert_eof(reader)
        assert rig.dev.connections == ()
        with pytest.raises(AgentConnectError):
            await connect_vsock_uds(rig.path, 4444, timeout=5)
        writer.close()


async def test_backend_guest_does_not_answer(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, accept_timeout=0.2, answer_requests=False) as rig:
        reader, writer = await asyncio.open_unix_connection(rig.path)
        t0 = time.monotonic()
        writer.write(b"CONNECT 1024\n")
        await assert_eof(reader)
        assert 0.15 < time.monotonic() - t0 < 3
        await rig.until(lambda: rig.dev.connections == ())
        await rig.until(lambda: [h.op for h, _ in rig.guest.packets] == [Op.REQUEST, Op.RST])
        writer.close()


async def test_backend_waits_for_a_slow_guest_past_the_handshake_timeout(sockdir: Path, mem: GuestMemory) -> None:
    """A busy (emulated) guest kernel answers a REQUEST late: the short handshake-line timeout does not cut
    it off; only accept_timeout does."""
    async with Rig(sockdir, mem, connect_timeout=0.2, accept_timeout=30) as rig:
        rig.guest.listening.add(1024)
        rig.paused = True
        reader, writer = await asyncio.open_unix_connection(rig.path)
        writer.write(b"CONNECT 1024\n")
        await asyncio.sleep(1.0)  # five handshake timeouts
        rig.paused = False
        assert await asyncio.wait_for(reader.readline(), 5) == f"OK {EPHEMERAL_PORT_BASE}\n".encode()
        writer.close()


@pytest.mark.parametrize("line", [b"HELLO\n", b"CONNECT\n", b"CONNECT \n", b"CONNECT abc\n", b"CONNECT -1\n",
                                  b"CONNECT +1\n", b"CONNECT 4294967296\n", b"CONNECT 1 2\n", b"connect 1\n",
                                  b"CONNECT 1\r\n", b"CONNECT " + b"1" * 100 + b"\n", b"X" * 500,
                                  b"\xff\xfe\n"])
async def test_backend_rejects_bad_handshakes(sockdir: Path, mem: GuestMemory, line: bytes) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1)
        reader, writer = await asyncio.open_unix_connection(rig.path)
        writer.write(line)
        await assert_eof(reader)
        assert rig.dev.connections == ()
        writer.close()
        _r, w, _ = await rig.open(1)  # still serving
        w.close()


async def test_backend_handshake_timeout(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, connect_timeout=0.2) as rig:
        reader, writer = await asyncio.open_unix_connection(rig.path)
        writer.write(b"CONN")
        await assert_eof(reader)
        writer.close()


async def test_backend_data_sent_with_the_handshake(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, echo=True) as rig:
        rig.guest.listening.add(7)
        reader, writer = await asyncio.open_unix_connection(rig.path)
        writer.write(b"CONNECT 7\nearly bytes")
        assert await asyncio.wait_for(reader.readline(), 5) == f"OK {EPHEMERAL_PORT_BASE}\n".encode()
        assert await read_exactly(reader, 11) == b"early bytes"
        writer.close()


async def test_backend_client_disconnect_shuts_down(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        _reader, writer, _ = await rig.open()
        writer.write(b"bye")
        await writer.drain()
        writer.close()
        (flow,) = rig.flows()
        await rig.until(lambda: flow.closed)
        shutdowns = [h for h, _ in rig.guest.packets if h.op == Op.SHUTDOWN]
        assert len(shutdowns) == 1 and shutdowns[0].flags == SHUTDOWN_BOTH
        assert flow.received == b"bye"
        await rig.until(lambda: rig.dev.connections == ())


async def test_backend_close_timeout_resets(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, close_timeout=0.2) as rig:
        rig.guest.answer_shutdown = False  # a guest that never answers our SHUTDOWN with RST
        rig.guest.listening.add(1024)
        _reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        writer.close()
        await rig.until(lambda: flow.got_rst)  # §5.10.6.5: forced RST after the timeout
        assert rig.dev.connections == ()


async def test_backend_guest_shutdown_gives_eof(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        with rig.lock:
            rig.guest.write(flow, b"final")
            rig.guest.send_flow(flow, Op.SHUTDOWN, flags=SHUTDOWN_SEND)
        assert await asyncio.wait_for(reader.read(), 5) == b"final"  # then EOF
        writer.write(b"still listening")  # half-closed: the other direction still works
        await writer.drain()
        await rig.until(lambda: flow.received == b"still listening")
        writer.close()
        await rig.until(lambda: rig.dev.connections == ())


async def test_backend_guest_rst_closes_client(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        with rig.lock:
            rig.guest.write(flow, b"abort")
            rig.guest.send_flow(flow, Op.RST)
            flow.closed = True
        assert await asyncio.wait_for(reader.read(), 5) == b"abort"
        writer.close()


async def test_backend_slow_guest_pauses_host_reads(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem, auto_consume=False, buf_alloc=16 * 1024) as rig:
        rig.guest.listening.add(1024)
        _reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        data = os.urandom(2 << 20)
        writer.write(data)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 0.3)  # the backend stopped reading
        with rig.lock:
            (conn,) = rig.dev.connections
            assert flow.rx_cnt == flow.buf_alloc  # exactly the guest's credit, no more
            assert len(conn.to_guest) <= rig.dev.to_guest_cap
        rig.guest.auto_consume = True
        await asyncio.wait_for(writer.drain(), 10)
        await rig.until(lambda: len(flow.received) == len(data))
        assert flow.received == data
        writer.close()


async def test_backend_slow_host_reader(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        data = os.urandom(2 << 20)
        with rig.lock:
            rig.guest.write(flow, data)
        await asyncio.sleep(0.3)  # the host does not read: the guest runs out of credit, nothing breaks
        with rig.lock:
            (conn,) = rig.dev.connections
            assert conn.state is ConnState.ESTABLISHED and len(conn.to_host) <= conn.buf_alloc
            assert flow.outbox  # still waiting for credit
        assert await read_exactly(reader, len(data)) == data
        writer.close()


async def test_backend_guest_connects_to_host_port(sockdir: Path, mem: GuestMemory) -> None:
    received = bytearray()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        received.extend(await r.readexactly(4))
        w.write(b"pong")
        await w.drain()
        w.close()

    async with Rig(sockdir, mem) as rig:
        server = await asyncio.start_unix_server(handle, f"{rig.path}_5000")  # Firecracker's convention
        async with server:
            with rig.lock:
                flow = rig.guest.connect(5000)
            await rig.until(lambda: flow.established)
            with rig.lock:
                rig.guest.write(flow, b"ping")
            await rig.until(lambda: flow.received == b"pong" and flow.peer_shutdown == SHUTDOWN_BOTH)
            assert received == b"ping"
            await rig.until(lambda: rig.dev.connections == ())
            with rig.lock:
                missing = rig.guest.connect(5001)  # nobody listens at <path>_5001
            await rig.until(lambda: missing.got_rst)
            assert not missing.established


async def test_backend_transport_reset_closes_clients(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        with rig.lock:
            rig.dev.send_transport_reset()
        await assert_eof(reader)
        await rig.until(lambda: rig.guest.events == [bytes(4)])
        writer.close()


async def test_backend_device_reset_closes_clients(sockdir: Path, mem: GuestMemory) -> None:
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        rig.paused = True
        with rig.lock:
            rig.guest.drv.reset()  # the driver writes status 0
        await assert_eof(reader)
        r2, w2 = await asyncio.open_unix_connection(rig.path)
        w2.write(b"CONNECT 1024\n")  # no running device: refused
        await assert_eof(r2)
        writer.close()
        w2.close()


async def test_backend_close(sockdir: Path, mem: GuestMemory) -> None:
    rig = Rig(sockdir, mem)
    async with rig:
        rig.guest.listening.add(1024)
        reader, writer, _ = await rig.open()
        (flow,) = rig.flows()
        assert Path(rig.path).exists()
    await assert_eof(reader)
    assert not Path(rig.path).exists()
    with rig.lock:
        rig.guest.poll()
    assert flow.got_rst and rig.dev.connections == () and rig.dev.host is None
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(rig.path)
    writer.close()


async def test_backend_start_replaces_stale_socket(sockdir: Path, mem: GuestMemory) -> None:
    path = sockdir / "v.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # left over by a dead VMM
    async with Rig(sockdir, mem) as rig:
        rig.guest.listening.add(1)
        _r, w, _ = await rig.open(1)
        w.close()
    path.write_text("not a socket")
    rig = Rig(sockdir, mem)
    with pytest.raises(VsockBackendError):
        await rig.backend.start()
    assert path.read_text() == "not a socket"


async def test_parse_connect() -> None:
    assert parse_connect(b"CONNECT 0") == 0
    assert parse_connect(b"CONNECT 4294967295") == 0xFFFFFFFF
    assert parse_connect(b"CONNECT 4294967296") is None
    assert parse_connect(b"CONNECT 00012") == 12


# -- the real host client and the real guest agent, through the device ------------------------------------
class AgentRelay:
    """A guest-side app: flows on ``port`` are piped to the guest agent's Unix socket."""

    def __init__(self, agent_path: str, port: int = 1024) -> None:
        self.agent_path = agent_path
        self.port = port
        self.links: dict[tuple[int, int], list[Any]] = {}  # key -> [writer | None, from_agent, eof]
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, guest: Guest) -> None:
        for key, flow in guest.flows.items():
            if flow.guest_port != self.port or not flow.established:
                continue
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = [None, bytearray(), False]
                self.tasks.append(asyncio.get_running_loop().create_task(self._pump(link)))
            if flow.closed:
                if link[0] is not None:
                    link[0].close()
                continue
            if link[0] is not None and flow.inbox:
                link[0].write(guest.consume(flow))
            if link[1]:
                guest.write(flow, bytes(link[1]))
                link[1].clear()

    async def _pump(self, link: list[Any]) -> None:
        reader, writer = await asyncio.open_unix_connection(self.agent_path)
        link[0] = writer
        while data := await reader.read(65536):
            link[1] += data
        link[2] = True


@contextlib.asynccontextmanager
async def agent_relay(sockdir: Path) -> AsyncIterator[AgentRelay]:
    """The real guest agent as a host process, and a relay from the rig's guest side to its socket; the relay's
    tasks are cancelled and the agent stopped afterwards."""
    agent_path = str(sockdir / "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "smol_agent", "--listen", f"unix:{agent_path}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not Path(agent_path).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "agent did not start"
            await asyncio.sleep(0.01)
        relay = AgentRelay(agent_path)
        try:
            yield relay
        finally:
            for task in relay.tasks:
                task.cancel()
    finally:
        proc.terminate()
        proc.wait(5)


async def test_agent_client_over_vsock(sockdir: Path, mem: GuestMemory) -> None:
    async with agent_relay(sockdir) as relay:
        async with Rig(sockdir, mem, app=relay, auto_consume=False) as rig:
            rig.guest.listening.add(1024)
            client = await connect_vsock_uds(rig.path, 1024, timeout=10)  # CONNECT, OK, then HELLO
            try:
                result = await asyncio.wait_for(client.run(["echo", "through virtio-vsock"]), 20)
                assert result.stdout == b"through virtio-vsock\n" and result.exit_code == 0
            finally:
                await client.close()
            await rig.until(lambda: rig.dev.connections == ())


# -- guest floods: host buffering stays within what the device advertised ---------------------------------
def test_flood_ignoring_credit_is_reset_not_queued(dev: Vsock, mem: GuestMemory) -> None:
    """A guest sending 8 MiB at a host that never reads, ignoring buf_alloc: at most buf_alloc is held;
    the flow is reset at the first byte beyond it and later packets of that flow are not buffered."""
    guest = Guest(dev, mem, rx_buffers=0)   # and it does not even take our RST
    guest.listening.add(1024)
    guest.rx_buffers = 1
    guest.refill()
    conn = dev.connect_to_guest(1024)
    guest.poll()
    guest.rx_buffers = 0
    flow = guest.flow(1024, conn.host_port)
    assert conn.state is ConnState.ESTABLISHED
    chunk = b"f" * MAX_PAYLOAD
    for _ in range((8 << 20) // MAX_PAYLOAD):
        guest.send_flow(flow, Op.RW, chunk)
        assert dev.pending_from_guest(conn) <= dev.buf_alloc
    assert conn.state is ConnState.CLOSED and dev.bad_packets >= 1
    assert dev.pending_from_guest(conn) <= dev.buf_alloc   # what was within credit, for the host to drain
    # Nothing else was queued for the guest: the flow's RST (it took the one buffer still posted), then
    # RSTs for the packets that followed and named no flow any more, up to the cap.
    guest.rx_buffers = 4 * MAX_PENDING_REPLIES
    guest.refill()
    got = guest.poll()
    assert set(ops(got)) == {Op.RST} and len(got) <= 1 + MAX_PENDING_REPLIES
    assert dev.connections == ()
    for _ in range(10 * MAX_PENDING_REPLIES):   # with rx buffers posted: one RST per packet, no more
        guest.send_flow(flow, Op.RW, chunk)
    got = guest.poll()
    assert set(ops(got)) == {Op.RST} and len(got) <= 10 * MAX_PENDING_REPLIES
    assert dev.connections == ()
    assert len(dev.recv_from_guest(conn, 1 << 30)) == dev.buf_alloc   # the host drains what it accepted


def test_request_flood_to_ports_nobody_listens_on(mem: GuestMemory) -> None:
    """Thousands of REQUESTs, refused by the host, from a guest that posts no rx buffers: the table stays
    within max_connections, the RST answers within max_connections + MAX_PENDING_REPLIES, and once the
    guest takes them the device is clean and usable again."""
    class RefusingHost(FakeHost):
        def on_guest_connect(self, conn: VsockConnection) -> None:
            super().on_guest_connect(conn)
            assert dev.host is self
            dev.reset_connection(conn)   # what the backend does when <path>_<port> does not exist

    host = RefusingHost()
    dev = Vsock(guest_cid=CID, host=host, max_connections=32)
    guest = Guest(dev, mem, rx_buffers=0, answer_requests=False)
    for i in range(4000):
        guest.send(Op.REQUEST, 40000 + i, 7000 + i % 50)
        assert len(dev.connections) <= 32
    assert len(host.connects) == 32   # the host was asked only while there was room
    guest.rx_buffers = 128
    guest.refill()
    got = []
    for _ in range(4):
        got += guest.poll()
    assert all(h.op == Op.RST for h, _ in got)
    assert len(got) <= 32 + MAX_PENDING_REPLIES
    assert dev.connections == ()
    guest.listening.add(9)
    guest.answer_requests = True
    conn = dev.connect_to_guest(9)
    guest.poll()
    assert conn.state is ConnState.ESTABLISHED


def test_credit_request_flood_is_coalesced(dev: Vsock, mem: GuestMemory) -> None:
    """10 000 CREDIT_REQUESTs while the guest posts no rx buffers: one CREDIT_UPDATE is owed, not 10 000."""
    guest = Guest(dev, mem, rx_buffers=0)
    guest.listening.add(1024)
    guest.rx_buffers = 1
    guest.refill()
    conn = dev.connect_to_guest(1024)
    guest.poll()
    guest.rx_buffers = 0
    flow = guest.flow(1024, conn.host_port)
    for _ in range(10_000):
        guest.send_flow(flow, Op.CREDIT_REQUEST)
    guest.rx_buffers = 64
    guest.refill()
    got = ops(guest.poll())   # the first answer may have gone into the one buffer still posted
    assert set(got) == {Op.CREDIT_UPDATE} and len(got) <= 2
    assert conn.state is ConnState.ESTABLISHED


def test_rst_flood_is_never_answered(dev: Vsock, guest: Guest) -> None:
    for i in range(5000):
        guest.send(Op.RST, 30000 + i, 8000 + i)
    assert guest.poll() == [] and dev.connections == ()


@pytest.mark.parametrize("buf_alloc, fwd_cnt", [(0xFFFFFFFF, 0x7FFFFFFF), (0xFFFFFFFF, 0), (0, 0)])
def test_bogus_guest_credit_does_not_grow_host_buffers(dev: Vsock, guest: Guest, buf_alloc: int,
                                                       fwd_cnt: int) -> None:
    """Whatever credit the guest claims (a 4 GiB window, a fwd_cnt far ahead of what we sent, none at
    all), the host holds at most to_guest_cap per connection: the rest is for the host program to keep."""
    conn, flow = open_host_conn(dev, guest)
    flow.buf_alloc = 1 << 33   # the mock guest's own credit check is off: it lies about its window
    guest.send(Op.CREDIT_UPDATE, flow.guest_port, conn.host_port, buf_alloc=buf_alloc, fwd_cnt=fwd_cnt)
    guest.auto_consume = False
    offered = taken = 0
    for _ in range(64):
        offered += 65536
        taken += dev.send_to_guest(conn, b"h" * 65536)
        assert len(conn.to_guest) <= dev.to_guest_cap
        guest.poll()
    sent = sum(len(p) for h, p in guest.packets if h.op == Op.RW)
    assert taken == sent + len(conn.to_guest) and len(conn.to_guest) <= dev.to_guest_cap
    if buf_alloc == 0:
        assert sent == 0 and taken == dev.to_guest_cap < offered


async def test_backend_host_not_reading_bounds_guest_flood(sockdir: Path, mem: GuestMemory) -> None:
    """A guest streams 8 MiB to a host program that accepted but does not read: the guest stalls on
    credit with a bounded amount in flight (device buffer + transport buffer + kernel socket buffers);
    when the host reads, every byte arrives in order."""
    accepted: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append((r, w))

    data = os.urandom(8 << 20)
    async with Rig(sockdir, mem) as rig:
        server = await asyncio.start_unix_server(handle, f"{rig.path}_5000", limit=1 << 16)
        async with server:
            with rig.lock:
                flow = rig.guest.connect(5000)
            await rig.until(lambda: flow.established and accepted)
            with rig.lock:
                rig.guest.write(flow, data)
            transport = accepted[0][1].transport
            transport.pause_reading()   # the host program does not read
            await asyncio.sleep(0.5)
            with rig.lock:
                (conn,) = rig.dev.connections
                in_flight = flow.tx_cnt
                assert conn.state is ConnState.ESTABLISHED and len(conn.to_host) <= conn.buf_alloc
                assert flow.outbox   # waiting for credit, not buffered on the host
            assert in_flight < 3 << 20, in_flight   # of 8 MiB: bounded by buf_alloc + socket buffers
            transport.resume_reading()
            got = await asyncio.wait_for(accepted[0][0].readexactly(len(data)), 30)
            assert got == data
            accepted[0][1].close()
async def test_agent_client_large_stdin_and_spilled_argv_over_vsock(sockdir: Path, mem: GuestMemory) -> None:
    """Inspect's large-input checks through the whole host path: 32 MiB of stdin (a ring's worth of wraps,
    the guest's 256 KiB credit window refilled hundreds of times) and a 1 MiB argv spilled to a file."""
    async with agent_relay(sockdir) as relay:
        async with Rig(sockdir, mem, app=relay, auto_consume=False, buf_alloc=256 * 1024,
                       rx_buffers=128) as rig:
            rig.guest.listening.add(1024)
            client = await connect_vsock_uds(rig.path, 1024, timeout=10)
            try:
                data = os.urandom(32 << 20)
                r = await asyncio.wait_for(client.run(["sha256sum"], stdin=data), 60)
                assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
                chunk = "x" * 65536
                argv = await guestops.spill_argv(client, "test", ["printf", "%s", *([chunk] * 16)])
                r = await asyncio.wait_for(client.run(argv), 60)
                assert r.exit_code == 0 and r.stdout == (chunk * 16).encode()
            finally:
                await client.close()
            (flow,) = [f for f in rig.flows() if f.guest_port == 1024]
            assert flow.rx_cnt > len(data) and flow.max_in_flight <= flow.buf_alloc
