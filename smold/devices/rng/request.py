"""Parse a virtio-rng request chain: the device-writable buffers to fill (virtio 1.2 §5.4.6); no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from smold.devices.virtio.queue import Descriptor, DescriptorChain

MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class RngRequest:
    head: int
    buffers: tuple[Descriptor, ...]

    @property
    def length(self) -> int:
        return sum(d.length for d in self.buffers)


def parse_request(chain: DescriptorChain, max_bytes: int = MAX_REQUEST_BYTES) -> RngRequest:
    """§5.4.6: the driver posts writable buffers; readable ones carry nothing and are skipped.

    The total filled is capped at ``max_bytes``; the used length tells the driver how much it got.
    """
    buffers: list[Descriptor] = []
    left = max_bytes
    for d in chain.writable:
        if left <= 0:
            break
        n = min(d.length, left)
        if n:
            buffers.append(Descriptor(d.addr, n, True))
        left -= n
    return RngRequest(chain.head, tuple(buffers))
