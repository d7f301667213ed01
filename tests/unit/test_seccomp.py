"""The VMM's seccomp filter: its BPF program evaluated here, and installed in forked children that are
killed by SIGSYS for a forbidden system call and keep working for allowed ones."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from smold.jail import seccomp as sc
from smold.jail.syscalls import X86_64
from smold.kvm import api

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


# -- the program, evaluated by a classic-BPF interpreter for the instructions the builder emits ----------
def run_bpf(prog: list[tuple[int, int, int, int]], nr: int, args: tuple[int, ...] = (),
            arch: int = sc.AUDIT_ARCH_X86_64) -> int:
    full = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, 0, *full)
    pc, acc = 0, 0
    for _ in range(len(prog) + 1):
        code, jt, jf, k = prog[pc]
        if code == sc.BPF_LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == sc.BPF_RET_K:
            return k
        elif code in (sc.BPF_JEQ_K, sc.BPF_JGE_K, sc.BPF_JSET_K):
            hit = {sc.BPF_JEQ_K: acc == k, sc.BPF_JGE_K: acc >= k, sc.BPF_JSET_K: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
    raise AssertionError("program did not return")


@pytest.fixture(scope="module")
def prog() -> list[tuple[int, int, int, int]]:
    return sc.build_filter(sc.Policy.for_vmm("on", pid=4242))


def test_allowed_calls_are_allowed(prog: list[tuple[int, int, int, int]]) -> None:
    for name in ("read", "write", "futex", "epoll_wait", "mmap", "openat", "exit_group", "eventfd2"):
        assert run_bpf(prog, X86_64[name]) == sc.SECCOMP_RET_ALLOW, name


def test_unlisted_calls_kill(prog: list[tuple[int, int, int, int]]) -> None:
    for name in ("execve", "execveat", "ptrace", "mount", "umount2", "pivot_root", "unshare", "setns",
                 "init_module", "kexec_load", "bpf", "perf_event_open", "process_vm_writev", "fork", "vfork",
                 "chroot", "setuid", "keyctl", "userfaultfd", "io_uring_setup"):
        assert run_bpf(prog, X86_64[name]) == sc.SECCOMP_RET_KILL_PROCESS, name


def test_wrong_arch_and_x32_kill(prog: list[tuple[int, int, int, int]]) -> None:
    assert run_bpf(prog, X86_64["read"], arch=0x40000003) == sc.SECCOMP_RET_KILL_PROCESS   # i386
    assert run_bpf(prog, X86_64["read"] | sc.X32_SYSCALL_BIT) == sc.SECCOMP_RET_KILL_PROCESS


def test_ioctl_only_kvm_and_listed_requests(prog: list[tuple[int, int, int, int]]) -> None:
    nr = X86_64["ioctl"]
    for req in (api.KVM_RUN, api.KVM_GET_REGS, api.KVM_SET_MSRS, api.KVM_IRQ_LINE, sc.FIONBIO):
        assert run_bpf(prog, nr, (5, req)) == sc.SECCOMP_RET_ALLOW, hex(req)
    assert run_bpf(prog, nr, (5, 0x5412)) == sc.SECCOMP_RET_ERRNO | errno.ENOTTY   # TIOCSTI
    assert run_bpf(prog, nr, (5, 0xAEFF)) == sc.SECCOMP_RET_ERRNO | errno.ENOTTY   # not a KVM ioctl we use


def test_socket_only_unix(prog: list[tuple[int, int, int, int]]) -> None:
    for name in ("socket", "socketpair"):
        assert run_bpf(prog, X86_64[name], (socket.AF_UNIX, socket.SOCK_STREAM)) == sc.SECCOMP_RET_ALLOW
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
            assert run_bpf(prog, X86_64[name], (family, socket.SOCK_STREAM)) == sc.SECCOMP_RET_KILL_PROCESS


def test_clone_threads_only(prog: list[tuple[int, int, int, int]]) -> None:
    thread_flags = 0x3D0F00    # what glibc's pthread_create passes (CLONE_VM|CLONE_FS|...|CLONE_THREAD|...)
    assert run_bpf(prog, X86_64["clone"], (thread_flags,)) == sc.SECCOMP_RET_ALLOW
    assert run_bpf(prog, X86_64["clone"], (signal.SIGCHLD,)) == sc.SECCOMP_RET_KILL_PROCESS   # fork
    assert run_bpf(prog, X86_64["clone3"], (0, 88)) == sc.SECCOMP_RET_ERRNO | errno.ENOSYS


def test_signals_only_to_itself(prog: list[tuple[int, int, int, int]]) -> None:
    assert run_bpf(prog, X86_64["tgkill"], (4242, 4243, signal.SIGUSR1)) == sc.SECCOMP_RET_ALLOW
    assert run_bpf(prog, X86_64["tgkill"], (1, 1, signal.SIGKILL)) == sc.SECCOMP_RET_KILL_PROCESS
    assert run_bpf(prog, X86_64["kill"], (1, signal.SIGKILL)) == sc.SECCOMP_RET_KILL_PROCESS


def test_prctl_names_only(prog: list[tuple[int, int, int, int]]) -> None:
    assert run_bpf(prog, X86_64["prctl"], (sc.PR_SET_NAME,)) == sc.SECCOMP_RET_ALLOW
    assert run_bpf(prog, X86_64["prctl"], (sc.PR_SET_NO_NEW_PRIVS,)) == sc.SECCOMP_RET_ERRNO | errno.EPERM


def test_log_mode_logs_instead_of_killing() -> None:
    prog = sc.build_filter(sc.Policy.for_vmm("log", pid=1))
    assert run_bpf(prog, X86_64["execve"]) == sc.SECCOMP_RET_LOG
    assert run_bpf(prog, X86_64["read"], arch=0x40000003) == sc.SECCOMP_RET_KILL_PROCESS


def test_bad_policy_is_refused() -> None:
    with pytest.raises(sc.SeccompError):
        sc.Policy.for_vmm("maybe")
    with pytest.raises(sc.SeccompError):
        sc.build_filter(sc.Policy(syscalls=("read", "no_such_call")))
    with pytest.raises(sc.SeccompError):
        sc.build_filter(sc.Policy(syscalls=("ioctl",), ioctls=(1,)))


def test_kvm_ioctls_cover_the_bindings() -> None:
    reqs = sc.kvm_ioctls()
    assert api.KVM_RUN in reqs and api.KVM_CREATE_VM in reqs and api.KVM_SET_USER_MEMORY_REGION in reqs
    assert all((r >> 8) & 0xFF == 0xAE for r in reqs)
    assert api.KVM_CAP_IOEVENTFD not in reqs     # capability numbers are not requests


def test_syscall_table_matches_the_kernel_header() -> None:
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip("no asm/unistd_64.h (linux-libc-dev) on this host")
    found = dict(re.findall(r"#define __NR_(\w+) (\d+)", header.read_text()))
    for name, nr in X86_64.items():
        if name in found:
            assert int(found[name]) == nr, name
    for name in ("read", "ioctl", "clone", "clone3", "execve", "seccomp", "tgkill"):
        assert X86_64[name] == int(found[name])


# -- installed for real, in forked children -------------------------------------------------------------
def in_filtered_child(body: Callable[[], int], mode: str = "on") -> int:
    """Fork; the child installs the VMM filter and runs ``body``; returns the child's wait status."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            sc.install_vmm_filter(mode)
            code = body()
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 71
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def killed_by_sigsys(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS


def raw_syscall(name: str, *args: int) -> int:
    return int(_libc.syscall(X86_64[name], *[ctypes.c_long(a) for a in args]))


def test_allowed_calls_work_under_the_filter(tmp_path: Path) -> None:
    def body() -> int:
        assert sc.filter_mode() == 2
        (tmp_path / "f").write_bytes(b"x" * 10)
        os.rename(tmp_path / "f", tmp_path / "g")
        assert (tmp_path / "g").read_bytes() == b"x" * 10
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(os.getpid()))
        t.start()
        t.join()
        a, b = socket.socketpair(socket.AF_UNIX)
        a.sendall(b"ping")
        assert b.recv(4) == b"ping"
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(str(tmp_path / "s.sock"))
        srv.listen()
        r, w = os.pipe()
        os.write(w, b"ok")
        assert os.read(r, 2) == b"ok"
        assert len(os.urandom(16)) == 16
        return 0 if out == [os.getpid()] else 3
    status = in_filtered_child(body)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.mark.parametrize("call", [
    "ptrace", "mount", "socket_inet", "execve", "fork", "unshare", "kill_other",
])
def test_forbidden_call_is_killed_by_sigsys(call: str) -> None:
    def body() -> int:
        if call == "ptrace":
            raw_syscall("ptrace", 0, 0, 0, 0)               # PTRACE_TRACEME
        elif call == "mount":
            _libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)
        elif call == "socket_inet":
            socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        elif call == "execve":
            os.execv("/bin/true", ["true"])
        elif call == "fork":
            if os.fork() == 0:
                os._exit(0)
        elif call == "unshare":
            raw_syscall("unshare", 0x20000)                 # CLONE_NEWNS
        elif call == "kill_other":
            os.kill(os.getppid(), 0)
        return 0
    status = in_filtered_child(body)
    assert killed_by_sigsys(status), f"{call}: status {status:#x}"


