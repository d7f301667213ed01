"""How a VM process is started, how its readiness is seen and how its guest agent is reached (the VMM launcher).

A Launcher is the one place that knows what a "VM process" is. The controller asks it for the command
line (``command``), starts that in its own session (``spawn``), waits for ``ready.json`` in the machine's
state directory (``wait_ready``), reaches the guest agent through ``connect`` and asks the VM process for a
snapshot through its control socket (``snapshot``). Restoring a checkpoint instead of a cold boot
(``LaunchSpec.restore_from``) only changes ``VmmLauncher.command``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smold.agent import AgentClient, connect_vsock_uds
from smold.authrecord import RecordAuthError, read_unverified

from .errors import LaunchError
from .images import Image
from .process import ChildProcess

log = logging.getLogger("smold.launcher")

READY_FILE = "ready.json"   # written by the VM process once its guest agent answers (removed at exit)
EXIT_FILE = "exit.json"     # written by the VMM when it ends: {kind, detail, error, exit_code}
CONSOLE_FILE = "console.log"
CONTROL_FILE = "control.sock"  # the VMM's control socket (smold/vmm/control.py)
VSOCK_FILE = "vsock.sock"      # the VMM's vsock Unix socket in its state dir (smold/vmm/machine.py)
AGENT_VSOCK_PORT = 1024        # the guest agent's vsock port (smold/vmm/runner.py)
LOG_FILE = "vmm.log"        # the VM process's stdout and stderr
NO_SPACE_ERRNOS = ("ENOSPC", "EDQUOT")   # control-socket "errno" values meaning the disk is full
READY_POLL_S = 0.05


# `python -m` puts its working directory first on sys.path, and a VM process starts in its state directory,
# which the VMM (and, through it, a hostile guest's exploit) can write: -P (Python 3.11's safe_path) leaves it
# out, so neither the root jailer nor the VMM can import a module planted there (issue #19, finding 8).
SAFE_PATH = ("-P",)


@dataclass(frozen=True)
class LaunchSpec:
    """What to start: one machine's VM with its image, size and state directory."""

    machine_id: str
    state_dir: Path
    image: Image
    cpus: int
    memory_mib: int
    hostname: str
    boot_timeout: float
    restore_from: Path | None = None  # a snapshot directory to restore (new identity) instead of booting
    net_args: tuple[str, ...] = ()    # the VMM's --net-* flags (docs/networking.md); () = no NIC
    netns_prefix: tuple[str, ...] = ()  # runs the VM process in its network namespace (not part of argv)


