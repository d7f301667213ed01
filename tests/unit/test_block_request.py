"""virtio-blk request parsing against GuestMemory, without a transport (virtio 1.2 §5.2.6)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from smold.devices.block.request import (
    BlockRequest,
    RequestError,
    RequestType,
    Status,
    parse_request,
    split,
)
from smold.devices.virtio.queue import Descriptor, DescriptorChain
from smold.memory import GuestMemory

R, W = False, True


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 1 << 16)]) as m:
        yield m


def chain(*descs: tuple[int, int, bool]) -> DescriptorChain:
    d = [Descriptor(a, n, w) for a, n, w in descs]
    return DescriptorChain(3, tuple(x for x in d if not x.write), tuple(x for x in d if x.write))


def put_hdr(mem: GuestMemory, addr: int, rtype: int, sector: int = 0) -> None:
    mem.write(addr, struct.pack("<IIQ", rtype, 0xDEAD, sector))


def parse(mem: GuestMemory, c: DescriptorChain, capacity: int = 100, read_only: bool = False,
          max_bytes: int = 1 << 20) -> BlockRequest:
    return parse_request(mem, c, capacity=capacity, read_only=read_only, max_bytes=max_bytes)


def test_split() -> None:
    d = (Descriptor(100, 10, W), Descriptor(200, 6, W))
    assert split(d, 0) == ((), d)
    assert split(d, 16) == (d, ())
    assert split(d, 12) == ((d[0], Descriptor(200, 2, W)), (Descriptor(202, 4, W),))
    assert split(d, 10) == ((d[0],), (d[1],))
    assert split(d, 100) == (d, ())


def test_in_request(mem: GuestMemory) -> None:
    put_hdr(mem, 0x100, RequestType.IN, 7)
    req = parse(mem, chain((0x100, 16, R), (0x1000, 1024, W), (0x2000, 1, W)))
    assert req.type == RequestType.IN and req.sector == 7 and req.offset == 7 * 512
    assert req.data == (Descriptor(0x1000, 1024, W),) and req.status_addr == 0x2000
    assert req.head == 3


def test_status_is_last_writable_byte(mem: GuestMemory) -> None:
    put_hdr(mem, 0x100, RequestType.IN, 0)
    req = parse(mem, chain((0x100, 16, R), (0x1000, 513, W), (0x3000, 0, W)))
    assert req.status_addr == 0x1000 + 512 and req.data_len == 512


def test_header_split_across_descriptors(mem: GuestMemory) -> None:
    put_hdr(mem, 0x100, RequestType.OUT, 5)
    mem.write(0x200, b"\x00" * 512)
    data = mem.read(0x100, 16)
    mem.write(0x400, data[:3])
    mem.write(0x500, data[3:] + b"\x00" * 512)
    req = parse(mem, chain((0x400, 3, R), (0x500, 13 + 512, R), (0x2000, 1, W)))
    assert req.type == RequestType.OUT and req.sector == 5
    assert req.data == (Descriptor(0x500 + 13, 512, R),)


def test_errors(mem: GuestMemory) -> None:
    put_hdr(mem, 0x100, RequestType.IN, 0)
    with pytest.raises(RequestError) as e:
        parse(mem, chain((0x100, 16, R)))
    assert e.value.status_addr is None
    with pytest.raises(RequestError) as e:
        parse(mem, chain((0x100, 15, R), (0x2000, 1, W)))
    assert (e.value.status, e.value.status_addr) == (Status.IOERR, 0x2000)
    with pytest.raises(RequestError) as e:
        parse(mem, chain((0x100, 16, R), (0x1000, 512, W), (0x2000, 1, W)), capacity=0)
    assert e.value.status == Status.IOERR
    with pytest.raises(RequestError):
        parse(mem, chain((0x100, 16, R), (0x1000, 1024, W), (0x2000, 1, W)), max_bytes=512)
    put_hdr(mem, 0x100, RequestType.OUT, 0)
    with pytest.raises(RequestError) as e:
        parse(mem, chain((0x100, 16, R), (0x1000, 512, R), (0x2000, 1, W)), read_only=True)
    assert e.value.status == Status.IOERR
    put_hdr(mem, 0x100, 99, 0)
    with pytest.raises(RequestError) as e:
        parse(mem, chain((0x100, 16, R), (0x2000, 1, W)))
    assert e.value.status == Status.UNSUPP


@pytest.mark.parametrize("sector", [2**64 - 1, 2**64 - 2, 101, 2**63])
def test_sector_overflow(mem: GuestMemory, sector: int) -> None:
    put_hdr(mem, 0x100, RequestType.IN, sector)
    with pytest.raises(RequestError):
        parse(mem, chain((0x100, 16, R), (0x1000, 1024, W), (0x2000, 1, W)))


def test_flush_and_get_id(mem: GuestMemory) -> None:
    put_hdr(mem, 0x100, RequestType.FLUSH, 12345)
    req = parse(mem, chain((0x100, 16, R), (0x2000, 1, W)))
    assert req.type == RequestType.FLUSH and req.data == ()
    put_hdr(mem, 0x100, RequestType.GET_ID)
    req = parse(mem, chain((0x100, 16, R), (0x1000, 64, W), (0x2000, 1, W)))
    assert req.type == RequestType.GET_ID and req.data == (Descriptor(0x1000, 20, W),)
