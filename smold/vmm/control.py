"""The VMM's control socket (``STATE_DIR/control.sock``): one JSON request per line, one JSON reply per line.

Requests (docs/snapshot.md):

    {"op": "status"}                                  -> {"ok": true, "paused": bool, "restored": bool}
    {"op": "pause"} / {"op": "resume"}                -> {"ok": true}
    {"op": "snapshot", "dir": "/abs/path", "resume": true, "digest": false}
                                                      -> {"ok": true, "snapshot": {...sizes, timings}}

Failures answer {"ok": false, "error": "..."}. The socket is created mode 0600; whoever can reach it
controls the VM, as with the vsock socket beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

from smold.snapshot.errors import SnapshotError, SnapshotWriteError
from smold.vmm.machine import Machine, MachineError, SnapshotResult

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024


class ControlError(Exception):
    """A control request was malformed or could not be carried out."""


def snapshot_info(result: SnapshotResult) -> dict[str, Any]:
    return {"directory": str(result.directory), "state_bytes": result.state_bytes,
            "memory_bytes": result.memory_bytes, "memory_written": result.memory_written,
            "timings": {k: round(v, 4) for k, v in result.timings.items()}}


class ControlServer:
    """Serves control requests for one Machine on the VMM's event loop."""

    def __init__(self, machine: Machine, path: Path) -> None:
        self.machine = machine
        self.path = Path(path)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(b'{"ok": false, "error": "request line too long"}\n')
                    return
                if not line:
                    return
                reply = await self.handle_line(line)
                writer.write(json.dumps(reply, sort_keys=True).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle_line(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ControlError("a request is a JSON object")
            return {"ok": True, **await self.handle(request)}
        except json.JSONDecodeError as e:
            return {"ok": False, "error": f"bad JSON: {e}"}
        except SnapshotWriteError as e:   # the caller tells a full disk from other failures by "errno"
            return {"ok": False, "error": str(e),
                    **({"errno": errno.errorcode.get(e.errno, str(e.errno))} if e.errno is not None else {})}
        except (ControlError, MachineError, SnapshotError, OSError) as e:
            return {"ok": False, "error": str(e)}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        m = self.machine
        if op == "status":
            return {"paused": m.paused, "restored": m.restored}
        if op == "pause":
            await m.pause()
            return {}
        if op == "resume":
            m.resume()
            return {}
        if op == "snapshot":
            directory = request.get("dir")
            if not isinstance(directory, str) or not os.path.isabs(directory):
                raise ControlError("snapshot needs an absolute 'dir'")
            resume = request.get("resume", True)
            digest = request.get("digest", False)
            if not isinstance(resume, bool) or not isinstance(digest, bool):
                raise ControlError("'resume' and 'digest' are booleans")
            result = await m.snapshot(Path(directory), resume=resume, digest=digest)
            return {"snapshot": snapshot_info(result)}
        raise ControlError(f"unknown op {op!r} (status, pause, resume, snapshot)")


async def control_request(path: Path | str, request: dict[str, Any], timeout: float = 120.0, *,
                          owner: int | None = None) -> dict[str, Any]:
    """Send one request to a VMM's control socket and return its reply. ``owner``: the path must be a socket of
    that uid, never a symlink (smold/unixsock.py: the daemon connecting to a socket a jailed VMM made)."""
    if owner is None:
        opened = asyncio.open_unix_connection(str(path), limit=MAX_LINE)
    else:
        from smold.unixsock import open_pinned_connection
        opened = open_pinned_connection(path, owner, limit=MAX_LINE)
    reader, writer = await asyncio.wait_for(opened, timeout)
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line:
        raise ControlError("the VMM closed the control connection without a reply")
    reply = json.loads(line)
    if not isinstance(reply, dict):
        raise ControlError(f"bad reply {reply!r}")
    return reply
