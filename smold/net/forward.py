"""Inbound port forwards: a host TCP listener per Smolfile ``network.forward`` entry, relaying each connection to
the guest's port through a socket made inside the machine's network namespace (docs/networking.md, "Port
forwards").

The relay is the daemon's, not the kernel's: the guest keeps the same address in every namespace (clones need
no re-addressing), so the host cannot route to it; a socket created in the namespace can. Its source is the
gateway (172.16.0.1), which the namespace's ruleset lets answer (``ct state established``); nothing new is
allowed out of the guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterable

from smold.smolfile.model import PortForward

from . import netns
from .errors import ForwardError, NetError

log = logging.getLogger("smold.net")

CONNECT_TIMEOUT_S = 10.0    # to the guest's port (an emulated guest answers slowly)
MAX_CONNECTIONS = 256       # per machine, all forwards together; more are closed at once
CHUNK = 64 * 1024


def _guest_socket() -> socket.socket:
    """A TCP socket made in the namespace's thread (it stays in that namespace)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    return s


class PortForwarder:
    """One machine's forwards: listening sockets on the host and the relays of their connections."""

    def __init__(self, machine_id: str, namespace: str, guest: ipaddress.IPv4Address,
                 forwards: Iterable[PortForward], *, auto_ports: bool = False,
                 connect_timeout: float = CONNECT_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        self.machine_id = machine_id
        self.namespace = namespace
        self.guest = str(guest)
        self.wanted = tuple(forwards)
        self.auto_ports = auto_ports        # a fork child: its parent holds the fixed ports
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.bound: tuple[PortForward, ...] = ()
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self, ports: dict[str, int] | None = None) -> None:
        """Listen for every forward, or none: a port already in use fails with NetError and closes the others.
        ``ports`` (re-adoption) maps a forward's text to the host port it had before."""
        bound: list[PortForward] = []
        try:
            for fwd in self.wanted:
                if ports is not None and str(fwd) in ports:
                    port = ports[str(fwd)]
                else:
                    port = 0 if self.auto_ports else fwd.host_port
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    listener.bind((fwd.host_address, port))
                    listener.listen(64)
                    listener.setblocking(False)
                except OSError as e:
                    listener.close()
                    raise ForwardError(f"machine {self.machine_id}: cannot forward {fwd.host_address}:{port} to guest "
                                   f"port {fwd.guest_port}: {e.strerror or e}") from None
                self._listeners.append(listener)
                self._accepting.append(asyncio.ensure_future(self._accept(fwd, listener)))
                bound.append(PortForward(fwd.guest_port, listener.getsockname()[1], fwd.host_address))
        except BaseException:
            await self.close()
            raise
        self.bound = tuple(bound)
        for f in self.bound:
            log.info("machine %s: %s:%d forwards to guest port %d", self.machine_id, f.host_address, f.host_port,
                     f.guest_port)

    def record(self) -> dict[str, int]:
        """What a restarted daemon needs to listen on the same ports again."""
        return {str(w): b.host_port for w, b in zip(self.wanted, self.bound, strict=True)}

    async def close(self) -> None:
        """Stop listening and cut every relayed connection."""
        self._closed = True
        tasks = [*self._accepting, *self._relays]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        self._accepting.clear()
        self._listeners.clear()
        self.bound = ()

    # --- one connection ---------------------------------------------------------------------------------------
    async def _accept(self, fwd: PortForward, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(listener)
            except OSError as e:  # EMFILE and the like: keep listening
                log.warning("machine %s: forward to guest port %d: accept failed: %s", self.machine_id,
                            fwd.guest_port, e)
                await asyncio.sleep(0.1)
                continue
            client.setblocking(False)
            self._accepted(fwd, client)

    def _accepted(self, fwd: PortForward, client: socket.socket) -> None:
        if self._closed or len(self._relays) >= self.max_connections:
            log.warning("machine %s: forward to guest port %d: %s, connection closed", self.machine_id,
                        fwd.guest_port, "closing" if self._closed else f"{self.max_connections} connections open")
            client.close()
            return
        task = asyncio.ensure_future(self._relay(fwd, client))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, fwd: PortForward, client: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        guest: socket.socket | None = None
        try:
            guest = await asyncio.to_thread(netns.in_netns, self.namespace, _guest_socket)
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(guest, (self.guest, fwd.guest_port))
            await asyncio.gather(_pump(loop, client, guest), _pump(loop, guest, client))
        except (OSError, TimeoutError, NetError) as e:  # the pumps end quietly: this is the connect failing
            log.info("machine %s: forward to guest port %d: cannot connect: %r", self.machine_id, fwd.guest_port, e)
        finally:
            client.close()
            if guest is not None:
                guest.close()


async def _pump(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src's EOF, then half-close dst; a reset ends both directions."""
    try:
        while True:
            data = await loop.sock_recv(src, CHUNK)
            if not data:
                break
            await loop.sock_sendall(dst, data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
