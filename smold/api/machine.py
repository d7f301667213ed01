"""What the API reports about machines and runs: state enum, machine snapshot, Run steps and result."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime

from smold.smolfile import PortForward, Smolfile
from smold.verifier import Evidence, Outcome, VerifyResult


class MachineState(enum.Enum):
    """Life cycle of a machine (proto: smol.v1.MachineState)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class DeniedDestination:
    """A destination the guest tried to reach and was refused (proto: smol.v1.DeniedDestination)."""

    address: str
    protocol: str  # "tcp", "udp", "icmp", ...
    port: int = 0  # 0 for protocols without ports
    packets: int = 0


@dataclass(frozen=True)
class NetworkReport:
    """What a machine's network policy refused (proto: smol.v1.NetworkReport; docs/networking.md "Report")."""

    counters: tuple[tuple[str, int], ...] = ()               # named nft counter -> packets
    denied: tuple[DeniedDestination, ...] = ()
    denied_names: tuple[tuple[str, int], ...] = ()           # DNS name -> queries refused
    denied_dns_queries: int = 0

    @property
    def denied_packets(self) -> int:
        return sum(n for name, n in self.counters if name.startswith("denied_"))


@dataclass(frozen=True)
class MachineInfo:
    """A machine as GetMachine/ListMachines show it (proto: smol.v1.Machine)."""

    id: str
    name: str
    state: MachineState
    cpus: int
    memory_mib: int
    image: str
    created_at: datetime  # timezone-aware (UTC)
    image_digest: str = ""
    smolfile_digest: str = ""
    failure_reason: str = ""
    console_tail: str = ""
    vmm_pid: int = 0  # the VMM process on the host; 0 when it is gone
    restored_from: str = ""  # "" (booted), "bake:sha256:<hex>", "checkpoint:<name>" or "fork:<parent id>"
    network: NetworkReport | None = None  # None: networking off (no NIC)
    forwarded_ports: tuple[PortForward, ...] = ()  # network.forward as listening now (host ports bound)


@dataclass(frozen=True)
class CheckpointInfo:
    """A named restore point in the daemon's checkpoint store (proto: smol.v1.Checkpoint)."""

    name: str
    path: str
    size_bytes: int
    created_at: datetime  # timezone-aware (UTC)
    machine_id: str = ""
    machine_ids: tuple[str, ...] = ()  # machines in the daemon's table restored from it


@dataclass(frozen=True)
class BakeInfo:
    """A pre-baked image in the daemon's bake store (proto: smol.v1.Bake)."""

    key: str
    path: str
    image: str
    image_digest: str
    cpus: int
    memory_mib: int
    size_bytes: int
    created_at: datetime  # timezone-aware (UTC)
    bake_seconds: float = 0.0
    smolfile_digest: str = ""
    error: str = ""  # set when the bake failed its checks
    machine_ids: tuple[str, ...] = ()  # machines in the daemon's table restored from it


@dataclass(frozen=True)
class StepResult:
    """One step of creating or running a machine: "boot", "mount[i]", "setup[i]" or "task" (proto: StepResult)."""

    name: str
    ok: bool
    evidence: Evidence


@dataclass(frozen=True)
class Artifact:
    """A file kept beside a stored result (evidence, never part of the verdict); ``content`` is carried only from
    the controller to the store, which keeps it and fills ``sha256`` and ``kept``."""

    name: str
    size_bytes: int
    sha256: str = ""
    kept: bool = False
    note: str = ""
    content: bytes = field(default=b"", repr=False, compare=False)


@dataclass(frozen=True)
class RunResult:
    """What Run returns: the verifier's result and every step's evidence; error when it stopped before verify."""

    result: VerifyResult
    steps: tuple[StepResult, ...]
    machine_id: str
    error: str = ""
    duration_ms: int = 0
    network: NetworkReport | None = None  # read just before the machine was destroyed; None: networking off
    # with error: INFRA_ERROR when a mount or setup step failed, VERIFIER_ERROR when the verifier could not reach
    # the guest (docs/verifier.md, "Outcomes")
    error_outcome: Outcome = Outcome.INFRA_ERROR
    sealed: bool = False           # the checks ran in a second, pristine machine (docs/verifier.md)
    verifier_machine_id: str = ""  # that machine (destroyed)
    image_digest: str = ""         # of the image the task ran on (result.image_digest: the verifier machine's)
    artifacts: tuple[Artifact, ...] = ()  # evidence kept beside the stored result (docs/verifier.md, "Artifacts")
    smolfile: Smolfile | None = None  # the validated Smolfile the Run ran (its identity, with result.smolfile_digest)

    @property
    def outcome(self) -> Outcome:
        """The Run's verdict: the verifier's, unless the run stopped before it could give one."""
        return self.error_outcome if self.error else self.result.outcome

    @property
    def outcome_detail(self) -> str:
        return self.error if self.error else self.result.outcome_detail


class ResultState(enum.Enum):
    """Where a stored result stands (proto: ResultState; docs/verifier.md, "Results")."""

    RUNNING = "running"          # the Run is still going
    DONE = "done"                # the outcome is final
    INTERRUPTED = "interrupted"  # the daemon stopped or crashed during the Run; its machine was removed


@dataclass(frozen=True)
class StoredResult:
    """One row of the result store. ``payload``: the RunResponse (kind "run") or VerifyResult (kind "verify")
    as proto bytes, empty while running, when interrupted, and in listings."""

    id: str
    kind: str                            # "run" or "verify"
    state: ResultState
    outcome: Outcome | None              # None while running
    outcome_detail: str
    labels: tuple[tuple[str, str], ...]  # sorted by key
    created_at: float                    # Unix time
    finished_at: float | None
    machine_id: str
    payload: bytes = b""
