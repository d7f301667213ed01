"""Host side of virtio-vsock: a Unix socket with the Firecracker-style CONNECT handshake, on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import threading
from contextlib import AbstractContextManager
from typing import Any, cast

from smold.devices.vsock.device import ConnState, Vsock, VsockConnection, VsockError, VsockHost
from smold.devices.vsock.packet import SHUTDOWN_SEND, U32

log = logging.getLogger(__name__)

CONNECT_LINE_MAX = 64  # "CONNECT 4294967295\n" is 19 bytes
CHUNK = 64 * 1024  # guest->host bytes handed to a host socket per write
DEFAULT_CONNECT_TIMEOUT = 5.0  # the client's handshake line, or connecting to <path>_<port>
# The guest's RESPONSE to a host connect. Only a backstop: the client sets its own deadline and closes its
# socket when it gives up. An emulated guest kernel busy forking can take well over 5 s to answer.
DEFAULT_ACCEPT_TIMEOUT = 300.0
DEFAULT_CLOSE_TIMEOUT = 5.0  # §5.10.6.5: wait this long for the guest's RST after our SHUTDOWN
MAX_HANDSHAKES = 64  # host clients that connected but have no vsock connection yet


class VsockBackendError(Exception):
    """The Unix socket could not be set up."""


def parse_connect(line: bytes) -> int | None:
    """``CONNECT <port>`` (the newline stripped), decimal port 0..2^32-1; None for anything else."""
    if not line.startswith(b"CONNECT "):
        return None
    digits = line[len(b"CONNECT "):]
    if not 1 <= len(digits) <= 10 or not digits.isdigit():
        return None
    port = int(digits)
    return port if port <= U32 else None


class _Stream(asyncio.Protocol):
    """One host-side socket: an accepted client (``CONNECT`` handshake first) or a connection the
    backend opened to ``<path>_<port>`` for the guest. Callbacks run on the event loop."""

    def __init__(self, backend: VsockBackend, *, inbound: bool) -> None:
        self.backend = backend
        self.inbound = inbound
        self.transport: asyncio.Transport | None = None
        self.conn: VsockConnection | None = None
        # handshake -> connecting (waiting for the guest) -> open; "pending" for outbound until attached.
        self.phase = "handshake" if inbound else "pending"
        self.line = bytearray()
        self.stash = b""  # host bytes read but not yet taken by the device
        self.read_paused = False
        self.write_paused = False
        self.host_eof = False  # the host end sent EOF or went away
        self.eof_sent = False  # we passed the guest's SHUTDOWN_F_SEND on as EOF
        self.timer: asyncio.TimerHandle | None = None

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def pause(self) -> None:
        if self.transport is not None and not self.read_paused:
            self.read_paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.read_paused and not self.transport.is_closing():
            self.read_paused = False
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()

    def close(self) -> None:
        self.cancel_timer()
        if self.transport is not None:
            self.transport.close()

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport's methods without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.backend._stream_made(self)

    def data_received(self, data: bytes) -> None:
        self.backend._stream_data(self, data)

    def eof_received(self) -> bool | None:
        self.backend._stream_eof(self)
        return False  # close our end too: the guest gets SHUTDOWN of both directions

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend._stream_lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True  # may run inside transport.write, under the lock: no locking here

    def resume_writing(self) -> None:
        self.write_paused = False
        self.backend._stream_writable(self)


class VsockBackend(VsockHost):
    """Bridges the vsock device to host Unix sockets (the Firecracker convention).

    Host -> guest: a client connects to ``path`` and writes ``CONNECT <port>\\n``; once the guest
    accepts (OP_RESPONSE) it reads ``OK <host port>\\n`` and the socket carries the stream. A refusal
    (OP_RST) or no answer in ``accept_timeout`` closes it without a reply.
    Guest -> host: a guest connection to host port P is connected to the Unix socket ``<path>_P``.

    Device and queue state are touched only with ``lock`` (the bus lock) held; the device's callbacks
    only record work, which runs on ``loop``. Nothing here blocks: both directions are buffered per
    connection within the credit limits (§5.10.6.3) and reading pauses when the other side is full.
    """

    def __init__(self, device: Vsock, path: str, *, loop: asyncio.AbstractEventLoop,
                 lock: AbstractContextManager[Any], connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 accept_timeout: float = DEFAULT_ACCEPT_TIMEOUT,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT) -> None:
        if connect_timeout <= 0 or accept_timeout <= 0 or close_timeout <= 0:
            raise VsockBackendError("timeouts must be positive")
        self.device = device
        self.path = path
        self.loop = loop
        self.lock = lock
        self.connect_timeout = connect_timeout
        self.accept_timeout = accept_timeout
        self.close_timeout = close_timeout
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None
        self._closed = False
        self._loop_thread: int | None = None
        self._streams: dict[VsockConnection, _Stream] = {}  # connections with a host socket
        self._all: set[_Stream] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dirty: set[VsockConnection] = set()  # guarded by lock
        self._pump_scheduled = False  # guarded by lock

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``path`` (a stale socket file there is replaced) and attach to the device."""
        if self._server is not None or self._closed:
            raise VsockBackendError("vsock backend already started or closed")
        self._loop_thread = threading.get_ident()
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise VsockBackendError(f"cannot inspect {self.path}: {e}") from e
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise VsockBackendError(f"{self.path} exists and is not a socket")
            os.unlink(self.path)
        try:
            self._server = await self.loop.create_unix_server(lambda: _Stream(self, inbound=True), self.path)
            st = os.stat(self.path)
        except OSError as e:
            raise VsockBackendError(f"cannot listen on {self.path}: {e}") from e
        self._inode = (st.st_dev, st.st_ino)
        with self.lock:
            self.device.attach_host(self)

    async def close(self) -> None:
        """Reset every connection, close every host socket and the listener, remove the socket file."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        with self.lock:
            if self.device.host is self:
                self.device.attach_host(None)
            for conn in self.device.connections:
                self.device.reset_connection(conn)  # the guest learns the host side is gone
            self._dirty.clear()
            streams = list(self._all) + list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.cancel_timer()
            if stream.transport is not None:
                if stream.transport.get_write_buffer_size():
                    stream.transport.abort()
                else:
                    stream.transport.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._unlink()

    def _unlink(self) -> None:
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        if self._inode == (st.st_dev, st.st_ino):
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    # -- VsockHost (lock held, any thread) ------------------------------------------------------------
    def on_guest_connect(self, conn: VsockConnection) -> None:
        if self._closed:
            self._call_soon(self._refuse, conn)
            return
        self._call_soon(self._start_outbound, conn)

    def on_change(self, conn: VsockConnection) -> None:
        if self._closed:
            return
        self._dirty.add(conn)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            if not self._call_soon(self._pump):
                self._pump_scheduled = False

    def _call_soon(self, fn: Any, *args: Any) -> bool:
        try:
            if threading.get_ident() == self._loop_thread:
                self.loop.call_soon(fn, *args)
            else:
                self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    # -- work on the loop ----------------------------------------------------------------------------
    def _pump(self) -> None:
        with self.lock:
            self._pump_scheduled = False
            dirty, self._dirty = self._dirty, set()
            for conn in dirty:
                self._service(conn)

    def _service(self, conn: VsockConnection) -> None:
        """Move whatever can move for ``conn`` (lock held)."""
        stream = self._streams.get(conn)
        if stream is None:
            return
        dev = self.device
        if stream.phase == "connecting":
            if conn.state is ConnState.ESTABLISHED:
                stream.phase = "open"
                stream.cancel_timer()
                if stream.transport is not None:
                    stream.transport.write(f"OK {conn.host_port}\n".encode())
            elif conn.closed:
                self._detach(conn, stream)  # refused or timed out: no OK line
                return
            else:
                return
        # guest -> host
        while dev.pending_from_guest(conn) and stream.alive and not stream.write_paused:
            assert stream.transport is not None
            stream.transport.write(dev.recv_from_guest(conn, CHUNK))
        if conn.closed:
            # What is left (at most buf_alloc) goes out before the socket closes.
            rest = dev.recv_from_guest(conn, dev.pending_from_guest(conn))
            if rest and stream.alive:
                assert stream.transport is not None
                stream.transport.write(rest)
            self._detach(conn, stream)
            return
        if not stream.alive and dev.pending_from_guest(conn):
            # Nobody to deliver to: the connection is going down.
            dev.recv_from_guest(conn, dev.pending_from_guest(conn))
        if (conn.peer_shutdown & SHUTDOWN_SEND and not dev.pending_from_guest(conn) and not stream.eof_sent
                and stream.alive):
            stream.eof_sent = True  # §5.10.6.5: the guest will send no more
            assert stream.transport is not None
            if stream.transport.can_write_eof():
                stream.transport.write_eof()
        # host -> guest
        if stream.stash:
            n = dev.send_to_guest(conn, stream.stash)
            stream.stash = stream.stash[n:]
        if stream.host_eof:
            if not stream.stash and conn.state is ConnState.ESTABLISHED:
                dev.shutdown_connection(conn)
                self._arm(stream, conn, self.close_timeout)
            elif stream.timer is None:
                self._arm(stream, conn, self.close_timeout)  # the guest is not taking the last bytes
        elif not stream.stash and stream.read_paused and dev.room_to_guest(conn) > 0:
            stream.resume()

    def _detach(self, conn: VsockConnection, stream: _Stream) -> None:
        self._streams.pop(conn, None)
        stream.conn = None
        stream.phase = "closed"
        stream.close()

    def _arm(self, stream: _Stream, conn: VsockConnection, delay: float) -> None:
        stream.cancel_timer()
        stream.timer = self.loop.call_later(delay, self._expire, conn)

    def _expire(self, conn: VsockConnection) -> None:
        """No RESPONSE to our REQUEST, or no RST after our SHUTDOWN: reset it (§5.10.6.5)."""
        with self.lock:
            if not conn.closed:
                log.debug("virtio-vsock: %r timed out", conn)
                self.device.reset_connection(conn)
            self._service(conn)

    def _refuse(self, conn: VsockConnection) -> None:
        with self.lock:
            self.device.reset_connection(conn)

    def _start_outbound(self, conn: VsockConnection) -> None:
        if self._closed:
            self._refuse(conn)
            return
        task = self.loop.create_task(self._outbound(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _outbound(self, conn: VsockConnection) -> None:
        """Guest -> host connect: ``<path>_<port>`` accepting means OP_RESPONSE, anything else OP_RST."""
        target = f"{self.path}_{conn.host_port}"
        stream = _Stream(self, inbound=False)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_unix_connection(lambda: stream, target)
        except (OSError, TimeoutError, ValueError) as e:
            log.debug("virtio-vsock: guest connect to %s refused: %r", target, e)
            with self.lock:
                self.device.reset_connection(conn)
            return
        except asyncio.CancelledError:
            stream.close()
            with self.lock:
                self.device.reset_connection(conn)
            raise
        with self.lock:
            if self._closed or conn.state is not ConnState.ACCEPTING or not stream.alive:
                stream.close()
                self.device.reset_connection(conn)
                return
            stream.conn = conn
            stream.phase = "open"
            self._streams[conn] = stream
            self.device.accept_connection(conn)
            self._service(conn)

    # -- stream events (loop thread) -----------------------------------------------------------------
    def _stream_made(self, stream: _Stream) -> None:
        if self._closed:
            stream.close()
            return
        self._all.add(stream)
        if not stream.inbound:
            stream.pause()  # nothing to deliver to until the guest's connection is attached
            return
        if sum(1 for s in self._all if s.phase == "handshake") > MAX_HANDSHAKES:
            stream.close()
            return
        stream.timer = self.loop.call_later(self.connect_timeout, self._handshake_expired, stream)

    def _handshake_expired(self, stream: _Stream) -> None:
        stream.timer = None
        if stream.phase == "handshake":
            stream.close()

    def _stream_data(self, stream: _Stream, data: bytes) -> None:
        if stream.phase == "handshake":
            self._handshake(stream, data)
        elif stream.phase in ("connecting", "pending"):
            stream.stash += data
            stream.pause()
            if len(stream.stash) > self.device.to_guest_cap + CHUNK:
                stream.close()
        elif stream.phase == "open" and stream.conn is not None:
            if stream.stash:  # keep the order; only reached if a read was already under way
                stream.stash += data
                stream.pause()
                return
            with self.lock:
                conn = stream.conn
                n = self.device.send_to_guest(conn, data)
                if n < len(data):
                    stream.stash = data[n:]
                if stream.stash or self.device.room_to_guest(conn) == 0:
                    stream.pause()

    def _handshake(self, stream: _Stream, data: bytes) -> None:
        stream.line += data
        end = stream.line.find(b"\n")
        if end < 0:
            if len(stream.line) > CONNECT_LINE_MAX:
                stream.close()
            return
        if end > CONNECT_LINE_MAX:
            stream.close()
            return
        line = bytes(stream.line[:end])
        rest = bytes(stream.line[end + 1:])
        stream.line = bytearray()
        port = parse_connect(line)
        if port is None:
            log.debug("virtio-vsock: bad handshake line %r", line)
            stream.close()
            return
        with self.lock:
            try:
                conn = self.device.connect_to_guest(port)
            except VsockError as e:
                log.debug("virtio-vsock: host connect to port %d: %s", port, e)
                stream.close()
                return
            stream.conn = conn
            stream.phase = "connecting"
            stream.stash = rest
            stream.pause()  # nothing goes to the guest before it accepts
            self._streams[conn] = stream
            self._arm(stream, conn, self.accept_timeout)

    def _stream_eof(self, stream: _Stream) -> None:
        stream.host_eof = True
        if stream.conn is None:
            stream.close()
            return
        with self.lock:
            self._service(stream.conn)

    def _stream_lost(self, stream: _Stream) -> None:
        self._all.discard(stream)
        stream.host_eof = True
        conn = stream.conn
        if conn is None or self._closed:
            stream.cancel_timer()
            return
        with self.lock:
            if conn.state in (ConnState.CONNECTING, ConnState.ACCEPTING):
                self.device.reset_connection(conn)
            self._service(conn)

    def _stream_writable(self, stream: _Stream) -> None:
        if stream.conn is not None and not self._closed:
            with self.lock:
                self._service(stream.conn)
