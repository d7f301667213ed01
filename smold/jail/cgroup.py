"""Per-VM cgroups: memory, CPU and task limits under a ``smol`` parent, on cgroup v2 or the v1 controllers.

cgroup v2 (Documentation/admin-guide/cgroup-v2.rst): ``memory.max``, ``memory.swap.max``, ``cpu.max``,
``pids.max``; an OOM kill is counted in ``memory.events`` (``oom_kill N``). Hosts still on the v1 memory
and cpu controllers (cgroup-v1/memory.rst, sched-bwc.rst) get ``memory.limit_in_bytes``,
``cpu.cfs_quota_us``/``cpu.cfs_period_us`` and ``pids.max``, and report OOM kills in ``memory.oom_control``.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


class CgroupError(Exception):
    """A cgroup could not be created, limited or joined."""


@dataclass(frozen=True)
class Limits:
    """What one VM process may use: bytes of memory (no swap), CPUs (a quota of that many cores), tasks."""

    memory_bytes: int
    cpus: float
    pids: int = 256


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise CgroupError(f"cannot write {text.strip()!r} to {path}: {e.strerror or e}") from None


PF_KTHREAD = 0x00200000   # include/linux/sched.h: the flags field (9th) of /proc/PID/stat


def _kernel_thread(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return bool(int(stat.rsplit(")", 1)[1].split()[6]) & PF_KTHREAD)
    except (OSError, ValueError, IndexError):
        return False


def unified(root: Path = ROOT) -> bool:
    """cgroup v2 is mounted at ``root`` (it has cgroup.controllers)."""
    return (root / "cgroup.controllers").exists()


class Cgroup:
    """One VM's cgroup (v2: one directory; v1: one directory per controller). ``create`` then ``join``."""

    def __init__(self, name: str, parent: str = "smol", root: Path = ROOT) -> None:
        if not name or "/" in name or name.startswith("."):
            raise CgroupError(f"bad cgroup name {name!r}")
        self.name, self.parent, self.root = name, parent, root
        self.v2 = unified(root)
        if self.v2:
            self.dirs = {"": root / parent / name}
        else:
            self.dirs = {c: root / c / parent / name for c in ("memory", "cpu", "pids") if (root / c).is_dir()}
            if "memory" not in self.dirs:
                raise CgroupError(f"no cgroup v2 and no v1 memory controller under {root}")

    def create(self, limits: Limits) -> None:
        """Make the cgroup(s) and write the limits; CgroupError if the memory limit cannot be set."""
        if self.v2:
            self._create_v2(limits)
        else:
            self._create_v1(limits)

    def _create_v2(self, limits: Limits) -> None:
        parent = self.root / self.parent
        parent.mkdir(exist_ok=True)
        wanted = ("memory", "cpu", "pids")
        available = (self.root / "cgroup.controllers").read_text().split()
        enable = " ".join(f"+{c}" for c in wanted if c in available)
        if "memory" not in available:
            raise CgroupError("the cgroup v2 root does not offer the memory controller")
        for d in (self.root, parent):
            _write(d / "cgroup.subtree_control", enable)
        d = self.dirs[""]
        d.mkdir(exist_ok=True)
        _write(d / "memory.max", str(limits.memory_bytes))
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
        if (d / "cpu.max").exists():
            _write(d / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        if (d / "pids.max").exists():
            _write(d / "pids.max", str(limits.pids))

    def _create_v1(self, limits: Limits) -> None:
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        mem = self.dirs["memory"]
        _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            with contextlib.suppress(CgroupError):
                _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if "cpu" in self.dirs:
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CPU_PERIOD_US))))
        if "pids" in self.dirs:
            _write(self.dirs["pids"] / "pids.max", str(limits.pids))

    def join(self, pid: int = 0) -> None:
        """Move ``pid`` (0: this process) into the cgroup; its children are born there."""
        for d in self.dirs.values():
            _write(d / "cgroup.procs", str(pid or os.getpid()))

    def memory_limit(self) -> int:
        d = self.dirs["" if self.v2 else "memory"]
        raw = (d / ("memory.max" if self.v2 else "memory.limit_in_bytes")).read_text().strip()
        return -1 if raw == "max" else int(raw)

    def memory_usage(self) -> int:
        """Bytes charged to the cgroup now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``)."""
        d = self.dirs["" if self.v2 else "memory"]
        return int((d / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def set_memory_limit(self, memory_bytes: int) -> None:
        """Change the memory limit of a running cgroup. On v1 the memory+swap limit follows it, in the order
        the kernel accepts (memory.limit_in_bytes may never exceed memory.memsw.limit_in_bytes)."""
        if memory_bytes <= 0:
            raise CgroupError(f"bad memory limit {memory_bytes}")
        if self.v2:
            _write(self.dirs[""] / "memory.max", str(memory_bytes))
            return
        mem = self.dirs["memory"]
        files = [mem / "memory.limit_in_bytes"]
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():   # the kernel has swap accounting
            files.append(memsw)
            if memory_bytes > int(memsw.read_text()):
                files.reverse()
        for f in files:
            _write(f, str(memory_bytes))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer took from this cgroup."""
        path = self.dirs[""] / "memory.events" if self.v2 else self.dirs["memory"] / "memory.oom_control"
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def procs(self) -> list[int]:
        """The user processes in the cgroup. Kernel threads are left out: on hardware KVM with cgroup v2 the
        kernel attaches each VM's worker thread (``kvm-nx-lpage-recovery``, kvm_vm_create_worker_thread) to the
        cgroup of the process that created the VM, where it lives until the VM's fd is closed."""
        out: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError, ValueError):
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return sorted(p for p in out if not _kernel_thread(p))

    def remove(self, timeout: float = 5.0) -> None:
        """Remove the (empty) cgroup directories; a cgroup still holding tasks is retried until ``timeout``."""
        deadline = time.monotonic() + timeout
        for d in self.dirs.values():
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
