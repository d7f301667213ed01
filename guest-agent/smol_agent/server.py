"""Agent server: one single-threaded poll() loop multiplexing connections, exec pipes, files and timers."""

# Concurrency model (docs/agent-protocol.md, "Concurrency"): any number of connections, each multiplexing
# any number of requests by request id. Everything is non-blocking and driven from one poll() loop, so no
# locks are needed and the reaper (process.Reaper) can never race a spawn. Flow control: when a
# connection's output buffer exceeds HIGH_WATER, the agent stops reading that connection's exec pipes and
# files until the host catches up; when an exec's stdin backlog exceeds STDIN_HIGH_WATER it stops reading
# that connection.

import _socket
import _struct
import errno
import os
import select
import stat
import time

from . import protocol as P
from .process import (
    DEFAULT_PATH,
    INHERITED_ENV,
    Reaper,
    SpawnError,
    UserInfo,
    decode_status,
    kill_group,
    resolve_user,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    AddFn = Callable[[int, int, Callable[[int], None]], None]

HIGH_WATER = 2 * 1024 * 1024
STDIN_HIGH_WATER = 4 * 1024 * 1024
RECV_SIZE = 256 * 1024
CLOSE_GRACE = 5.0  # seconds a connection being closed after a fatal error gets to flush its output
DEFAULT_LINGER = 0.25  # seconds to keep collecting output after the exec's main process exited
REAP_SWEEP = 5.0  # periodic waitpid sweep, in case a SIGCHLD wakeup was ever lost
POLLIN = select.POLLIN
POLLOUT = select.POLLOUT
POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


class RequestError(Exception):
    """A request failed; becomes an ERROR frame with `code`, `message` and optionally `errno`."""

    def __init__(self, code: str, message: str, errno_value: "int | None" = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.errno = errno_value


def set_realtime(spec: "dict[str, Any]") -> "dict[str, Any]":
    """SET_TIME: step CLOCK_REALTIME (a restored snapshot's wall clock stood still while it was on disk).

    CLOCK_MONOTONIC is not touched. Needs CAP_SYS_TIME (the agent runs as root, PID 1 in the guest).
    """
    ns = spec.get("realtime_ns")
    if not isinstance(ns, int) or isinstance(ns, bool) or ns <= 0:
        raise RequestError(P.ErrorCode.EINVAL, "SET_TIME needs a positive integer 'realtime_ns'")
    before = time.time_ns()
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)
    except OSError as exc:
        raise os_error(exc, "clock_settime(CLOCK_REALTIME)") from None
    except OverflowError:
        raise RequestError(P.ErrorCode.EINVAL, f"realtime_ns {ns} is out of range") from None
    return {"previous_ns": before, "realtime_ns": time.time_ns()}


HOSTNAME_MAX = 64
ENTROPY_MAX = 512  # bytes
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]) (include/uapi/linux/random.h)
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the crng from the input pool now


def _hostname_ok(name: str) -> bool:
    if not 0 < len(name) <= HOSTNAME_MAX or name[0] in "-." or name[-1] in "-.":
        return False
    return all(c.isascii() and (c.isalnum() or c in "-.") for c in name)


