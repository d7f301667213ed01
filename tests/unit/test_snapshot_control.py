"""The VMM control socket (snapshot/pause/resume) and the agent's SET_TIME request used after a restore."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smold.agent import AgentRequestError, connect_unix
from smold.vmm.control import ControlServer, control_request
from smold.vmm.machine import MachineError, SnapshotResult

pytestmark = pytest.mark.timeout(60)


class FakeMachine:
    """What ControlServer needs of a Machine, recording the calls."""

    def __init__(self) -> None:
        self.paused = False
        self.restored = True
        self.calls: list[tuple[str, Any]] = []

    async def pause(self) -> None:
        self.calls.append(("pause", None))
        self.paused = True

    def resume(self) -> None:
        self.calls.append(("resume", None))
        self.paused = False

    async def snapshot(self, directory: Path, *, resume: bool = True, digest: bool = False) -> SnapshotResult:
        self.calls.append(("snapshot", (directory, resume, digest)))
        if directory.name == "fail":
            raise MachineError("vCPUs did not pause within 10s")
        return SnapshotResult(directory, 100, 512 << 20, 4096, {"total": 0.25})


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smolctl-", dir="/tmp"))   # AF_UNIX paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_control_requests_over_the_socket(sockdir: Path) -> None:
    machine = FakeMachine()
    server = ControlServer(machine, sockdir / "control.sock")  # type: ignore[arg-type]
    await server.start()
    try:
        assert (os.stat(sockdir / "control.sock").st_mode & 0o777) == 0o600
        path = sockdir / "control.sock"
        assert await control_request(path, {"op": "status"}) == {"ok": True, "paused": False, "restored": True}
        assert (await control_request(path, {"op": "pause"}))["ok"] and machine.paused
        assert (await control_request(path, {"op": "resume"}))["ok"] and not machine.paused
        reply = await control_request(path, {"op": "snapshot", "dir": "/x/snap", "resume": False})
        assert reply["ok"] and reply["snapshot"]["memory_written"] == 4096
        assert machine.calls[-1] == ("snapshot", (Path("/x/snap"), False, False))
        failed = await control_request(path, {"op": "snapshot", "dir": "/x/fail"})
        assert failed == {"ok": False, "error": "vCPUs did not pause within 10s"}
    finally:
        await server.close()
    assert not (sockdir / "control.sock").exists()


@pytest.mark.parametrize("line,error", [
    (b"{nope\n", "bad JSON"),
    (b"[1]\n", "a request is a JSON object"),
    (b'{"op": "reboot"}\n', "unknown op 'reboot'"),
    (b'{"op": "snapshot", "dir": "relative/dir"}\n', "absolute 'dir'"),
    (b'{"op": "snapshot", "dir": "/abs", "resume": "yes"}\n', "booleans"),
])
async def test_bad_control_requests_are_answered_not_fatal(line: bytes, error: str) -> None:
    machine = FakeMachine()
    server = ControlServer(machine, Path("/nonexistent/control.sock"))  # type: ignore[arg-type]
    reply = await server.handle_line(line)
    assert reply["ok"] is False and error in reply["error"]
    assert not [c for c in machine.calls if c[0] == "snapshot"]


# -- SET_TIME in the guest agent ----------------------------------------------------------------------------
@pytest.fixture
def unprivileged_agent() -> Iterator[str]:
    """The agent as user nobody, so SET_TIME cannot (and must not) change this host's clock."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop privileges")
    d = Path(tempfile.mkdtemp(prefix="smolst-", dir="/tmp"))
    os.chmod(d, 0o777)
    path = str(d / "agent.sock")
    # user nobody may not be able to enter the checkout (a clone under a 0700 directory, as the preflight makes):
    # the agent (stdlib only) runs from a copy here, with the interpreter the venv's python points at
    shutil.copytree(Path(__file__).resolve().parents[2] / "guest-agent" / "smol_agent", d / "smol_agent",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for p in [d, *d.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o644)
    env = {**os.environ, "PYTHONPATH": str(d), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             os.path.realpath(sys.executable), "-m", "smol_agent", "--listen", f"unix:{path}"],
                            env=env, cwd=d,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 15
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"agent did not start: {proc.communicate()[1]!r}") from None
            time.sleep(0.02)
    yield path
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(d, ignore_errors=True)


async def test_set_time_validates_and_reports_a_refused_clock(unprivileged_agent: str) -> None:
    client = await connect_unix(unprivileged_agent)
    try:
        for bad in (0, -5, True, "1"):
            with pytest.raises(AgentRequestError) as e:
                await client._call(0x30, {"realtime_ns": bad})
            assert e.value.code == "EINVAL"
        before = time.time()
        with pytest.raises(AgentRequestError) as e:
            await client.set_time(time.time_ns() + 3600 * 10**9)
        assert e.value.code == "EPERM" and "clock_settime" in e.value.message
        assert abs(time.time() - before) < 60, "the host clock was not touched"
        assert (await client.health()).pid > 0, "the agent keeps serving"
    finally:
        await client.close()


def test_set_time_is_a_known_request_type() -> None:
    from smol_agent import protocol as P  # type: ignore[import-not-found]
    assert P.MsgType.SET_TIME == 0x30 and P.PROTOCOL_MINOR >= 1
    assert P.TYPE_NAMES[0x30] == "SET_TIME"


async def test_identity_validates_everything_before_changing_anything(unprivileged_agent: str) -> None:
    client = await connect_unix(unprivileged_agent)
    try:
        for bad in ({"hostname": "-x"}, {"hostname": "a" * 65}, {"hostname": "a b"}, {"hostname": 5},
                    {"machine_id": "ABCDEF" * 5 + "00"}, {"machine_id": "0" * 31},
                    {"entropy": "zz"}, {"entropy": "00" * 513}, {"entropy": ""},
                    {"hostname": "ok", "machine_id": "nope"}):
            with pytest.raises(AgentRequestError) as e:
                await client._call(0x31, bad)
            assert e.value.code == "EINVAL", (bad, e.value)
        host = socket.gethostname()
        with pytest.raises(AgentRequestError) as e:
            await client.set_identity(hostname="smol-kid-1")
        assert e.value.code == "EPERM", e.value   # sethostname(2) as nobody: the host is not renamed
        assert socket.gethostname() == host
    finally:
        await client.close()
