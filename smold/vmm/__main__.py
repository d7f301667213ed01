"""CLI: ``python -m smold.vmm``: boot (or restore) one microVM, wait for its agent, optionally run a command
and snapshot it, exit."""

from __future__ import annotations

import time

_PROCESS_START = time.monotonic()

import argparse  # noqa: E402  (the start time above is taken before any import work)
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from smold.agent import AgentClient, ExecExit, ExecStderr, ExecStdout  # noqa: E402
from smold.jail.seccomp import SeccompError, install_early  # noqa: E402
from smold.kvm import is_pvm  # noqa: E402
from smold.kvm.cpuid import default_vcpus  # noqa: E402
from smold.snapshot.errors import SnapshotError  # noqa: E402
from smold.snapshot.state import VmSnapshot  # noqa: E402
from smold.vmm.console import DEFAULT_CONSOLE_LOG_MAX  # noqa: E402
from smold.vmm.control import snapshot_info  # noqa: E402
from smold.vmm.logs import install as install_log_limit  # noqa: E402
from smold.vmm.machine import (  # noqa: E402
    DEFAULT_CMDLINE,
    DEFAULT_NET_GATEWAY,
    DEFAULT_NET_GUEST,
    MachineConfig,
    MachineError,
    NetConfig,
    SnapshotResult,
)
from smold.vmm.runner import AfterSnapshot, ReadyInfo, Runner  # noqa: E402

