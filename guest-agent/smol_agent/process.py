"""Child processes: vfork/exec (or fork/exec) spawning into a new session, and the single waitpid(-1) reaper."""

# subprocess.Popen is deliberately not used: as PID 1 the agent must reap every orphan with one waitpid(-1)
# loop, which would race with Popen's own per-child waitpid. The same reaper runs in non-pid1 mode.
#
# Spawning: fork() of this ~30 MB Python process copies its page tables and then takes copy-on-write
# faults, all of it kernel work, which under an emulated guest kernel costs seconds per command
# (docs/performance.md). _posixsubprocess.fork_exec (the C core of subprocess) uses vfork(): no
# page-table copy. It is used whenever no user switch is needed (CPython only vforks without
# setuid/setgid/setgroups) on the CPython versions whose signature is known; otherwise os.fork().

import _signal
import os
import sys

try:
    import _posixsubprocess
except ImportError:  # pragma: no cover - not CPython
    _posixsubprocess = None  # type: ignore[assignment]

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # noqa: F811  (typeshed has no stub for the C module _signal)
    from collections.abc import Callable

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Set for the whole guest by the VMM (on the kernel command line, which Linux turns into /init's
# environment) and passed on from the agent's own environment to every command it runs. GLIBC_TUNABLES:
# the compat CPU template keeps glibc off AVX (smold/kvm/cpuid.py, docs/pvm-emulator.md item 10).
INHERITED_ENV = ("GLIBC_TUNABLES",)

# Signals whose disposition the agent changes and a child must get back as SIG_DFL before exec
# (CPython ignores SIGPIPE/SIGXFSZ; PID 1 ignores SIGTERM/SIGINT/SIGHUP; ignored dispositions survive exec).
_RESET_SIGNALS = (
    _signal.SIGPIPE,
    _signal.SIGXFSZ,
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGQUIT,
    _signal.SIGTSTP,
    _signal.SIGTTIN,
    _signal.SIGTTOU,
    _signal.SIGCHLD,
)


class SpawnError(Exception):
    """The child could not be started; `stage` is 'cwd', 'user' or 'exec', `errno` the OS error."""

    def __init__(self, stage: str, errno_value: int, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.errno = errno_value


class UserInfo:
    """Resolved identity for a child: uid, gid, supplementary groups, name and home."""

    __slots__ = ("uid", "gid", "name", "home", "shell", "groups")

    def __init__(
        self, uid: int, gid: int, name: str, home: str, shell: str, groups: "list[int] | None"
    ) -> None:
        self.uid = uid
        self.gid = gid
        self.name = name
        self.home = home
        self.shell = shell
        self.groups = groups  # None: initgroups(name, gid) in the child


def resolve_user(user: "str | int | None") -> "UserInfo | None":
    """Resolve a user name or uid via the passwd database; None means 'stay as the agent's user'.

    Raises LookupError for an unknown name. A numeric uid without a passwd entry is allowed (gid = uid).
    """
    if user is None:
        return None
    import pwd

    if isinstance(user, str) and user.isdigit():
        user = int(user)
    if isinstance(user, int):
        try:
            pw = pwd.getpwuid(user)
        except KeyError:
            return UserInfo(user, user, str(user), "/", "/bin/sh", [])
    else:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise LookupError(f"unknown user {user!r}") from None
    return UserInfo(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir or "/", pw.pw_shell or "/bin/sh", None)


def _child(
    argv: "list[str]",
    env: "dict[str, str]",
    cwd: str,
    user: "UserInfo | None",
    stdin_fd: int,
    stdout_fd: int,
    stderr_fd: int,
    err_w: int,
) -> None:
    """Runs in the forked child: never returns (exec or _exit)."""
    stage = "setup"
    try:
        os.setsid()  # own session and process group: pgid == pid, killed as a whole on timeout/disconnect
        for sig in _RESET_SIGNALS:
            _signal.signal(sig, _signal.SIG_DFL)
        _signal.set_wakeup_fd(-1)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, [])
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        stage = "user"
        if user is not None:
            if user.groups is None:
                os.initgroups(user.name, user.gid)
            else:
                os.setgroups(user.groups)
            os.setgid(user.gid)
            os.setuid(user.uid)
        stage = "cwd"
        os.chdir(cwd)
        stage = "exec"
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        code = exc.errno or 0
    except BaseException:
        code = 0
    try:
        os.write(err_w, f"{stage}:{code}".encode())
    finally:
        os._exit(127)


class Reaper:
    """The one reaper: SIGCHLD wakes the event loop via a pipe; reap() runs waitpid(-1, WNOHANG) until empty.

    Exit statuses of registered pids go to their callback; any other child (an orphan re-parented to PID 1)
    is reaped and discarded. Spawn and register happen on the loop thread between reap() calls, so a child
    can never be reaped before its pid is registered.
    """

    def __init__(self) -> None:
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self.orphans_reaped = 0

    def install(self) -> None:
        """Install the SIGCHLD handler (main thread only)."""
        _signal.set_wakeup_fd(self.wakeup_w, warn_on_full_buffer=False)
        _signal.signal(_signal.SIGCHLD, _on_sigchld)

    def register(self, pid: int, callback: "Callable[[int], None]") -> None:
        self._callbacks[pid] = callback

    def forget(self, pid: int) -> None:
        """Keep reaping pid but drop its callback (the owner went away)."""
        if pid in self._callbacks:
            self._callbacks[pid] = _discard

    def reap(self) -> None:
        """Drain the wakeup pipe and collect every exited child."""
        try:
            while os.read(self.wakeup_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            callback = self._callbacks.pop(pid, None)
            if callback is None:
                self.orphans_reaped += 1
            else:
                callback(status)

    def spawn(
        self,
        argv: "list[str]",
        env: "dict[str, str]",
        cwd: str,
        user: "UserInfo | None",
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        on_exit: "Callable[[int], None]",
    ) -> int:
        """Start argv in a new session; returns the pid (also its pgid) or raises SpawnError.

        vfork when no user switch is asked for (cheap: no copy of the agent's page tables), else fork;
        on_exit gets the waitpid status once the command has exited."""
        if user is None and VFORK_SPAWN:
            pid = vfork_exec(argv, env, cwd, stdin_fd, stdout_fd, stderr_fd)
        else:
            pid = fork_exec(argv, env, cwd, user, stdin_fd, stdout_fd, stderr_fd)
        self.register(pid, on_exit)
        return pid


def _on_sigchld(signum: int, frame: object) -> None:
    """Python-level no-op: the C handler already wrote to the wakeup fd."""


def _discard(status: int) -> None:
    """Callback for children whose owner is gone."""


def decode_status(status: int) -> "tuple[int | None, int | None]":
    """waitpid status -> (exit_code, signal)."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def kill_group(pgid: int, sig: int = _signal.SIGKILL) -> bool:
    """Signal a whole process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def fork_exec(
    argv: "list[str]",
    env: "dict[str, str]",
    cwd: str,
    user: "UserInfo | None",
    stdin_fd: int,
    stdout_fd: int,
    stderr_fd: int,
) -> int:
    """os.fork() and exec argv as any user; returns the pid (also its pgid).

    The child reports a failure before exec as "stage:errno" on a CLOEXEC pipe (_child); that raises
    SpawnError here after the child is reaped."""
    def start(err_r: int, err_w: int) -> int:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(err_r)
            _child(argv, env, cwd, user, stdin_fd, stdout_fd, stderr_fd, err_w)
        return pid

    pid, data = _start_reporting(start)
    if not data:
        return pid
    stage, _, code_s = data.decode("ascii", "replace").partition(":")
    code = int(code_s) if code_s.isdigit() else 0
    raise SpawnError(stage, code, os.strerror(code) if code else "child setup failed")


def _start_reporting(start: "Callable[[int, int], int]") -> "tuple[int, bytes]":
    """start(err_r, err_w) starts a child that reports a failure before exec on a CLOEXEC pipe; returns its
    pid and that report (b"" once it exec'd: EOF). A child that reported has _exit()ed and is reaped here:
    it was never registered with the Reaper."""
    err_r, err_w = os.pipe()  # O_CLOEXEC: EOF on a successful exec
    try:
        pid = start(err_r, err_w)
        os.close(err_w)
        err_w = -1
        data = _read_error_pipe(err_r)
    finally:
        os.close(err_r)
        if err_w >= 0:
            os.close(err_w)
    if data:
        _reap(pid)
    return pid, data


def _read_error_pipe(fd: int, limit: int = 4096) -> bytes:
    """What a spawned child wrote on its error pipe before exec (b"" on success: EOF at exec)."""
    data = b""
    while len(data) <= limit:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    return data


def _reap(pid: int) -> None:
    """Collect a child that failed before exec (never registered with the Reaper)."""
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return


# _posixsubprocess.fork_exec(args, executable_list, close_fds, pass_fds, cwd, env, p2cread, p2cwrite,
# c2pread, c2pwrite, errread, errwrite, errpipe_read, errpipe_write, restore_signals, call_setsid,
# pgid_to_set, gid, extra_groups, uid, child_umask, preexec_fn, allow_vfork): CPython 3.11-3.13.
VFORK_SPAWN = _posixsubprocess is not None and (3, 11) <= sys.version_info[:2] <= (3, 13)


def vfork_exec(
    argv: "list[str]", env: "dict[str, str]", cwd: str, stdin_fd: int, stdout_fd: int, stderr_fd: int
) -> int:
    """vfork, setsid, dup2 the three fds, close all others, chdir, exec (PATH from env); returns the pid.

    The child resets handled signals and SIGPIPE/SIGXFSZ to SIG_DFL and gets the caller's signal mask; so
    the agent must not leave other signals ignored (SIG_IGN survives exec) nor blocked. A failure before
    or at exec raises SpawnError ('cwd' or 'exec') after the child is reaped.
    """
    env_list = []
    for k, v in env.items():
        key = os.fsencode(k)
        if b"=" in key or b"\0" in key:
            raise SpawnError("exec", 22, f"invalid environment variable name {k!r}")
        env_list.append(key + b"=" + os.fsencode(v))
    exe = os.fsencode(argv[0])
    if os.path.dirname(exe):
        executables: tuple[bytes, ...] = (exe,)
    else:  # the lookup os.execvpe does, with the child's PATH
        executables = tuple(os.path.join(os.fsencode(d), exe) for d in os.get_exec_path(env))
    def start(err_r: int, err_w: int) -> int:
        return _posixsubprocess.fork_exec(
            [os.fsencode(a) for a in argv], executables, True, (err_w,), cwd, env_list,
            stdin_fd, -1, -1, stdout_fd, -1, stderr_fd, err_r, err_w,
            True, True, -1, None, None, None, -1, None, True,
        )

    pid, data = _start_reporting(start)
    if not data:
        return pid
    # "ExceptionName:hex_errno:message"; message "noexec" means the chdir (or another pre-exec step) failed.
    _name, _, rest = data.decode("ascii", "replace").partition(":")
    hex_errno, _, msg = rest.partition(":")
    try:
        code = int(hex_errno, 16)
    except ValueError:
        code = 0
    stage = "cwd" if msg.startswith("noexec") else "exec"
    raise SpawnError(stage, code, os.strerror(code) if code else (msg or "child setup failed"))
