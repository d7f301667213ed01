"""The daemon's configuration: where it listens and keeps state, its limits, and its shutdown policy."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from smold.authrecord import KEY_FILE

BAKES_KEY_FILE = ".bake.key"   # in a shared --bakes-dir: the key its daemons authenticate bakes with
DEFAULT_SOCKET = Path("/run/smold/smold.sock")
DEFAULT_STATE_DIR = Path("/var/lib/smold")
DEFAULT_COPY_CAP = 64 * 1024 * 1024
DEFAULT_ARTIFACT_CAP = 16 * 1024 * 1024
DEFAULT_CONSOLE_TAIL = 4096
MAX_CONSOLE_TAIL = 1024 * 1024


def host_memory_mib() -> int:
    """MemTotal of this host in MiB (from /proc/meminfo; 4096 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4096


def default_max_memory_mib() -> int:
    """Guest RAM the daemon hands out by default: 75% of the host's memory."""
    return max(128, host_memory_mib() * 3 // 4)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``smold`` is told on its command line (see ``python -m smold.daemon --help``)."""

    socket_path: Path = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str | None = None  # group name or gid owning the socket; None: the daemon's group
    state_dir: Path = DEFAULT_STATE_DIR
    max_machines: int = 32  # live (creating or running) machines
    max_memory_mib: int = field(default_factory=default_max_memory_mib)  # sum over live machines
    max_cpus: int = 64  # per machine
    copy_cap_bytes: int = DEFAULT_COPY_CAP  # CopyIn/CopyOut content and mount archives
    artifact_cap_bytes: int = DEFAULT_ARTIFACT_CAP  # each artifact kept beside a stored result (docs/verifier.md);
                                                    # never more than copy_cap_bytes (GetArtifact's reply)
    verifier_logs_path: str = "/logs/verifier"  # the guest directory kept as a Run's verifier-logs.tar (tests move it)
    destroy_grace_s: float = 10.0  # SIGTERM -> SIGKILL
    boot_grace_s: float = 30.0  # waited past the Smolfile's boot timeout before killing the VMM
    agent_connect_timeout_s: float = 60.0  # connect + HELLO to a guest agent (a busy guest answers late)
    keep_failed: int = 16  # failed machines kept for inspection; the oldest are removed beyond this
    on_shutdown: str = "destroy"  # "destroy" or "leave" (re-adopted by the next daemon)
    launcher: str = "vmm"  # "vmm" or "module:attribute" naming a Launcher factory (tests)
    images: tuple[tuple[str, tuple[Path, Path, Path]], ...] = ()  # extra named images (--image)
    tcp: str | None = None  # HOST:PORT of the optional TLS listener; needs tls_cert, tls_key, token_file
    tls_cert: Path | None = None  # PEM certificate chain served on tcp
    tls_key: Path | None = None  # its PEM private key
    token_file: Path | None = None  # bearer token every TCP call must carry (mode 0600 or stricter)
    vmm_seccomp: str = "on"  # each VM process's seccomp filter: on, log or off (smold/jail/seccomp.py)
    mount_roots: tuple[Path, ...] = ()  # when set, mount sources must resolve inside one of these directories
    max_concurrent_calls: int = 256  # gRPC calls in progress at once (per listener); more get RESOURCE_EXHAUSTED
    jail: bool = False  # run each VMM in its jail (smold/jail/jailer.py): namespaces, chroot, uid, cgroup
    jail_uid: int = 64000  # the first of the jailed VMMs' uids and gids, one pair per machine (not 0)
    jail_gid: int = 64000
    net_pool: str = "10.213.0.0/16"  # per-machine /30 uplinks of networked machines (docs/networking.md)
    public_network: bool = True  # machines may ask for network = "public" (--no-public-network refuses them)
    bakes_path: Path | None = None  # the bake store (--bakes-dir); None: STATE_DIR/bakes
    bakes_key_path: Path | None = None  # the key that authenticates the bakes (--bakes-key); see bakes_key_file
    auto_bake: bool = True  # a machine that had to boot is baked as its image's base before mounts and setup

    @property
    def machines_dir(self) -> Path:
        return self.state_dir / "machines"

    @property
    def records_dir(self) -> Path:
        """The daemon's own records of each machine (smold/daemon/record.py), where no VMM can write."""
        return self.state_dir / "records"

    @property
    def checkpoints_dir(self) -> Path:
        """Named checkpoints (Snapshot RPC; CreateMachine.from_checkpoint): ``<name>/``."""
        return self.state_dir / "checkpoints"

    @property
    def bakes_dir(self) -> Path:
        """Pre-baked images (BakeImage, base bakes; CreateMachine restores a matching one): ``<key hex>/``."""
        return self.bakes_path if self.bakes_path is not None else self.state_dir / "bakes"

    @property
    def bakes_key_file(self) -> Path:
        """The key the bakes' MACs use (smold/daemon/bakes.py): --bakes-key; else the daemon's record key for its
        own store, and ``.bake.key`` in a --bakes-dir (made 0600 by the first daemon, owned by its uid)."""
        if self.bakes_key_path is not None:
            return self.bakes_key_path
        if self.bakes_path is None:
            return self.state_dir / KEY_FILE
        return self.bakes_path / BAKES_KEY_FILE

    @property
    def forks_dir(self) -> Path:
        """Private fork bases, each removed when the last machine restored from it is destroyed."""
        return self.state_dir / "forks"

    def validate(self) -> None:
        """Raise ValueError naming the first unusable setting."""
        if not self.socket_path.is_absolute():
            raise ValueError(f"--socket must be an absolute path (got {self.socket_path})")
        if len(os.fsencode(self.socket_path)) > 107:
            raise ValueError(f"--socket path is longer than a Unix socket allows: {self.socket_path}")
        if not self.state_dir.is_absolute():
            raise ValueError(f"--state-dir must be an absolute path (got {self.state_dir})")
        if self.max_machines < 1:
            raise ValueError("--max-machines must be at least 1")
        if self.max_memory_mib < 128:
            raise ValueError("--max-memory must be at least 128 MiB")
        if not 1 <= self.max_cpus <= 64:
            raise ValueError("--max-cpus must be in 1..64")
        if self.copy_cap_bytes < 1:
            raise ValueError("--max-copy-bytes must be positive")
        if self.artifact_cap_bytes < 0:
            raise ValueError("--max-artifact-bytes must not be negative (0: keep no artifacts)")
        if self.destroy_grace_s < 0 or self.boot_grace_s < 0:
            raise ValueError("grace periods must not be negative")
        if self.keep_failed < 0:
            raise ValueError("--keep-failed must not be negative")
        if self.on_shutdown not in ("destroy", "leave"):
            raise ValueError("--on-shutdown must be 'destroy' or 'leave'")
        if self.agent_connect_timeout_s <= 0:
            raise ValueError("--agent-connect-timeout must be positive")
        if self.max_concurrent_calls < 1:
            raise ValueError("--max-concurrent-calls must be at least 1")
        if self.bakes_key_path is not None and not self.bakes_key_path.is_absolute():
            raise ValueError(f"--bakes-key must be an absolute path (got {self.bakes_key_path})")
        if self.bakes_path is not None and not self.bakes_path.is_absolute():
            raise ValueError(f"--bakes-dir must be an absolute path (got {self.bakes_path})")
        if any(not p.is_absolute() for p in self.mount_roots):
            raise ValueError("--mount-root must be an absolute path")
        if self.jail and (self.jail_uid <= 0 or self.jail_gid <= 0):
            raise ValueError("--jail-uid and --jail-gid must be positive (not root)")
        if self.vmm_seccomp not in ("on", "log", "off"):
            raise ValueError("--vmm-seccomp must be 'on', 'log' or 'off'")
        import ipaddress
        try:
            pool = ipaddress.ip_network(self.net_pool, strict=True)
        except ValueError as e:
            raise ValueError(f"--net-pool: {e}") from None
        if pool.version != 4 or pool.prefixlen > 30:
            raise ValueError(f"--net-pool must be an IPv4 network of /30 or larger (got {self.net_pool})")
        if self.socket_mode & ~0o777:
            raise ValueError(f"--socket-mode must be permission bits (got {oct(self.socket_mode)})")
        tls = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--token-file": self.token_file}
        if self.tcp is None:
            given = [k for k, v in tls.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with --tcp")
        else:
            parse_tcp_address(self.tcp)
            missing = [k for k, v in tls.items() if v is None]
            if missing:
                raise ValueError(f"--tcp needs {', '.join(missing)} (TCP is served only with TLS and a token)")


def parse_tcp_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6ADDR]:PORT`` -> (host, port); raise ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535 or ("[" in host or "]" in host):
        raise ValueError(f"--tcp must be HOST:PORT or [IPV6]:PORT (got {text!r})")
    if ":" in host and not text.startswith("["):
        raise ValueError(f"--tcp: write an IPv6 address in brackets, [ADDR]:PORT (got {text!r})")
    return host, int(port)
