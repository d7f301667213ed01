"""asyncio client for the guest agent: framing from smol_agent.protocol, requests multiplexed by id."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from smol_agent import protocol as P  # type: ignore[attr-defined]

from .errors import (
    AgentClosedError,
    AgentConnectError,
    AgentError,
    AgentProtocolError,
    AgentTimeoutError,
    AgentVersionError,
    error_from_payload,
)

T = P.MsgType
_MISSING = object()


def _decode(payload: bytes) -> dict[str, Any]:
    """A control payload from the guest as a JSON object; AgentProtocolError for anything else (the guest is
    hostile: a malformed frame fails the request, never the caller with a stray ValueError)."""
    try:
        return P.decode_json(payload)
    except P.ProtocolError as e:
        raise AgentProtocolError(f"bad payload from agent: {e.message}", e.code) from None


def _integer(info: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    value = info.get(key, default)
    if value is _MISSING or isinstance(value, bool) or not isinstance(value, int):
        raise AgentProtocolError(f"agent sent {key}={value if value is not _MISSING else 'nothing'!r}, "
                                 "not an integer")
    return value


def _number(info: dict[str, Any], key: str, default: float) -> float:
    value = info.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:  # NaN
        raise AgentProtocolError(f"agent sent {key}={value!r}, not a number")
    return float(value)


def _optional_integer(info: dict[str, Any], key: str) -> int | None:
    return None if info.get(key) is None else _integer(info, key)


MAX_BUFFERED_BYTES = 4 << 20   # per connection: frames read from the agent and not yet taken by a request
SIGNAL_SEND_S = 10.0           # an abandoned exec's SIGKILL must be sent by then, else the connection is dropped


@dataclass(frozen=True)
class Frame:
    """One received frame."""

    type: int
    flags: int
    payload: bytes


@dataclass(frozen=True)
class ExecStdout:
    """A chunk of the child's stdout (raw bytes, as produced)."""

    data: bytes


@dataclass(frozen=True)
class ExecStderr:
    """A chunk of the child's stderr (raw bytes, as produced)."""

    data: bytes


