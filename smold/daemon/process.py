"""Host processes the daemon supervises: its own children and processes re-adopted after a restart (/proc, pidfd)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SIGKILL = signal.SIGKILL


class ProcessGoneError(Exception):
    """The process no longer exists (or its pid now belongs to another program)."""


@dataclass(frozen=True)
class ExitStatus:
    """How a supervised process ended: returncode (negative: killed by that signal), None if not our child."""

    returncode: int | None

    def describe(self) -> str:
        rc = self.returncode
        if rc is None:
            return "exited (status unknown: not the daemon's child)"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"killed by {name}"
        return f"exited with status {rc}"


# --- /proc -----------------------------------------------------------------------------------------------
def read_cmdline(pid: int) -> list[str] | None:
    """argv of a live process, None if it is gone (or a zombie, whose cmdline is empty)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None
    return [os.fsdecode(a) for a in raw.rstrip(b"\0").split(b"\0")]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def is_running(pid: int) -> bool:
    """The pid exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def is_same_process(pid: int, argv: list[str], started: int | None) -> bool:
    """pid is alive and still the program we started: same argv and, when known, the same start time."""
    if read_cmdline(pid) != argv:
        return False
    return started is None or start_time(pid) == started


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; a group that no longer exists is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --- supervised processes --------------------------------------------------------------------------------
class VmProcess:
    """A VM process: pid, the argv it was started with, its start time; wait() for its end, signal() it.

    Each VM process leads its own session and process group (pgid == pid), so it survives the daemon
    and a group signal reaches everything it started.
    """

    def __init__(self, pid: int, argv: list[str], started: int | None) -> None:
        self.pid = pid
        self.argv = argv
        self.started = started
        self.status: ExitStatus | None = None

    async def wait(self) -> ExitStatus:
        raise NotImplementedError

    def alive(self) -> bool:
        return self.status is None and is_same_process(self.pid, self.argv, self.started)

    def signal(self, sig: int) -> None:
        """Signal the process itself (not after it ended: its pid may have been reused)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill_group(self, sig: int = _SIGKILL) -> None:
        """Signal the process group (everything the VM process started)."""
        kill_group(self.pid, sig)


class ChildProcess(VmProcess):
    """A VM process this daemon started (subprocess.Popen, watched through a pidfd, reaped for its status).

    Not an asyncio subprocess on purpose: asyncio and uvloop SIGKILL a child whose transport is closed,
    and VM processes must outlive the daemon when it restarts or leaves them running.
    """

    def __init__(self, popen: subprocess.Popen[bytes], argv: list[str]) -> None:
        super().__init__(popen.pid, argv, start_time(popen.pid))
        self._popen = popen
        self._pidfd = os.pidfd_open(popen.pid)  # a child cannot be reaped behind our back: the pid is ours

    async def wait(self) -> ExitStatus:
        if self.status is not None:
            return self.status
        await _pidfd_readable(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self.status = ExitStatus(self._popen.wait())  # it has terminated: this reaps at once
        return self.status

    def signal(self, sig: int) -> None:
        if self.status is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def alive(self) -> bool:
        return self.status is None and is_running(self.pid)


async def _pidfd_readable(pidfd: int) -> None:
    """Wait until a pidfd polls readable: its process has terminated."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def ready() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, ready)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


class AdoptedProcess(VmProcess):
    """A VM process started by an earlier daemon: watched through a pidfd (readable once it exits)."""

    def __init__(self, pid: int, argv: list[str], started: int | None) -> None:
        super().__init__(pid, argv, started)
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise ProcessGoneError(f"process {pid} is gone") from None
        if not is_same_process(pid, argv, started):  # checked after opening: the pidfd pins this process
            os.close(self._pidfd)
            raise ProcessGoneError(f"process {pid} is not the VM process it was")

    async def wait(self) -> ExitStatus:
        if self.status is not None:
            return self.status
        await _pidfd_readable(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self.status = ExitStatus(None)
        return self.status

    def signal(self, sig: int) -> None:
        if self.status is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def alive(self) -> bool:
        return self.status is None and is_running(self.pid)
