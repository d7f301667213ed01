"""End-to-end tests of the guest agent (real subprocess on a Unix socket) driven by the real AgentClient."""

import asyncio
import errno
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from smol_agent import protocol as P

from smold.agent import (
    AgentClosedError,
    AgentConnectError,
    AgentFileTooLargeError,
    AgentRequestError,
    AgentTimeoutError,
    AgentVersionError,
    ExecExit,
    ExecStdout,
    connect_unix,
    connect_vsock_uds,
    wait_ready,
)

pytestmark = pytest.mark.timeout(60)

AGENT_CMD = [sys.executable, "-m", "smol_agent"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


# --- helpers ------------------------------------------------------------------------------------------------
class AgentProcess:
    """The agent started as a subprocess listening on unix:<path>."""

    def __init__(self, workdir: Path, *, pid1: bool = False, prefix: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.path = str(workdir / "agent.sock")
        self.log = workdir / "agent.log"
        cmd = [*(prefix or []), *AGENT_CMD, "--listen", f"unix:{self.path}", *(["--pid1"] if pid1 else [])]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env={**os.environ, **env} if env else None)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited early ({self.proc.returncode}): {self.log.read_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent did not listen: {self.log.read_text()}") from None
                time.sleep(0.01)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="smolag-", dir="/tmp"))  # short: AF_UNIX paths are limited to 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(workdir):
    a = AgentProcess(workdir)
    yield a
    alive = a.alive()
    a.stop()
    assert alive, f"agent died during the test: {a.log.read_text()}"
    assert a.proc.returncode == 0, a.log.read_text()


