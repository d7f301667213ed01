"""The VMM jail: cgroup, new mount/PID/IPC/UTS namespaces, a pivot_root into a per-VM tmpfs, rlimits, an
unprivileged uid, no_new_privs, then exec of the VMM (Firecracker's jailer is the model; docs/security.md).

``run_jailed`` is the jailer process (root). It creates and joins the VM's cgroup, unshares the namespaces
and forks: the child becomes PID 1 of the new PID namespace, builds the jail root and execs the VMM; the
parent stays outside, forwards SIGTERM/SIGINT/SIGHUP, waits, reports an OOM kill in ``exit.json`` (the VMM
cannot: it was SIGKILLed), removes the cgroup and exits with the VMM's status.

Inside the jail the VMM sees only: a read-only tmpfs root; read-only binds of /usr (and the /bin, /lib
links), the Python interpreter, its virtualenv and the import path; the VM's kernel, initramfs, root disk
and snapshot (read-only unless asked); its state directory (read-write); /dev/{kvm,net/tun,null,urandom}
(fresh device nodes: /dev/kvm and the tun node owned by the VM's uid); a fresh /proc of its own PID
namespace; an empty /tmp. It also gets a new, empty network namespace (only lo, down) unless
``keep_netns``: a networked VM is started inside its machine's namespace (smold/net), which it keeps.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .cgroup import Cgroup, CgroupError, Limits

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x04000000, 0x08000000, 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = 155
EXIT_FILE = "exit.json"
DEVICES = ("/dev/kvm", "/dev/net/tun", "/dev/null", "/dev/urandom")
OWNED_DEVICES = ("/dev/kvm", "/dev/net/tun")     # the VMM opens these: owned by its uid, mode 0600
IMPORTED_PACKAGES = ("smold", "smol_agent")   # what the VMM imports from this project
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class JailError(Exception):
    """The jail could not be set up."""


@dataclass(frozen=True)
class JailSpec:
    """One VM's jail: who it runs as, what it sees, what it may use."""

    name: str                      # the machine id: cgroup and jail directory name
    uid: int
    gid: int
    state_dir: Path                # bound read-write, owned by uid
    jail_base: Path                # the jail root is jail_base/name (a tmpfs mount point)
    read_only: tuple[Path, ...] = ()      # kernel, initramfs, root disk, snapshot directory
    read_write: tuple[Path, ...] = ()     # e.g. a writable root disk
    limits: Limits | None = None   # None: no cgroup
    cgroup_parent: str = "smol"
    nofile: int = 4096
    nproc: int = 4096
    hostname: str = "smol-vmm"
    keep_netns: bool = False       # True: stay in the caller's network namespace (the machine's, with its tap)
    extra_env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.uid == 0 or self.gid == 0:
            raise JailError("the jail's uid and gid must not be 0")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise JailError(f"bad jail name {self.name!r}")
        for p in (self.state_dir, self.jail_base, *self.read_only, *self.read_write):
            if not p.is_absolute():
                raise JailError(f"jail paths must be absolute: {p}")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str | Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, os.fsencode(target),
                       fstype.encode() if fstype else None, flags, data.encode() if data else None),
           f"mount {source} on {target}")


def python_paths() -> list[Path]:
    """What the interpreter needs to start and import smold: its prefixes and every import path directory."""
    paths = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.exec_prefix), Path(sys.executable).parent]
    paths += [Path(p) for p in sys.path if p and os.path.isabs(p)]
    for name in IMPORTED_PACKAGES:   # an editable install finds these through a meta path finder, not sys.path
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            paths.append(Path(spec.origin).parent.parent)
    return [p for p in paths if p.is_dir()]


def minimal(paths: Iterable[Path]) -> list[Path]:
    """Resolved, deduplicated, without paths inside another one of the list."""
    out: list[Path] = []
    for p in sorted({Path(os.path.realpath(p)) for p in paths}, key=lambda x: len(x.parts)):
        if not any(p == q or q in p.parents for q in out):
            out.append(p)
    return out


