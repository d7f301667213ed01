"""Validated Smolfile content as frozen dataclasses of plain values (schema: docs/smolfile.md)."""

from __future__ import annotations

import ipaddress
import posixpath
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal

DEFAULT_IMAGE = "default"
DEFAULT_CPUS = 2
MIN_CPUS = 1
MAX_CPUS = 64
DEFAULT_MEMORY_MIB = 1024
MIN_MEMORY_MIB = 128
DEFAULT_MAX_MEMORY_MIB = 64 * 1024
MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_REWARD_PATHS = ("/logs/verifier/reward.txt", "/logs/verifier/reward.json")
# [verifier] outputs may not be, hold or sit inside these: the verifier's own tools, libraries, configuration and
# home (root's user site-packages), and where its reward is written (docs/verifier.md, "Sealed verification").
SYSTEM_PATHS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/boot", "/dev", "/proc", "/sys",
                "/root", "/run", "/var/lib/dpkg", "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
                "/etc/ld.so.cache", "/etc/profile", "/etc/profile.d", "/etc/environment", "/etc/sudoers",
                "/etc/sudoers.d", "/etc/passwd", "/etc/group", "/etc/shadow", "/logs/verifier")
SYSTEM_PARENTS = ("/", "/etc", "/var", "/var/lib", "/logs")  # they hold system paths: not an output either
MAX_OUTPUTS = 64


@dataclass(frozen=True)
class Limits:
    """Host-side bounds a Smolfile is validated against (the daemon passes its configured ones)."""

    max_memory_mib: int = DEFAULT_MAX_MEMORY_MIB
    max_cpus: int = MAX_CPUS


@dataclass(frozen=True)
class Command:
    """A command: a string runs with `sh -c`, a tuple is the argv itself."""

    run: str | tuple[str, ...]
    timeout: float | None = None  # seconds; None: bounded only by the stage's timeout
    cwd: str | None = None  # absolute guest path; None: "/"
    user: str | None = None  # name or numeric uid; None: root

    @property
    def argv(self) -> tuple[str, ...]:
        return ("sh", "-c", self.run) if isinstance(self.run, str) else self.run


@dataclass(frozen=True)
class AllowRule:
    """One network allowlist entry: a CIDR (a single address is a /32 or /128) or a DNS name, maybe a port."""

    kind: Literal["cidr", "host"]
    value: str  # normalized: "10.0.0.0/8", "192.0.2.1/32", "pypi.org"
    port: int | None = None

    def __str__(self) -> str:
        """The canonical text form, which parses back to an equal rule."""
        text = self.value
        if self.kind == "cidr":
            net = ipaddress.ip_network(self.value)
            if net.num_addresses == 1:
                text = str(net.network_address)
                if self.port is not None and net.version == 6:
                    return f"[{text}]:{self.port}"
        return text if self.port is None else f"{text}:{self.port}"


@dataclass(frozen=True)
class PortForward:
    """An inbound forward: host_address:host_port on the host relays TCP to guest_port in the guest.
    host_port 0: the daemon picks a free port (reported in the machine's network report)."""

    guest_port: int
    host_port: int = 0
    host_address: str = "127.0.0.1"  # an IPv4 address of the host to listen on

    def __str__(self) -> str:
        """The canonical text form, "HOST_ADDRESS:HOST_PORT:GUEST_PORT", which parses back to an equal forward."""
        return f"{self.host_address}:{self.host_port}:{self.guest_port}"


@dataclass(frozen=True)
class NetworkPolicy:
    """Guest networking: off when allow and forward are empty and public is false, else a NIC that reaches
    only the listed destinations (with ``public``: also every public IPv4 address, never the host, the
    machines' pool, link-local, loopback or private ranges unless listed), and that the listed host ports
    forward into."""

    allow: tuple[AllowRule, ...] = ()
    forward: tuple[PortForward, ...] = ()
    public: bool = False
    closed: bool = False   # network = "closed": a NIC with nothing allowed (a policy set later, SetNetworkPolicy)

    @property
    def enabled(self) -> bool:
        return bool(self.allow or self.forward or self.public or self.closed)


@dataclass(frozen=True)
class Mount:
    """A host file or directory (relative to the Smolfile's directory) copied to an absolute guest path."""

    host: str  # normalized relative POSIX path; "." is the Smolfile's directory itself
    guest: str  # normalized absolute guest path


@dataclass(frozen=True)
class Timeouts:
    """Stage timeouts in seconds."""

    boot: float = 300.0
    setup: float = 600.0  # all setup commands together
    task: float = 1800.0
    verify: float = 600.0  # all checks together


