"""sd_notify(3) without a dependency: datagrams to $NOTIFY_SOCKET (READY=1, STOPPING=1, STATUS=...)."""

from __future__ import annotations

import os
import socket


def sd_notify(*lines: str, env: dict[str, str] | None = None) -> bool:
    """Send ``KEY=VALUE`` lines to the service manager; False when not run under one (or it failed)."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    elif not path.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall("\n".join(lines).encode())
    except OSError:
        return False
    return True
