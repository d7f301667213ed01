"""A seccomp-BPF system call allowlist for the VMM process, built as a classic BPF program in pure Python.

The filter (``build_filter``) is a flat classic-BPF program over ``struct seccomp_data`` (linux/seccomp.h):

1. ``arch`` must be AUDIT_ARCH_X86_64, else the process is killed (a 32-bit ``int 0x80`` call would
   otherwise be checked against the wrong numbers); x32 numbers (bit 30 set) are killed too.
2. Each allowed system call is one ``jeq nr`` followed by ``ret ALLOW``; calls whose arguments matter
   (``ioctl``, ``socket``, ``clone``, ``prctl``, ``tgkill``, ...) jump into a small block checking them.
3. Anything else gets the default action: SECCOMP_RET_KILL_PROCESS (``mode="on"``) or SECCOMP_RET_LOG
   (``mode="log"``: allowed, but logged by the kernel, for finding what a new code path needs).

A few calls answer an errno instead of killing, on purpose (see ``ERRNO_RULES``): ``clone3`` answers ENOSYS
so glibc falls back to ``clone``, whose flags a filter can see (``clone3`` passes them in memory); an
ioctl whose request is not on the list answers ENOTTY (what a driver answers for an unknown request).

``install`` sets PR_SET_NO_NEW_PRIVS and loads the filter with SECCOMP_FILTER_FLAG_TSYNC, so every
thread of the process (and every thread or child it makes later) is filtered. docs/security.md.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .syscalls import X86_64

# linux/audit.h, linux/seccomp.h, linux/filter.h
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_TRAP = 0x00030000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_LOG = 0x7FFC0000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_GET_ACTION_AVAIL = 2
SECCOMP_FILTER_FLAG_TSYNC = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_NAME, PR_GET_NAME = 15, 16
BPF_LD_W_ABS = 0x20      # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15         # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x35         # BPF_JMP | BPF_JGE | BPF_K
BPF_JSET_K = 0x45        # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06         # BPF_RET | BPF_K
BPF_MAXINSNS = 4096

# struct seccomp_data offsets: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
OFF_NR, OFF_ARCH = 0, 4


def arg_low(i: int) -> int:
    """Offset of the low 32 bits of argument ``i`` (x86-64 is little-endian). Only the low half is checked
    for int arguments: the kernel ignores the upper half of a 32-bit argument's register."""
    return 16 + 8 * i


AF_UNIX = 1
CLONE_THREAD = 0x00010000
FIONBIO, FIOCLEX, FIONCLEX, TCGETS, FIONREAD = 0x5421, 0x5451, 0x5450, 0x5401, 0x541B
# linux/if_tun.h: a virtio-net device may change the tap's offloads when the guest negotiates features.
TUNSETIFF, TUNGETIFF, TUNSETOFFLOAD, TUNSETVNETHDRSZ = 0x400454CA, 0x800454D2, 0x400454D0, 0x400454D8


class SeccompError(Exception):
    """The filter could not be built or installed."""


# The VMM after setup: Python, uvloop/asyncio, threads, vsock/control Unix sockets, snapshot files, KVM_RUN.
# Derived from strace -f -c of a boot + exec + snapshot and a restore + exec (docs/security.md).
VMM_SYSCALLS: tuple[str, ...] = (
    # files and fds (snapshot writing, console log, state files, lazy imports)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "lseek", "close",
    "openat", "open", "newfstatat", "fstat", "stat", "lstat", "statx", "access", "faccessat", "faccessat2",
    "getdents64", "readlink", "readlinkat", "fcntl", "dup", "dup2", "dup3", "pipe2", "fsync", "fdatasync",
    "ftruncate", "fallocate", "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir", "mkdirat",
    "rmdir", "fchmod", "getcwd", "sendfile", "copy_file_range", "fadvise64", "flock", "utimensat", "umask",
    "close_range",
    # memory
    "mmap", "munmap", "mremap", "mprotect", "madvise", "brk", "mincore",
    # event loop, eventfds (ioeventfd/irqfd), polling
    "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd2", "poll", "ppoll",
    "select", "pselect6", "timerfd_create", "timerfd_settime",
    # Unix sockets (vsock backend, control socket); socket() and socketpair() are checked for AF_UNIX below
    "bind", "listen", "accept", "accept4", "connect", "getsockname", "getpeername", "getsockopt",
    "setsockopt", "sendto", "recvfrom", "sendmsg", "recvmsg", "shutdown",
    # threads, signals, time
    "futex", "set_robust_list", "get_robust_list", "rseq", "sched_yield", "sched_getaffinity",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "rt_sigtimedwait", "restart_syscall",
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getrandom", "uname",
    "getrlimit", "prlimit64", "getrusage", "sysinfo", "set_tid_address", "membarrier",
    "exit", "exit_group",
)

