"""Snapshot state of the virtio-mmio transport: registers and queues as plain values (virtio 1.2 §4.2.2)."""

from __future__ import annotations

from dataclasses import dataclass

from smold.devices.virtio.device import VirtioError
from smold.devices.virtio.queue import QueueState


class PersistError(VirtioError):
    """A snapshot does not fit the device or transport it is restored into."""


@dataclass(frozen=True)
class MmioState:
    """Everything the guest programmed into one virtio-mmio register window."""

    device_type: int
    status: int
    device_features_sel: int
    driver_features: int
    driver_features_sel: int
    driver_features_unoffered: bool
    queue_sel: int
    interrupt_status: int
    config_generation: int
    queues: tuple[QueueState, ...]