@pytest.fixture
async def client(agent):
    c = await connect_unix(agent.path)
    yield c
    await c.close()


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def wait_dead(pids, timeout: float = 5.0) -> list[int]:
    """Wait until none of pids is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        await asyncio.sleep(0.02)


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    return s


def raw_hello(s: socket.socket) -> None:
    s.sendall(P.pack_json(P.MsgType.HELLO, 1, {"major": P.PROTOCOL_MAJOR, "minor": 0}))
    mtype, _flags, rid, payload = read_frame(s)
    assert (mtype, rid) == (P.MsgType.HELLO_OK, 1), payload


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_frame(s: socket.socket) -> tuple[int, int, int, bytes]:
    mtype, flags, rid, length = P.unpack_header(recv_exact(s, P.HEADER_SIZE))
    return mtype, flags, rid, recv_exact(s, length)


def read_error(s: socket.socket) -> tuple[int, dict]:
    mtype, _flags, rid, payload = read_frame(s)
    assert mtype == P.MsgType.ERROR, (P.TYPE_NAMES.get(mtype), payload)
    return rid, P.decode_json(payload)


def assert_closed(s: socket.socket) -> None:
    assert s.recv(1) == b"", "agent should close the connection after a fatal protocol error"


# --- exec ---------------------------------------------------------------------------------------------------
async def test_exec_stdout_stderr_exit_code(client):
    r = await client.run(["sh", "-c", "echo hi; echo err >&2; exit 3"])
    assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == (b"hi\n", b"err\n", 3, None, False)
    assert r.pid and r.pid > 0


async def test_exec_event_stream_separates_stdout_and_stderr(client):
    events = [ev async for ev in client.exec(["sh", "-c", "printf out; printf err >&2; printf more"])]
    assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 0
    stdout = b"".join(e.data for e in events if isinstance(e, ExecStdout))
    stderr = b"".join(e.data for e in events[:-1] if not isinstance(e, ExecStdout))
    assert (stdout, stderr) == (b"outmore", b"err")


async def test_exec_reports_signal(client):
    r = await client.run(["sh", "-c", "kill -TERM $$"])
    assert (r.exit_code, r.signal, r.timed_out) == (None, signal.SIGTERM, False)
    r = await client.run(["sh", "-c", "kill -KILL $$"])
    assert (r.exit_code, r.signal) == (None, signal.SIGKILL)


async def test_stdin_bytes_large_and_async_iterator(client):
    data = os.urandom(3 * 1024 * 1024 + 17)
    r = await client.run(["cat"], stdin=data)
    assert r.exit_code == 0 and r.stdout == data

    async def gen():
        for i in range(5):
            yield f"line {i}\n".encode()
            await asyncio.sleep(0.01)

    r = await client.run(["sh", "-c", "wc -l"], stdin=gen())
    assert r.stdout.strip() == b"5"


async def test_no_stdin_is_dev_null(client):
    r = await client.run(["sh", "-c", "cat; readlink /proc/self/fd/0"])
    assert (r.exit_code, r.stdout) == (0, b"/dev/null\n")


async def test_stdin_not_read_by_child_does_not_hang(client):
    r = await client.run(["true"], stdin=bytes(8 * 1024 * 1024))
    assert r.exit_code == 0


async def test_env_and_cwd(client, workdir):
    r = await client.run(
        ["sh", "-c", 'echo "$FOO|$PATH|$HOME"; pwd'], env={"FOO": "bar baz"}, cwd=str(workdir)
    )
    foo, path, home = r.stdout.splitlines()[0].decode().split("|")
    assert foo == "bar baz" and "/usr/bin" in path and home == "/root"
    assert r.stdout.splitlines()[1].decode() == str(workdir)
    r = await client.run(["/usr/bin/env"], env={"ONLY": "1"}, env_replace=True)
    assert r.stdout == b"ONLY=1\n"
    r = await client.run(["sh", "-c", "pwd"])
    assert r.stdout == b"/\n"


@needs_root
async def test_user_switching(client):
    r = await client.run(["sh", "-c", 'id -u; id -g; id -G; echo "$HOME $USER"'], user="nobody")
    uid, gid, groups, who = r.stdout.decode().splitlines()
    nobody = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True).stdout.strip()
    assert uid == nobody != "0"
    assert gid != "0" and "0" not in groups.split()
    assert who.endswith(" nobody")
    r = await client.run(["id", "-u"], user=int(nobody))
    assert r.stdout.strip().decode() == nobody
    with pytest.raises(AgentRequestError) as info:
        await client.run(["true"], user="no-such-user-xyz")
    assert info.value.code == "EINVAL"


async def test_timeout_kills_whole_process_group(client):
    t0 = time.monotonic()
    stream = await client.exec(["sh", "-c", "sleep 100 & echo $!; sleep 100 & echo $!; wait"], timeout=0.5)
    out = bytearray()
    exit_ev = None
    async for ev in stream:
        if isinstance(ev, ExecStdout):
            out += ev.data
        elif isinstance(ev, ExecExit):
            exit_ev = ev
    assert exit_ev is not None and exit_ev.timed_out and exit_ev.signal == signal.SIGKILL
    assert time.monotonic() - t0 < 10
    pids = [int(x) for x in out.split()] + [stream.pid]
    assert len(pids) == 3
    assert await wait_dead(pids) == []


async def test_client_disconnect_kills_process_group(agent):
    c = await connect_unix(agent.path)
    stream = await c.exec(["sh", "-c", "sleep 100 & echo $!; sleep 100 & echo $!; wait"])
    out = bytearray()
    async for ev in stream:
        assert isinstance(ev, ExecStdout)
        out += ev.data
        if out.count(b"\n") == 2:
            break
    pids = [int(x) for x in out.split()] + [stream.pid]
    assert all(pid_alive(p) for p in pids)
    c._writer.transport.abort()  # an abrupt disconnect, not a polite SIGNAL
    await c.close()
    assert await wait_dead(pids) == []


async def test_exec_signal_delivery(client):
    stream = await client.exec(["sleep", "100"])
    await stream.signal(signal.SIGTERM)
    events = [ev async for ev in stream]
    assert events[-1] == ExecExit(None, signal.SIGTERM, False, events[-1].duration)


async def test_missing_executable_and_cwd_and_permission(client, workdir):
    with pytest.raises(AgentRequestError) as info:
        await client.run(["definitely-not-a-command-xyz"])
    assert info.value.code == "ENOENT" and "definitely-not-a-command-xyz" in info.value.message
    with pytest.raises(AgentRequestError) as info:
        await client.run(["true"], cwd="/nonexistent/dir")
    assert info.value.code == "ENOENT" and "cannot change directory" in info.value.message
    script = workdir / "noexec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(AgentRequestError) as info:
        await client.run([str(script)])
    assert info.value.code == "EACCES"
    # the connection is still usable after failed requests
    assert (await client.run(["true"])).exit_code == 0


@pytest.mark.parametrize("vfork", [True, False], ids=["vfork", "fork"])
def test_spawn_paths_report_the_failing_stage(monkeypatch, tmp_path, vfork):
    """Reaper.spawn: both the vfork and the fork path name the stage and errno of a failed start."""
    from smol_agent import process

    if vfork and not process.VFORK_SPAWN:
        pytest.skip("no vfork spawn on this Python")
    monkeypatch.setattr(process, "VFORK_SPAWN", vfork)
    reaper = process.Reaper()
    env = {"PATH": "/usr/bin:/bin"}
    noexec = tmp_path / "noexec.sh"
    noexec.write_text("#!/bin/sh\n")
    noexec.chmod(0o644)
    for argv, cwd, stage, code in (
        (["no-such-command-xyz"], "/", "exec", errno.ENOENT),
        (["true"], str(tmp_path / "missing"), "cwd", errno.ENOENT),
        ([str(noexec)], "/", "exec", errno.EACCES),
    ):
        with pytest.raises(process.SpawnError) as info:
            reaper.spawn(argv, env, cwd, None, 0, 1, 2, lambda status: None)
        assert (info.value.stage, info.value.errno) == (stage, code), argv
    r, w = os.pipe()
    try:
        statuses: list[int] = []
        pid = reaper.spawn(["sh", "-c", "echo $PWD; exit 3"], env, str(tmp_path), None, 0, w, 2, statuses.append)
        os.close(w)
        w = -1
        assert os.read(r, 100) == f"{tmp_path}\n".encode()
        deadline = time.monotonic() + 10
        while not statuses:
            assert time.monotonic() < deadline
            reaper.reap()
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(statuses[0]) == 3 and pid > 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


async def test_invalid_exec_requests(client):
    for argv in ([], [1, 2], ["true", None]):
        with pytest.raises(AgentRequestError) as info:
            await client.run(argv)  # type: ignore[arg-type]
        assert info.value.code == "EINVAL"
    with pytest.raises(AgentRequestError) as info:
        await client.run(["true"], timeout=-1)
    assert info.value.code == "EINVAL"


async def test_concurrent_execs_on_one_and_many_connections(agent, client):
    t0 = time.monotonic()
    results = await asyncio.gather(*(client.run(["sh", "-c", f"sleep 0.5; echo {i}"]) for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    assert time.monotonic() - t0 < 3.0  # 8 x 0.5 s serially would be 4 s

    clients = [await connect_unix(agent.path) for _ in range(4)]
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(c.run(["sh", "-c", "sleep 0.5; echo x"]) for c in clients))
        assert all(r.stdout == b"x\n" for r in results)
        assert time.monotonic() - t0 < 2.0
    finally:
        for c in clients:
            await c.close()


async def test_non_utf8_output_passes_through(client):
    blob = bytes(range(256)) * 3 + b"\xff\xfe\x00\xc3("
    r = await client.run(["sh", "-c", "cat; cat /proc/self/fd/0 >&2"], stdin=blob)
    assert r.stdout == blob
    r = await client.run(["sh", "-c", r"printf '\377\000\200\n'; printf '\376' >&2"])
    assert (r.stdout, r.stderr) == (b"\xff\x00\x80\n", b"\xfe")


async def test_large_output_all_arrives_before_exit(client):
    r = await client.run(["sh", "-c", "head -c 20000000 /dev/zero; echo tail"])
    assert len(r.stdout) == 20_000_005 and r.stdout.endswith(b"tail\n")


async def test_background_child_holding_stdout_does_not_block_exit(client):
    t0 = time.monotonic()
    r = await client.run(["sh", "-c", "sleep 3 & echo done"], linger=0.2)
    assert r.stdout == b"done\n" and r.exit_code == 0
    assert time.monotonic() - t0 < 2.0


# --- files --------------------------------------------------------------------------------------------------
async def test_write_and_read_5mb_binary_file(client, workdir):
    data = os.urandom(5 * 1024 * 1024)
    path = workdir / "sub" / "blob.bin"
    assert await client.write_file(str(path), data, mode=0o600, mkdirs=True) == len(data)
    assert path.read_bytes() == data
    assert path.stat().st_mode & 0o777 == 0o600
    assert await client.read_file(str(path), max_size=len(data)) == data
    assert [p.name for p in path.parent.iterdir()] == ["blob.bin"]  # no temp files left behind


async def test_write_file_replaces_atomically_and_empty_file(client, workdir):
    path = workdir / "f.txt"
    path.write_bytes(b"old")
    await client.write_file(str(path), b"new contents")
    assert path.read_bytes() == b"new contents"
    await client.write_file(str(path), b"")
    assert path.read_bytes() == b""
    with pytest.raises(AgentRequestError) as info:
        await client.write_file(str(workdir / "missing" / "x"), b"data")
    assert info.value.code == "ENOENT"
    with pytest.raises(AgentRequestError) as info:
        await client.write_file("relative/path", b"data")
    assert info.value.code == "EINVAL"


async def test_interrupted_write_leaves_original_untouched(agent, workdir):
    path = workdir / "keep.txt"
    path.write_bytes(b"original")
    s = raw_connect(agent.path)
    raw_hello(s)
    s.sendall(P.pack_json(P.MsgType.WRITE_FILE, 5, {"path": str(path), "mode": 0o644}))
    s.sendall(P.pack_frame(P.MsgType.DATA, 5, b"partial"))
    time.sleep(0.2)
    s.close()
    async with await connect_unix(agent.path) as c:  # a round trip: the agent has processed the disconnect
        await c.health()
    assert path.read_bytes() == b"original"
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".keep")) == []


async def test_read_file_cap_missing_and_directory(client, workdir):
    path = workdir / "data.bin"
    path.write_bytes(b"x" * 1000)
    assert await client.read_file(str(path), max_size=1000) == b"x" * 1000
    with pytest.raises(AgentFileTooLargeError) as info:
        await client.read_file(str(path), max_size=999)
    assert info.value.code == "EFBIG" and "1000" in info.value.message and "999" in info.value.message
    with pytest.raises(AgentRequestError) as info:
        await client.read_file(str(workdir / "nope"), max_size=10)
    assert info.value.code == "ENOENT"
    with pytest.raises(AgentRequestError) as info:
        await client.read_file(str(workdir), max_size=10)
    assert info.value.code == "EISDIR"
    # /proc files stat as size 0: the cap is enforced while streaming
    status = await client.read_file("/proc/self/status", max_size=1 << 20)
    assert status.startswith(b"Name:")
    with pytest.raises(AgentFileTooLargeError):
        await client.read_file("/proc/self/status", max_size=10)


@needs_root
async def test_exec_as_user_has_that_users_permissions(client, workdir):
    secret = workdir / "secret"
    secret.write_bytes(b"s")
    secret.chmod(0o600)
    workdir.chmod(0o755)
    r = await client.run(["cat", str(secret)], user="nobody")
    assert r.exit_code != 0 and b"Permission denied" in r.stderr


# --- health, poweroff, readiness ------------------------------------------------------------------------------
async def test_hello_and_health(client, agent):
    assert client.agent_info is not None and client.agent_info["major"] == P.PROTOCOL_MAJOR
    h1 = await client.health()
    await asyncio.sleep(0.05)
    h2 = await client.health()
    assert h1.agent_version == P.AGENT_VERSION and h1.pid1 is False and h1.pid == agent.proc.pid
    assert 0 < h1.uptime < h2.uptime


async def test_poweroff_non_pid1_exits_agent_and_kills_execs(workdir):
    a = AgentProcess(workdir)
    try:
        c = await connect_unix(a.path)
        stream = await c.exec(["sleep", "100"])
        await c.poweroff()
        assert a.proc.wait(10) == 0
        assert await wait_dead([stream.pid]) == []
        await c.close()
    finally:
        a.stop()


async def test_wait_ready_retries_until_agent_listens(workdir):
    path = str(workdir / "agent.sock")
    proc_holder = {}

    async def start_later():
        await asyncio.sleep(0.5)
        proc_holder["p"] = subprocess.Popen(
            [*AGENT_CMD, "--listen", f"unix:{path}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    starter = asyncio.create_task(start_later())
    try:
        t0 = time.monotonic()
        c = await wait_ready(lambda: connect_unix(path), time.monotonic() + 20)
        assert time.monotonic() - t0 >= 0.5
        assert (await c.run(["echo", "ready"])).stdout == b"ready\n"
        await c.close()
    finally:
        await starter
        proc_holder["p"].terminate()
        proc_holder["p"].wait()


async def test_wait_ready_times_out(workdir):
    t0 = time.monotonic()
    with pytest.raises(AgentTimeoutError) as info:
        await wait_ready(lambda: connect_unix(str(workdir / "none.sock")), time.monotonic() + 0.5)
    assert isinstance(info.value.__cause__, AgentConnectError)
    assert 0.4 < time.monotonic() - t0 < 3


async def _vsock_proxy(workdir: Path, agent_path: str, reply: bytes | None):
    """A stand-in for the VMM's vsock UDS: CONNECT <port> handshake, then a byte pipe to the agent."""
    seen: list[bytes] = []

    async def handle(reader, writer):
        line = await reader.readline()
        seen.append(line)
        if reply is None:
            writer.close()
            return
        writer.write(reply)
        await writer.drain()
        if not reply.startswith(b"OK "):
            writer.close()
            return
        up_r, up_w = await asyncio.open_unix_connection(agent_path)

        async def pipe(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer), return_exceptions=True)

    path = str(workdir / "vsock.sock")
    server = await asyncio.start_unix_server(handle, path)
    return server, path, seen


