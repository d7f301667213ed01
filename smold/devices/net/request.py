"""Parse virtio-net chains (virtio 1.2 §5.1.6): the header and frame of a TX chain, the room of an RX chain; no I/O."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from smold.devices.virtio.queue import ChainError, DescriptorChain
from smold.memory import GuestMemory

# §5.1.6: struct virtio_net_hdr. With VIRTIO_F_VERSION_1 the num_buffers field is always present: 12 bytes.
NET_HDR = struct.Struct("<BBHHHHH")
NET_HDR_SIZE = NET_HDR.size
VIRTIO_NET_HDR_F_NEEDS_CSUM = 1
VIRTIO_NET_HDR_F_DATA_VALID = 2
VIRTIO_NET_HDR_GSO_NONE = 0

ETH_HLEN = 14           # destination, source, ethertype
VLAN_HLEN = 4
# No offloads are offered, so a frame is at most what one MTU-sized packet can be. The guest driver
# allows an MTU up to 65535 when VIRTIO_NET_F_MTU is not offered: accept that, with one VLAN tag.
MAX_FRAME_LEN = ETH_HLEN + VLAN_HLEN + 65535

assert NET_HDR_SIZE == 12


class FrameError(Exception):
    """A TX chain does not hold a frame this device accepts: that request fails, the queue goes on."""

    def __init__(self, head: int, reason: str) -> None:
        super().__init__(f"tx chain {head}: {reason}")
        self.head = head
        self.reason = reason


@dataclass(frozen=True)
class NetHeader:
    """struct virtio_net_hdr (§5.1.6), little-endian fields."""

    flags: int = 0
    gso_type: int = VIRTIO_NET_HDR_GSO_NONE
    hdr_len: int = 0
    gso_size: int = 0
    csum_start: int = 0
    csum_offset: int = 0
    num_buffers: int = 0

    def pack(self) -> bytes:
        return NET_HDR.pack(self.flags, self.gso_type, self.hdr_len, self.gso_size, self.csum_start,
                            self.csum_offset, self.num_buffers)

    @classmethod
    def unpack(cls, data: bytes) -> NetHeader:
        return cls(*NET_HDR.unpack(data[:NET_HDR_SIZE]))


# §5.1.6.4: without VIRTIO_NET_F_MRG_RXBUF every received packet sits in one buffer: num_buffers is 1.
# No VIRTIO_NET_F_GUEST_CSUM either, so flags stay 0 (the host kernel checksummed the frame).
RX_HEADER = NetHeader(num_buffers=1).pack()


@dataclass(frozen=True)
class TxFrame:
    head: int
    header: NetHeader
    frame: bytes


def parse_tx(mem: GuestMemory, chain: DescriptorChain, max_frame: int = MAX_FRAME_LEN) -> TxFrame:
    """§5.1.6.2: a TX chain is device-readable only: the header, then one Ethernet frame.

    FrameError for a chain the device refuses, ChainError for one that points outside guest RAM.
    """
    if chain.writable:
        raise FrameError(chain.head, "device-writable descriptor in a transmit chain")
    total = chain.readable_len
    if total < NET_HDR_SIZE + ETH_HLEN:
        raise FrameError(chain.head, f"{total} bytes: shorter than the header and an Ethernet header")
    if total > NET_HDR_SIZE + max_frame:
        raise FrameError(chain.head, f"frame of {total - NET_HDR_SIZE} bytes exceeds {max_frame}")
    data = chain.read_all(mem, NET_HDR_SIZE + max_frame)
    header = NetHeader.unpack(data)
    # §5.1.6.2.1: without VIRTIO_NET_F_CSUM the driver MUST set flags to zero; without the TSO/UFO
    # features it MUST set gso_type to VIRTIO_NET_HDR_GSO_NONE. Neither is offered.
    if header.flags:
        raise FrameError(chain.head, f"header flags {header.flags:#x} were not negotiated")
    if header.gso_type != VIRTIO_NET_HDR_GSO_NONE:
        raise FrameError(chain.head, f"gso_type {header.gso_type} was not negotiated")
    return TxFrame(chain.head, header, data[NET_HDR_SIZE:])


def rx_room(chain: DescriptorChain) -> int:
    """Frame bytes an RX chain can take after the header; -1 if it is not a receive buffer (§5.1.6.3:
    receive buffers are device-writable only and hold at least the header)."""
    if chain.readable or chain.writable_len < NET_HDR_SIZE:
        return -1
    return chain.writable_len - NET_HDR_SIZE


def write_rx(mem: GuestMemory, chain: DescriptorChain, frame: bytes) -> int:
    """Scatter the RX header and ``frame`` into ``chain``; returns the used length (ChainError on a bad
    buffer). The caller checked ``rx_room``."""
    written = chain.write_all(mem, RX_HEADER)
    written += chain.write_all(mem, frame, NET_HDR_SIZE)
    if written != NET_HDR_SIZE + len(frame):
        raise ChainError(chain.head, f"wrote {written} of {NET_HDR_SIZE + len(frame)} bytes")
    return written
