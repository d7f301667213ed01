"""What the API reports about a machine: its state enum and a frozen snapshot of its public fields."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime


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
