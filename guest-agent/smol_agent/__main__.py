"""Entry point: `python3 -m smol_agent --listen vsock:1024 [--pid1]`."""

import _signal
import _socket
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # noqa: F811  (typeshed has no stub for the C module _signal)

USAGE = """\
usage: python3 -m smol_agent [--listen ADDR] [--pid1]

smol guest agent: serves exec and file requests over a framed protocol (docs/agent-protocol.md).

  --listen ADDR  vsock:PORT (AF_VSOCK, any CID) or unix:/path/to/socket   [default: vsock:1024]
  --pid1         run as the guest's PID 1: reap all orphans, ignore SIGTERM/SIGINT, never exit,
                 reboot the guest (RB_AUTOBOOT) on POWEROFF or on a crash
  --version      print the agent version
  -h, --help     show this help
"""

RB_AUTOBOOT = 0x01234567
PID1_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "linux",
}
# PID 1 swallows these with a no-op handler rather than SIG_IGN: a handled signal is reset to SIG_DFL by
# exec (and by the vfork spawn path), an ignored one would stay ignored in every command the agent runs.
_PID1_SWALLOWED = (
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGQUIT,
    _signal.SIGTSTP,
    _signal.SIGTTIN,
    _signal.SIGTTOU,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
    _signal.SIGPWR,
)


class UsageError(Exception):
    """Bad command line."""


def parse_args(argv: "list[str]") -> "dict[str, object]":
    """Tiny hand-written parser (argparse would import re, gettext, ... at guest boot)."""
    opts: dict[str, object] = {"listen": "vsock:1024", "pid1": False, "help": False, "version": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            opts["help"] = True
        elif arg == "--version":
            opts["version"] = True
        elif arg == "--pid1":
            opts["pid1"] = True
        elif arg == "--listen":
            i += 1
            if i >= len(argv):
                raise UsageError("--listen needs an address")
            opts["listen"] = argv[i]
        elif arg.startswith("--listen="):
            opts["listen"] = arg.partition("=")[2]
        else:
            raise UsageError(f"unknown argument {arg!r}")
        i += 1
    return opts


def make_listener(spec: str) -> _socket.socket:
    """Create the listening socket for vsock:PORT or unix:PATH."""
    kind, _, addr = spec.partition(":")
    if kind == "vsock":
        if not addr.isdigit():
            raise UsageError(f"bad vsock port {addr!r}")
        sock = _socket.socket(_socket.AF_VSOCK, _socket.SOCK_STREAM)
        sock.bind((_socket.VMADDR_CID_ANY, int(addr)))
    elif kind == "unix":
        if not addr:
            raise UsageError("unix: needs a path")
        try:
            os.unlink(addr)  # a stale socket from a previous run
        except FileNotFoundError:
            pass
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.bind(addr)
    else:
        raise UsageError(f"unsupported listen address {spec!r} (want vsock:PORT or unix:PATH)")
    sock.listen(64)
    return sock


def console(message: str) -> None:
    """Write a line to /dev/console, falling back to stderr."""
    data = f"smol-agent: {message}\n".encode(errors="replace")
    try:
        fd = os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    try:
        os.write(fd if fd >= 0 else 2, data)
    except OSError:
        pass
    finally:
        if fd >= 0:
            os.close(fd)


def setup_pid1() -> None:
    """Sane process state for PID 1: std fds open, known env and cwd, terminal signals ignored."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            target = "/dev/null" if fd == 0 else "/dev/console"
            try:
                new = os.open(target, os.O_RDWR | os.O_NOCTTY)
            except OSError:
                new = os.open("/dev/null", os.O_RDWR)
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
    from .process import INHERITED_ENV  # the server imports it anyway

    inherited = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    os.environ.clear()
    os.environ.update(PID1_ENV)
    os.environ.update(inherited)
    os.chdir("/")
    os.umask(0o022)
    for sig in _PID1_SWALLOWED:
        _signal.signal(sig, _swallow)


def _swallow(signum: int, frame: object) -> None:
    """Handler for the signals PID 1 must survive (see _PID1_SWALLOWED)."""


def reboot_guest() -> None:
    """sync(), then reboot(RB_AUTOBOOT): with kernel arg reboot=k the VMM sees the i8042 reset and exits.

    Only when this process really is PID 1 (of the guest, or of a PID namespace in tests); never returns.
    """
    os.sync()
    if os.getpid() == 1:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.reboot(RB_AUTOBOOT)
        console(f"reboot(RB_AUTOBOOT) failed: {os.strerror(ctypes.get_errno())}")
    # PID 1 must never exit (the kernel would panic): keep reaping until someone pulls the plug.
    while True:
        try:
            os.wait()
        except ChildProcessError:
            _signal.pause()
        except InterruptedError:
            pass


def main(argv: "list[str] | None" = None) -> int:
    try:
        opts = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        sys.stderr.write(f"smol-agent: {exc}\n{USAGE}")
        return 2
    if opts["help"]:
        sys.stdout.write(USAGE)
        return 0
    if opts["version"]:
        from .protocol import AGENT_VERSION

        sys.stdout.write(f"smol-agent {AGENT_VERSION}\n")
        return 0
    pid1 = bool(opts["pid1"])
    if not pid1:
        return serve(str(opts["listen"]), pid1=False)
    setup_pid1()
    try:
        serve(str(opts["listen"]), pid1=True)
        console("power off requested")
    except BaseException:
        import traceback

        console("fatal error in pid1 mode, rebooting the guest:\n" + traceback.format_exc())
    reboot_guest()
    return 1  # not reached


def serve(listen: str, pid1: bool) -> int:
    """Run the agent until POWEROFF; in non-pid1 mode SIGTERM also stops it cleanly."""
    from .server import Agent, log

    try:
        listener = make_listener(listen)
    except (UsageError, OSError) as exc:
        if pid1:
            raise
        log(f"cannot listen on {listen}: {exc}")
        return 1
    agent = Agent(listener, pid1=pid1)
    if not pid1:
        _signal.signal(_signal.SIGTERM, lambda signum, frame: agent.request_stop("SIGTERM"))
    log(f"listening on {listen} (pid {os.getpid()}{', pid1' if pid1 else ''})")
    try:
        reason = agent.run()
    finally:
        if agent.stop_reason is None:  # an exception: still kill every exec's process group
            agent.request_stop("error")
            agent._shutdown()
    log(f"stopped: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
