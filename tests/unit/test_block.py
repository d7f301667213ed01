"""virtio-blk through the real transport against a temp image file (virtio 1.2 §5.2)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from virtio_driver import DriverQueue, VirtioDriver

from smold.devices.block import BackendError, Block, BlockError, FileBackend
from smold.devices.block.device import (
    MAX_REQUEST_BYTES,
    SEG_MAX,
    SIZE_MAX,
    VIRTIO_BLK_F_BLK_SIZE,
    VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_RO,
    VIRTIO_BLK_F_SEG_MAX,
    VIRTIO_BLK_F_SIZE_MAX,
)
from smold.devices.block.request import RequestType, Status
from smold.devices.irq import CountingIrq
from smold.devices.virtio.device import VIRTIO_F_VERSION_1, VIRTIO_ID_BLOCK
from smold.devices.virtio.mmio import MmioTransport, Reg
from smold.memory import GuestMemory

SECTORS = 64
IMAGE = bytes((i * 7 + i // 512) & 0xFF for i in range(SECTORS * 512))


def hdr(rtype: int, sector: int = 0) -> bytes:
    return struct.pack("<IIQ", rtype, 0, sector)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    p = tmp_path / "disk.img"
    p.write_bytes(IMAGE)
    return p


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 2 << 20)]) as m:
        yield m


class Rig:
    def __init__(self, path: Path, mem: GuestMemory, read_only: bool = False, **kw: object) -> None:
        self.backend = FileBackend(path, read_only=read_only)
        self.block = Block(self.backend, read_only=read_only, **kw)  # type: ignore[arg-type]
        self.irq = CountingIrq()
        self.transport = MmioTransport(self.block, mem, self.irq)
        self.drv = VirtioDriver(self.transport, mem)
        self.mem = mem
        (self.q,) = self.drv.negotiate()

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def rig(image: Path, mem: GuestMemory) -> Iterator[Rig]:
    r = Rig(image, mem)
    yield r
    r.close()


@pytest.fixture
def ro_rig(image: Path, mem: GuestMemory) -> Iterator[Rig]:
    r = Rig(image, mem, read_only=True)
    yield r
    r.close()


def test_identity_features_and_config(rig: Rig) -> None:
    assert rig.drv.read32(Reg.DEVICE_ID) == VIRTIO_ID_BLOCK
    f = rig.drv.device_features()
    assert f & VIRTIO_BLK_F_FLUSH and f & VIRTIO_F_VERSION_1
    assert f & VIRTIO_BLK_F_SEG_MAX and f & VIRTIO_BLK_F_SIZE_MAX and f & VIRTIO_BLK_F_BLK_SIZE
    assert not f & VIRTIO_BLK_F_RO
    assert struct.unpack("<Q", rig.drv.read_config(0, 8))[0] == SECTORS
    # Linux reads the le64 capacity as two 32-bit halves; any byte granularity must agree.
    lo, hi = rig.drv.read_config(0, 4), rig.drv.read_config(4, 4)
    assert struct.unpack("<Q", lo + hi)[0] == SECTORS
    assert bytes(rig.drv.read_config(i, 1)[0] for i in range(8)) == struct.pack("<Q", SECTORS)
    assert struct.unpack("<I", rig.drv.read_config(8, 4))[0] == SIZE_MAX
    assert struct.unpack("<I", rig.drv.read_config(12, 4))[0] == SEG_MAX
    assert struct.unpack("<I", rig.drv.read_config(20, 4))[0] == 512
    assert SEG_MAX * SIZE_MAX == MAX_REQUEST_BYTES
    assert rig.transport.queues[0].max_size == 256


def test_capacity_rounds_down_partial_sector(tmp_path: Path, mem: GuestMemory) -> None:
    p = tmp_path / "odd.img"
    p.write_bytes(bytes(512 * 3 + 100))
    with FileBackend(p) as be:
        t = MmioTransport(Block(be), mem, CountingIrq())
        assert struct.unpack("<Q", t.read(0x100, 8))[0] == 3


def test_read(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 3)], writable=[1024, 1])
    assert used.length == 1025
    assert data[:1024] == IMAGE[3 * 512:5 * 512]
    assert data[1024] == Status.OK
    assert rig.irq.count == 1
    assert rig.drv.ack_interrupts() == 1


def test_read_scattered_and_status_sharing_a_descriptor(rig: Rig) -> None:
    # Descriptor boundaries carry no meaning (§2.7.4): data split 100/412+512+1 where the
    # status byte is the last byte of the final data descriptor.
    h = hdr(RequestType.IN, 10)
    used, data = rig.drv.request(0, readable=[h[:5], h[5:]], writable=[100, 412, 513])
    assert used.length == 1025
    assert data[:1024] == IMAGE[10 * 512:12 * 512]
    assert data[1024] == Status.OK


def test_write_then_read_back(rig: Rig, image: Path) -> None:
    payload = os.urandom(1536)
    used, data = rig.drv.request(0, readable=[hdr(RequestType.OUT, 60), payload[:1000], payload[1000:]],
                                 writable=[1])
    assert (used.length, data) == (1, bytes([Status.OK]))
    assert image.read_bytes()[60 * 512:63 * 512] == payload
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 60)], writable=[1536, 1])
    assert data[:1536] == payload and data[1536] == Status.OK


def test_flush(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    used, data = rig.drv.request(0, readable=[hdr(RequestType.FLUSH)], writable=[1])
    assert (used.length, data) == (1, bytes([Status.OK]))
    assert synced == [rig.backend.fd]


def test_get_id(image: Path, mem: GuestMemory) -> None:
    r = Rig(image, mem, serial="disk-0")
    try:
        used, data = r.drv.request(0, readable=[hdr(RequestType.GET_ID)], writable=[20, 1])
        assert used.length == 21
        assert data[:20] == b"disk-0".ljust(20, b"\x00") and data[20] == Status.OK
        # A short buffer gets a truncated id.
        used, data = r.drv.request(0, readable=[hdr(RequestType.GET_ID)], writable=[4, 1])
        assert used.length == 5 and data == b"disk" + bytes([Status.OK])
    finally:
        r.close()


def test_serial_too_long() -> None:
    class B:
        size = 512
        read_only = False

    with pytest.raises(BlockError):
        Block(B(), serial=b"x" * 21)  # type: ignore[arg-type]


def test_read_only_rejects_out(ro_rig: Rig, image: Path) -> None:
    assert ro_rig.drv.device_features() & VIRTIO_BLK_F_RO
    assert ro_rig.block.acked_features & VIRTIO_BLK_F_RO
    used, data = ro_rig.drv.request(0, readable=[hdr(RequestType.OUT, 0), b"\x00" * 512], writable=[1])
    assert (used.length, data) == (1, bytes([Status.IOERR]))
    assert image.read_bytes() == IMAGE
    used, data = ro_rig.drv.request(0, readable=[hdr(RequestType.IN, 0)], writable=[512, 1])
    assert data == IMAGE[:512] + bytes([Status.OK])
    used, data = ro_rig.drv.request(0, readable=[hdr(RequestType.FLUSH)], writable=[1])
    assert data == bytes([Status.OK])


def test_read_only_backend_needs_read_only_device(image: Path) -> None:
    with FileBackend(image, read_only=True) as be, pytest.raises(BlockError):
        Block(be, read_only=False)


def test_backend_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BackendError):
        FileBackend(tmp_path / "nope.img")


@pytest.mark.parametrize(("sector", "nbytes"), [(SECTORS, 512), (SECTORS - 1, 1024), (2**64 - 1, 512),
                                                (2**63, 2**9 * 2), (SECTORS + 1, 0)])
def test_sector_beyond_capacity(rig: Rig, sector: int, nbytes: int) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, sector)], writable=[nbytes, 1] if nbytes
                                 else [1])
    assert data[-1] == Status.IOERR
    assert used.length == 1


def test_last_sector_is_readable(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, SECTORS - 1)], writable=[512, 1])
    assert data == IMAGE[-512:] + bytes([Status.OK])
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, SECTORS)], writable=[1])
    assert data == bytes([Status.OK])  # zero-length request at the end: nothing to do


def test_write_beyond_capacity_does_not_touch_file(rig: Rig, image: Path) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.OUT, SECTORS - 1), b"\x01" * 1024],
                                 writable=[1])
    assert data == bytes([Status.IOERR])
    assert image.stat().st_size == len(IMAGE) and image.read_bytes() == IMAGE


def test_data_not_multiple_of_512(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 0)], writable=[511, 1])
    assert used.length == 1 and data[-1] == Status.IOERR
    assert data[:511] == b"\xa5" * 511  # no data written on a rejected request
    used, data = rig.drv.request(0, readable=[hdr(RequestType.OUT, 0), b"x" * 100], writable=[1])
    assert data == bytes([Status.IOERR])


def test_header_too_short(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 0)[:15]], writable=[512, 1])
    assert used.length == 1
    assert data[-1] == Status.IOERR


def test_no_header_no_status(rig: Rig) -> None:
    # No writable byte at all: nowhere to put a status, complete with used length 0.
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 0)])
    assert used.length == 0 and data == b""
    assert rig.irq.count == 1


def test_unsupported_type(rig: Rig) -> None:
    for rtype in (2, 11, 13, 0xFFFFFFFF):
        used, data = rig.drv.request(0, readable=[hdr(rtype)], writable=[1])
        assert (used.length, data) == (1, bytes([Status.UNSUPP]))


def test_in_with_extra_readable_data_fails(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, 0), b"junk"], writable=[512, 1])
    assert used.length == 1 and data[-1] == Status.IOERR


def test_out_with_writable_data_fails(rig: Rig, image: Path) -> None:
    used, data = rig.drv.request(0, readable=[hdr(RequestType.OUT, 0), b"\x02" * 512], writable=[512, 1])
    assert used.length == 1 and data[-1] == Status.IOERR
    assert image.read_bytes() == IMAGE


def test_request_size_cap(image: Path, mem: GuestMemory) -> None:
    r = Rig(image, mem, max_request_bytes=1024)
    try:
        used, data = r.drv.request(0, readable=[hdr(RequestType.IN, 0)], writable=[1536, 1])
        assert used.length == 1 and data[-1] == Status.IOERR
        used, data = r.drv.request(0, readable=[hdr(RequestType.IN, 0)], writable=[1024, 1])
        assert data == IMAGE[:1024] + bytes([Status.OK])
    finally:
        r.close()


def test_sparse_image_reads_zeros(tmp_path: Path, mem: GuestMemory) -> None:
    p = tmp_path / "sparse.img"
    p.write_bytes(b"\x11" * 512)
    with FileBackend(p, size=8 * 512) as be:
        t = MmioTransport(Block(be), mem, CountingIrq())
        drv = VirtioDriver(t, mem)
        drv.negotiate()
        used, data = drv.request(0, readable=[hdr(RequestType.IN, 0)], writable=[2048, 1])
        assert data == b"\x11" * 512 + bytes(1536) + bytes([Status.OK])
        assert used.length == 2049


class FailingBackend:
    size = 16 * 512
    read_only = False

    def read_into(self, offset: int, buf: memoryview) -> None:
        raise OSError(5, "EIO")

    def write(self, offset: int, data: memoryview) -> None:
        raise OSError(28, "ENOSPC")

    def flush(self) -> None:
        raise OSError(5, "EIO")


def test_backend_errors_become_ioerr(mem: GuestMemory) -> None:
    t = MmioTransport(Block(FailingBackend()), mem, CountingIrq())
    drv = VirtioDriver(t, mem)
    drv.negotiate()
    for req in ([hdr(RequestType.IN, 0)], [hdr(RequestType.OUT, 0), bytes(512)], [hdr(RequestType.FLUSH)]):
        writable = [512, 1] if req[0][:4] == hdr(RequestType.IN)[:4] else [1]
        used, data = drv.request(0, readable=req, writable=writable)
        assert data[-1] == Status.IOERR and used.length == 1
    assert not t.needs_reset


def test_many_requests_in_one_kick(rig: Rig) -> None:
    q: DriverQueue = rig.q
    pend = [q.add([hdr(RequestType.IN, i)], [512, 1]) for i in range(40)]
    rig.drv.kick(0, ioeventfd=True)
    done = q.used()
    assert [u.head for u in done] == [p.head for p in pend]
    for i, p in enumerate(pend):
        assert p.written(rig.mem) == IMAGE[i * 512:(i + 1) * 512] + bytes([Status.OK])
        q.release(p)
    assert rig.irq.count == 1  # one interrupt for the batch


def test_queue_wraps_many_times(rig: Rig) -> None:
    for i in range(600):  # more than 2 * 256 descriptors and avail entries: indices wrap
        used, data = rig.drv.request(0, readable=[hdr(RequestType.IN, i % SECTORS)], writable=[512, 1])
        assert data[:512] == IMAGE[(i % SECTORS) * 512:(i % SECTORS + 1) * 512]
    assert rig.transport.queues[0].next_used == 600
