"""virtio-vsock device model: connections, credit and packets; host I/O is injected (virtio 1.2 §5.10)."""

from __future__ import annotations

import abc
import logging
import struct
from collections import deque
from enum import Enum

from smold.devices.virtio.device import VIRTIO_ID_VSOCK, VirtioDevice, VirtioError
from smold.devices.virtio.queue import ChainError, DescriptorChain, QueueError
from smold.devices.vsock.packet import (
    CID_RESERVED_HIGH,
    EVENT_SIZE,
    EVENT_TRANSPORT_RESET,
    HOST_CID,
    MAX_PAYLOAD,
    SHUTDOWN_BOTH,
    SHUTDOWN_RECEIVE,
    SHUTDOWN_SEND,
    TYPE_STREAM,
    U32,
    Header,
    Op,
    PacketError,
    is_guest_cid,
    parse_tx,
    rx_room,
    write_rx,
)
from smold.devices.vsock.persist import VsockState, restore_vsock, save_vsock
from smold.memory import GuestMemory

log = logging.getLogger(__name__)

# §5.10.2: virtqueues.
RX_QUEUE = 0
TX_QUEUE = 1
EVENT_QUEUE = 2
QUEUE_SIZE = 256

DEFAULT_BUF_ALLOC = 256 * 1024  # our receive buffer per connection, advertised in every header (§5.10.6.3)
DEFAULT_TO_GUEST_CAP = 128 * 1024  # host->guest bytes held per connection while the guest lacks credit
DEFAULT_MAX_CONNECTIONS = 1024
EPHEMERAL_PORT_BASE = 1 << 30  # host ports for host-initiated connections are allocated from here
MAX_PENDING_REPLIES = 64  # RST answers to packets of no connection, waiting for rx buffers


class VsockError(VirtioError):
    """A bad vsock configuration, or a host-side request the device cannot take now."""


class ConnState(Enum):
    CONNECTING = "connecting"  # host-initiated: REQUEST queued or sent, waiting for the guest's RESPONSE
    ACCEPTING = "accepting"  # guest-initiated: the host side is connecting, RESPONSE or RST follows
    ESTABLISHED = "established"
    CLOSING = "closing"  # the host end closed: SHUTDOWN queued or sent, waiting for the guest's RST
    CLOSED = "closed"  # gone (an RST towards the guest may still be queued)


class VsockConnection:
    """One stream flow between host port and guest port, with both directions' credit (§5.10.6.3).

    Owned by the device; the host side reads ``state``, ``peer_shutdown`` and the ports, and moves data
    with ``Vsock.send``/``Vsock.recv``. Counters are u32 and wrap like the spec's.
    """

    def __init__(self, host_port: int, guest_port: int, *, host_initiated: bool, buf_alloc: int) -> None:
        self.host_port = host_port
        self.guest_port = guest_port
        self.host_initiated = host_initiated
        self.state = ConnState.CONNECTING if host_initiated else ConnState.ACCEPTING
        self.peer_shutdown = 0  # §5.10.6.5: SHUTDOWN flags the guest sent; permanent once set
        # host -> guest: what the guest told us, and what we sent.
        self.peer_buf_alloc = 0
        self.peer_fwd_cnt = 0
        self.tx_cnt = 0
        self.to_guest = bytearray()
        # guest -> host: our buffer and counters.
        self.buf_alloc = buf_alloc
        self.rx_cnt = 0
        self.fwd_cnt = 0
        self.last_fwd_cnt_sent = 0
        self.to_host = bytearray()
        # Packets owed to the guest (sent when rx buffers are available).
        self.request_pending = host_initiated
        self.request_sent = False
        self.response_pending = False
        self.credit_update_pending = False
        self.shutdown_pending = False
        self.rst_pending = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.host_port, self.guest_port)

    @property
    def closed(self) -> bool:
        return self.state is ConnState.CLOSED

    @property
    def peer_free(self) -> int:
        """§5.10.6.3: peer_free = peer_buf_alloc - (tx_cnt - peer_fwd_cnt), u32 arithmetic; a guest
        reporting nonsense gets no credit."""
        in_flight = (self.tx_cnt - self.peer_fwd_cnt) & U32
        return max(0, self.peer_buf_alloc - in_flight)

    def __repr__(self) -> str:
        return (f"VsockConnection(host_port={self.host_port}, guest_port={self.guest_port}, "
                f"state={self.state.value})")