# --- verifier checks ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CheckBase:
    """Fields every check has."""

    kind: ClassVar[str]
    name: str
    timeout: float | None = None  # seconds; None: bounded only by the verify timeout


@dataclass(frozen=True, kw_only=True)
class CommandCheck(CheckBase):
    """Passes iff the command exits with expect_exit."""

    kind: ClassVar[str] = "command"
    run: str | tuple[str, ...]
    expect_exit: int = 0
    cwd: str | None = None
    user: str | None = None

    @property
    def argv(self) -> tuple[str, ...]:
        return ("sh", "-c", self.run) if isinstance(self.run, str) else self.run


@dataclass(frozen=True, kw_only=True)
class FileExistsCheck(CheckBase):
    """Passes iff the path exists in the guest (regular file, directory or other)."""

    kind: ClassVar[str] = "file_exists"
    path: str


@dataclass(frozen=True, kw_only=True)
class FileMatchesCheck(CheckBase):
    """Passes iff the file's content equals `content`, contains a match of `regex`, or hashes to `sha256`."""

    kind: ClassVar[str] = "file_matches"
    path: str
    content: str | None = None
    regex: str | None = None
    sha256: str | None = None  # lowercase hex


@dataclass(frozen=True, kw_only=True)
class HttpCheck(CheckBase):
    """Passes iff a GET of url, made inside the guest, answers expect_status (and the body has `contains`)."""

    kind: ClassVar[str] = "http"
    url: str
    expect_status: int = 200
    contains: str | None = None


@dataclass(frozen=True, kw_only=True)
class RewardCheck(CheckBase):
    """Passes iff the reward read from the reward file is >= threshold."""

    kind: ClassVar[str] = "reward"
    path: str | None = None  # None: reward.txt, else reward.json, under /logs/verifier
    threshold: float = 1.0

    @property
    def candidate_paths(self) -> tuple[str, ...]:
        return DEFAULT_REWARD_PATHS if self.path is None else (self.path,)


Check = CommandCheck | FileExistsCheck | FileMatchesCheck | HttpCheck | RewardCheck
CHECK_TYPES: dict[str, type[Check]] = {
    c.kind: c for c in (CommandCheck, FileExistsCheck, FileMatchesCheck, HttpCheck, RewardCheck)
}


# --- the whole file -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Smolfile:
    """A validated Smolfile with every default filled in. base_dir is where it came from (not in digests)."""

    image: str = DEFAULT_IMAGE
    cpus: int = DEFAULT_CPUS
    memory_mib: int = DEFAULT_MEMORY_MIB
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    mounts: tuple[Mount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # sorted by name
    setup: tuple[Command, ...] = ()
    task: Command | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    checks: tuple[Check, ...] = ()
    base_dir: str | None = None  # absolute host directory; required when there are mounts
    # [verifier.mounts]: copied in only when verification starts and removed when it ends, so the task never sees
    # them (the tests of a task; docs/smolfile.md, "Verifier mounts"); not part of a bake
    verifier_mounts: tuple[Mount, ...] = ()
    # [verifier] outputs: guest paths where the task's work lands. Declared, a Run is sealed: only these leave the
    # task's machine, which is then destroyed, and the checks run in a pristine machine of the same Smolfile
    # that receives them (docs/verifier.md, "Sealed verification")
    verifier_outputs: tuple[str, ...] = ()
    # [verifier] image: the sealed verification's machine boots this image (Harbor's separate verifier
    # environment) with the Smolfile's resources, env and network, but none of the task's mounts or setup; "": the
    # task's own image, with its mounts and setup (docs/verifier.md, "A separate verifier image")
    verifier_image: str = ""

    @property
    def sealed(self) -> bool:
        return bool(self.verifier_outputs)

    def verifier_smolfile(self) -> Smolfile:
        """The Smolfile the sealed verification's machine is created from: this one, or with a verifier image,
        that image with neither the task's mounts nor its setup (they belong to the task's environment)."""
        if not self.verifier_image:
            return self
        return replace(self, image=self.verifier_image, mounts=(), setup=(), task=None)

    @property
    def all_mounts(self) -> tuple[tuple[tuple[str, ...], Mount], ...]:
        """Every mount with the key path its errors are reported at: [mounts] then [verifier.mounts]."""
        return (tuple((("mounts",), m) for m in self.mounts)
                + tuple((("verifier", "mounts"), m) for m in self.verifier_mounts))

    @property
    def environ(self) -> dict[str, str]:
        return dict(self.env)

    def host_path(self, mount: Mount) -> Path:
        """Absolute host path of a mount's source (lexically inside base_dir)."""
        if self.base_dir is None:
            raise ValueError("this Smolfile has no base directory")
        return Path(posixpath.normpath(posixpath.join(self.base_dir, mount.host)))