async def test_connect_vsock_uds_handshake(agent, workdir):
    server, path, seen = await _vsock_proxy(workdir, agent.path, b"OK 1073741824\n")
    async with server:
        c = await connect_vsock_uds(path, 1024)
        assert (await c.run(["echo", "via vsock"])).stdout == b"via vsock\n"
        await c.close()
    assert seen == [b"CONNECT 1024\n"]


@pytest.mark.parametrize("reply", [b"ERR no listener\n", None, b"OK\n"])
async def test_connect_vsock_uds_refused(agent, workdir, reply):
    server, path, _seen = await _vsock_proxy(workdir, agent.path, reply)
    async with server:
        with pytest.raises(AgentConnectError):
            await connect_vsock_uds(path, 1024, timeout=5)


# --- malformed input ----------------------------------------------------------------------------------------
async def _still_serving(agent) -> None:
    async with await connect_unix(agent.path) as c:
        assert (await c.run(["echo", "ok"])).stdout == b"ok\n"


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (b"GARBAGE-GARBAGE-GARBAGE", "EPROTO"),
        (struct.pack(">4sBBHII", b"SMOL", 7, P.MsgType.HELLO, 0, 1, 0), "EVERSION"),
        (struct.pack(">4sBBHII", b"SMOL", 1, P.MsgType.DATA, 0, 1, P.MAX_PAYLOAD + 1), "EMSGSIZE"),
        (struct.pack(">4sBBHII", b"SMOL", 1, P.MsgType.HELLO, 0, 1, 0xFFFFFFFF), "EMSGSIZE"),
    ],
)
async def test_malformed_headers_get_error_and_agent_keeps_serving(agent, wire, code):
    s = raw_connect(agent.path)
    s.sendall(wire)
    rid, err = read_error(s)
    assert (rid, err["code"]) == (0, code) and err["message"]
    assert_closed(s)
    s.close()
    await _still_serving(agent)