class VsockHost(abc.ABC):
    """The host side of the device (the backend).

    Called with the device lock held, possibly from a vCPU thread: record the event and return; do the
    I/O later on the event loop. No blocking, no taking the lock again.
    """

    @abc.abstractmethod
    def on_guest_connect(self, conn: VsockConnection) -> None:
        """The guest asked for host port ``conn.host_port``: answer ``accept_connection`` or
        ``reset_connection``."""

    @abc.abstractmethod
    def on_change(self, conn: VsockConnection) -> None:
        """``conn`` changed: state, data from the guest, its shutdown flags, or room for data to it."""


class Vsock(VirtioDevice):
    """virtio-vsock: §5.10.2 rx/tx/event queues, §5.10.3 stream sockets only, §5.10.4 le64 guest_cid.

    The host side calls ``connect_to_guest``, ``accept_connection``, ``send_to_guest``,
    ``recv_from_guest``, ``shutdown_connection`` and ``reset_connection``; the device calls a
    ``VsockHost`` back. Every method must be called with the lock that serialises the transport (the
    bus lock) held. Guest-driven work never raises out of the device: bad packets are dropped (and
    answered with RST where they name a flow), malformed chains complete with used length 0.
    """

    device_type = VIRTIO_ID_VSOCK
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, guest_cid: int, *, host: VsockHost | None = None, buf_alloc: int = DEFAULT_BUF_ALLOC,
                 to_guest_cap: int = DEFAULT_TO_GUEST_CAP,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        super().__init__()
        if not is_guest_cid(guest_cid):
            raise VsockError(f"guest CID {guest_cid!r} is reserved or out of range "
                             f"(3 .. {CID_RESERVED_HIGH - 1})")
        self.guest_cid = guest_cid
        if not 0 < buf_alloc <= U32:
            raise VsockError(f"buf_alloc {buf_alloc} must be in 1 .. {U32}")
        if to_guest_cap <= 0 or max_connections <= 0:
            raise VsockError("to_guest_cap and max_connections must be positive")
        self.host = host
        self.buf_alloc = buf_alloc
        self.to_guest_cap = to_guest_cap
        self.max_connections = max_connections
        self.credit_update_threshold = max(1, buf_alloc // 4)
        self.bad_packets = 0  # tx packets dropped as malformed or misaddressed
        self._conns: dict[tuple[int, int], VsockConnection] = {}
        self._ready: deque[VsockConnection] = deque()  # connections that owe the guest a packet
        self._ready_set: set[VsockConnection] = set()
        self._replies: deque[Header] = deque()  # RSTs for packets of no connection
        self._next_port = EPHEMERAL_PORT_BASE
        self._event_pending = False

    # -- features and config space (§5.10.3, §5.10.4) -----------------------------------------------
    def device_features(self) -> int:
        return 0  # stream sockets only: "no feature bit" means VIRTIO_VSOCK_F_STREAM (§5.10.3)

    def config_space(self) -> bytes:
        return struct.pack("<Q", self.guest_cid)

    def attach_host(self, host: VsockHost | None) -> None:
        self.host = host

    @property
    def connections(self) -> tuple[VsockConnection, ...]:
        """Connections in the table (including closed ones whose RST is still queued)."""
        return tuple(self._conns.values())

    # -- queues -----------------------------------------------------------------------------------------
    def queue_notify(self, index: int) -> None:
        if index == TX_QUEUE:
            self.process_queue(TX_QUEUE, self._handle_tx)
            self._flush_rx()  # replies and credit updates the tx packets produced
        elif index == RX_QUEUE:
            self._flush_rx()
        elif index == EVENT_QUEUE:
            self._deliver_event()

    def on_activate(self) -> None:
        if self._event_pending:
            self._deliver_event()

    def on_reset(self) -> None:
        self._drop_all()
        self._event_pending = False

    # -- host side API (lock held) ----------------------------------------------------------------------
    def connect_to_guest(self, port: int) -> VsockConnection:
        """Host-initiated connection to guest ``port`` (§5.10.6.5): queue OP_REQUEST; the host learns the
        answer through ``on_change`` (ESTABLISHED, or CLOSED on the guest's RST)."""
        if not isinstance(port, int) or not 0 <= port <= U32:
            raise VsockError(f"vsock port {port!r} out of range")
        if not self.activated:
            raise VsockError("the guest driver has not started the vsock device")
        if len(self._conns) >= self.max_connections:
            raise VsockError(f"too many vsock connections ({self.max_connections})")
        conn = VsockConnection(self._allocate_port(port), port, host_initiated=True, buf_alloc=self.buf_alloc)
        self._conns[conn.key] = conn
        self._mark_ready(conn)
        self._kick_rx()
        return conn

    def accept_connection(self, conn: VsockConnection) -> None:
        """The host side of a guest-initiated connection is up: answer OP_RESPONSE."""
        if conn.state is not ConnState.ACCEPTING or self._conns.get(conn.key) is not conn:
            return
        conn.state = ConnState.ESTABLISHED
        conn.response_pending = True
        self._mark_ready(conn)
        self._kick_rx()

    def send_to_guest(self, conn: VsockConnection, data: bytes | bytearray | memoryview) -> int:
        """Queue host->guest bytes; returns how many were taken (0 when the buffer is full: retry after
        ``on_change``). Data is sent as the guest's credit allows (§5.10.6.3)."""
        if conn.state is not ConnState.ESTABLISHED or conn.shutdown_pending or not data:
            return 0
        if conn.peer_shutdown & SHUTDOWN_RECEIVE:
            return len(data)  # the guest will not receive any more (§5.10.6.5): discard
        n = min(len(data), self.room_to_guest(conn))
        if n:
            conn.to_guest += data[:n]
            self._mark_ready(conn)
            self._kick_rx()
        return n

    def room_to_guest(self, conn: VsockConnection) -> int:
        """How many bytes ``send_to_guest`` would take now."""
        if conn.state is not ConnState.ESTABLISHED or conn.shutdown_pending:
            return 0
        return max(0, self.to_guest_cap - len(conn.to_guest))

    def pending_from_guest(self, conn: VsockConnection) -> int:
        """Guest->host bytes waiting for ``recv_from_guest``."""
        return len(conn.to_host)

    def recv_from_guest(self, conn: VsockConnection, limit: int) -> bytes:
        """Take up to ``limit`` guest->host bytes; this frees credit (a CREDIT_UPDATE follows once a
        quarter of buf_alloc was consumed). Works on a closed connection to drain what is left."""
        n = min(max(0, limit), len(conn.to_host))
        if n == 0:
            return b""
        data = bytes(conn.to_host[:n])
        del conn.to_host[:n]
        if conn.closed:
            return data
        conn.fwd_cnt = (conn.fwd_cnt + n) & U32
        if (conn.fwd_cnt - conn.last_fwd_cnt_sent) & U32 >= self.credit_update_threshold:
            conn.credit_update_pending = True
            self._mark_ready(conn)
        self._maybe_finish(conn)
        self._kick_rx()
        return data

    def shutdown_connection(self, conn: VsockConnection) -> None:
        """The host end closed: after the queued data, send SHUTDOWN with both flags (§5.10.6.5) and wait
        for the guest's RST; the host resets the connection if none comes in time."""
        if conn.state is ConnState.ESTABLISHED:
            conn.state = ConnState.CLOSING
            conn.shutdown_pending = True
            conn.to_host.clear()  # nobody will read it any more
            self._mark_ready(conn)
            self._maybe_finish(conn)  # the guest may have shut down both directions already
            self._kick_rx()
        elif conn.state in (ConnState.CONNECTING, ConnState.ACCEPTING):
            self.reset_connection(conn)

    def reset_connection(self, conn: VsockConnection) -> None:
        """Abort the connection: OP_RST to the guest (§5.10.6.5), CLOSED for the host."""
        if conn.closed or self._conns.get(conn.key) is not conn:
            return
        self._reset(conn)
        self._kick_rx()

    def send_transport_reset(self) -> None:
        """§5.10.6.7: VIRTIO_VSOCK_EVENT_TRANSPORT_RESET; the guest drops its connections, so do we."""
        self._drop_all()
        self._event_pending = True
        if self.activated:
            try:
                self._deliver_event()
            except QueueError as e:
                self._needs_reset(f"event queue: {e}")

    # -- tx: guest -> host (§5.10.6.4) -----------------------------------------------------------------
    def _handle_tx(self, mem: GuestMemory, chain: DescriptorChain) -> int:
        try:
            packet = parse_tx(mem, chain)
        except PacketError as e:
            self.bad_packets += 1
            log.debug("virtio-vsock: %s", e)
            if e.header is not None and self._addressed_to_us(e.header):
                conn = self._conns.get((e.header.dst_port, e.header.src_port))
                if conn is None:
                    self._reply_rst(e.header)
                elif not conn.closed:
                    self._reset(conn)  # part of its stream is lost
            return 0
        self._dispatch(packet.header, packet.payload)
        return 0  # tx buffers are device-readable only: nothing written

    def _addressed_to_us(self, hdr: Header) -> bool:
        # §5.10.6.4: the driver uses guest_cid as source; this device only reaches the host.
        return hdr.src_cid == self.guest_cid and hdr.dst_cid == HOST_CID

    def _dispatch(self, hdr: Header, payload: bytes) -> None:
        if not self._addressed_to_us(hdr):
            self.bad_packets += 1
            log.debug("virtio-vsock: dropped packet %d:%d -> %d:%d", hdr.src_cid, hdr.src_port,
                      hdr.dst_cid, hdr.dst_port)
            return
        if hdr.type != TYPE_STREAM:
            self.bad_packets += 1
            self._reply_rst(hdr)  # §5.10.6.4: an unknown type is answered with RST
            return
        op = hdr.op
        conn = self._conns.get((hdr.dst_port, hdr.src_port))
        if conn is not None and conn.closed:  # its RST is queued; only the guest's own RST matters
            if op == Op.RST:
                self._forget(conn)
            return
        if op == Op.REQUEST:
            self._guest_request(hdr, conn)
            return
        if conn is None:
            self._reply_rst(hdr)  # §5.10.6.5: no such connection (never answers an RST)
            return
        # §5.10.6.3: every packet of a flow carries the sender's credit.
        conn.peer_buf_alloc = hdr.buf_alloc
        conn.peer_fwd_cnt = hdr.fwd_cnt
        if op == Op.RW:
            self._guest_data(conn, payload)
        elif op == Op.CREDIT_UPDATE:
            if conn.to_guest:
                self._mark_ready(conn)
        elif op == Op.CREDIT_REQUEST:
            conn.credit_update_pending = True
            self._mark_ready(conn)
        elif op == Op.RESPONSE:
            if conn.state is ConnState.CONNECTING and conn.request_sent:
                conn.state = ConnState.ESTABLISHED
                self._mark_ready(conn)
                self._notify(conn)
            else:
                self.bad_packets += 1
                self._reset(conn)
        elif op == Op.SHUTDOWN:
            self._guest_shutdown(conn, hdr.flags)
        elif op == Op.RST:
            self._forget(conn)
            conn.state = ConnState.CLOSED
            conn.to_guest.clear()
            self._notify(conn)
        else:
            self.bad_packets += 1
            self._reset(conn)  # unknown op on a live connection

    def _guest_request(self, hdr: Header, existing: VsockConnection | None) -> None:
        if existing is not None:
            self.bad_packets += 1
            self._reset(existing)  # a second REQUEST for a live flow
            return
        if self.host is None or len(self._conns) >= self.max_connections:
            self._reply_rst(hdr)  # §5.10.6.5: nobody listening, or no resources
            return
        conn = VsockConnection(hdr.dst_port, hdr.src_port, host_initiated=False, buf_alloc=self.buf_alloc)
        conn.peer_buf_alloc = hdr.buf_alloc
        conn.peer_fwd_cnt = hdr.fwd_cnt
        self._conns[conn.key] = conn
        self.host.on_guest_connect(conn)

    def _guest_data(self, conn: VsockConnection, payload: bytes) -> None:
        n = len(payload)
        if conn.state is ConnState.CLOSING:
            # We announced SHUTDOWN_F_RECEIVE; count the bytes as consumed and drop them.
            conn.rx_cnt = (conn.rx_cnt + n) & U32
            conn.fwd_cnt = (conn.fwd_cnt + n) & U32
            return
        if conn.state is not ConnState.ESTABLISHED or conn.peer_shutdown & SHUTDOWN_SEND:
            self.bad_packets += 1
            self._reset(conn)
            return
        if len(conn.to_host) + n > conn.buf_alloc:
            self.bad_packets += 1
            log.debug("virtio-vsock: %r overran its credit", conn)
            self._reset(conn)  # §5.10.6.3: the guest ignored our buf_alloc
            return
        if n:
            conn.to_host += payload
            conn.rx_cnt = (conn.rx_cnt + n) & U32
            self._notify(conn)

    def _guest_shutdown(self, conn: VsockConnection, flags: int) -> None:
        if conn.state not in (ConnState.ESTABLISHED, ConnState.CLOSING):
            self.bad_packets += 1
            self._reset(conn)
            return
        new = flags & SHUTDOWN_BOTH & ~conn.peer_shutdown
        conn.peer_shutdown |= new  # §5.10.6.5: the hints are permanent
        if new & SHUTDOWN_RECEIVE:
            conn.to_guest.clear()
        if new:
            self._notify(conn)
        self._maybe_finish(conn)

    def _maybe_finish(self, conn: VsockConnection) -> None:
        """§5.10.6.5: after the guest's SHUTDOWN of both directions and once its data reached the host,
        answer RST to complete the clean disconnect."""
        if conn.peer_shutdown == SHUTDOWN_BOTH and not conn.to_host and not conn.closed:
            self._reset(conn)

    # -- connection table -----------------------------------------------------------------------------
    def _allocate_port(self, guest_port: int) -> int:
        in_use = {c.host_port for c in self._conns.values() if c.host_initiated}
        while True:
            port = self._next_port
            self._next_port = port + 1 if port < U32 else EPHEMERAL_PORT_BASE
            if port not in in_use and (port, guest_port) not in self._conns:
                return port

    def _reset(self, conn: VsockConnection) -> None:
        conn.state = ConnState.CLOSED
        conn.to_guest.clear()
        conn.request_pending = conn.response_pending = False
        conn.credit_update_pending = conn.shutdown_pending = False
        if conn.host_initiated and not conn.request_sent:
            self._forget(conn)  # the guest never heard of it
        else:
            conn.rst_pending = True
            self._mark_ready(conn)
        self._notify(conn)

    def _forget(self, conn: VsockConnection) -> None:
        if self._conns.get(conn.key) is conn:
            del self._conns[conn.key]
        conn.rst_pending = False
        if conn in self._ready_set:
            self._ready_set.discard(conn)
            self._ready.remove(conn)

    def _drop_all(self) -> None:
        conns = list(self._conns.values())
        self._conns.clear()
        self._ready.clear()
        self._ready_set.clear()
        self._replies.clear()
        for conn in conns:
            was_closed = conn.closed
            conn.state = ConnState.CLOSED
            conn.to_guest.clear()
            conn.rst_pending = False
            if not was_closed:
                self._notify(conn)

    def _notify(self, conn: VsockConnection) -> None:
        if self.host is not None:
            self.host.on_change(conn)

    def _reply_rst(self, hdr: Header) -> None:
        if hdr.op == Op.RST or len(self._replies) >= MAX_PENDING_REPLIES:
            return
        self._replies.append(Header(HOST_CID, self.guest_cid, hdr.dst_port, hdr.src_port, 0, hdr.type,
                                    Op.RST))

    # -- rx: host -> guest (§5.10.6.4) -----------------------------------------------------------------
    def _mark_ready(self, conn: VsockConnection) -> None:
        if conn not in self._ready_set:
            self._ready_set.add(conn)
            self._ready.append(conn)

    @staticmethod
    def _has_work(conn: VsockConnection) -> bool:
        if conn.rst_pending or conn.request_pending or conn.response_pending or conn.credit_update_pending:
            return True
        if conn.to_guest and conn.peer_free > 0 and conn.state in (ConnState.ESTABLISHED, ConnState.CLOSING):
            return True
        return conn.shutdown_pending and not conn.to_guest

    def _header(self, conn: VsockConnection, op: Op, length: int = 0, flags: int = 0) -> Header:
        # §5.10.6.3: every packet of a flow carries our buf_alloc and fwd_cnt.
        conn.last_fwd_cnt_sent = conn.fwd_cnt
        conn.credit_update_pending = False
        return Header(HOST_CID, self.guest_cid, conn.host_port, conn.guest_port, length, TYPE_STREAM, op,
                      flags, conn.buf_alloc, conn.fwd_cnt)

    def _next_packet(self, conn: VsockConnection, room: int) -> tuple[Header, bytes]:
        """The next packet ``conn`` owes the guest, for a chain with ``room`` payload bytes (``_has_work``
        was true)."""
        if conn.rst_pending:
            self._forget(conn)
            return self._header(conn, Op.RST), b""
        if conn.request_pending:
            conn.request_pending = False
            conn.request_sent = True
            return self._header(conn, Op.REQUEST), b""
        if conn.response_pending:
            conn.response_pending = False
            return self._header(conn, Op.RESPONSE), b""
        n = min(len(conn.to_guest), conn.peer_free, room, MAX_PAYLOAD)
        if n > 0 and conn.state in (ConnState.ESTABLISHED, ConnState.CLOSING):
            payload = bytes(conn.to_guest[:n])
            del conn.to_guest[:n]
            conn.tx_cnt = (conn.tx_cnt + n) & U32
            return self._header(conn, Op.RW, n), payload
        if conn.shutdown_pending and not conn.to_guest:
            conn.shutdown_pending = False
            return self._header(conn, Op.SHUTDOWN, flags=SHUTDOWN_BOTH), b""
        return self._header(conn, Op.CREDIT_UPDATE), b""  # also when a header-only chain can't carry data

    def _flush_rx(self) -> None:
        """Write owed packets into available rx chains: connection-less replies first, then connections
        round-robin, one packet each per turn. Raises QueueError if the ring is broken."""
        if not self.activated or self.mem is None or self.interrupt is None or len(self.queues) <= RX_QUEUE:
            return
        mem = self.mem
        q = self.queues[RX_QUEUE]
        completed = 0
        sent_data: list[VsockConnection] = []
        try:
            # Bounded to one queue's worth per call, however fast the driver recycles buffers.
            while (self._replies or self._ready) and completed < q.size:
                if not self._replies and not self._has_work(self._ready[0]):
                    self._ready_set.discard(self._ready.popleft())
                    continue
                try:
                    chain = q.pop(mem)
                except ChainError as e:
                    log.debug("virtio-vsock rx: %s", e)
                    q.add_used(mem, e.head, 0)
                    completed += 1
                    continue
                if chain is None:
                    break
                room = rx_room(chain)
                if room < 0:
                    q.add_used(mem, chain.head, 0)  # not a usable rx buffer; the packet waits
                    completed += 1
                    continue
                conn: VsockConnection | None = None
                if self._replies:
                    hdr, payload = self._replies.popleft(), b""
                else:
                    conn = self._ready.popleft()
                    self._ready_set.discard(conn)
                    hdr, payload = self._next_packet(conn, room)
                    if self._has_work(conn):
                        self._mark_ready(conn)
                    if payload and conn not in sent_data:
                        sent_data.append(conn)
                try:
                    used = write_rx(mem, chain, hdr, payload)
                except ChainError as e:
                    log.warning("virtio-vsock rx: %s", e)
                    used = 0
                    if conn is not None and payload and not conn.closed:
                        self._reset(conn)  # part of its stream is lost
                q.add_used(mem, chain.head, used)
                completed += 1
        finally:
            if completed:
                self.interrupt.signal_used(RX_QUEUE)
            for conn in sent_data:
                self._notify(conn)  # room for more host data

    def _kick_rx(self) -> None:
        """Flush from host-driven work: a broken ring sets DEVICE_NEEDS_RESET (§2.1.2)."""
        try:
            self._flush_rx()
        except QueueError as e:
            self._needs_reset(f"rx queue: {e}")

    def _needs_reset(self, reason: str) -> None:
        log.warning("virtio-vsock: %s", reason)
        if self.interrupt is not None:
            self.interrupt.signal_needs_reset(reason)

    # -- event queue (§5.10.6.7) -------------------------------------------------------------------------
    def _deliver_event(self) -> None:
        """Hand a pending TRANSPORT_RESET event to the first usable event buffer (one event, then stop)."""
        if self._event_pending:
            self.process_queue(EVENT_QUEUE, self._write_event, done=lambda: not self._event_pending)

    def _write_event(self, mem: GuestMemory, chain: DescriptorChain) -> int:
        if chain.readable or chain.writable_len < EVENT_SIZE:
            return 0  # not a device-writable buffer of one event: completed unused
        try:
            used = chain.write_all(mem, struct.pack("<I", EVENT_TRANSPORT_RESET))
        except ChainError:
            return 0
        if used == EVENT_SIZE:
            self._event_pending = False
        return used

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> VsockState:
        return save_vsock(self)

    def restore(self, state: VsockState) -> None:
        restore_vsock(self, state)