# A system call answered with an errno instead of the default action: (name, errno).
ERRNO_RULES: tuple[tuple[str, int], ...] = (
    ("clone3", errno.ENOSYS),  # glibc falls back to clone(2), whose flags are checked below
)


def kvm_ioctls() -> tuple[int, ...]:
    """Every KVM ioctl request the bindings define (smold/kvm/api.py: type 0xAE, computed from struct sizes)."""
    from smold.kvm import api
    out = set()
    for name in dir(api):
        value = getattr(api, name)
        if name.startswith("KVM_") and isinstance(value, int) and (value >> 8) & 0xFF == 0xAE:
            out.add(value & 0xFFFFFFFF)
    return tuple(sorted(out))


def vmm_ioctls() -> tuple[int, ...]:
    """ioctl requests the VMM may make once running: KVM's, tap offloads, and the tty/fd ones Python and
    libuv use (FIONBIO, FIOCLEX, TCGETS for isatty)."""
    return kvm_ioctls() + (FIONBIO, FIOCLEX, FIONCLEX, TCGETS, FIONREAD,
                           TUNSETIFF, TUNGETIFF, TUNSETOFFLOAD, TUNSETVNETHDRSZ)


@dataclass(frozen=True)
class Policy:
    """What the filter allows: plain system calls, ioctl requests, errno answers, and the default action."""

    syscalls: tuple[str, ...] = VMM_SYSCALLS
    ioctls: tuple[int, ...] = ()
    errno_rules: tuple[tuple[str, int], ...] = ERRNO_RULES
    pid: int | None = None   # tgkill/tkill/kill only to this process (the VMM's own threads)
    default: int = SECCOMP_RET_KILL_PROCESS

    @classmethod
    def for_vmm(cls, mode: str = "on", pid: int | None = None) -> Policy:
        if mode not in ("on", "log"):
            raise SeccompError(f"seccomp mode must be 'on' or 'log' (got {mode!r})")
        return cls(ioctls=vmm_ioctls(), pid=os.getpid() if pid is None else pid,
                   default=SECCOMP_RET_KILL_PROCESS if mode == "on" else SECCOMP_RET_LOG)


def _stmt(code: int, k: int) -> tuple[int, int, int, int]:
    return (code, 0, 0, k & 0xFFFFFFFF)


def _jump(code: int, k: int, jt: int, jf: int) -> tuple[int, int, int, int]:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise SeccompError(f"BPF jump out of range ({jt}, {jf})")
    return (code, jt, jf, k & 0xFFFFFFFF)


def _number(name: str) -> int:
    try:
        return X86_64[name]
    except KeyError:
        raise SeccompError(f"unknown x86-64 system call {name!r}") from None


def _block_values(offset: int, values: Iterable[int], then: int, otherwise: int) -> list[tuple[int, int, int, int]]:
    """Load the 32-bit word at ``offset``; ``then`` if it equals one of ``values``, else ``otherwise``."""
    prog = [_stmt(BPF_LD_W_ABS, offset)]
    for v in values:
        prog += [_jump(BPF_JEQ_K, v, 0, 1), _stmt(BPF_RET_K, then)]
    prog.append(_stmt(BPF_RET_K, otherwise))
    return prog


