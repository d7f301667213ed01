"""virtio-vsock (virtio 1.2 section 5.10): device model, packets, Unix-socket backend, snapshot state."""

from smold.devices.vsock.backend import VsockBackend, VsockBackendError
from smold.devices.vsock.device import ConnState, Vsock, VsockConnection, VsockError, VsockHost
from smold.devices.vsock.persist import VsockState

__all__ = ["ConnState", "Vsock", "VsockBackend", "VsockBackendError", "VsockConnection", "VsockError",
           "VsockHost", "VsockState"]