def _write_file(path: str, data: bytes, mode: int) -> None:
    """Atomic replace (temporary file + rename)."""
    tmp = f"{path}.smol-tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def set_identity(spec: "dict[str, Any]") -> "dict[str, Any]":
    """IDENTITY: give a restored copy of a VM its own hostname, machine-id and entropy (a fork child).

    hostname: sethostname(2), /etc/hostname and the 127.0.1.1 line of /etc/hosts. machine_id: 32 hex
    digits to /etc/machine-id. entropy: hex bytes from the host mixed into the input pool and credited
    (RNDADDENTROPY), then RNDRESEEDCRNG, so the copies' getrandom() streams diverge at once instead of
    at the next periodic reseed. Everything is validated before anything is changed.
    """
    hostname, machine_id, entropy = spec.get("hostname"), spec.get("machine_id"), spec.get("entropy")
    if hostname is not None and (not isinstance(hostname, str) or not _hostname_ok(hostname)):
        raise RequestError(P.ErrorCode.EINVAL, f"bad hostname {hostname!r}")
    if machine_id is not None and (
        not isinstance(machine_id, str) or len(machine_id) != 32 or any(c not in "0123456789abcdef" for c in machine_id)
    ):
        raise RequestError(P.ErrorCode.EINVAL, "machine_id must be 32 lowercase hex digits")
    seed = b""
    if entropy is not None:
        try:
            seed = bytes.fromhex(entropy) if isinstance(entropy, str) else b""
        except ValueError:
            seed = b""
        if not 0 < len(seed) <= ENTROPY_MAX:
            raise RequestError(P.ErrorCode.EINVAL, f"entropy must be 1..{ENTROPY_MAX} bytes as hex")
    result: dict[str, Any] = {}
    try:
        if hostname is not None:
            _socket.sethostname(hostname)
            _write_file("/etc/hostname", hostname.encode() + b"\n", 0o644)
            _write_file("/etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n".encode(), 0o644)
            result["hostname"] = hostname
        if machine_id is not None:
            _write_file("/etc/machine-id", machine_id.encode() + b"\n", 0o444)
            result["machine_id"] = machine_id
        if seed:
            import fcntl  # only here: not on the boot path

            fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, RNDADDENTROPY, _struct.pack("ii", len(seed) * 8, len(seed)) + seed)
                fcntl.ioctl(fd, RNDRESEEDCRNG)
            finally:
                os.close(fd)
            result["reseeded"] = True
    except OSError as exc:
        raise os_error(exc, "IDENTITY") from None
    return result


def kill_all(pid1: bool) -> "dict[str, Any]":
    """KILL_ALL: SIGKILL every process of the guest but PID 1 (this agent) and kernel threads, so that nothing a
    task left running (a server, a fork bomb, a process rewriting files, a hook on this agent's connections) is
    alive when the host takes the guest's files. One kill(-1) suffices: the kernel walks the process list under
    the lock fork() needs, so no child is born past it. Only as PID 1: elsewhere kill(-1) reaches every process
    of the agent's user on its host."""
    if not pid1:
        raise RequestError(P.ErrorCode.EPERM, "KILL_ALL needs the agent to run as PID 1 (--pid1)")
    me = os.getpid()
    killed = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    killed += bool(f.read(1))  # kernel threads (and zombies) have none
            except OSError:
                pass
    try:
        os.kill(-1, 9)
    except ProcessLookupError:  # nothing else was running
        pass
    except OSError as exc:
        raise os_error(exc, "KILL_ALL") from None
    return {"killed": killed}


def os_error(exc: OSError, what: str) -> RequestError:
    """Map an OSError to a RequestError whose code is the errno name."""
    num = exc.errno or errno.EIO
    return RequestError(errno.errorcode.get(num, "EIO"), f"{what}: {os.strerror(num)}", num)


def log(message: str) -> None:
    """Log a line to stderr (the console in pid1 mode)."""
    try:
        os.write(2, f"smol-agent: {message}\n".encode(errors="replace"))
    except OSError:
        pass


class Timer:
    """A one-shot timer on the agent loop."""

    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: "Callable[[], None]") -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


# --- spec validation helpers --------------------------------------------------------------------------------
def _field(
    spec: "dict[str, Any]", name: str, types: "type | tuple[type, ...]", default: "Any" = None
) -> "Any":
    value = spec.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RequestError(P.ErrorCode.EINVAL, f"field {name!r} has the wrong type")
    if not isinstance(value, types):
        raise RequestError(P.ErrorCode.EINVAL, f"field {name!r} has the wrong type")
    return value


def _abs_path(spec: "dict[str, Any]") -> str:
    path = _field(spec, "path", str)
    if not path or not path.startswith("/") or "\0" in path:
        raise RequestError(P.ErrorCode.EINVAL, "field 'path' must be an absolute path")
    return str(path)


def _no_nul(value: str, what: str) -> str:
    if "\0" in value:
        raise RequestError(P.ErrorCode.EINVAL, f"{what} contains a NUL byte")
    return value