class Launcher(abc.ABC):
    """Starts VM processes and connects to their guest agents."""

    kind: str = "abstract"

    @abc.abstractmethod
    def command(self, spec: LaunchSpec) -> list[str]:
        """The VM process's argv (also what a restarted daemon compares /proc/PID/cmdline against)."""

    async def spawn(self, spec: LaunchSpec) -> ChildProcess:
        """Start the VM process in its own session, output to ``vmm.log``; returns at once."""
        argv = self.command(spec)
        run_argv = [*spec.netns_prefix, *argv]  # nsenter execs argv: /proc/PID/cmdline is argv itself
        log = os.open(spec.state_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        try:
            popen = subprocess.Popen(run_argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=spec.state_dir,
                                     start_new_session=True, env=self.environment(), close_fds=True)
        except OSError as e:
            raise LaunchError(f"cannot start the VM process {argv[0]}: {e}") from e
        finally:
            os.close(log)
        return ChildProcess(popen, argv)

    def environment(self) -> dict[str, str]:
        """The VM process's environment (the daemon's, without the systemd notification socket)."""
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        return env

    async def wait_ready(self, spec: LaunchSpec, proc: ChildProcess) -> dict[str, Any]:
        """Poll for ``ready.json`` until it holds a JSON object; the caller bounds this with a deadline
        and races it against the process's exit."""
        path = spec.state_dir / READY_FILE
        while True:
            info = read_ready(path)
            if info is not None:
                return info
            await asyncio.sleep(READY_POLL_S)

    async def snapshot(self, state_dir: Path, directory: Path, timeout: float = 300.0, *,
                       digest: bool = False) -> dict[str, Any]:
        """Have the VM process write a snapshot of its running VM into ``directory`` (absolute) and resume;
        ``digest``: record the memory file's sha256 in the state. Returns the control socket's ``snapshot``
        reply. LaunchError when it cannot."""
        from smold.vmm.control import ControlError, control_request  # the VMM package only when needed

        sock = state_dir / CONTROL_FILE
        if not sock.exists():
            raise LaunchError(f"the VM process has no control socket ({sock})")
        try:
            reply = await control_request(sock, {"op": "snapshot", "dir": str(directory), "resume": True,
                                                 "digest": digest},
                                          timeout=timeout, owner=self.vmm_ids(state_dir)[0])
        except (ControlError, OSError, ValueError, TimeoutError) as e:
            raise LaunchError(f"control socket {sock}: {e or type(e).__name__}") from None
        if not reply.get("ok"):
            raise LaunchError(f"the VMM refused the snapshot: {reply.get('error')}",
                              no_space=reply.get("errno") in NO_SPACE_ERRNOS)
        info = reply.get("snapshot")
        return info if isinstance(info, dict) else {}

    def vmm_ids(self, state_dir: Path) -> tuple[int, int]:
        """The uid and gid the VM process of the machine in ``state_dir`` runs as: the sockets it makes there
        must be that uid's, and its tap is handed to them (the daemon's own here)."""
        return os.geteuid(), os.getegid()

    def assign_vmm_ids(self, state_dir: Path) -> tuple[int, int]:
        """``vmm_ids`` for a new machine, assigning them first where the launcher gives each VM its own."""
        return self.vmm_ids(state_dir)

    @abc.abstractmethod
    async def connect(self, state_dir: Path, ready: dict[str, Any], timeout: float = 10.0) -> AgentClient:
        """A new connection to the machine's guest agent (HELLO done)."""

    def cleanup(self, machine_id: str) -> None:
        """Remove what the VM process's launch left on the host outside its state directory, once the
        process is gone (nothing here; the jail: its cgroup and mount point)."""

    def leftovers(self, machine_id: str) -> list[str]:
        """What ``cleanup`` should have removed and still exists."""
        return []


def read_ready(path: Path) -> dict[str, Any] | None:
    """The ready file's JSON object, or None while it is missing or incomplete. The VM process wrote it: read
    without following a link, at most 4 MiB (smold/authrecord.py), its values never trusted as paths."""
    try:
        return read_unverified(path)
    except RecordAuthError:
        return None


@dataclass(frozen=True)
class JailOptions:
    """How VmmLauncher jails each VMM (``python -m smold.jail``, smold/jail/jailer.py; docs/security.md)."""

    uid: int = 64000                         # each VM gets its own uid and gid: the first free of JAIL_IDS from these
    gid: int = 64000
    base: Path = Path("/run/smol-jail")      # jail roots: BASE/<machine id>
    memory_overhead_mib: int = 256           # cgroup memory.max = guest RAM + this (the VMM's own memory)
    cgroup_parent: str = "smol"


JAIL_IDS = 1024   # uids (and gids) per daemon for its jailed VMs: --jail-uid .. --jail-uid + 1023, one per machine


class JailIdsExhaustedError(LaunchError):
    """Every uid of the jail's range belongs to a live machine."""


VMM_ENVIRONMENT = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
SNAPSHOT_OUT = "snapshot.out"   # a jailed VMM writes snapshots here (its state dir), the daemon moves them


class VmmLauncher(Launcher):
    """One ``python -m smold.vmm`` process per VM, cold-booting the image or restoring a snapshot
    (smold/vmm/__main__.py); with ``jail``, each inside its jail (``python -m smold.jail ... -- VMM``)."""

    kind = "vmm"

    def __init__(self, python: str = sys.executable, seccomp: str = "on", jail: JailOptions | None = None) -> None:
        self.python = python
        self.seccomp = seccomp   # the VMM's system call filter: on, log or off (smold/jail/seccomp.py)
        self.jail = jail

    def vmm_ids(self, state_dir: Path) -> tuple[int, int]:
        """Jailed: the machine's own uid and gid (``assign_vmm_ids``), read from its state directory's owner,
        which only root can change: a restarted daemon finds them there too."""
        if self.jail is None:
            return super().vmm_ids(state_dir)
        j = self.jail
        st = state_dir.lstat()
        if j.uid <= st.st_uid < j.uid + JAIL_IDS and st.st_gid == j.gid + (st.st_uid - j.uid):
            return st.st_uid, st.st_gid
        if st.st_uid == os.geteuid():   # not assigned yet (or a machine of an unjailed daemon): root's
            return st.st_uid, st.st_gid
        raise LaunchError(f"{state_dir} is owned by uid {st.st_uid}, neither the daemon's nor one of its jail's")

    def assign_vmm_ids(self, state_dir: Path) -> tuple[int, int]:
        """Jailed: a uid and gid of the machine's own, so that one VMM a guest took over cannot signal, trace or
        write another's files (#19 finding 5): the lowest pair of the range (``JAIL_IDS`` from --jail-uid and
        --jail-gid) that no other machine directory is owned by; the state directory is chowned to it with no
        await in between (the daemon's event loop makes the choice atomic)."""
        if self.jail is None:
            return super().assign_vmm_ids(state_dir)
        j = self.jail
        ids = self.vmm_ids(state_dir)
        if ids[0] != os.geteuid():
            return ids
        taken = _process_uids()   # a destroyed machine's VMM that outlived its directory keeps its uid
        with contextlib.suppress(OSError):
            for d in state_dir.parent.iterdir():
                with contextlib.suppress(OSError):
                    taken.add(d.lstat().st_uid)
        for slot in range(JAIL_IDS):
            if j.uid + slot not in taken:
                os.chown(state_dir, j.uid + slot, j.gid + slot, follow_symlinks=False)
                return j.uid + slot, j.gid + slot
        raise JailIdsExhaustedError(f"all {JAIL_IDS} jail uids from {j.uid} are in use by live machines")

    def command(self, spec: LaunchSpec) -> list[str]:
        argv = self.vmm_command(spec)
        if self.jail is None:
            return argv
        j = self.jail
        uid, gid = self.assign_vmm_ids(spec.state_dir)
        paths = [spec.image.kernel, spec.image.initramfs, spec.image.rootfs]
        if spec.restore_from is not None:
            paths.append(spec.restore_from)
        ro = [a for p in paths for a in ("--ro", str(Path(p).absolute()))]
        return [self.python, *SAFE_PATH, "-m", "smold.jail", "--name", spec.machine_id, "--uid", str(uid), "--gid", str(gid),
                "--state-dir", str(spec.state_dir), "--jail-base", str(j.base), *ro,
                "--memory-bytes", str((spec.memory_mib + j.memory_overhead_mib) << 20), "--cpus", str(spec.cpus),
                "--cgroup-parent", j.cgroup_parent, *(["--keep-netns"] if spec.netns_prefix else []), "--", *argv]

    def _jail_paths(self, machine_id: str) -> list[Path]:
        if self.jail is None:
            return []
        from smold.jail.cgroup import Cgroup, CgroupError  # the jail package only when jailing
        try:
            dirs = list(Cgroup(machine_id, self.jail.cgroup_parent).dirs.values())
        except CgroupError:
            dirs = []
        return [*dirs, self.jail.base / machine_id]

    def cleanup(self, machine_id: str) -> None:
        """A jailer that ended normally removed its cgroup and mount point; one killed by SIGKILL (a destroy
        that had to escalate) could not. Both are empty directories once the VMM is gone."""
        for d in self._jail_paths(machine_id):
            with contextlib.suppress(FileNotFoundError):
                try:
                    d.rmdir()
                except OSError as e:
                    log.warning("machine %s: cannot remove %s: %s", machine_id, d, e.strerror or e)

    def leftovers(self, machine_id: str) -> list[str]:
        return [f"{d} still exists" for d in self._jail_paths(machine_id) if d.exists()]

    async def snapshot(self, state_dir: Path, directory: Path, timeout: float = 300.0, *,
                       digest: bool = False) -> dict[str, Any]:
        if self.jail is None:
            return await super().snapshot(state_dir, directory, timeout, digest=digest)
        # The jail shows the VMM only its state dir: it writes there, the daemon moves the result into place
        # (a rename under the daemon's state directory; a copy into a --bakes-dir on another filesystem).
        out = state_dir / SNAPSHOT_OUT
        await asyncio.to_thread(shutil.rmtree, out, True)
        info = await super().snapshot(state_dir, out, timeout, digest=digest)
        staging = state_dir.parent / f".snapshot-{state_dir.name}-{os.urandom(4).hex()}"
        try:
            await asyncio.to_thread(_take_snapshot, out, staging, self.vmm_ids(state_dir)[0])
        except OSError as e:
            raise LaunchError(f"the VM process's snapshot is refused: {e.strerror or e}") from None
        try:
            await asyncio.to_thread(shutil.move, staging, directory)
        except OSError as e:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            raise LaunchError(f"cannot move the snapshot into {directory}: {e}") from None
        info["directory"] = str(directory)
        return info

    def environment(self) -> dict[str, str]:
        """The VMM's environment: a fixed minimum, never the daemon's own (which may hold a registry password
        or a cloud key the VMM, the process a guest attacks, has no use for; #19 finding 5). The VMM reads no
        variable; PYTHONPATH is kept only so that a daemon run from a source tree finds its package."""
        env = dict(VMM_ENVIRONMENT)
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def vmm_command(self, spec: LaunchSpec) -> list[str]:
        """The VMM's own argv (``command`` without the jail)."""
        d = spec.state_dir
        if spec.restore_from is not None:  # vCPUs, memory, kernel and disk come from the snapshot
            return [
                self.python, *SAFE_PATH, "-m", "smold.vmm",
                "--restore", str(spec.restore_from),
                "--state-dir", str(d),
                "--console-log", str(d / CONSOLE_FILE),
                "--boot-timeout", f"{spec.boot_timeout:g}",
                "--hostname", spec.hostname,
                "--seccomp", self.seccomp,
                "--new-identity",
                *spec.net_args,
            ]
        return [
            self.python, *SAFE_PATH, "-m", "smold.vmm",
            "--kernel", str(spec.image.kernel),
            "--initramfs", str(spec.image.initramfs),
            "--rootfs", str(spec.image.rootfs),
            "--cpus", str(spec.cpus),
            "--memory", str(spec.memory_mib),
            "--state-dir", str(d),
            "--console-log", str(d / CONSOLE_FILE),
            "--boot-timeout", f"{spec.boot_timeout:g}",
            "--hostname", spec.hostname,
            "--seccomp", self.seccomp,
            *spec.net_args,
        ]

    async def connect(self, state_dir: Path, ready: dict[str, Any], timeout: float = 10.0) -> AgentClient:
        # ready.json is the VM process's (a jailed VMM can write it): its vsock_path and agent_port are never
        # used. The daemon connects to the one fixed path, only to a socket the VM process's uid made there.
        return await connect_vsock_uds(str(state_dir / VSOCK_FILE), AGENT_VSOCK_PORT, timeout=timeout,
                                       owner=self.vmm_ids(state_dir)[0])


def _process_uids() -> set[int]:
    """The uids of every process on the host (the owners of /proc's PID directories)."""
    uids = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    uids.add(entry.stat(follow_symlinks=False).st_uid)
    return uids


SNAPSHOT_NAMES = frozenset({"snapshot.state", "memory.raw"})   # smold/snapshot/store.py: all a snapshot holds


def _take_snapshot(out: Path, staging: Path, owner: int) -> None:
    """Take the snapshot a jailed VMM wrote at ``out`` (in its state directory) out of its reach, into
    ``staging`` (root's path on the same filesystem), and check that it is what a snapshot is: a real directory
    holding only the snapshot's own files, each a plain file with one link. A link, FIFO or device planted there
    would be followed by root later (a copy into another filesystem, a restore outside the jail), a hard link
    would tie it to another file, a file of another name (say checkpoint.json, kept open) would let the VMM
    write what the daemon reads back. Everything is done through descriptors opened without following links:
    each must be the VMM's (``owner``) with one link before anything is changed (so no other file is ever
    touched, whatever protected_hardlinks says), then becomes root's, mode 0755 and 0644, and is checked again,
    so a VMM that kept a descriptor of either can add, link or rename nothing after. OSError says what was
    wrong; whatever was renamed into ``staging`` is removed then."""
    os.rename(out, staging)   # whatever it is now: a symlink is renamed as itself, never followed
    try:
        try:
            dfd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise OSError(f"{out.name} is not a directory") from None
        try:
            if os.fstat(dfd).st_uid != owner:
                raise OSError(f"{out.name} is not the VM process's")
            os.fchown(dfd, 0, 0)
            os.fchmod(dfd, 0o755)
            for name in os.listdir(dfd):
                if name not in SNAPSHOT_NAMES:
                    raise OSError(f"{name} is not a file a snapshot holds")
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    raise OSError(f"{name} is not a plain file") from None
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise OSError(f"{name} is not a plain file")
                    if st.st_uid != owner or st.st_nlink != 1:
                        raise OSError(f"{name} is not the VM process's own file with one link")
                    os.fchown(fd, 0, 0)
                    os.fchmod(fd, 0o644)
                    if os.fstat(fd).st_nlink != 1:   # linked while it was still the VMM's
                        raise OSError(f"{name} was linked elsewhere")
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
    except OSError:
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                staging.unlink()
        raise


def load_launcher(name: str, seccomp: str = "on", jail: JailOptions | None = None) -> Launcher:
    """``vmm``, or ``module:attribute`` naming a Launcher subclass or a factory returning one (tests)."""
    if name == "vmm":
        return VmmLauncher(seccomp=seccomp, jail=jail)
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--launcher must be 'vmm' or 'module:attribute' (got {name!r})")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--launcher {name!r}: {e}") from None
    if not callable(factory):
        raise ValueError(f"--launcher {name!r} did not give a Launcher (got {type(factory).__name__})")
    launcher = factory()
    if not isinstance(launcher, Launcher):
        raise ValueError(f"--launcher {name!r} did not give a Launcher (got {type(launcher).__name__})")
    return launcher
