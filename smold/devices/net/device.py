"""virtio-net device model: one receive and one transmit queue over an injected backend (virtio 1.2 §5.1)."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

from smold.devices.net.backend import NetBackend
from smold.devices.net.persist import NetState, restore_net, save_net
from smold.devices.net.request import FrameError, parse_tx, rx_room, write_rx
from smold.devices.virtio.device import VIRTIO_ID_NET, VirtioDevice, VirtioError
from smold.devices.virtio.queue import ChainError, DescriptorChain, Queue, QueueError
from smold.memory import GuestMemory, GuestMemoryError

log = logging.getLogger(__name__)

# §5.1.2: virtqueues (no VIRTIO_NET_F_MQ, no VIRTIO_NET_F_CTRL_VQ: just receiveq1 and transmitq1).
RX_QUEUE = 0
TX_QUEUE = 1
QUEUE_SIZE = 256

# §5.1.3: feature bits.
VIRTIO_NET_F_MAC = 1 << 5
VIRTIO_NET_F_STATUS = 1 << 16
# §5.1.4: config space status bits.
VIRTIO_NET_S_LINK_UP = 1

DEFAULT_MAC = "06:00:ac:10:00:02"


class NetError(VirtioError):
    """A bad net device configuration."""


def parse_mac(text: str | bytes) -> bytes:
    """``aa:bb:cc:dd:ee:ff`` (or 6 raw bytes) -> 6 bytes; a unicast address only (I/G bit clear)."""
    if isinstance(text, bytes):
        mac = text
    else:
        parts = text.split(":")
        if len(parts) != 6 or not all(len(p) == 2 for p in parts):
            raise NetError(f"MAC address {text!r} is not six colon-separated hex octets")
        try:
            mac = bytes(int(p, 16) for p in parts)
        except ValueError:
            raise NetError(f"MAC address {text!r} is not six colon-separated hex octets") from None
    if len(mac) != 6:
        raise NetError(f"MAC address of {len(mac)} bytes")
    if mac[0] & 1:
        raise NetError(f"MAC address {format_mac(mac)} is a multicast address")
    if mac == bytes(6):
        raise NetError("MAC address 00:00:00:00:00:00 is not usable")
    return mac


def format_mac(mac: bytes) -> str:
    return ":".join(f"{b:02x}" for b in mac)


@dataclass
class NetStats:
    """Counters for diagnostics (not snapshot state)."""

    rx_frames: int = 0
    rx_bytes: int = 0
    rx_dropped: int = 0      # frames from the host that did not fit the guest's buffer, hit a bad one, or were
                             # held when the backend was detached or the device reset
    tx_frames: int = 0
    tx_bytes: int = 0
    tx_errors: int = 0       # malformed transmit chains (used length 0, nothing sent)
    tx_dropped: int = 0      # frames the backend refused or there was no backend


class Net(VirtioDevice):
    """virtio-net with §5.1.3 VIRTIO_NET_F_MAC and VIRTIO_NET_F_STATUS only: no offloads, no mergeable
    buffers, so every frame travels whole in one chain behind a 12-byte header (§5.1.6).

    RX is host-driven: the backend says frames are waiting (``backend_readable``, lock held), the device
    moves them into the guest's receive buffers until either runs out. When the guest has no buffers
    left the device stops asking the backend (``want_rx(False)``) and holds at most one frame; the
    guest's next receive-queue kick resumes it. Nothing is queued without bound: frames pile up only in
    the host kernel's TAP queue, which drops beyond its length. A frame larger than the buffer at hand
    is dropped and that buffer returned with used length 0.
    """

    device_type = VIRTIO_ID_NET
    queue_max_sizes = (QUEUE_SIZE, QUEUE_SIZE)

    def __init__(self, mac: str | bytes = DEFAULT_MAC, backend: NetBackend | None = None) -> None:
        super().__init__()
        self.mac = parse_mac(mac)
        self.backend = backend
        self.link_up = True
        self.stats = NetStats()
        self._pending: bytes | None = None  # one frame taken from the backend, waiting for a buffer
        self._rx_wanted = False

    # -- features and config space (§5.1.3, §5.1.4) ---------------------------------------------------
    def device_features(self) -> int:
        return VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS

    def config_space(self) -> bytes:
        # struct virtio_net_config: u8 mac[6]; le16 status; (max_virtqueue_pairs, mtu, ...: not offered).
        return self.mac + struct.pack("<H", VIRTIO_NET_S_LINK_UP if self.link_up else 0)

    def set_link(self, up: bool) -> None:
        """Change the link status the guest sees (§5.1.4.2: a configuration change notification)."""
        if up == self.link_up:
            return
        self.link_up = up
        if self.activated and self.interrupt is not None:
            self.interrupt.signal_config()

    def attach_backend(self, backend: NetBackend | None) -> None:
        if self.backend is not None and self.backend is not backend:
            self.backend.want_rx(False)
        self.backend = backend
        self._rx_wanted = False
        self._drop_pending()
        self._update_rx_interest()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def queue_notify(self, index: int) -> None:
        if index == TX_QUEUE:
            self.process_queue(TX_QUEUE, self._handle_tx)
        elif index == RX_QUEUE:
            self._fill_rx()  # the guest posted receive buffers: take waiting frames, resume reading

    def on_activate(self) -> None:
        self._update_rx_interest()

    def on_reset(self) -> None:
        self._drop_pending()
        self._set_rx_wanted(False)

    def _drop_pending(self) -> None:
        """Forget the frame held for the next receive buffer, counted as dropped."""
        if self._pending is not None:
            self.stats.rx_dropped += 1
            self._pending = None

    # -- tx: guest -> host (§5.1.6.2) ----------------------------------------------------------------------
    def _handle_tx(self, mem: GuestMemory, chain: DescriptorChain) -> int:
        try:
            tx = parse_tx(mem, chain)
        except (FrameError, ChainError) as e:
            self.stats.tx_errors += 1
            log.debug("virtio-net: %s", e)
            return 0
        if self.backend is None:
            self.stats.tx_dropped += 1
            return 0
        try:
            self.backend.send(tx.frame)
        except OSError as e:
            self.stats.tx_dropped += 1
            log.debug("virtio-net: tx frame of %d bytes lost: %s", len(tx.frame), e)
            return 0
        self.stats.tx_frames += 1
        self.stats.tx_bytes += len(tx.frame)
        return 0  # transmit buffers are device-readable only: nothing written (§2.7.8)

    # -- rx: host -> guest (§5.1.6.3, §5.1.6.4) ------------------------------------------------------------
    def backend_readable(self) -> None:
        """The backend has frames (host-driven, lock held). A broken ring sets DEVICE_NEEDS_RESET."""
        try:
            self._fill_rx()
        except QueueError as e:
            self._set_rx_wanted(False)
            log.warning("virtio-net: rx queue: %s", e)
            if self.interrupt is not None:
                self.interrupt.signal_needs_reset(f"rx queue: {e}")

    def _recv(self) -> bytes | None:
        if self.backend is None:
            return None
        try:
            return self.backend.recv()
        except OSError as e:
            log.warning("virtio-net: backend receive failed: %s", e)
            return None

    def _fill_rx(self) -> None:
        """Move frames into available receive buffers, at most one queue's worth per call. Raises
        QueueError if the ring is broken."""
        if not self._rx_ready():
            return
        assert self.mem is not None and self.interrupt is not None
        mem = self.mem
        q = self.queues[RX_QUEUE]
        self._check_ring(q, mem)
        completed = 0
        try:
            while completed < q.size and q.has_available(mem):
                if self._pending is None:
                    self._pending = self._recv()
                    if self._pending is None:
                        break
                try:
                    chain = q.pop(mem)
                except ChainError as e:
                    log.debug("virtio-net rx: %s", e)
                    q.add_used(mem, e.head, 0)  # the frame waits for the next buffer
                    completed += 1
                    continue
                if chain is None:
                    break
                completed += 1
                room = rx_room(chain)
                if room < 0:
                    log.debug("virtio-net rx: chain %d is not a receive buffer", chain.head)
                    q.add_used(mem, chain.head, 0)  # the frame waits for the next buffer
                    continue
                frame, self._pending = self._pending, None
                if len(frame) > room:
                    self.stats.rx_dropped += 1
                    log.debug("virtio-net rx: frame of %d bytes dropped: buffer %d holds %d",
                              len(frame), chain.head, room)
                    q.add_used(mem, chain.head, 0)
                    continue
                try:
                    used = write_rx(mem, chain, frame)
                except ChainError as e:
                    self.stats.rx_dropped += 1
                    log.debug("virtio-net rx: %s", e)
                    used = 0
                else:
                    self.stats.rx_frames += 1
                    self.stats.rx_bytes += len(frame)
                q.add_used(mem, chain.head, used)
        finally:
            if completed:
                self.interrupt.signal_used(RX_QUEUE)
        self._update_rx_interest()

    @staticmethod
    def _check_ring(q: Queue, mem: GuestMemory) -> None:
        """§2.7.13.3: the driver never makes more than the queue size available; catch a ring that claims
        otherwise when it is kicked, not only once a frame arrives."""
        try:
            ahead = (q.avail_idx(mem) - q.next_avail) & 0xFFFF
        except GuestMemoryError as e:
            q.broken = True
            raise QueueError(str(e)) from e
        if ahead > q.size:
            q.broken = True
            raise QueueError(f"available index is {ahead} ahead (queue size {q.size})")

    def _rx_ready(self) -> bool:
        return (self.activated and self.mem is not None and self.interrupt is not None
                and len(self.queues) > RX_QUEUE and self.queues[RX_QUEUE].ready)

    def _update_rx_interest(self) -> None:
        """Ask the backend for frames exactly while the guest has receive buffers posted."""
        wanted = False
        if self._rx_ready() and self.backend is not None:
            assert self.mem is not None
            wanted = self.queues[RX_QUEUE].has_available(self.mem)
        self._set_rx_wanted(wanted)

    def _set_rx_wanted(self, on: bool) -> None:
        if on != self._rx_wanted and self.backend is not None:
            self.backend.want_rx(on)
        self._rx_wanted = on

    @property
    def rx_wanted(self) -> bool:
        return self._rx_wanted

    @property
    def pending_frame(self) -> bool:
        return self._pending is not None

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> NetState:
        return save_net(self)

    def restore(self, state: NetState) -> None:
        restore_net(self, state)