@pytest.mark.parametrize("cut", [5, P.HEADER_SIZE + 3])
async def test_truncated_frame_gets_error(agent, cut):
    s = raw_connect(agent.path)
    raw_hello(s)
    frame = P.pack_json(P.MsgType.EXEC, 2, {"argv": ["true"]})
    s.sendall(frame[:cut])
    s.shutdown(socket.SHUT_WR)
    rid, err = read_error(s)
    assert err["code"] == "EPROTO" and "truncated" in err["message"]
    assert_closed(s)
    s.close()
    await _still_serving(agent)


async def test_hello_major_mismatch_and_missing_hello(agent):
    s = raw_connect(agent.path)
    s.sendall(P.pack_json(P.MsgType.HELLO, 9, {"major": P.PROTOCOL_MAJOR + 1, "minor": 0}))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (9, "EVERSION") and "agent speaks 1." in err["message"]
    assert_closed(s)
    s.close()

    s = raw_connect(agent.path)
    s.sendall(P.pack_json(P.MsgType.EXEC, 3, {"argv": ["true"]}))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (3, "EPROTO") and "HELLO" in err["message"]
    s.close()
    await _still_serving(agent)


async def test_client_raises_version_error_from_agent(workdir):
    # a peer that answers HELLO the way an agent of another major version would
    async def handle(reader, writer):
        header = await reader.readexactly(P.HEADER_SIZE)
        _t, _f, rid, length = P.unpack_header(header)
        await reader.readexactly(length)
        writer.write(P.pack_json(P.MsgType.ERROR, rid, P.error_payload("EVERSION", "agent speaks 2.0")))
        await writer.drain()
        writer.close()

    path = str(workdir / "v2.sock")
    async with await asyncio.start_unix_server(handle, path):
        with pytest.raises(AgentVersionError) as info:
            await connect_unix(path)
    assert info.value.code == "EVERSION"