DEFAULT_MEMORY_MIB = 512


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
    ap.add_argument("--cpus", type=int, help="vCPUs (default 2, 1 on PVM hosts; a restore takes the snapshot's)")
    ap.add_argument("--memory", type=int,
                    help=f"guest RAM in MiB (default {DEFAULT_MEMORY_MIB}; a restore takes the snapshot's)")
    ap.add_argument("--cpu-template", default="auto", help="host | compat | auto (compat on PVM hosts)")
    ap.add_argument("--state-dir", type=Path,
                    help="where vsock.sock, console.log, ready.json, exit.json live (default: a temp dir, "
                         "removed at exit)")
    ap.add_argument("--console-log", type=Path, help="serial console log (default: STATE_DIR/console.log)")
    ap.add_argument("--console-log-max", type=_size, default=DEFAULT_CONSOLE_LOG_MAX, metavar="SIZE",
                    help="rotate the console log at this size (bytes, or with a k/M suffix), keeping one older "
                         f"file (default: {DEFAULT_CONSOLE_LOG_MAX >> 20}M)")
    ap.add_argument("--console", action="store_true", help="also copy the serial console to stderr")
    ap.add_argument("--cmdline", default=DEFAULT_CMDLINE, help="base kernel command line")
    ap.add_argument("--cmdline-extra", default="", help="appended to the kernel command line")
    ap.add_argument("--hostname", help="guest hostname (default smol; a restore keeps the snapshot's)")
    ap.add_argument("--cid", type=int, help="guest vsock CID (default 3; a restore keeps the snapshot's)")
    ap.add_argument("--boot-timeout", type=float, default=600.0, help="seconds to wait for agent-ready")
    ap.add_argument("--exec-timeout", type=float, default=0.0, help="timeout for the command (0 = none)")
    ap.add_argument("--snapshot-on-ready", type=Path, metavar="DIR",
                    help="once the agent is ready and the command (if any) exited 0, pause the VM and write a "
                         "snapshot to DIR (docs/snapshot.md); prints 'SNAPSHOT {json}'")
    ap.add_argument("--after-snapshot", choices=(AfterSnapshot.EXIT, AfterSnapshot.CONTINUE),
                    default=AfterSnapshot.EXIT,
                    help="after --snapshot-on-ready: exit at once (default) or resume the guest and go on")
    ap.add_argument("--restore", type=Path, metavar="DIR",
                    help="restore the snapshot in DIR instead of booting; READY then has \"restored\": true")
    ap.add_argument("--new-identity", action="store_true",
                    help="with --restore: new machine-id, reseeded guest entropy and the --hostname (a fork "
                         "child)")
    ap.add_argument("--verify-memory", action="store_true",
                    help="with --restore: check the memory file against its recorded sha256 first (reads it all)")
    ap.add_argument("--seccomp", choices=("on", "off", "log"), default="off",
                    help="system call filter installed before the vCPUs run: on (kill on a forbidden call), "
                         "log (allow but log), off (default here; the daemon passes on). docs/security.md")
    net = ap.add_argument_group(
        "network (docs/networking.md)",
        "Without --net-tap the guest has no NIC, only lo. With --restore only --net-tap applies: the guest "
        "keeps the snapshot's MAC and addresses.")
    net.add_argument("--net-tap", metavar="NAME",
                     help="attach a virtio-net NIC to this existing TAP interface in the VMM's network "
                          "namespace (also with --restore: each restored copy gets its own TAP)")
    net.add_argument("--net-mac", metavar="MAC", help="guest MAC address (default 06:00:ac:10:00:02)")
    net.add_argument("--net-guest", metavar="CIDR", help=f"guest address/prefix (default {DEFAULT_NET_GUEST})")
    net.add_argument("--net-gateway", metavar="IP", help=f"default route (default {DEFAULT_NET_GATEWAY})")
    net.add_argument("--net-dns", metavar="IP", help="nameserver for /etc/resolv.conf (default: the gateway)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("command", nargs="*", help="command to run in the guest (after --)")
    return ap


def _size(text: str) -> int:
    """``4096``, ``64k`` or ``8M`` -> bytes (argparse type)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    scale = units.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with k, M or G)")
    return int(digits) * scale


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


def _load_snapshot(args: argparse.Namespace) -> VmSnapshot:
    """Read and check ``--restore``'s snapshot; SystemExit with the reason if it is refused."""
    from smold.snapshot.store import read_snapshot, verify_memory
    try:
        snap = read_snapshot(args.restore)
        if args.verify_memory:
            verify_memory(args.restore, snap)
    except SnapshotError as e:
        raise SystemExit(f"error: cannot restore {args.restore}: {e}") from None
    for flag, given, saved in (("--cpus", args.cpus, snap.spec.cpus), ("--memory", args.memory, snap.spec.memory_mib)):
        if given is not None and given != saved:
            raise SystemExit(f"error: {flag} {given} differs from the snapshot's {saved}")
    for flag in ("kernel", "initramfs"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"error: --{flag} cannot be combined with --restore")
    return snap


def _net_config(args: argparse.Namespace) -> NetConfig | None:
    """--net-* flags -> NetConfig; SystemExit if addresses are given without a TAP."""
    extra = [f for f in ("mac", "guest", "gateway", "dns") if getattr(args, f"net_{f}") is not None]
    if args.net_tap is None:
        if extra:
            raise SystemExit(f"error: --net-{extra[0]} needs --net-tap")
        return None
    given = {f: getattr(args, f"net_{f}") for f in extra}
    return NetConfig(tap=args.net_tap, **given)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:
        install_log_limit()   # device warnings a guest can provoke are rate-limited (smold/vmm/logs.py)
    if args.restore is not None and args.snapshot_on_ready is not None and \
            args.restore.resolve() == args.snapshot_on_ready.resolve():
        print("error: --snapshot-on-ready must not overwrite the snapshot being restored", file=sys.stderr)
        return 1
    snap = _load_snapshot(args) if args.restore is not None else None
    net = _net_config(args)
    if snap is None:
        _default_artifacts(args)
    own_dir = args.state_dir is None
    state_dir = Path(tempfile.mkdtemp(prefix="smol-vm-")) if own_dir else args.state_dir
    console_stream = None
    if args.console:
        def console_stream(data: bytes) -> None:
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()
    try:
        if snap is not None:
            config = MachineConfig.for_restore(args.restore, state_dir, snap, rootfs=args.rootfs, vsock_cid=args.cid,
                                               hostname=args.hostname, console_log=args.console_log,
                                               console_stream=console_stream, net_tap=args.net_tap)
        else:
            config = MachineConfig(
                kernel=args.kernel, initramfs=args.initramfs, rootfs=args.rootfs,
                rootfs_read_only=not args.rootfs_rw, cpus=args.cpus or default_vcpus(is_pvm()),
                memory_mib=args.memory or DEFAULT_MEMORY_MIB, cpu_template=args.cpu_template,
                state_dir=state_dir, cmdline=args.cmdline, cmdline_extra=args.cmdline_extra,
                hostname=args.hostname if args.hostname is not None else "smol",
                vsock_cid=args.cid if args.cid is not None else 3,
                console_log=args.console_log, console_stream=console_stream, net=net)
        config = dataclasses.replace(config, console_log_max=args.console_log_max)
        config.validate()
    except MachineError as e:
        print(f"error: {e}", file=sys.stderr)
        if own_dir:
            import shutil
            shutil.rmtree(state_dir, ignore_errors=True)
        return 1

    def on_ready(info: ReadyInfo) -> None:
        print(f"READY {info.to_json()}", flush=True)

    def on_snapshot(result: SnapshotResult) -> None:
        print(f"SNAPSHOT {json.dumps(snapshot_info(result), sort_keys=True)}", flush=True)

    runner = Runner(config, boot_timeout=args.boot_timeout, process_start=_PROCESS_START,
                    on_ready=on_ready, remove_state_dir=own_dir, snapshot_dir=args.snapshot_on_ready,
                    after_snapshot=args.after_snapshot, on_snapshot=on_snapshot, restore_state=snap,
                    new_identity=args.new_identity, seccomp=args.seccomp)
    body = None
    if args.command:
        def body(r: Runner, c: AgentClient) -> object:
            return _exec_body(r, c, args.command, args.exec_timeout)
    try:
        install_early(args.seccomp)   # no io_uring for libuv: ring operations escape seccomp
    except SeccompError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