def _make_target(target: Path, source: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        target.mkdir(exist_ok=True)
    elif not target.exists():
        target.touch()


def bind(root: Path, source: Path, *, writable: bool) -> None:
    """Bind ``source`` at the same path under ``root``; read-only, nosuid, nodev unless ``writable``."""
    target = root / str(source).lstrip("/")
    _make_target(target, source)
    mount(str(source), target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def make_devices(root: Path, uid: int, gid: int) -> None:
    for dev in DEVICES:
        try:
            st = os.stat(dev)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            continue
        node = root / dev.lstrip("/")
        node.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(node, stat.S_IFCHR | 0o600, st.st_rdev)
        if dev in OWNED_DEVICES:
            os.chown(node, uid, gid)
        else:
            os.chmod(node, 0o666)


def build_root(spec: JailSpec, root: Path) -> None:
    """Populate the jail's tmpfs (this process is in the new mount and PID namespaces)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)          # nothing we mount propagates back to the host
    root.mkdir(parents=True, exist_ok=True)
    mount("tmpfs", root, "tmpfs", MS_NOSUID, "mode=0755,size=16m")
    (root / "proc").mkdir()
    mount("proc", root / "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    (root / "tmp").mkdir()   # before the binds: a state directory may live under /tmp (tests)
    mount("tmpfs", root / "tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size=16m,uid={spec.uid}")
    for link in SYSTEM_LINKS:
        p = Path(link)
        if p.is_symlink():
            (root / link.lstrip("/")).symlink_to(os.readlink(p))
        elif p.is_dir():
            bind(root, p, writable=False)
    ro = [Path("/usr"), *python_paths(), *spec.read_only]
    for extra in ("/etc/ld.so.cache", "/etc/localtime", "/sys/module/kvm_pvm"):
        if os.path.exists(extra):
            ro.append(Path(extra))
    rw = minimal([spec.state_dir, *spec.read_write])
    for p in minimal(ro):
        if not any(p == q or q in p.parents for q in rw):
            bind(root, p, writable=False)
    for p in rw:
        bind(root, p, writable=True)
    make_devices(root, spec.uid, spec.gid)


def pivot_into(root: Path) -> None:
    """pivot_root(2) into ``root``, detach the old root, make / read-only."""
    os.chdir(root)
    old = root / ".old-root"
    old.mkdir()
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b".old-root"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount the old root")
    os.rmdir("/.old-root")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def drop_privileges(spec: JailSpec) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec.nofile, spec.nofile))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec.nproc, spec.nproc))
    os.setgroups([])
    os.setresgid(spec.gid, spec.gid, spec.gid)
    os.setresuid(spec.uid, spec.uid, spec.uid)
    if os.getuid() != spec.uid or os.geteuid() != spec.uid:
        raise JailError("could not drop to the jail's uid")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _child(spec: JailSpec, argv: Sequence[str], env: dict[str, str]) -> None:
    """PID 1 of the new namespace: build the jail, drop privileges, exec the VMM. Never returns."""
    try:
        # The mount namespace is the child's alone: pivot_root moves every process of the namespace.
        flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (0 if spec.keep_netns else CLONE_NEWNET)
        _check(_libc.unshare(flags), "unshare")
        socket.sethostname(spec.hostname)
        root = spec.jail_base / spec.name
        build_root(spec, root)
        pivot_into(root)
        drop_privileges(spec)
        os.chdir(spec.state_dir)
        os.execve(argv[0], list(argv), env)
    except BaseException as e:  # noqa: BLE001 - report anything, then leave without running the VMM
        with contextlib.suppress(OSError):
            os.write(2, f"smol-jail: {type(e).__name__}: {e}\n".encode())
        os._exit(126)


def _write_oom_exit(state_dir: Path, limit: int) -> None:
    text = json.dumps({"kind": "error", "detail": "out of memory",
                       "error": f"the VMM was killed by the kernel's OOM killer: it exceeded its cgroup memory "
                                f"limit of {limit // (1024 * 1024)} MiB",
                       "exit_code": 137, "timings": {}}, sort_keys=True)
    tmp = state_dir / f".{EXIT_FILE}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, state_dir / EXIT_FILE)


def run_jailed(spec: JailSpec, argv: Sequence[str]) -> int:
    """Jail and run ``argv`` (the VMM command line); returns the exit status to exit with."""
    spec.validate()
    if os.geteuid() != 0:
        raise JailError("the jailer must run as root")
    env = {**os.environ, **spec.extra_env}
    os.chown(spec.state_dir, spec.uid, spec.gid)
    for p in spec.read_write:
        os.chown(p, spec.uid, spec.gid)
    cgroup = None
    if spec.limits is not None:
        cgroup = Cgroup(spec.name, spec.cgroup_parent)
        try:
            cgroup.create(spec.limits)
        except (CgroupError, OSError) as e:
            cgroup.remove(0)
            raise JailError(f"cgroup: {e}") from None
    try:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")   # for the child only
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            if os.read(go_r, 1) != b"1":   # wait until the jailer put us in the cgroup
                os._exit(126)
            os.close(go_r)
            _child(spec, argv, env)
        os.close(go_r)
        try:
            if cgroup is not None:
                cgroup.join(pid)          # only the VMM is in the cgroup: the OOM killer can take only it
            os.write(go_w, b"1")
        except (CgroupError, OSError) as e:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise JailError(f"cgroup: {e}") from None
        finally:
            os.close(go_w)
        forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        for sig in forwarded:
            signal.signal(sig, lambda s, _f: os.kill(pid, s))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if cgroup is not None and code == -signal.SIGKILL and cgroup.oom_kills() > 0:
            _write_oom_exit(spec.state_dir, cgroup.memory_limit())
        return 128 - code if code < 0 else code
    finally:
        with contextlib.suppress(OSError):
            (spec.jail_base / spec.name).rmdir()   # the tmpfs went with the namespace; the mount point stays
        if cgroup is not None:
            cgroup.remove()