def test_unlisted_ioctl_fails_with_enotty_and_the_process_lives() -> None:
    def body() -> int:
        r, _w = os.pipe()
        ret = _libc.ioctl(r, ctypes.c_ulong(0x5412), ctypes.c_void_p(0))   # TIOCSTI
        return 0 if ret == -1 and ctypes.get_errno() == errno.ENOTTY else 5
    status = in_filtered_child(body)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_log_mode_does_not_kill() -> None:
    def body() -> int:
        ret = raw_syscall("ptrace", 0, 0, 0, 0)             # allowed (and logged): PTRACE_TRACEME works
        return 0 if ret == 0 else 6
    status = in_filtered_child(body, mode="log")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_off_installs_nothing() -> None:
    assert sc.install_vmm_filter("off") == 0
    assert sc.filter_mode() == 0


def test_io_uring_is_refused_so_uvloop_falls_back_to_epoll() -> None:
    import asyncio

    import uvloop

    def body() -> int:
        sc.install_early("on")
        assert raw_syscall("io_uring_setup", 8, 0) == -1 and ctypes.get_errno() == errno.ENOSYS

        async def main() -> int:
            sc.install_vmm_filter("on")   # as the VMM does, in a running loop: io_uring_enter would now kill
            r, w = os.pipe()
            got = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(r, lambda: got.set_result(os.read(r, 1)))
            os.write(w, b"x")
            return 0 if await asyncio.wait_for(got, 5) == b"x" else 4
        return uvloop.run(main())
    status = in_filtered_child(body, mode="off")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
