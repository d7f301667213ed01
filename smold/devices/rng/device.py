"""virtio-rng device model: one request queue filled with host entropy (virtio 1.2 §5.4)."""

from __future__ import annotations

import logging

from smold.devices.rng.backend import RngBackend, RngBackendError, UrandomBackend
from smold.devices.rng.persist import RngState, restore_rng, save_rng
from smold.devices.rng.request import MAX_REQUEST_BYTES, RngRequest, parse_request
from smold.devices.virtio.device import VIRTIO_ID_RNG, VirtioDevice, VirtioError
from smold.memory import GuestMemory, GuestMemoryError

log = logging.getLogger(__name__)

QUEUE_SIZE = 256


class RngError(VirtioError):
    """A bad rng device configuration."""


class Rng(VirtioDevice):
    """virtio-rng: §5.4.2 one virtqueue (requestq), §5.4.3 no feature bits, §5.4.4 no config space."""

    device_type = VIRTIO_ID_RNG
    queue_max_sizes = (QUEUE_SIZE,)

    def __init__(self, backend: RngBackend | None = None, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        super().__init__()
        if max_request_bytes <= 0:
            raise RngError("max_request_bytes must be positive")
        self.backend: RngBackend = backend if backend is not None else UrandomBackend()
        self.max_request_bytes = max_request_bytes

    def device_features(self) -> int:
        return 0

    def queue_notify(self, index: int) -> None:
        if index == 0:
            self.process_queue(0, lambda mem, chain: self._fill(
                mem, chain.head, parse_request(chain, self.max_request_bytes)))

    def _fill(self, mem: GuestMemory, head: int, request: RngRequest) -> int:
        """Scatter fresh entropy over the request's buffers; returns bytes written (the used length)."""
        written = 0
        try:
            data = self.backend.read(request.length)
            for d in request.buffers:
                chunk = data[written:written + d.length]
                if not chunk:
                    break
                mem.write(d.addr, chunk)
                written += len(chunk)
        except (RngBackendError, GuestMemoryError) as e:
            log.warning("virtio-rng: request %d failed: %s", head, e)
        return written

    def save(self) -> RngState:
        return save_rng(self)

    def restore(self, state: RngState) -> None:
        restore_rng(self, state)