async def test_bad_requests_fail_only_that_request(agent):
    s = raw_connect(agent.path)
    raw_hello(s)
    s.sendall(P.pack_frame(P.MsgType.EXEC, 2, b"{not json"))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (2, "EINVAL") and "JSON" in err["message"]
    s.sendall(P.pack_frame(0x7E, 3, b"{}"))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (3, "ENOSYS")
    s.sendall(P.pack_json(P.MsgType.HEALTH, 0, {}))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (0, "EINVAL")
    s.sendall(P.pack_json(P.MsgType.READ_FILE, 4, {"path": "/etc/hostname"}))
    rid, err = read_error(s)
    assert (rid, err["code"]) == (4, "EINVAL") and "max_size" in err["message"]
    s.sendall(P.pack_json(P.MsgType.HEALTH, 5, {}))  # same connection still works
    mtype, _f, rid, payload = read_frame(s)
    assert (mtype, rid) == (P.MsgType.RESULT, 5) and P.decode_json(payload)["ready"] is True
    s.close()
    await _still_serving(agent)


async def test_requests_after_connection_loss_raise(agent):
    c = await connect_unix(agent.path)
    await c.close()
    with pytest.raises(AgentClosedError):
        await c.health()


# --- pid1 mode (PID namespace) ------------------------------------------------------------------------------
def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


