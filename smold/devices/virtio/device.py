"""The contract between a virtio device model and its transport (virtio 1.2 sections 2 and 4.2)."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence

from smold.devices.virtio.queue import ChainError, DescriptorChain, Queue
from smold.memory import GuestMemory

_log = logging.getLogger(__name__)

# virtio 1.2 §5: device IDs.
VIRTIO_ID_NET = 1
VIRTIO_ID_BLOCK = 2
VIRTIO_ID_RNG = 4
VIRTIO_ID_VSOCK = 19

# §6: reserved feature bits.
VIRTIO_F_VERSION_1 = 1 << 32

# §2.1: device status bits.
STATUS_ACKNOWLEDGE = 1
STATUS_DRIVER = 2
STATUS_DRIVER_OK = 4
STATUS_FEATURES_OK = 8
STATUS_DEVICE_NEEDS_RESET = 64
STATUS_FAILED = 128

# §4.2.2: interrupt status bits.
INT_USED_RING = 1
INT_CONFIG_CHANGE = 2


class VirtioError(Exception):
    """A device or transport fault."""


class InterruptSink(abc.ABC):
    """What a device calls to tell the driver about used buffers or a config change."""

    @abc.abstractmethod
    def signal_used(self, queue_index: int) -> None: ...

    @abc.abstractmethod
    def signal_config(self) -> None: ...

    def signal_needs_reset(self, reason: str) -> None:  # noqa: B027 - optional hook, default no-op
        """The device found its rings broken outside ``queue_notify`` (e.g. host-driven RX work):
        the transport sets DEVICE_NEEDS_RESET (virtio 1.2 §2.1.2). Devices hitting QueueError inside
        ``queue_notify`` may simply let it propagate instead."""


class VirtioDevice(abc.ABC):
    """A device model: features, config space and queue processing; no transport knowledge.

    Lifecycle: the transport calls ``activate`` once the driver sets DRIVER_OK (queues validated),
    ``queue_notify`` when the driver kicks a queue, ``reset`` when the driver writes status 0.
    Device work runs on the VMM's event loop under the bus lock.
    """

    device_type: int = 0
    queue_max_sizes: Sequence[int] = (256,)

    def __init__(self) -> None:
        self.acked_features = 0
        self.mem: GuestMemory | None = None
        self.queues: list[Queue] = []
        self.interrupt: InterruptSink | None = None
        self.activated = False

    @abc.abstractmethod
    def device_features(self) -> int:
        """Feature bits offered (VIRTIO_F_VERSION_1 is added by the transport)."""

    def read_config(self, offset: int, size: int) -> bytes:
        cfg = self.config_space()
        if offset < 0 or offset + size > len(cfg):
            return b"\x00" * size
        return cfg[offset:offset + size]

    def write_config(self, offset: int, data: bytes) -> None:
        """Config writes are ignored unless a device overrides this."""

    def config_space(self) -> bytes:
        return b""

    def activate(self, mem: GuestMemory, queues: list[Queue], interrupt: InterruptSink) -> None:
        self.mem = mem
        self.queues = queues
        self.interrupt = interrupt
        self.activated = True
        self.on_activate()

    def on_activate(self) -> None:
        """Hook for devices that start work when the driver is ready."""

    @abc.abstractmethod
    def queue_notify(self, index: int) -> None:
        """Process queue ``index`` after the driver kicked it."""

    def process_queue(
        self,
        index: int,
        handle: Callable[[GuestMemory, DescriptorChain], int],
        *,
        done: Callable[[], bool] | None = None,
    ) -> None:
        """Complete every available chain of queue ``index`` with ``handle``'s used length.

        Bounded to one queue's worth per kick (the driver kicks again for more), and stops early once
        ``done()`` is true (checked before each chain). A malformed chain is completed with used length 0
        (§2.7.4); one interrupt is raised if anything completed.
        """
        if not self.activated or self.mem is None or self.interrupt is None or index >= len(self.queues):
            return
        mem = self.mem
        q = self.queues[index]
        completed = 0
        try:
            for _ in range(q.size):
                if done is not None and done():
                    break
                try:
                    chain = q.pop(mem)
                except ChainError as e:
                    _log.debug("%s: %s", type(self).__name__, e)
                    q.add_used(mem, e.head, 0)
                    completed += 1
                    continue
                if chain is None:
                    break
                q.add_used(mem, chain.head, handle(mem, chain))
                completed += 1
        finally:
            if completed:
                self.interrupt.signal_used(index)

    def reset(self) -> None:
        self.acked_features = 0
        self.mem = None
        self.queues = []
        self.interrupt = None
        self.activated = False
        self.on_reset()

    def on_reset(self) -> None:
        """Hook for devices that must drop backend state on reset."""
