"""virtio-rng entropy device (virtio 1.2 section 5.4): device model, request parser, backend, snapshot state."""

from smold.devices.rng.backend import RngBackend, UrandomBackend
from smold.devices.rng.device import Rng
from smold.devices.rng.persist import RngState

__all__ = ["Rng", "RngBackend", "RngState", "UrandomBackend"]
