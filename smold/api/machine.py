"""What the API reports about machines and runs: state enum, machine snapshot, Run steps and result."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from smold.verifier import Evidence, VerifyResult


class MachineState(enum.Enum):
    """Life cycle of a machine (proto: smol.v1.MachineState)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


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
class RunResult:
    """What Run returns: the verifier's result and every step's evidence; error when it stopped before verify."""

    result: VerifyResult
    steps: tuple[StepResult, ...]
    machine_id: str
    error: str = ""
    duration_ms: int = 0
