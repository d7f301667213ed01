"""smold: the per-host daemon that owns microVMs and serves the smol.v1 gRPC API on a Unix socket."""

from .config import DaemonConfig
from .controller import Controller
from .errors import DaemonError, DaemonSetupError, LaunchError
from .images import Image, ImageStore
from .launcher import Launcher, LaunchSpec, VmmLauncher
from .server import Daemon

__all__ = [
    "Controller",
    "Daemon",
    "DaemonConfig",
    "DaemonError",
    "DaemonSetupError",
    "Image",
    "ImageStore",
    "LaunchError",
    "LaunchSpec",
    "Launcher",
    "VmmLauncher",
]
