"""The small JSON record the daemon keeps of each machine, so a restarted daemon can re-adopt it: in
``STATE_DIR/records/<id>/`` (0700, root's), not in the machine's state directory, which its jailed VMM owns;
authenticated with the daemon's key all the same (smold/authrecord.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from smold.authrecord import RecordAuthError, RecordKey

RECORD_FILE = "machine.json"
RECORD_VERSION = 1
RECORDS_DIR = "records"   # beside machines/ in the daemon's state directory


def record_dir(state_dir: Path) -> Path:
    """Where the daemon keeps the records of the machine whose state directory is ``state_dir``
    (``STATE_DIR/machines/<id>`` -> ``STATE_DIR/records/<id>``): out of its VMM's reach."""
    return state_dir.parent.parent / RECORDS_DIR / state_dir.name


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

    def save(self, state_dir: Path, key: RecordKey) -> None:
        """Write atomically, with the daemon's MAC (smold/authrecord.py)."""
        key.write(state_dir / RECORD_FILE, asdict(self), f"{RECORD_FILE} {self.id}", indent=1)

    @classmethod
    def load(cls, state_dir: Path, key: RecordKey) -> MachineRecord:
        """The record of the machine whose directory this is; RecordError unless this daemon wrote it there."""
        path = state_dir / RECORD_FILE
        try:
            data = key.read(path, f"{RECORD_FILE} {state_dir.name}")
        except RecordAuthError as e:
            raise RecordError(str(e)) from None
        if data.get("version") != RECORD_VERSION:
            raise RecordError(f"{path}: not a version {RECORD_VERSION} machine record")
        try:
            return cls(**data)
        except TypeError as e:
            raise RecordError(f"{path}: {e}") from None
