"""Test support for smold: launchers that run the real guest agent on the host, and a daemon in a subprocess.

The HostAgentLauncher starts ``python -m smol_agent --listen unix:STATE/agent.sock`` as the "VM process"
(its own session, like a VMM), so the daemon's create/exec/copy/verify/destroy/Run paths run for real
against the real agent, in milliseconds instead of a two-minute emulated boot. Commands then run on the
host as the test user: tests only use guest paths under their own temporary directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smold.agent import AgentClient, connect_unix, wait_ready
from smold.daemon.config import DaemonConfig
from smold.daemon.errors import LaunchError
from smold.daemon.images import ImageStore
from smold.daemon.launcher import READY_FILE, Launcher, LaunchSpec
from smold.daemon.process import ChildProcess
from smold.daemon.server import Daemon

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = Path(__file__).resolve().parent
AGENT_SOCKET = "agent.sock"


class HostAgentLauncher(Launcher):
    """The guest agent as a host process stands in for a VM (no isolation: tests only)."""

    kind = "host-agent"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-m", "smol_agent", "--listen", f"unix:{spec.state_dir / AGENT_SOCKET}"]

    async def wait_ready(self, spec: LaunchSpec, proc: ChildProcess) -> dict[str, Any]:
        path = str(spec.state_dir / AGENT_SOCKET)
        try:
            client = await wait_ready(lambda: connect_unix(path, timeout=2),
                                      time.monotonic() + spec.boot_timeout, interval=0.01)
        except Exception as e:
            raise LaunchError(f"agent not ready: {e}", timed_out=True) from e
        await client.close()
        info = {"agent_socket": path, "pid": proc.pid}
        tmp = spec.state_dir / f".{READY_FILE}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, spec.state_dir / READY_FILE)
        return info

    async def connect(self, state_dir: Path, ready: dict[str, Any], timeout: float = 10.0) -> AgentClient:
        return await connect_unix(str(ready["agent_socket"]), timeout=timeout)


class CrashingLauncher(HostAgentLauncher):
    """A "VM process" that prints a line and exits 3 before it is ready."""

    kind = "crashing"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-c", "import sys; print('vmm: boom'); sys.exit(3)"]


class SilentConsoleLauncher(HostAgentLauncher):
    """A "VM process" with an empty console (as a restored guest's starts) that logs why it ends and exits 1."""

    kind = "silent-console"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1], 'console.log').touch(); "
                "print('vcpu1 ended 0.2 s after the vCPUs started: reset triple fault'); sys.exit(1)",
                str(spec.state_dir)]


class NeverReadyLauncher(HostAgentLauncher):
    """A "VM process" that runs but never becomes ready (boot timeout)."""

    kind = "never-ready"

    def command(self, spec: LaunchSpec) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(3600)", str(spec.state_dir)]

    async def wait_ready(self, spec: LaunchSpec, proc: ChildProcess) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def fake_image_files(tmp: Path) -> tuple[Path, Path, Path]:
    """Three small files standing in for kernel, initramfs and rootfs (the host agent boots nothing)."""
    files = []
    for name in ("vmlinux", "initramfs.cpio", "rootfs.ext4"):
        p = tmp / name
        p.write_bytes(name.encode() * 100)
        files.append(p)
    return files[0], files[1], files[2]


async def start_daemon_task(config: DaemonConfig, images: ImageStore,
                            launcher: Launcher | None = None) -> tuple[Daemon, asyncio.Task[None]]:
    """An in-process daemon serving ``config``, with VMs replaced by host agents unless ``launcher``."""
    daemon = Daemon(config, launcher=launcher or HostAgentLauncher(), images=images)
    task = asyncio.create_task(daemon.run(handle_signals=False))
    for _ in range(500):
        if daemon.server is not None or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    return daemon, task


def fake_images(tmp: Path) -> ImageStore:
    """An ImageStore whose "default" image is fake_image_files()."""
    files = fake_image_files(tmp)
    return ImageStore({"default": lambda: files})


# --- a daemon in a subprocess ----------------------------------------------------------------------------------
class DaemonProcess:
    """``python -m smold.daemon`` with the host-agent launcher on a temp socket and state dir."""

    def __init__(self, workdir: Path, *extra: str, launcher: str = "daemon_support:HostAgentLauncher",
                 env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.socket = workdir / "smold.sock"
        self.state = workdir / "state"
        self.log = workdir / "smold.log"
        k, i, r = fake_image_files(workdir)
        self.argv = [sys.executable, "-m", "smold.daemon", "--socket", str(self.socket), "--state-dir",
                     str(self.state), "--launcher", launcher, "--log-level", "debug",
                     "--image", f"default={k}:{i}:{r}", *extra]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(UNIT_DIR), str(REPO)]), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smold exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"smold did not listen within {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def smolctl(self, *args: str, stdin: bytes | None = None, timeout: float = 60.0,
                cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
        return run_smolctl(self.socket, *args, stdin=stdin, timeout=timeout, cwd=cwd)


@contextlib.contextmanager
def daemon_in_tempdir(prefix: str, *extra: str, launcher: str = "daemon_support:HostAgentLauncher",
                      check_exit: bool = False) -> Iterator[DaemonProcess]:
    """A started DaemonProcess in a fresh directory under /tmp (short: AF_UNIX paths are limited), killed and
    removed afterwards. ``check_exit``: when the block ends normally, stop it with SIGTERM and require 0."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    proc = DaemonProcess(d, *extra, launcher=launcher)
    try:
        yield proc.start()
        if check_exit:
            assert proc.terminate() == 0, proc.log_text()
    finally:
        proc.kill()
        shutil.rmtree(d, ignore_errors=True)


def run_smolctl(sock: Path, *args: str, stdin: bytes | None = None, timeout: float = 60.0,
                cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SMOL_SOCKET": str(sock)}
    return subprocess.run([sys.executable, "-m", "smolctl", *args], input=stdin if stdin is not None else b"",
                          capture_output=True, timeout=timeout, env=env, cwd=cwd)


# --- looking at what a machine left on the host -----------------------------------------------------------
def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains text."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in raw:
                out.append(int(entry))
    return out


def unix_sockets_under(path: Path) -> list[str]:
    """Bound Unix sockets (from /proc/net/unix) whose path is under path."""
    prefix = str(path)
    found = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(prefix):
                found.append(parts[7])
    return found


def files_under(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