def build_filter(policy: Policy) -> list[tuple[int, int, int, int]]:
    """The BPF program as (code, jt, jf, k) instructions."""
    kill = SECCOMP_RET_KILL_PROCESS
    default = policy.default
    allow = SECCOMP_RET_ALLOW
    prog = [
        _stmt(BPF_LD_W_ABS, OFF_ARCH),
        _jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        _stmt(BPF_RET_K, kill),
        _stmt(BPF_LD_W_ABS, OFF_NR),
        _jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        _stmt(BPF_RET_K, kill),
    ]
    blocks: list[tuple[str, list[tuple[int, int, int, int]]]] = []
    if policy.ioctls:
        blocks.append(("ioctl", _block_values(arg_low(1), policy.ioctls, allow,
                                              SECCOMP_RET_ERRNO | errno.ENOTTY)))
    blocks.append(("socket", _block_values(arg_low(0), (AF_UNIX,), allow, default)))
    blocks.append(("socketpair", _block_values(arg_low(0), (AF_UNIX,), allow, default)))
    # clone: threads only (CLONE_THREAD set); a fork or a new namespace is not a thread.
    blocks.append(("clone", [_stmt(BPF_LD_W_ABS, arg_low(0)), _jump(BPF_JSET_K, CLONE_THREAD, 0, 1),
                             _stmt(BPF_RET_K, allow), _stmt(BPF_RET_K, default)]))
    blocks.append(("prctl", _block_values(arg_low(0), (PR_SET_NAME, PR_GET_NAME), allow,
                                          SECCOMP_RET_ERRNO | errno.EPERM)))
    if policy.pid is not None:
        # Signals only to this process: tgkill(tgid, tid, sig), kill(pid, sig).
        for name in ("tgkill", "kill"):
            blocks.append((name, _block_values(arg_low(0), (policy.pid,), allow, default)))
    for name, err in policy.errno_rules:
        blocks.append((name, [_stmt(BPF_RET_K, SECCOMP_RET_ERRNO | (err & 0xFFFF))]))
    seen: set[str] = set()
    for name, block in blocks:
        seen.add(name)
        prog.append(_jump(BPF_JEQ_K, _number(name), 0, len(block)))
        prog += block
    for name in policy.syscalls:
        if name in seen:
            raise SeccompError(f"{name!r} is both plain and argument-checked")
        seen.add(name)
        prog += [_jump(BPF_JEQ_K, _number(name), 0, 1), _stmt(BPF_RET_K, allow)]
    prog.append(_stmt(BPF_RET_K, default))
    if len(prog) > BPF_MAXINSNS:
        raise SeccompError(f"filter too long: {len(prog)} instructions")
    return prog


def pack(prog: Sequence[tuple[int, int, int, int]]) -> bytes:
    """``struct sock_filter[]``: u16 code, u8 jt, u8 jf, u32 k."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _fail(what: str) -> SeccompError:
    err = ctypes.get_errno()
    return SeccompError(f"{what}: {os.strerror(err)}")


def action_available(action: int) -> bool:
    """Whether the kernel knows a SECCOMP_RET_* action (SECCOMP_GET_ACTION_AVAIL, Linux 4.14)."""
    value = ctypes.c_uint32(action)
    return _libc.syscall(X86_64["seccomp"], SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(value)) == 0


def install(prog: Sequence[tuple[int, int, int, int]]) -> None:
    """Load ``prog`` for every thread of this process (TSYNC) after setting no_new_privs; irreversible."""
    if os.uname().machine != "x86_64":
        raise SeccompError(f"the filter is for x86-64, this host is {os.uname().machine}")
    if not action_available(SECCOMP_RET_KILL_PROCESS):
        raise SeccompError("this kernel lacks SECCOMP_RET_KILL_PROCESS (Linux 4.14+)")
    code = pack(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")
    ret = _libc.syscall(X86_64["seccomp"], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog))
    if ret < 0:
        raise _fail("seccomp(SECCOMP_SET_MODE_FILTER)")
    if ret > 0:
        raise SeccompError(f"seccomp TSYNC: thread {ret} could not be synchronised")


IO_URING_CALLS = ("io_uring_setup", "io_uring_enter", "io_uring_register")


def build_io_uring_filter() -> list[tuple[int, int, int, int]]:
    """A filter answering ENOSYS to io_uring and allowing everything else.

    libuv (under uvloop) batches epoll_ctl through an io_uring whatever UV_USE_IO_URING says; operations
    submitted to a ring are not system calls and no seccomp filter sees them. Installed before the event
    loop exists, it makes libuv fall back to plain epoll_ctl; the VMM filter then kills any io_uring call.
    """
    prog = [_stmt(BPF_LD_W_ABS, OFF_NR)]
    for name in IO_URING_CALLS:
        prog += [_jump(BPF_JEQ_K, _number(name), 0, 1), _stmt(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    prog.append(_stmt(BPF_RET_K, SECCOMP_RET_ALLOW))
    return prog


def install_early(mode: str) -> None:
    """Before the event loop is created: refuse io_uring (see ``build_io_uring_filter``); nothing for off."""
    if mode != "off":
        install(build_io_uring_filter())


def install_vmm_filter(mode: str) -> int:
    """Install the VMM's filter (``mode`` on or log); ``off`` installs nothing. Returns the instruction count."""
    if mode == "off":
        return 0
    prog = build_filter(Policy.for_vmm(mode))
    install(prog)
    return len(prog)


def filter_mode(pid: int | str = "self") -> int:
    """A process's seccomp mode (0 none, 1 strict, 2 filter): the ``Seccomp:`` line of /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Seccomp:"):
                return int(line.split()[1])
    raise SeccompError(f"/proc/{pid}/status has no Seccomp line")
