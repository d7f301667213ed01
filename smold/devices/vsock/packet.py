"""virtio-vsock packets: the 44-byte header in tx/rx descriptor chains (virtio 1.2 §5.10.6); no I/O."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from smold.devices.virtio.queue import Descriptor, DescriptorChain
from smold.memory import GuestMemory, GuestMemoryError

# §5.10.6: struct virtio_vsock_hdr {le64 src_cid; le64 dst_cid; le32 src_port; le32 dst_port; le32 len;
# le16 type; le16 op; le32 flags; le32 buf_alloc; le32 fwd_cnt;}
_HEADER = struct.Struct("<QQIIIHHIII")
HEADER_SIZE = _HEADER.size  # 44
HOST_CID = 2  # §5.10.4: the well-known CID of the host
CID_RESERVED_HIGH = 0xFFFFFFFF  # §5.10.4: 0, 1, 2 and 0xffffffff (and anything wider) are reserved
TYPE_STREAM = 1  # §5.10.6.2: VIRTIO_VSOCK_TYPE_STREAM (SEQPACKET, 2, is not offered)
# §5.10.6.5: VIRTIO_VSOCK_OP_SHUTDOWN flags.
SHUTDOWN_RECEIVE = 1
SHUTDOWN_SEND = 2
SHUTDOWN_BOTH = SHUTDOWN_RECEIVE | SHUTDOWN_SEND
# The largest payload this device accepts in one tx packet or puts in one rx packet (Linux uses 64 KiB).
MAX_PAYLOAD = 64 * 1024
# §5.10.6.7: struct virtio_vsock_event {le32 id;}.
EVENT_TRANSPORT_RESET = 0
EVENT_SIZE = 4
U32 = 0xFFFFFFFF


def is_guest_cid(cid: object) -> bool:
    """§5.10.4: a CID the device may present as guest_cid (the upper 32 bits are zero)."""
    return isinstance(cid, int) and not isinstance(cid, bool) and HOST_CID < cid < CID_RESERVED_HIGH


class Op(IntEnum):
    """§5.10.6: the op field."""

    INVALID = 0
    REQUEST = 1
    RESPONSE = 2
    RST = 3
    SHUTDOWN = 4
    RW = 5
    CREDIT_UPDATE = 6
    CREDIT_REQUEST = 7


@dataclass(frozen=True)
class Header:
    """One virtio_vsock_hdr with every field as the integer it carries (not yet validated)."""

    src_cid: int
    dst_cid: int
    src_port: int
    dst_port: int
    len: int
    type: int
    op: int
    flags: int = 0
    buf_alloc: int = 0
    fwd_cnt: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(self.src_cid, self.dst_cid, self.src_port, self.dst_port, self.len, self.type,
                            self.op, self.flags, self.buf_alloc & U32, self.fwd_cnt & U32)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        if len(raw) != HEADER_SIZE:
            raise ValueError(f"a virtio_vsock_hdr is {HEADER_SIZE} bytes, not {len(raw)}")
        return cls(*_HEADER.unpack(raw))


class PacketError(Exception):
    """A tx chain that is not a valid packet: complete it with used length 0 and drop it.

    ``header`` is set when the header itself was readable, so the caller can reset the connection it names.
    """

    def __init__(self, head: int, reason: str, header: Header | None = None) -> None:
        super().__init__(f"vsock packet {head}: {reason}")
        self.head = head
        self.reason = reason
        self.header = header


@dataclass(frozen=True)
class Packet:
    """A packet the driver put on the tx queue, header and payload gathered from its descriptors."""

    head: int
    header: Header
    payload: bytes


def gather(mem: GuestMemory, descs: tuple[Descriptor, ...], offset: int, length: int) -> bytes:
    """Read ``length`` bytes starting ``offset`` bytes into ``descs`` (descriptor boundaries carry no
    meaning, §2.7.4); the caller checked the total length. Raises GuestMemoryError."""
    out: list[bytes] = []
    pos = 0
    for d in descs:
        if length <= 0:
            break
        if offset >= pos + d.length:
            pos += d.length
            continue
        start = max(0, offset - pos)
        n = min(d.length - start, length)
        out.append(mem.read(d.addr + start, n))
        length -= n
        offset += n
        pos += d.length
    return b"".join(out)


def parse_tx(mem: GuestMemory, chain: DescriptorChain, max_payload: int = MAX_PAYLOAD) -> Packet:
    """§5.10.6.4: a tx buffer is device-readable only and holds the header then ``len`` payload bytes,
    split across descriptors any way the driver likes. Raises PacketError for anything else."""
    head = chain.head
    if chain.writable:
        raise PacketError(head, "tx chain has device-writable descriptors")
    total = chain.readable_len
    if total < HEADER_SIZE:
        raise PacketError(head, f"chain holds {total} bytes, the header needs {HEADER_SIZE}")
    try:
        header = Header.unpack(gather(mem, chain.readable, 0, HEADER_SIZE))
    except GuestMemoryError as e:
        raise PacketError(head, str(e)) from e
    if header.len > max_payload:
        raise PacketError(head, f"payload length {header.len} exceeds {max_payload}", header)
    if header.len > total - HEADER_SIZE:
        raise PacketError(head, f"payload length {header.len} exceeds the {total - HEADER_SIZE} bytes "
                                "the chain carries", header)
    try:
        payload = gather(mem, chain.readable, HEADER_SIZE, header.len) if header.len else b""
    except GuestMemoryError as e:
        raise PacketError(head, str(e), header) from e
    return Packet(head, header, payload)


def rx_room(chain: DescriptorChain) -> int:
    """Payload bytes an rx chain can take after the header; -1 if it cannot hold a packet at all
    (§5.10.6.4: rx buffers are device-writable only and must fit the header)."""
    if chain.readable:
        return -1
    return chain.writable_len - HEADER_SIZE


def write_rx(mem: GuestMemory, chain: DescriptorChain, header: Header, payload: bytes = b"") -> int:
    """Scatter header and payload into an rx chain; returns the used length. ``header.len`` must equal
    ``len(payload)`` and the caller checked ``rx_room``. Raises ChainError on a bad buffer."""
    if header.len != len(payload):
        raise ValueError(f"header says {header.len} payload bytes, got {len(payload)}")
    data = header.pack() + payload
    if len(data) > chain.writable_len:
        raise ValueError(f"packet of {len(data)} bytes does not fit a {chain.writable_len}-byte chain")
    return chain.write_all(mem, data)
