"""The small JSON record each machine keeps in its state directory, so a restarted daemon can re-adopt it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORD_FILE = "machine.json"
RECORD_VERSION = 1


class RecordError(Exception):
    """A machine record is missing, unreadable or not of this version."""


@dataclass
class MachineRecord:
    """Plain values only: what the machine is, which process runs it, and the Smolfile it came from."""

    id: str
    name: str
    phase: str                      # "creating", "running", "failed" (see smold.api.machine.MachineState)
    created_at: str                 # ISO 8601, UTC
    cpus: int
    memory_mib: int
    image: str
    image_digest: str
    smolfile: dict[str, Any]        # smold.smolfile.to_mapping(); parse_mapping() gives it back
    smolfile_digest: str
    base_dir: str | None
    launcher: str                   # Launcher.kind
    pid: int = 0
    argv: list[str] = field(default_factory=list)
    started: int | None = None      # /proc/PID/stat start time of the VM process
    failure_reason: str = ""
    checkpoint: str = ""            # the checkpoint directory it was restored from ("" when booted)
    run_result: str = ""            # the stored result of the Run it serves ("": not a Run's machine)
    version: int = RECORD_VERSION

    def save(self, state_dir: Path) -> None:
        """Write atomically (temp file + rename)."""
        path = state_dir / RECORD_FILE
        tmp = state_dir / f".{RECORD_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), sort_keys=True, indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: Path) -> MachineRecord:
        try:
            data = json.loads((state_dir / RECORD_FILE).read_text())
        except (OSError, ValueError) as e:
            raise RecordError(f"{state_dir / RECORD_FILE}: {e}") from None
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise RecordError(f"{state_dir / RECORD_FILE}: not a version {RECORD_VERSION} machine record")
        try:
            return cls(**data)
        except TypeError as e:
            raise RecordError(f"{state_dir / RECORD_FILE}: {e}") from None