# --- requests -----------------------------------------------------------------------------------------------
class Request:
    """An in-flight request on a connection, keyed by its request id."""

    producing = False  # True when produce() should be called whenever the connection has room

    def __init__(self, conn: "Connection", rid: int) -> None:
        self.conn = conn
        self.rid = rid

    def interest(self, add: "AddFn") -> None:
        """Register fds this request waits on."""

    def on_frame(self, mtype: int, flags: int, payload: bytes) -> None:
        """A follow-up frame (DATA, STDIN, SIGNAL) for this request."""

    def produce(self) -> None:
        """Emit the next chunk of output (producers only)."""

    def abort(self) -> None:
        """The connection is going away: release everything, kill what was started."""

    def done(self) -> None:
        self.conn.requests.pop(self.rid, None)

    def fail(self, err: RequestError) -> None:
        self.abort()
        self.done()
        self.conn.send_error(self.rid, err.code, err.message, err.errno)


class ExecRequest(Request):
    """EXEC: a child in its own session, with piped stdout/stderr, optional streamed stdin and a timeout."""

    def __init__(self, conn: "Connection", rid: int, spec: "dict[str, Any]") -> None:
        super().__init__(conn, rid)
        agent = conn.agent
        argv = _field(spec, "argv", list)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise RequestError(P.ErrorCode.EINVAL, "field 'argv' must be a non-empty list of strings")
        for a in argv:
            _no_nul(a, "argv")
        env_in = _field(spec, "env", dict, {})
        for k, v in env_in.items():
            if not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
                raise RequestError(P.ErrorCode.EINVAL, f"invalid environment variable {k!r}")
        replace = _field(spec, "env_replace", bool, False)
        cwd = _no_nul(_field(spec, "cwd", str, "/"), "cwd")
        user_spec = _field(spec, "user", (str, int))
        want_stdin = _field(spec, "stdin", bool, False)
        timeout = _field(spec, "timeout", (int, float))
        if timeout is not None and not timeout > 0:
            raise RequestError(P.ErrorCode.EINVAL, "field 'timeout' must be > 0")
        self.linger = float(_field(spec, "linger", (int, float), DEFAULT_LINGER))
        if not self.linger >= 0:
            raise RequestError(P.ErrorCode.EINVAL, "field 'linger' must be >= 0")
        try:
            user = resolve_user(user_spec)
        except LookupError as exc:
            raise RequestError(P.ErrorCode.EINVAL, str(exc)) from None
        env = {} if replace else agent.default_env(user)
        env.update(env_in)

        self.out_r: int | None = None
        self.err_r: int | None = None
        self.in_w: int | None = None
        self.stdin_buf = bytearray()
        self.stdin_eof = False
        self.status: int | None = None
        self.timed_out = False
        self.finished = False
        self.timers: list[Timer] = []
        child_fds: list[int] = []
        try:
            self.out_r, out_w = os.pipe()
            child_fds.append(out_w)
            self.err_r, err_w = os.pipe()
            child_fds.append(err_w)
            if want_stdin:
                in_r, self.in_w = os.pipe()
            else:
                in_r = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            child_fds.append(in_r)
            for fd in (self.out_r, self.err_r, self.in_w):
                if fd is not None:
                    os.set_blocking(fd, False)
            self.started = time.monotonic()
            self.pid = agent.reaper.spawn(argv, env, cwd, user, in_r, out_w, err_w, self._on_exit)
        except SpawnError as exc:
            self._close_fds()
            num = exc.errno or errno.EIO
            name = errno.errorcode.get(num, "EIO")
            if exc.stage == "exec":
                what = f"cannot execute {argv[0]!r}"
                if num == errno.ENOENT:
                    what = f"executable not found: {argv[0]!r}"
            elif exc.stage == "cwd":
                what = f"cannot change directory to {cwd!r}"
            elif exc.stage == "user":
                what = f"cannot switch to user {user_spec!r}"
            else:
                what = "child setup failed"
            raise RequestError(name, f"{what}: {os.strerror(num)}", num) from None
        except OSError as exc:
            self._close_fds()
            raise os_error(exc, "cannot create exec pipes") from None
        finally:
            for fd in child_fds:
                os.close(fd)
        if timeout is not None:
            self.timers.append(agent.call_later(float(timeout), self._on_timeout))
        conn.send_json(P.MsgType.STARTED, rid, {"pid": self.pid})

    # fds -------------------------------------------------------------------------------------------------
    def interest(self, add: "AddFn") -> None:
        if not self.conn.congested:
            if self.out_r is not None:
                add(self.out_r, POLLIN, self._on_stdout)
            if self.err_r is not None:
                add(self.err_r, POLLIN, self._on_stderr)
        if self.in_w is not None and self.stdin_buf:
            add(self.in_w, POLLOUT, self._on_stdin)

    def _on_stdout(self, events: int) -> None:
        if self.out_r is not None:
            self.out_r = self._pump(self.out_r, P.MsgType.STDOUT)
            self._maybe_finish()

    def _on_stderr(self, events: int) -> None:
        if self.err_r is not None:
            self.err_r = self._pump(self.err_r, P.MsgType.STDERR)
            self._maybe_finish()

    def _pump(self, fd: int, mtype: int) -> "int | None":
        try:
            data = os.read(fd, P.CHUNK_SIZE)
        except BlockingIOError:
            return fd
        except OSError:
            data = b""
        if data:
            self.conn.send_frame(mtype, self.rid, data)
            return fd
        os.close(fd)
        return None

    def backlog(self) -> int:
        return len(self.stdin_buf)

    def _on_stdin(self, events: int) -> None:
        self._write_stdin()

    def _write_stdin(self) -> None:
        if self.in_w is None:
            self.stdin_buf.clear()
            return
        while self.stdin_buf:
            try:
                n = os.write(self.in_w, self.stdin_buf[: P.CHUNK_SIZE])
            except BlockingIOError:
                return
            except OSError:  # EPIPE: the child closed its stdin; the rest is discarded
                self.stdin_buf.clear()
                self._close_stdin()
                return
            del self.stdin_buf[:n]
        if self.stdin_eof:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.in_w is not None:
            os.close(self.in_w)
            self.in_w = None

    def on_frame(self, mtype: int, flags: int, payload: bytes) -> None:
        if mtype == P.MsgType.STDIN:
            if self.in_w is None or self.stdin_eof:
                return  # stdin not requested, already closed, or broken: discarded
            self.stdin_buf += payload
            if flags & P.FLAG_END:
                self.stdin_eof = True
            self._write_stdin()
        elif mtype == P.MsgType.SIGNAL:
            try:
                sig = P.decode_json(payload).get("signal")
            except P.ProtocolError:
                return
            if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 65:
                kill_group(self.pid, sig)

    # lifecycle -------------------------------------------------------------------------------------------
    def _on_exit(self, status: int) -> None:
        self.status = status
        if not self._maybe_finish():
            self.timers.append(self.conn.agent.call_later(self.linger, self._on_linger))

    def _on_linger(self) -> None:
        if self.finished:
            return
        if self.conn.congested:  # output not collected because the host is slow: wait more
            self.timers.append(self.conn.agent.call_later(self.linger, self._on_linger))
            return
        self._finish()

    def _on_timeout(self) -> None:
        if not self.finished:
            self.timed_out = True
            kill_group(self.pid)

    def _maybe_finish(self) -> bool:
        if self.status is not None and self.out_r is None and self.err_r is None:
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._release()
        exit_code, signal = decode_status(self.status or 0)
        self.done()
        self.conn.send_json(
            P.MsgType.EXIT,
            self.rid,
            {
                "exit_code": exit_code,
                "signal": signal,
                "timed_out": self.timed_out,
                "duration": round(time.monotonic() - self.started, 6),
            },
        )

    def _close_fds(self) -> None:
        for name in ("out_r", "err_r", "in_w"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def _release(self) -> None:
        for t in self.timers:
            t.cancel()
        self.timers.clear()
        self._close_fds()
        self.stdin_buf.clear()

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        kill_group(self.pid)  # the whole session: leader and everything it started
        self.conn.agent.reaper.forget(self.pid)
        self._release()


class WriteFileRequest(Request):
    """WRITE_FILE: DATA frames go to a temp file in the target directory, renamed over path at FLAG_END."""

    def __init__(self, conn: "Connection", rid: int, spec: "dict[str, Any]") -> None:
        super().__init__(conn, rid)
        self.path = _abs_path(spec)
        self.mode = _field(spec, "mode", int, 0o644)
        if not 0 <= self.mode <= 0o7777:
            raise RequestError(P.ErrorCode.EINVAL, "field 'mode' must be within 0..0o7777")
        mkdirs = _field(spec, "mkdirs", bool, False)
        self.fsync = _field(spec, "fsync", bool, False)
        parent, _, base = self.path.rpartition("/")
        if not base:
            raise RequestError(P.ErrorCode.EINVAL, "field 'path' names a directory")
        parent = parent or "/"
        try:
            if mkdirs:
                os.makedirs(parent, exist_ok=True)
            conn.agent.tmp_counter += 1
            self.tmp = f"{parent.rstrip('/')}/.{base}.smol-tmp.{os.getpid()}.{conn.agent.tmp_counter}"
            self.fd: int | None = os.open(
                self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise os_error(exc, f"cannot create {self.path!r}") from None
        self.size = 0
        self.committed = False

    def on_frame(self, mtype: int, flags: int, payload: bytes) -> None:
        if mtype != P.MsgType.DATA or self.fd is None:
            return
        try:
            view = memoryview(payload)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
            self.size += len(payload)
            if flags & P.FLAG_END:
                os.fchmod(self.fd, self.mode)
                if self.fsync:
                    os.fsync(self.fd)
                os.close(self.fd)
                self.fd = None
                os.rename(self.tmp, self.path)
                self.committed = True
                self.done()
                self.conn.send_json(P.MsgType.RESULT, self.rid, {"size": self.size, "path": self.path})
        except OSError as exc:
            self.fail(os_error(exc, f"cannot write {self.path!r}"))

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.committed:
            self.committed = True
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


class ReadFileRequest(Request):
    """READ_FILE: a regular file streamed as DATA frames, refused with EFBIG beyond max_size."""

    producing = True

    def __init__(self, conn: "Connection", rid: int, spec: "dict[str, Any]") -> None:
        super().__init__(conn, rid)
        self.path = _abs_path(spec)
        max_size = spec.get("max_size")
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 0:
            raise RequestError(P.ErrorCode.EINVAL, "field 'max_size' must be an integer >= 0")
        self.max_size = max_size
        try:
            self.fd: int | None = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise os_error(exc, f"cannot open {self.path!r}") from None
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            self.abort()
            raise os_error(exc, f"cannot stat {self.path!r}") from None
        if stat.S_ISDIR(st.st_mode):
            self.abort()
            raise RequestError("EISDIR", f"{self.path!r} is a directory", errno.EISDIR)
        if not stat.S_ISREG(st.st_mode):
            self.abort()
            raise RequestError(P.ErrorCode.EINVAL, f"{self.path!r} is not a regular file")
        if st.st_size > max_size:
            self.abort()
            raise self._too_big(st.st_size)
        self.sent = 0

    def _too_big(self, size: int, at_least: bool = False) -> RequestError:
        prefix = "at least " if at_least else ""
        return RequestError(
            P.ErrorCode.EFBIG,
            f"{self.path!r} is {prefix}{size} bytes, larger than max_size {self.max_size}",
            errno.EFBIG,
        )

    def produce(self) -> None:
        if self.fd is None:
            return
        try:
            data = os.read(self.fd, min(P.CHUNK_SIZE, self.max_size - self.sent + 1))
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(os_error(exc, f"cannot read {self.path!r}"))
            return
        if not data:
            self.abort()
            self.done()
            self.conn.send_json(P.MsgType.RESULT, self.rid, {"size": self.sent})
            return
        if self.sent + len(data) > self.max_size:  # the file grew (or stat lied, as in /proc)
            self.fail(self._too_big(self.sent + len(data), at_least=True))
            return
        self.sent += len(data)
        self.conn.send_frame(P.MsgType.DATA, self.rid, data)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --- connections --------------------------------------------------------------------------------------------
class Connection:
    """One host connection: frame decoding, dispatch by request id, buffered non-blocking output."""

    def __init__(self, agent: "Agent", sock: _socket.socket) -> None:
        self.agent = agent
        self.sock = sock
        self.fd = sock.fileno()
        sock.setblocking(False)
        self.decoder = P.FrameDecoder()
        self.out = bytearray()
        self.requests: dict[int, Request] = {}
        self.hello = False
        self.closing = False  # fatal error sent: flush, then close
        self.dead = False  # socket error: close at the end of this loop iteration
        self.closed = False

    @property
    def congested(self) -> bool:
        return len(self.out) >= HIGH_WATER

    def interest(self, add: "AddFn") -> None:
        mask = 0
        if not self.closing and not any(
            isinstance(r, ExecRequest) and r.backlog() > STDIN_HIGH_WATER for r in self.requests.values()
        ):
            mask |= POLLIN
        if self.out:
            mask |= POLLOUT
        add(self.fd, mask, self.on_event)
        for req in list(self.requests.values()):
            req.interest(add)

    def on_event(self, events: int) -> None:
        if self.closed:
            return
        if events & POLLOUT:
            self.flush()
        if events & (POLLIN | POLLERR) and not self.closing:
            self._read()
        elif events & select.POLLNVAL:
            self.dead = True

    # output ----------------------------------------------------------------------------------------------
    def send_frame(self, mtype: int, rid: int, payload: bytes = b"", flags: int = 0) -> None:
        if self.closed or self.dead:
            return
        was_empty = not self.out
        self.out += P.pack_frame(mtype, rid, payload, flags)
        if was_empty:
            self.flush()

    def send_json(self, mtype: int, rid: int, obj: "dict[str, Any]") -> None:
        self.send_frame(mtype, rid, P.encode_json(obj))

    def send_error(self, rid: int, code: str, message: str, errno_value: "int | None" = None) -> None:
        self.send_json(P.MsgType.ERROR, rid, P.error_payload(code, message, errno_value))

    def flush(self) -> None:
        while self.out and not self.dead:
            try:
                n = self.sock.send(self.out)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:
                self.dead = True
                self.out.clear()
                break
            del self.out[:n]
        if self.closing and not self.out:
            self.dead = True

    def fatal(self, code: str, message: str, rid: int = 0) -> None:
        """Protocol violation: send ERROR, drop every request, close once flushed (or after CLOSE_GRACE)."""
        if self.closing:
            return
        self.send_error(rid, code, message)
        self.closing = True
        self.abort_requests()
        self.agent.call_later(CLOSE_GRACE, self._grace_expired)
        if not self.out:
            self.dead = True

    def _grace_expired(self) -> None:
        self.dead = True

    # input -----------------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            data = self.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.dead = True
            return
        if not data:
            if self.decoder.pending:
                self.fatal(
                    P.ErrorCode.EPROTO,
                    f"truncated frame: peer closed with {self.decoder.pending} bytes of an incomplete frame",
                )
            else:
                self.dead = True  # host disconnected: everything it started is killed in close()
            return
        self.decoder.feed(data)
        while not self.closing and not self.dead:
            try:
                frame = self.decoder.next_frame()
            except P.ProtocolError as exc:
                self.fatal(exc.code, exc.message)
                return
            if frame is None:
                return
            mtype, flags, rid, payload = frame
            try:
                self._dispatch(mtype, flags, rid, payload)
            except RequestError as exc:
                self.send_error(rid, exc.code, exc.message, exc.errno)
            except P.ProtocolError as exc:
                self.send_error(rid, exc.code, exc.message)
            except Exception as exc:  # an agent bug must fail the request, not the agent
                log(f"internal error handling {P.TYPE_NAMES.get(mtype, mtype)}: {exc!r}")
                self.send_error(rid, P.ErrorCode.EINTERNAL, f"internal agent error: {exc!r}")

    def _dispatch(self, mtype: int, flags: int, rid: int, payload: bytes) -> None:
        T = P.MsgType
        if mtype == T.HELLO:
            self._hello(rid, payload)
            return
        if not self.hello:
            self.fatal(P.ErrorCode.EPROTO, f"expected HELLO, got {P.TYPE_NAMES.get(mtype, hex(mtype))}", rid)
            return
        if mtype in (T.DATA, T.STDIN, T.SIGNAL):
            req = self.requests.get(rid)
            if req is not None:  # frames for finished/failed requests are dropped silently
                req.on_frame(mtype, flags, payload)
            return
        if mtype not in _REQUEST_TYPES:
            raise RequestError(P.ErrorCode.ENOSYS, f"unknown or unexpected message type {mtype:#04x}")
        if rid == 0:
            raise RequestError(P.ErrorCode.EINVAL, "request id 0 is reserved")
        if rid in self.requests:
            raise RequestError(P.ErrorCode.EINVAL, f"request id {rid} is already in use")
        spec = P.decode_json(payload)
        if mtype == T.HEALTH:
            self.send_json(T.RESULT, rid, self.agent.health())
        elif mtype == T.POWEROFF:
            self.send_json(T.RESULT, rid, {"pid1": self.agent.pid1})
            self.agent.request_stop("poweroff")
        elif mtype == T.SET_TIME:
            self.send_json(T.RESULT, rid, set_realtime(spec))
        elif mtype == T.IDENTITY:
            self.send_json(T.RESULT, rid, set_identity(spec))
        elif mtype == T.KILL_ALL:
            self.send_json(T.RESULT, rid, kill_all(self.agent.pid1))
        elif mtype == T.EXEC:
            self.requests[rid] = ExecRequest(self, rid, spec)
        elif mtype == T.READ_FILE:
            self.requests[rid] = ReadFileRequest(self, rid, spec)
        else:
            req = self.requests[rid] = WriteFileRequest(self, rid, spec)
            if flags & P.FLAG_END:  # an empty file in a single frame
                req.on_frame(T.DATA, P.FLAG_END, b"")

    def _hello(self, rid: int, payload: bytes) -> None:
        try:
            spec = P.decode_json(payload)
        except P.ProtocolError as exc:
            self.fatal(exc.code, f"bad HELLO: {exc.message}", rid)
            return
        major, minor = spec.get("major"), spec.get("minor", 0)
        if not isinstance(major, int) or not isinstance(minor, int):
            self.fatal(P.ErrorCode.EINVAL, "HELLO needs integer 'major' and 'minor'", rid)
            return
        if major != P.PROTOCOL_MAJOR:
            self.fatal(
                P.ErrorCode.EVERSION,
                f"client speaks protocol {major}.{minor}, agent speaks {P.PROTOCOL_MAJOR}.{P.PROTOCOL_MINOR}",
                rid,
            )
            return
        self.hello = True
        self.send_json(
            P.MsgType.HELLO_OK,
            rid,
            {
                "major": P.PROTOCOL_MAJOR,
                "minor": P.PROTOCOL_MINOR,
                "agent_version": P.AGENT_VERSION,
                "pid1": self.agent.pid1,
                "max_payload": P.MAX_PAYLOAD,
            },
        )

    def produce(self) -> bool:
        """Let producers (READ_FILE) emit while there is room; True if one still has more to send."""
        if self.closing or self.dead:
            return False
        for req in list(self.requests.values()):
            if req.producing:
                if self.congested:
                    return False
                req.produce()
        return not self.congested and any(r.producing for r in self.requests.values())

    def abort_requests(self) -> None:
        reqs = list(self.requests.values())
        self.requests.clear()
        for req in reqs:
            try:
                req.abort()
            except Exception as exc:
                log(f"error aborting request {req.rid}: {exc!r}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.abort_requests()
        self.agent.conns.discard(self)
        self.sock.close()


_REQUEST_TYPES = frozenset(
    {P.MsgType.EXEC, P.MsgType.WRITE_FILE, P.MsgType.READ_FILE, P.MsgType.HEALTH, P.MsgType.POWEROFF,
     P.MsgType.SET_TIME, P.MsgType.IDENTITY, P.MsgType.KILL_ALL}
)


# --- the agent ----------------------------------------------------------------------------------------------
class Agent:
    """Owns the listener, the connections, the timers and the reaper; run() is the event loop."""

    def __init__(self, listener: _socket.socket, pid1: bool = False) -> None:
        self.listener = listener
        listener.setblocking(False)
        self.pid1 = pid1
        self.reaper = Reaper()
        self.conns: set[Connection] = set()
        self.timers: list[Timer] = []
        self.started = time.monotonic()
        self.stop_reason: str | None = None
        self.tmp_counter = 0
        self._self_env: dict[str, str] | None = None
        self._poller = select.poll()
        self._handlers: dict[int, Callable[[int], None]] = {}

    def call_later(self, delay: float, callback: "Callable[[], None]") -> Timer:
        timer = Timer(time.monotonic() + delay, callback)
        self.timers.append(timer)
        return timer

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def default_env(self, user: "UserInfo | None") -> "dict[str, str]":
        if user is None:
            if self._self_env is None:
                me = resolve_user(os.getuid())
                assert me is not None
                self._self_env = self._env_for(me)
            return dict(self._self_env)
        return self._env_for(user)

    @staticmethod
    def _env_for(user: UserInfo) -> "dict[str, str]":
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            "SHELL": user.shell,
            "LANG": "C.UTF-8",
        }
        env.update((k, os.environ[k]) for k in INHERITED_ENV if k in os.environ)
        return env

    def health(self) -> "dict[str, Any]":
        return {
            "ready": True,
            "agent_version": P.AGENT_VERSION,
            "major": P.PROTOCOL_MAJOR,
            "minor": P.PROTOCOL_MINOR,
            "uptime": round(time.monotonic() - self.started, 6),
            "pid1": self.pid1,
            "pid": os.getpid(),
            "connections": len(self.conns),
            "execs": sum(isinstance(r, ExecRequest) for c in self.conns for r in c.requests.values()),
            "orphans_reaped": self.reaper.orphans_reaped,
        }

    def _accept(self, events: int) -> None:
        while True:
            try:
                fd, _addr = self.listener._accept()  # type: ignore[attr-defined]  # _socket: (fd, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving existing connections
                log(f"accept failed: {exc!r}")
                return
            self.conns.add(Connection(self, _socket.socket(fileno=fd)))

    def _reap(self, events: int = 0) -> None:
        self.reaper.reap()

    def run(self) -> str:
        """Serve until a POWEROFF (or request_stop); returns the stop reason."""
        self.reaper.install()
        next_sweep = time.monotonic() + REAP_SWEEP
        while self.stop_reason is None:
            busy = any(c.produce() for c in list(self.conns))
            self._close_dead()
            poller = self._poller = select.poll()
            handlers = self._handlers = {}
            add = self._add
            add(self.listener.fileno(), POLLIN, self._accept)
            add(self.reaper.wakeup_r, POLLIN, self._reap)
            for conn in list(self.conns):
                conn.interest(add)
            now = time.monotonic()
            deadline = min([t.when for t in self.timers if not t.cancelled] + [next_sweep])
            timeout_ms = 0 if busy else max(0, int((deadline - now) * 1000) + 1)
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                events = []
            for fd, ev in events:
                handlers[fd](ev)
            now = time.monotonic()
            if now >= next_sweep:
                self.reaper.reap()
                next_sweep = now + REAP_SWEEP
            self._run_timers(now)
            self._close_dead()
        self._shutdown()
        return self.stop_reason

    def _add(self, fd: int, mask: int, handler: "Callable[[int], None]") -> None:
        """Register fd for this loop iteration (interest is rebuilt every iteration, level-triggered)."""
        self._poller.register(fd, mask)
        self._handlers[fd] = handler

    def _run_timers(self, now: float) -> None:
        due = [t for t in self.timers if t.when <= now or t.cancelled]
        if not due:
            return
        self.timers = [t for t in self.timers if t.when > now and not t.cancelled]
        for t in due:
            if not t.cancelled:
                t.callback()

    def _close_dead(self) -> None:
        for conn in [c for c in self.conns if c.dead]:
            conn.close()

    def _shutdown(self) -> None:
        """Flush replies (bounded), kill every exec, close every connection."""
        deadline = time.monotonic() + 2.0
        for conn in list(self.conns):
            try:
                conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
                conn.sock.sendall(conn.out)
                conn.out.clear()
            except OSError:
                pass
            conn.close()
        self.listener.close()
