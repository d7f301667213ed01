"""virtio-blk device model: features, config space and request-queue processing (virtio 1.2 §5.2)."""

from __future__ import annotations

import logging
import struct

from smold.devices.block.backend import BlockBackend
from smold.devices.block.persist import BlockState, restore_block, save_block
from smold.devices.block.request import (
    ID_BYTES,
    SECTOR_SIZE,
    BlockRequest,
    RequestError,
    RequestType,
    Status,
    parse_request,
)
from smold.devices.virtio.device import VIRTIO_ID_BLOCK, VirtioDevice, VirtioError
from smold.devices.virtio.queue import DescriptorChain
from smold.memory import GuestMemory, GuestMemoryError

log = logging.getLogger(__name__)

# §5.2.3: feature bits.
VIRTIO_BLK_F_SIZE_MAX = 1 << 1
VIRTIO_BLK_F_SEG_MAX = 1 << 2
VIRTIO_BLK_F_RO = 1 << 5
VIRTIO_BLK_F_BLK_SIZE = 1 << 6
VIRTIO_BLK_F_FLUSH = 1 << 9

QUEUE_SIZE = 256
SEG_MAX = 128  # data segments per request (fits a 256-entry queue with header and status)
SIZE_MAX = 128 * 1024  # bytes per segment
MAX_REQUEST_BYTES = SEG_MAX * SIZE_MAX  # the largest request a driver honouring the limits sends
CONFIG_SIZE = 60  # struct virtio_blk_config up to write_zeroes_may_unmap and padding (§5.2.4)


class BlockError(VirtioError):
    """A bad block device configuration (never raised for guest requests)."""


class Block(VirtioDevice):
    """A virtio-blk disk over a BlockBackend; one request queue of 256 entries."""

    device_type = VIRTIO_ID_BLOCK
    queue_max_sizes = (QUEUE_SIZE,)

    def __init__(self, backend: BlockBackend, read_only: bool = False, *, serial: bytes | str = b"smol",
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        super().__init__()
        if backend.read_only and not read_only:
            raise BlockError("a read-only backend needs read_only=True")
        if isinstance(serial, str):
            serial = serial.encode("ascii")
        if len(serial) > ID_BYTES:
            raise BlockError(f"serial {serial!r} is longer than {ID_BYTES} bytes")
        if max_request_bytes <= 0 or max_request_bytes % SECTOR_SIZE:
            raise BlockError("max_request_bytes must be a positive multiple of 512")
        self.backend = backend
        self.read_only = read_only
        self.serial = serial
        self.max_request_bytes = max_request_bytes
        self.capacity = backend.size // SECTOR_SIZE  # a trailing partial sector is not exposed

    # -- features and config space (§5.2.3, §5.2.4) -----------------------------------------------
    def device_features(self) -> int:
        features = VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_SIZE_MAX | VIRTIO_BLK_F_BLK_SIZE
        if self.read_only:
            features |= VIRTIO_BLK_F_RO
        return features

    def config_space(self) -> bytes:
        # le64 capacity; le32 size_max; le32 seg_max; geometry {le16 cyl; u8 heads; u8 sectors};
        # le32 blk_size; topology {u8; u8; le16; le32}; u8 writeback; u8 unused; le16 num_queues; ...
        cfg = struct.pack("<QIIHBBIBBHIBBH", self.capacity, SIZE_MAX, SEG_MAX, 0, 0, 0, SECTOR_SIZE,
                          0, 0, 0, 0, 0, 0, 1)
        return cfg + bytes(CONFIG_SIZE - len(cfg))

    # -- request queue (§5.2.6) ---------------------------------------------------------------------
    def queue_notify(self, index: int) -> None:
        if index == 0:
            self.process_queue(0, self._handle)

    def _handle(self, mem: GuestMemory, chain: DescriptorChain) -> int:
        try:
            request = parse_request(mem, chain, capacity=self.capacity, read_only=self.read_only,
                                    max_bytes=self.max_request_bytes)
        except RequestError as e:
            log.debug("virtio-blk: %s", e)
            return 0 if e.status_addr is None else self._finish(mem, e.status_addr, e.status, 0)
        return self._execute(mem, request)

    def _execute(self, mem: GuestMemory, req: BlockRequest) -> int:
        """Do the I/O; returns the used length (bytes written to the guest, status included)."""
        written = 0
        status = Status.OK
        try:
            if req.type == RequestType.IN:
                offset = req.offset
                for d in req.data:
                    with mem.view(d.addr, d.length) as buf:
                        self.backend.read_into(offset, buf)
                    offset += d.length
                    written += d.length
            elif req.type == RequestType.OUT:
                offset = req.offset
                for d in req.data:
                    with mem.view(d.addr, d.length) as buf:
                        self.backend.write(offset, buf)
                    offset += d.length
            elif req.type == RequestType.FLUSH:
                if not self.read_only:
                    self.backend.flush()
            elif req.type == RequestType.GET_ID:
                ident = self.serial.ljust(ID_BYTES, b"\x00")
                for d in req.data:
                    mem.write(d.addr, ident[written:written + d.length])
                    written += d.length
        except (OSError, GuestMemoryError) as e:
            log.warning("virtio-blk: request %d (type %s) failed: %s", req.head, req.type.name, e)
            status = Status.IOERR
        return self._finish(mem, req.status_addr, status, written)

    @staticmethod
    def _finish(mem: GuestMemory, status_addr: int, status: Status, written: int) -> int:
        try:
            mem.write_u8(status_addr, status)
        except GuestMemoryError:
            return written
        return written + 1

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> BlockState:
        return save_block(self)

    def restore(self, state: BlockState) -> None:
        restore_block(self, state)