needs_pidns = pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare --pid --mount-proc")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):   # gone before the open, or between the open and the read
        return "gone"


@pytest.fixture
def pid1_agent(workdir):
    a = AgentProcess(workdir, pid1=True, prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    deadline = time.monotonic() + 10
    while not _children(a.proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (a.agent_pid,) = _children(a.proc.pid)  # type: ignore[attr-defined]
    yield a
    if a.alive():
        os.kill(a.agent_pid, signal.SIGKILL)  # type: ignore[attr-defined]  # PID 1 ignores SIGTERM
        a.proc.wait(10)


@needs_pidns
async def test_pid1_reaps_orphaned_grandchildren(pid1_agent):
    agent_pid = pid1_agent.agent_pid
    async with await connect_unix(pid1_agent.path) as c:
        h = await c.health()
        assert h.pid1 is True and h.pid == 1
        r = await c.run(["sh", "-c", "(sleep 0.6 &) ; (sleep 0.6 &) ; (true &) ; exit 4"])
        assert r.exit_code == 4
        # the sleeps were double-forked: their parent died, so they are now children of the agent (PID 1)
        orphans = _children(agent_pid)
        assert len([p for p in orphans if _state(p) != "Z"]) >= 2, orphans
        await asyncio.sleep(1.2)
        leftover = {p: _state(p) for p in _children(agent_pid)}
        assert leftover == {}, f"unreaped children of PID 1: {leftover}"
        assert (await c.health()).raw["orphans_reaped"] >= 3
        # its own execs still get their real exit status through the same reaper
        r = await c.run(["sh", "-c", "exit 7"])
        assert r.exit_code == 7


@needs_pidns
async def test_pid1_ignores_sigterm_and_env_is_sane(pid1_agent):
    os.kill(pid1_agent.agent_pid, signal.SIGTERM)
    os.kill(pid1_agent.agent_pid, signal.SIGINT)
    await asyncio.sleep(0.2)
    assert pid1_agent.alive()
    async with await connect_unix(pid1_agent.path) as c:
        r = await c.run(["sh", "-c", 'echo "$PATH"; trap - TERM; kill -TERM $$'])
        assert b"/usr/bin" in r.stdout
        assert r.signal == signal.SIGTERM  # dispositions ignored by PID 1 are reset in the child


@needs_pidns
async def test_pid1_kill_all_leaves_nothing_the_task_started(pid1_agent):
    """KILL_ALL: a respawning storm of processes, a detached sleeper and a running exec are all gone after one
    request; the agent goes on serving (a sealed Run's outputs are taken after it)."""
    agent_pid = pid1_agent.agent_pid
    async with await connect_unix(pid1_agent.path) as c:
        storm = "for i in 1 2 3 4 5 6 7 8; do (while :; do sleep 5 & sleep 0.01; done) & done; (setsid sleep 60 &)"
        assert (await c.run(["sh", "-c", f"({storm}) > /dev/null 2>&1 &"])).exit_code == 0
        await asyncio.sleep(0.5)
        hung = await c.exec(["sleep", "60"])  # an exec still running on this connection
        assert len(_descendants(agent_pid)) > 10
        killed = await c.kill_all()
        assert killed > 10
        async for _ in hung:
            pass
        assert hung.exit is not None and hung.exit.signal == signal.SIGKILL
        deadline = time.monotonic() + 5
        while (left := [p for p in _descendants(agent_pid) if _state(p) != "Z"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert left == [], {p: _state(p) for p in left}
        assert (await c.run(["sh", "-c", "echo alive"])).stdout == b"alive\n"


async def test_kill_all_is_refused_unless_pid1(agent):
    async with await connect_unix(agent.path) as c:
        with pytest.raises(AgentRequestError) as e:
            await c.kill_all()
        assert e.value.code == "EPERM" and "PID 1" in e.value.message
        assert (await c.run(["true"])).exit_code == 0  # and nothing was killed


def _descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += _children(p)
        except (FileNotFoundError, ProcessLookupError):   # it exited meanwhile
            pass
    return out


# The VMM sets GLIBC_TUNABLES for the whole guest on PVM hosts (smold/kvm/cpuid.py, docs/pvm-emulator.md
# item 10); commands must inherit it from the agent, which otherwise builds their environment from scratch.
PLATFORM_ENV = {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2", "SMOL_NOT_INHERITED": "1"}
SHOW_ENV = ["sh", "-c", 'echo "${GLIBC_TUNABLES-unset}|${SMOL_NOT_INHERITED-unset}"']


async def test_commands_inherit_glibc_tunables(workdir):
    a = AgentProcess(workdir, env=PLATFORM_ENV)
    try:
        async with await connect_unix(a.path) as c:
            assert (await c.run(SHOW_ENV)).stdout == b"glibc.cpu.hwcaps=-AVX2|unset\n"
            # a caller's own value wins; env_replace means exactly the caller's environment
            r = await c.run(SHOW_ENV, env={"GLIBC_TUNABLES": "mine"})
            assert r.stdout == b"mine|unset\n"
            assert (await c.run(SHOW_ENV, env={"X": "1"}, env_replace=True)).stdout == b"unset|unset\n"
    finally:
        a.stop()


@needs_pidns
async def test_pid1_keeps_glibc_tunables_for_commands(workdir):
    # As PID 1 the agent resets its environment (setup_pid1); what /init got from the kernel command line
    # must survive that.
    a = AgentProcess(workdir, pid1=True, prefix=["unshare", "--pid", "--fork", "--mount-proc"], env=PLATFORM_ENV)
    try:
        async with await connect_unix(a.path) as c:
            assert (await c.run(SHOW_ENV)).stdout == b"glibc.cpu.hwcaps=-AVX2|unset\n"
    finally:
        for pid in _children(a.proc.pid):
            os.kill(pid, signal.SIGKILL)  # PID 1 ignores SIGTERM
        a.proc.wait(10)


def _sigmask(status: bytes, field: bytes) -> int:
    for line in status.splitlines():
        if line.startswith(field + b":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field!r} in {status!r}")


@needs_pidns
@pytest.mark.parametrize("user", [None, "root"], ids=["vfork-path", "fork-path"])
async def test_pid1_children_start_with_default_signal_dispositions(pid1_agent, user):
    """Both spawn paths hand commands a clean slate: nothing ignored or blocked that PID 1 swallows."""
    async with await connect_unix(pid1_agent.path) as c:
        r = await c.run(["cat", "/proc/self/status"], user=user)
        assert r.exit_code == 0, r.stderr
        ignored, blocked = _sigmask(r.stdout, b"SigIgn"), _sigmask(r.stdout, b"SigBlk")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE,
                    signal.SIGUSR1, signal.SIGCHLD):
            assert not ignored & (1 << (sig - 1)), f"{sig!r} ignored in the child ({user=})"
        assert blocked == 0, f"signals blocked in the child: {blocked:#x}"
        r = await c.run(["sh", "-c", "pwd; echo $$; cat /proc/$$/stat"], cwd="/tmp", user=user)
        out = r.stdout.split(b"\n")
        assert out[0] == b"/tmp"
        pid, stat = out[1], out[2].rpartition(b")")[2].split()
        assert stat[2] == pid and stat[3] == pid  # pgrp and session: its own process group and session


@needs_pidns
async def test_pid1_poweroff_reboots_the_namespace(pid1_agent):
    async with await connect_unix(pid1_agent.path) as c:
        await c.poweroff()
    # reboot(RB_AUTOBOOT) inside a PID namespace terminates its init: the unshare wrapper exits
    pid1_agent.proc.wait(15)
    assert not os.path.exists(f"/proc/{pid1_agent.agent_pid}") or _state(pid1_agent.agent_pid) in (
        "Z",
        "gone",
    )


async def test_a_consumer_that_stops_reading_bounds_what_the_client_buffers(client):
    """Issue #19 (7): a command floods its output while nobody takes it (an Exec whose gRPC client stopped
    reading): the client stops reading from the agent at its bound, so the agent's writes, then the command,
    wait; nothing is lost once the consumer reads again."""
    from smold.agent.client import MAX_BUFFERED_BYTES
    total = 48 << 20
    stream = await client.exec(["head", "-c", str(total), "/dev/zero"])
    await asyncio.sleep(3)                   # the flood runs into the bound while nobody reads
    # the command is held up (unbounded, its 48 MiB would all be read into memory within a second and it done)
    assert stream.pid is not None and Path(f"/proc/{stream.pid}").exists()
    assert client._buffered <= MAX_BUFFERED_BYTES + (1 << 20), client._buffered
    got = 0
    async for event in stream:
        if isinstance(event, ExecStdout):
            got += len(event.data)
    assert got == total and stream.exit is not None and stream.exit.exit_code == 0
    assert client._buffered == 0


async def test_abandoning_an_exec_held_at_the_bound_kills_it_promptly(client):
    """An Exec whose client left while its output was held at the bound: aclose lets go of the held frames
    first, so the agent reads the SIGKILL and the command ends (it must not wait for a reader that is gone)."""
    stream = await client.exec(["sh", "-c", "head -c 64000000 /dev/zero; sleep 600"])
    await asyncio.sleep(2)
    pid = stream.pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    await asyncio.wait_for(stream.aclose(), 15)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        await asyncio.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
    assert client._buffered == 0
    assert (await client.run(["true"])).exit_code == 0   # the connection still serves
