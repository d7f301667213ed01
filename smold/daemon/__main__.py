"""CLI: ``smold`` / ``python -m smold.daemon``: serve the smol.v1 API until SIGTERM (see docs/daemon.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .config import (
    DEFAULT_ARTIFACT_CAP,
    DEFAULT_COPY_CAP,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    DaemonConfig,
    default_max_memory_mib,
)
from .errors import DaemonSetupError
from .images import parse_image_option


def _mode(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="smold", description="Run disposable microVMs for agent evaluation; serve the smol.v1 gRPC API.")
    ap.add_argument("--socket", type=Path, default=DEFAULT_SOCKET, help=f"Unix socket to serve on ({DEFAULT_SOCKET})")
    ap.add_argument("--socket-mode", type=_mode, default=0o660, help="the socket's permission bits (0660)")
    ap.add_argument("--group", help="group owning the socket (name or gid); its members may use smold")
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                    help=f"machines' state directories and the daemon lock ({DEFAULT_STATE_DIR})")
    ap.add_argument("--max-machines", type=int, default=32, help="machines running or being created at once (32)")
    ap.add_argument("--max-memory", type=int, default=default_max_memory_mib(), metavar="MIB",
                    help="guest RAM of all live machines together, in MiB (default: 75%% of the host's)")
    ap.add_argument("--max-cpus", type=int, default=64, help="vCPUs of one machine (64)")
    ap.add_argument("--max-copy-bytes", type=int, default=DEFAULT_COPY_CAP,
                    help=f"largest CopyIn/CopyOut content and mount archive ({DEFAULT_COPY_CAP})")
    ap.add_argument("--max-artifact-bytes", type=int, default=DEFAULT_ARTIFACT_CAP,
                    help="largest artifact kept beside a stored result, e.g. a sealed Run's outputs "
                         f"({DEFAULT_ARTIFACT_CAP}; 0: none; --max-copy-bytes bounds it too)")
    ap.add_argument("--destroy-grace", type=float, default=10.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL of a VM process being destroyed (10)")
    ap.add_argument("--agent-connect-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a request waits to connect to a machine's guest agent; a guest busy starting "
                         "many commands (or an emulated one) answers late (60)")
    ap.add_argument("--keep-failed", type=int, default=16,
                    help="failed machines kept for inspection; older ones are removed (16)")
    ap.add_argument("--on-shutdown", choices=("destroy", "leave"), default="destroy",
                    help="at SIGTERM: destroy every machine, or leave running ones to be re-adopted (destroy)")
    ap.add_argument("--image", action="append", default=[], metavar="NAME=KERNEL:INITRAMFS:ROOTFS",
                    help="add (or replace) a named image; 'default' is the built default guest otherwise")
    ap.add_argument("--tcp", metavar="HOST:PORT",
                    help="also serve on TCP, with TLS and a bearer token (needs --tls-cert, --tls-key, --token-file)")
    ap.add_argument("--tls-cert", type=Path, metavar="FILE", help="PEM certificate (chain) for --tcp")
    ap.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key for --tcp (mode 0600)")
    ap.add_argument("--token-file", type=Path, metavar="FILE",
                    help="bearer token (32+ characters) every TCP call must send (mode 0600)")
    ap.add_argument("--vmm-seccomp", choices=("on", "log", "off"), default="on",
                    help="each VM process's system call filter: on, log (allow but log) or off (on). "
                         "docs/security.md")
    ap.add_argument("--mount-root", type=Path, action="append", default=[], metavar="DIR",
                    help="mount sources must lie inside one of these directories (repeatable; default: anywhere "
                         "the client's base_dir says, as read by the daemon's user). docs/security.md")
    ap.add_argument("--max-concurrent-calls", type=int, default=256,
                    help="gRPC calls in progress at once per listener; more are refused (256)")
    ap.add_argument("--jail", action="store_true",
                    help="run each VM process in a jail: own mount/PID/IPC/UTS namespaces, a root holding only its "
                         "files, an unprivileged uid, a cgroup memory and CPU limit (docs/security.md)")
    ap.add_argument("--jail-uid", type=int, default=64000,
                    help="first of the 1024 uids of jailed VM processes, one per machine (64000)")
    ap.add_argument("--jail-gid", type=int, default=64000,
                    help="first of the 1024 gids of jailed VM processes, one per machine (64000)")
    ap.add_argument("--net-pool", default="10.213.0.0/16", metavar="CIDR",
                    help="IPv4 pool of the per-machine /30 uplinks of networked machines (10.213.0.0/16)")
    ap.add_argument("--no-public-network", dest="public_network", action="store_false",
                    help="refuse machines whose Smolfile asks for network = \"public\" (allowlists still work)")
    ap.add_argument("--bakes-dir", type=Path, metavar="DIR",
                    help="the bake store (STATE_DIR/bakes); daemons on one host may share one")
    ap.add_argument("--bakes-key", type=Path, metavar="FILE",
                    help="the key that authenticates bakes (a file of 32+ random bytes, 0600, owned by this "
                         "daemon's uid): only bakes it authenticates are restored. Default: the daemon's own key "
                         "for STATE_DIR/bakes, BAKES_DIR/.bake.key (made on first use) for a --bakes-dir")
    ap.add_argument("--no-auto-bake", dest="auto_bake", action="store_false",
                    help="do not bake a machine that had to boot as its image's base (by default the next machine "
                         "of that image, size and network restores it, then copies its mounts and runs its setup)")
    ap.add_argument("--launcher", default="vmm", help=argparse.SUPPRESS)  # tests: module:attribute
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        socket_path=args.socket.absolute(), socket_mode=args.socket_mode, socket_group=args.group,
        state_dir=args.state_dir.absolute(), max_machines=args.max_machines, max_memory_mib=args.max_memory,
        max_cpus=args.max_cpus, copy_cap_bytes=args.max_copy_bytes,
        artifact_cap_bytes=args.max_artifact_bytes, destroy_grace_s=args.destroy_grace,
        agent_connect_timeout_s=args.agent_connect_timeout,
        keep_failed=args.keep_failed, on_shutdown=args.on_shutdown, launcher=args.launcher,
        images=tuple(parse_image_option(i) for i in args.image), tcp=args.tcp,
        tls_cert=args.tls_cert and args.tls_cert.absolute(), tls_key=args.tls_key and args.tls_key.absolute(),
        token_file=args.token_file and args.token_file.absolute(), vmm_seccomp=args.vmm_seccomp,
        mount_roots=tuple(p.absolute() for p in args.mount_root), max_concurrent_calls=args.max_concurrent_calls,
        jail=args.jail, jail_uid=args.jail_uid, jail_gid=args.jail_gid, net_pool=args.net_pool,
        public_network=args.public_network,
        bakes_path=args.bakes_dir and args.bakes_dir.absolute(),
        bakes_key_path=args.bakes_key and args.bakes_key.absolute(), auto_bake=args.auto_bake)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("grpc").setLevel(max(logging.WARNING, logging.getLogger().level))
    from .server import Daemon

    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as e:
        print(f"smold: error: {e}", file=sys.stderr)
        return 2

    async def go() -> None:
        await Daemon(config).run()

    try:
        import uvloop
        uvloop.run(go())
    except (DaemonSetupError, ValueError) as e:
        print(f"smold: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled by the loop once it runs
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