@dataclass(frozen=True)
class ExecExit:
    """The exec finished: exit_code if it exited, signal if killed by one; timed_out if the agent killed it."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration: float


ExecEvent = ExecStdout | ExecStderr | ExecExit


@dataclass(frozen=True)
class ExecResult:
    """Collected outcome of AgentClient.run()."""

    stdout: bytes
    stderr: bytes
    exit_code: int | None
    signal: int | None
    timed_out: bool
    pid: int | None = None
    duration: float = 0.0


@dataclass(frozen=True)
class AgentHealth:
    """HEALTH reply."""

    agent_version: str
    uptime: float
    pid1: bool
    pid: int
    raw: dict[str, Any] = field(default_factory=dict)


StdinSource = bytes | bytearray | memoryview | AsyncIterable[bytes]


class AgentClient:
    """A connection to the guest agent over any asyncio (reader, writer) stream pair.

    Several requests may be in flight at once (each has its own request id); a background task reads
    frames and routes them to the waiting request. Create it inside a running event loop.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._next_id = 1
        self._pending: dict[int, asyncio.Queue[Frame | BaseException]] = {}
        # Backpressure (issue #19, finding 7): frames read from the agent that no request has taken yet are
        # bounded; past MAX_BUFFERED_BYTES the read loop stops reading until requests have taken half, so a
        # consumer that stops reading (an Exec whose gRPC client is slow or gone) makes the guest's writes wait
        # (socket buffers, then the command's pipe) instead of growing the daemon's memory.
        self._buffered = 0
        self._room = asyncio.Event()
        self._room.set()
        self._error: BaseException | None = None
        self.agent_info: dict[str, Any] | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._error is not None

    async def close(self) -> None:
        """Close the connection; in-flight requests fail with AgentClosedError (their execs are killed)."""
        self._fail_all(AgentClosedError("client closed the connection"))
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._read_task.cancel()
        with contextlib.suppress(BaseException):
            await self._read_task

    # --- plumbing -------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        exc: BaseException
        try:
            while True:
                header = await self._reader.readexactly(P.HEADER_SIZE)
                mtype, flags, rid, length = P.unpack_header(header)
                payload = await self._reader.readexactly(length) if length else b""
                if rid == 0 and mtype == T.ERROR:  # connection-level error: the agent closes after this
                    self._fail_all(error_from_payload(P.decode_json(payload)))
                    continue
                queue = self._pending.get(rid)
                if queue is not None:  # frames of abandoned requests are dropped
                    queue.put_nowait(Frame(mtype, flags, payload))
                    self._buffered += len(payload)
                    if self._buffered > MAX_BUFFERED_BYTES:
                        self._room.clear()
                        await self._room.wait()
        except asyncio.IncompleteReadError as e:
            exc = AgentClosedError("agent closed the connection" + (" mid-frame" if e.partial else ""))
        except P.ProtocolError as e:
            exc = AgentProtocolError(f"bad frame from agent: {e.message}", e.code)
        except (OSError, ConnectionError) as e:
            exc = AgentClosedError(f"connection to agent failed: {e!r}")
        except asyncio.CancelledError:
            exc = AgentClosedError("client closed the connection")
            self._fail_all(exc)
            raise
        except Exception as e:  # e.g. an undecodable connection-level ERROR payload
            exc = AgentProtocolError(f"cannot process frame from agent: {e!r}")
        self._fail_all(exc)
        if isinstance(exc, AgentProtocolError):
            self._writer.close()

    def _fail_all(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        for queue in self._pending.values():
            queue.put_nowait(self._error)

    def _open(self) -> tuple[int, asyncio.Queue[Frame | BaseException]]:
        if self._error is not None:
            raise self._error
        rid = self._next_id
        self._next_id = rid + 1 if rid < P.MAX_REQUEST_ID else 1
        queue: asyncio.Queue[Frame | BaseException] = asyncio.Queue()
        self._pending[rid] = queue
        return rid, queue

    def _release(self, rid: int) -> None:
        queue = self._pending.pop(rid, None)
        while queue is not None and not queue.empty():   # what it never took no longer counts
            item = queue.get_nowait()
            if isinstance(item, Frame):
                self._taken(len(item.payload))

    def _taken(self, n: int) -> None:
        self._buffered -= n
        if self._buffered <= MAX_BUFFERED_BYTES // 2:
            self._room.set()

    async def _send(self, frame: bytes) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (OSError, ConnectionError) as e:
            raise AgentClosedError(f"cannot send to agent: {e!r}") from e

    async def _send_json(self, mtype: int, rid: int, obj: dict[str, Any], flags: int = 0) -> None:
        await self._send(P.pack_json(mtype, rid, obj, flags))

    async def _recv(self, queue: asyncio.Queue[Frame | BaseException]) -> Frame:
        item = await queue.get()
        if isinstance(item, Frame):
            self._taken(len(item.payload))
        if isinstance(item, BaseException):
            queue.put_nowait(item)  # keep failing later reads too
            raise item
        if item.type == T.ERROR:
            raise error_from_payload(P.decode_json(item.payload))
        return item

    async def _call(self, mtype: int, obj: dict[str, Any], expect: int = T.RESULT) -> dict[str, Any]:
        rid, queue = self._open()
        try:
            await self._send_json(mtype, rid, obj)
            frame = await self._recv(queue)
            if frame.type != expect:
                raise AgentProtocolError(
                    f"expected {P.TYPE_NAMES.get(expect)}, got {P.TYPE_NAMES.get(frame.type, frame.type)}"
                )
            return P.decode_json(frame.payload)
        finally:
            self._release(rid)

    # --- API ------------------------------------------------------------------------------------------
    async def hello(self) -> dict[str, Any]:
        """Version negotiation; must be the first request. Raises AgentVersionError on a major mismatch."""
        info = await self._call(
            T.HELLO, {"major": P.PROTOCOL_MAJOR, "minor": P.PROTOCOL_MINOR, "client": "smold"}, T.HELLO_OK
        )
        if info.get("major") != P.PROTOCOL_MAJOR:
            raise AgentVersionError(f"agent speaks protocol {info.get('major')}, client {P.PROTOCOL_MAJOR}")
        self.agent_info = info
        return info

    async def health(self) -> AgentHealth:
        """Liveness/readiness: agent version, uptime, pid1 flag."""
        info = await self._call(T.HEALTH, {})
        return AgentHealth(
            agent_version=str(info.get("agent_version")),
            uptime=float(info.get("uptime", 0.0)),
            pid1=bool(info.get("pid1")),
            pid=int(info.get("pid", 0)),
            raw=info,
        )

    def exec(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        stdin: StdinSource | None = None,
        timeout: float | None = None,
        *,
        env_replace: bool = False,
        linger: float | None = None,
    ) -> ExecStream:
        """Start a command; `async for event in client.exec(...)` or `stream = await client.exec(...)`."""
        spec: dict[str, Any] = {"argv": list(argv), "stdin": stdin is not None}
        if env is not None:
            spec["env"] = dict(env)
        if env_replace:
            spec["env_replace"] = True
        if cwd is not None:
            spec["cwd"] = cwd
        if user is not None:
            spec["user"] = user
        if timeout is not None:
            spec["timeout"] = timeout
        if linger is not None:
            spec["linger"] = linger
        return ExecStream(self, spec, stdin)

    async def run(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        stdin: StdinSource | None = None,
        timeout: float | None = None,
        *,
        env_replace: bool = False,
        linger: float | None = None,
    ) -> ExecResult:
        """Run a command to completion and collect its output."""
        out, err = bytearray(), bytearray()
        async with self.exec(
            argv, env, cwd, user, stdin, timeout, env_replace=env_replace, linger=linger
        ) as stream:
            async for event in stream:
                if isinstance(event, ExecStdout):
                    out += event.data
                elif isinstance(event, ExecStderr):
                    err += event.data
        done = stream.exit
        assert done is not None
        return ExecResult(
            bytes(out), bytes(err), done.exit_code, done.signal, done.timed_out, stream.pid, done.duration
        )

    async def write_file(
        self, path: str, data: bytes | bytearray | memoryview, mode: int = 0o644, *, mkdirs: bool = False
    ) -> int:
        """Atomically write a file (temp file + rename in the target directory); returns its size."""
        view = memoryview(data).cast("B")
        rid, queue = self._open()
        try:
            spec = {"path": path, "mode": mode, "mkdirs": mkdirs}
            await self._send_json(T.WRITE_FILE, rid, spec, P.FLAG_END if not view else 0)
            for off in range(0, len(view), P.CHUNK_SIZE):
                if not queue.empty():  # the agent already failed the request: stop streaming
                    break
                end = off + P.CHUNK_SIZE
                last = end >= len(view)
                await self._send(P.pack_frame(T.DATA, rid, bytes(view[off:end]), P.FLAG_END if last else 0))
            frame = await self._recv(queue)
            if frame.type != T.RESULT:
                raise AgentProtocolError(
                    f"unexpected {P.TYPE_NAMES.get(frame.type, frame.type)} for WRITE_FILE"
                )
            return int(P.decode_json(frame.payload).get("size", -1))
        finally:
            self._release(rid)

    async def read_file(self, path: str, max_size: int) -> bytes:
        """Read a whole regular file; AgentFileTooLargeError if it is larger than max_size bytes."""
        rid, queue = self._open()
        try:
            await self._send_json(T.READ_FILE, rid, {"path": path, "max_size": max_size})
            buf = bytearray()
            while True:
                frame = await self._recv(queue)
                if frame.type == T.DATA:
                    buf += frame.payload
                    if len(buf) > max_size:
                        raise AgentProtocolError(f"agent sent more than max_size={max_size} bytes")
                elif frame.type == T.RESULT:
                    size = P.decode_json(frame.payload).get("size")
                    if size != len(buf):
                        raise AgentProtocolError(f"agent reported size {size}, sent {len(buf)} bytes")
                    return bytes(buf)
                else:
                    raise AgentProtocolError(
                        f"unexpected {P.TYPE_NAMES.get(frame.type, frame.type)} for READ_FILE"
                    )
        finally:
            self._release(rid)

    async def set_time(self, realtime_ns: int | None = None) -> dict[str, Any]:
        """Step the guest's CLOCK_REALTIME to ``realtime_ns`` (default: the host's clock, read now).

        Returns the agent's RESULT: ``previous_ns`` (the guest clock before) and ``realtime_ns`` (after).
        """
        if realtime_ns is None:
            realtime_ns = time.time_ns()
        return await self._call(T.SET_TIME, {"realtime_ns": int(realtime_ns)})

    async def set_identity(self, *, hostname: str | None = None, machine_id: str | None = None,
                           entropy: bytes | None = None) -> dict[str, Any]:
        """Give a restored copy its own hostname, /etc/machine-id and reseeded entropy (IDENTITY)."""
        spec: dict[str, Any] = {}
        if hostname is not None:
            spec["hostname"] = hostname
        if machine_id is not None:
            spec["machine_id"] = machine_id
        if entropy is not None:
            spec["entropy"] = entropy.hex()
        return await self._call(T.IDENTITY, spec)

    async def kill_all(self) -> int:
        """SIGKILL every guest process but the agent (KILL_ALL, protocol 1.2; the agent must be PID 1); how many
        there were. AgentRequestError (ENOSYS from an older agent, EPERM when not PID 1) otherwise."""
        res = await self._call(T.KILL_ALL, {})
        killed = res.get("killed")
        if not isinstance(killed, int) or isinstance(killed, bool):
            raise AgentProtocolError(f"KILL_ALL: bad result {res!r}")
        return killed

    async def poweroff(self) -> None:
        """Ask the agent to power the guest off (sync + reboot syscall; in non-pid1 mode the agent exits)."""
        try:
            await self._call(T.POWEROFF, {})
        except AgentClosedError:
            pass  # the guest went down before the reply made it out: that is what we asked for


class ExecStream:
    """Events of one exec; awaitable (sends EXEC, waits for STARTED) and async-iterable."""

    def __init__(self, client: AgentClient, spec: dict[str, Any], stdin: StdinSource | None) -> None:
        self._client = client
        self._spec = spec
        self._stdin = stdin
        self._rid: int | None = None
        self._queue: asyncio.Queue[Frame | BaseException] | None = None
        self._stdin_task: asyncio.Task[None] | None = None
        self._done = False
        self.pid: int | None = None
        self.exit: ExecExit | None = None

    async def start(self) -> ExecStream:
        if self._rid is not None:
            return self
        client = self._client
        rid, queue = client._open()
        self._rid, self._queue = rid, queue
        try:
            await client._send_json(T.EXEC, rid, self._spec)
            if self._stdin is not None:  # pipelined: the agent handles frames in order
                self._stdin_task = asyncio.get_running_loop().create_task(self._feed_stdin(rid, self._stdin))
            frame = await client._recv(queue)
            if frame.type != T.STARTED:
                raise AgentProtocolError(f"expected STARTED, got {P.TYPE_NAMES.get(frame.type, frame.type)}")
            self.pid = _integer(_decode(frame.payload), "pid")
        except BaseException:
            self._finish()
            raise
        return self

    def __await__(self) -> Generator[Any, None, ExecStream]:
        return self.start().__await__()

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self

    async def __anext__(self) -> ExecEvent:
        if self._rid is None:
            await self.start()
        if self._done or self._queue is None:
            raise StopAsyncIteration
        try:
            frame = await self._client._recv(self._queue)
        except BaseException:
            self._finish()
            raise
        if frame.type == T.STDOUT:
            return ExecStdout(frame.payload)
        if frame.type == T.STDERR:
            return ExecStderr(frame.payload)
        if frame.type == T.EXIT:
            try:    # type-checked: a guest's "exit_code": "0" must not look like an exit status
                info = _decode(frame.payload)
                self.exit = ExecExit(_optional_integer(info, "exit_code"), _optional_integer(info, "signal"),
                                     bool(info.get("timed_out")), _number(info, "duration", 0.0))
            finally:
                self._finish()
            return self.exit
        self._finish()
        raise AgentProtocolError(f"unexpected {P.TYPE_NAMES.get(frame.type, frame.type)} during exec")

    async def _feed_stdin(self, rid: int, source: StdinSource) -> None:
        send = self._client._send
        try:
            if isinstance(source, bytes | bytearray | memoryview):
                view = memoryview(source).cast("B")
                for off in range(0, len(view), P.CHUNK_SIZE):
                    await send(P.pack_frame(T.STDIN, rid, bytes(view[off : off + P.CHUNK_SIZE])))
            else:
                async for chunk in source:
                    for off in range(0, len(chunk), P.CHUNK_SIZE):
                        await send(P.pack_frame(T.STDIN, rid, bytes(chunk[off : off + P.CHUNK_SIZE])))
            await send(P.pack_frame(T.STDIN, rid, b"", P.FLAG_END))
        except AgentError:
            pass  # the exec's own frames report what went wrong

    async def signal(self, signum: int) -> None:
        """Send a signal to the exec's whole process group."""
        if self._rid is None or self._done:
            return
        await self._client._send_json(T.SIGNAL, self._rid, {"signal": signum})

    def _finish(self) -> None:
        self._done = True
        if self._rid is not None:
            self._client._release(self._rid)
        if self._stdin_task is not None and not self._stdin_task.done():
            self._stdin_task.cancel()

    async def aclose(self) -> None:
        """Abandon the exec: stop listening for its frames, SIGKILL its process group if still running."""
        rid = self._rid if not self._done else None
        # Frames first: what this exec left unread may be what keeps the read loop paused (backpressure), and
        # with it the agent, which must read the SIGNAL below.
        self._finish()
        if rid is None:
            return
        try:
            await asyncio.wait_for(self._client._send_json(T.SIGNAL, rid, {"signal": 9}), SIGNAL_SEND_S)
        except AgentError:
            pass
        except TimeoutError:   # the agent does not read: drop the connection, which kills the exec too
            self._client._writer.close()

    async def __aenter__(self) -> ExecStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --- connecting ---------------------------------------------------------------------------------------------
async def connect_unix(path: str, *, hello: bool = True, timeout: float | None = 10.0) -> AgentClient:
    """Connect to an agent listening on a Unix socket (tests, `--listen unix:PATH`)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
    except (TimeoutError, OSError) as e:
        raise AgentConnectError(f"cannot connect to {path}: {e!r}") from e
    return await _handshake(AgentClient(reader, writer), hello, timeout)


async def connect_vsock_uds(
    path: str, port: int, *, hello: bool = True, timeout: float | None = 10.0, owner: int | None = None
) -> AgentClient:
    """Connect through the VMM's vsock Unix socket: `CONNECT <port>\\n` -> `OK <host port>\\n`, then HELLO.
    ``owner``: the path must be a socket of that uid, never a symlink (smold/unixsock.py; the daemon's side)."""
    from smold.unixsock import UnsafeSocketError, open_pinned_connection
    try:
        if owner is None:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
        else:
            reader, writer = await asyncio.wait_for(open_pinned_connection(path, owner), timeout)
    except UnsafeSocketError as e:
        raise AgentConnectError(str(e)) from None
    except (TimeoutError, OSError) as e:
        raise AgentConnectError(f"cannot connect to vsock socket {path}: {e!r}") from e
    try:
        writer.write(f"CONNECT {int(port)}\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (TimeoutError, OSError, ValueError) as e:
        writer.close()
        raise AgentConnectError(f"vsock handshake with {path} port {port} failed: {e!r}") from e
    if not (line.startswith(b"OK ") and line.endswith(b"\n") and len(line) > 4):
        writer.close()
        raise AgentConnectError(f"vsock handshake with {path} port {port} refused: {line[:200]!r}")
    return await _handshake(AgentClient(reader, writer), hello, timeout)


async def _handshake(client: AgentClient, hello: bool, timeout: float | None) -> AgentClient:
    if hello:
        try:
            await asyncio.wait_for(client.hello(), timeout)
        except BaseException as e:
            await client.close()
            if isinstance(e, asyncio.TimeoutError):
                raise AgentTimeoutError("agent did not answer HELLO") from e
            raise
    return client


async def wait_ready(
    connect_factory: Callable[[], Awaitable[AgentClient]],
    deadline: float,
    *,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> AgentClient:
    """Retry connect_factory() until the agent answers HEALTH; returns that connected client.

    `deadline` is an absolute time.monotonic() value. Raises AgentTimeoutError (chained to the last
    failure) when it passes. Used by the VMM while the guest boots.
    """
    last: BaseException | None = None
    delay = interval
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AgentTimeoutError(f"agent not ready before the deadline (last error: {last!r})") from last
        client: AgentClient | None = None
        try:
            client = await asyncio.wait_for(connect_factory(), remaining)
            await asyncio.wait_for(client.health(), max(0.001, deadline - time.monotonic()))
            return client
        except (TimeoutError, AgentError, OSError) as e:
            last = e
            if client is not None:
                await client.close()
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, max_interval)
