"""virtio-net network device (virtio 1.2 section 5.1): device model, frame parser, TAP backend, snapshot state."""

from smold.devices.net.backend import NetBackend, TapBackend
from smold.devices.net.device import Net, parse_mac
from smold.devices.net.persist import NetState

__all__ = ["Net", "NetBackend", "NetState", "TapBackend", "parse_mac"]
