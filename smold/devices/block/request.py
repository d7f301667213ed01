"""Parse a virtio-blk descriptor chain into a validated request (virtio 1.2 §5.2.6); no host I/O."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from smold.devices.virtio.queue import Descriptor, DescriptorChain
from smold.memory import GuestMemory, GuestMemoryError

SECTOR_SIZE = 512  # §5.2.6: sector is always in 512-byte units, whatever blk_size says
HEADER_SIZE = 16  # struct virtio_blk_req: le32 type, le32 reserved, le64 sector
ID_BYTES = 20  # §5.2.6: VIRTIO_BLK_T_GET_ID answers a 20-byte, NUL-padded serial


class RequestType(IntEnum):
    """§5.2.6 request types this device implements (the rest are answered UNSUPP)."""

    IN = 0
    OUT = 1
    FLUSH = 4
    GET_ID = 8


class Status(IntEnum):
    """§5.2.6: the status byte."""

    OK = 0
    IOERR = 1
    UNSUPP = 2


class RequestError(Exception):
    """This request fails: write ``status`` at ``status_addr``, or complete with used length 0 if None."""

    def __init__(self, head: int, status: Status, status_addr: int | None, reason: str) -> None:
        super().__init__(f"block request {head}: {reason}")
        self.head = head
        self.status = status
        self.status_addr = status_addr
        self.reason = reason


@dataclass(frozen=True)
class BlockRequest:
    """A validated request. ``data`` are guest buffers: readable for OUT, writable for IN/GET_ID."""

    head: int
    type: RequestType
    sector: int
    data: tuple[Descriptor, ...]
    status_addr: int

    @property
    def data_len(self) -> int:
        return sum(d.length for d in self.data)

    @property
    def offset(self) -> int:
        return self.sector * SECTOR_SIZE


def split(descs: tuple[Descriptor, ...], n: int) -> tuple[tuple[Descriptor, ...], tuple[Descriptor, ...]]:
    """Split a buffer list after its first ``n`` bytes (descriptor boundaries carry no meaning, §2.7.4)."""
    head: list[Descriptor] = []
    tail: list[Descriptor] = []
    left = n
    for d in descs:
        if left >= d.length:
            head.append(d)
            left -= d.length
        elif left > 0:
            head.append(Descriptor(d.addr, left, d.write))
            tail.append(Descriptor(d.addr + left, d.length - left, d.write))
            left = 0
        else:
            tail.append(d)
    return tuple(x for x in head if x.length), tuple(x for x in tail if x.length)


def parse_request(mem: GuestMemory, chain: DescriptorChain, *, capacity: int, read_only: bool,
                  max_bytes: int) -> BlockRequest:
    """Validate ``chain`` as a virtio_blk_req; raises RequestError naming the status to report.

    Layout (§5.2.6): header in device-readable buffers, then OUT data (readable) or IN data
    (writable), and the status byte as the last device-writable byte.
    """
    head = chain.head
    writable_len = chain.writable_len
    if writable_len == 0:
        raise RequestError(head, Status.IOERR, None, "no device-writable status byte")
    data_w, status = split(chain.writable, writable_len - 1)
    status_addr = status[-1].addr
    readable_len = chain.readable_len
    if readable_len < HEADER_SIZE:
        raise RequestError(head, Status.IOERR, status_addr, f"header is {readable_len} bytes, need 16")
    hdr_descs, data_r = split(chain.readable, HEADER_SIZE)
    try:
        raw = b"".join(mem.read(d.addr, d.length) for d in hdr_descs)
    except GuestMemoryError as e:
        raise RequestError(head, Status.IOERR, status_addr, str(e)) from e
    rtype, _reserved, sector = struct.unpack("<IIQ", raw)

    if rtype == RequestType.IN or rtype == RequestType.OUT:
        if rtype == RequestType.IN:
            if data_r:
                raise RequestError(head, Status.IOERR, status_addr, "IN request carries readable data")
            data = data_w
        else:
            if read_only:
                raise RequestError(head, Status.IOERR, status_addr, "write to a read-only disk")
            if data_w:
                raise RequestError(head, Status.IOERR, status_addr, "OUT request has writable data")
            data = data_r
        length = sum(d.length for d in data)
        if length % SECTOR_SIZE:
            raise RequestError(head, Status.IOERR, status_addr, f"data length {length} not a multiple of 512")
        if length > max_bytes:
            raise RequestError(head, Status.IOERR, status_addr, f"data length {length} exceeds {max_bytes}")
        # Overflow-safe range check: never form sector + count in fixed width.
        count = length // SECTOR_SIZE
        if sector > capacity or count > capacity - sector:
            raise RequestError(head, Status.IOERR, status_addr,
                               f"sectors {sector}+{count} beyond capacity {capacity}")
        return BlockRequest(head, RequestType(rtype), sector, data, status_addr)
    if rtype == RequestType.FLUSH:
        return BlockRequest(head, RequestType.FLUSH, sector, (), status_addr)
    if rtype == RequestType.GET_ID:
        if data_r:
            raise RequestError(head, Status.IOERR, status_addr, "GET_ID request carries readable data")
        id_bufs, _ = split(data_w, ID_BYTES)
        return BlockRequest(head, RequestType.GET_ID, sector, id_bufs, status_addr)
    raise RequestError(head, Status.UNSUPP, status_addr, f"unsupported request type {rtype}")
