"""CLI: ``python -m smold.vmm``: boot one microVM, wait for its agent, optionally run a command, exit."""

from __future__ import annotations

import time

_PROCESS_START = time.monotonic()

import argparse  # noqa: E402  (the start time above is taken before any import work)
import asyncio  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from smold.agent import AgentClient, ExecExit, ExecStderr, ExecStdout  # noqa: E402
from smold.vmm.machine import DEFAULT_CMDLINE, MachineConfig, MachineError  # noqa: E402
from smold.vmm.runner import ReadyInfo, Runner  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m smold.vmm",
        description="Boot one microVM, wait for the guest agent, print 'READY {json}' on stdout. "
                    "With a command after '--', run it in the guest, stream its output, power off and "
                    "exit with its exit code. Otherwise run until the guest powers off or SIGTERM.")
    ap.add_argument("--kernel", type=Path, help="ELF vmlinux or bzImage (default: the built default guest)")
    ap.add_argument("--initramfs", type=Path, help="newc cpio (default: the built default guest)")
    ap.add_argument("--rootfs", type=Path, help="ext4 root disk image (default: the built default guest)")
    ap.add_argument("--rootfs-rw", action="store_true", help="attach the root disk writable (default: read-only)")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--memory", type=int, default=512, help="guest RAM in MiB")
    ap.add_argument("--cpu-template", default="auto", help="host | compat | auto (compat on PVM hosts)")
    ap.add_argument("--state-dir", type=Path,
                    help="where vsock.sock, console.log, ready.json, exit.json live (default: a temp dir, "
                         "removed at exit)")
    ap.add_argument("--console-log", type=Path, help="serial console log (default: STATE_DIR/console.log)")
    ap.add_argument("--console", action="store_true", help="also copy the serial console to stderr")
    ap.add_argument("--cmdline", default=DEFAULT_CMDLINE, help="base kernel command line")
    ap.add_argument("--cmdline-extra", default="", help="appended to the kernel command line")
    ap.add_argument("--hostname", default="smol")
    ap.add_argument("--cid", type=int, default=3, help="guest vsock CID")
    ap.add_argument("--boot-timeout", type=float, default=600.0, help="seconds to wait for agent-ready")
    ap.add_argument("--exec-timeout", type=float, default=0.0, help="timeout for the command (0 = none)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("command", nargs="*", help="command to run in the guest (after --)")
    return ap


def _default_artifacts(args: argparse.Namespace) -> None:
    """Fill --kernel/--initramfs/--rootfs that were not given from the built default guest."""
    from smold.images.artifacts import resolve
    from smold.images.errors import ImageBuildError
    for kind in ("kernel", "initramfs", "rootfs"):
        if getattr(args, kind) is None:
            try:
                setattr(args, kind, resolve(kind, build=False))
            except ImageBuildError as e:
                raise SystemExit(f"error: {e}") from None


async def _exec_body(runner: Runner, client: AgentClient, argv: list[str], timeout: float) -> int:
    stream = client.exec(argv, timeout=timeout or None)
    code = 1
    async for ev in stream:
        if isinstance(ev, ExecStdout):
            sys.stdout.buffer.write(ev.data)
            sys.stdout.buffer.flush()
        elif isinstance(ev, ExecStderr):
            sys.stderr.buffer.write(ev.data)
            sys.stderr.buffer.flush()
        elif isinstance(ev, ExecExit):
            code = ev.exit_code if ev.exit_code is not None else 128 + (ev.signal or 0)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _default_artifacts(args)
    own_dir = args.state_dir is None
    state_dir = Path(tempfile.mkdtemp(prefix="smol-vm-")) if own_dir else args.state_dir
    console_stream = None
    if args.console:
        def console_stream(data: bytes) -> None:
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()
    try:
        config = MachineConfig(
            kernel=args.kernel, initramfs=args.initramfs, rootfs=args.rootfs,
            rootfs_read_only=not args.rootfs_rw, cpus=args.cpus, memory_mib=args.memory,
            cpu_template=args.cpu_template, state_dir=state_dir, cmdline=args.cmdline,
            cmdline_extra=args.cmdline_extra, hostname=args.hostname, vsock_cid=args.cid,
            console_log=args.console_log, console_stream=console_stream)
        config.validate()
    except MachineError as e:
        print(f"error: {e}", file=sys.stderr)
        if own_dir:
            import shutil
            shutil.rmtree(state_dir, ignore_errors=True)
        return 1

    def on_ready(info: ReadyInfo) -> None:
        print(f"READY {info.to_json()}", flush=True)

    runner = Runner(config, boot_timeout=args.boot_timeout, process_start=_PROCESS_START,
                    on_ready=on_ready, remove_state_dir=own_dir)
    body = None
    if args.command:
        def body(r: Runner, c: AgentClient) -> object:
            return _exec_body(r, c, args.command, args.exec_timeout)
    try:
        import uvloop
        outcome = uvloop.run(runner.run(body))
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        outcome = asyncio.run(runner.run(body))
    if outcome.error:
        print(f"error: {outcome.error}", file=sys.stderr)
    elif args.verbose and outcome.exit is not None:
        print(f"vm exit: {outcome.exit.kind} {outcome.exit.detail}", file=sys.stderr)
    if outcome.exec_code is not None and outcome.exit_code == 0:
        return outcome.exec_code
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
