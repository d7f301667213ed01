"""Plain result types of the smol SDK: machines, exec events and results, verifier results."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from smold.api.v1 import smol_pb2 as pb

_STATES = {v: k.removeprefix("MACHINE_STATE_").lower() for k, v in pb.MachineState.items()}
# proto Outcome -> the SDK's string ("pass", "fail", "verifier_error", "infra_error"); unset -> ""
OUTCOME_NAMES = {v: k.removeprefix("OUTCOME_").lower() for k, v in pb.Outcome.items() if v}


@dataclass(frozen=True)
class MachineInfo:
    """A machine as smold reports it; ``state`` is "creating", "running", "failed", ..."""

    id: str
    name: str
    state: str
    cpus: int
    memory_mib: int
    image: str
    image_digest: str
    smolfile_digest: str
    created_at: datetime | None
    failure_reason: str
    console_tail: str
    vmm_pid: int

    @classmethod
    def from_proto(cls, m: pb.Machine) -> MachineInfo:
        return cls(id=m.id, name=m.name, state=_STATES.get(m.state, str(m.state)), cpus=m.cpus,
                   memory_mib=m.memory_mib, image=m.image, image_digest=m.image_digest,
                   smolfile_digest=m.smolfile_digest,
                   created_at=m.created_at.ToDatetime() if m.HasField("created_at") else None,
                   failure_reason=m.failure_reason, console_tail=m.console_tail, vmm_pid=m.vmm_pid)


@dataclass(frozen=True)
class DaemonInfo:
    """smold's limits and what of them is in use now (GetDaemonInfo)."""

    max_machines: int
    max_memory_mib: int
    max_cpus: int
    default_memory_mib: int
    live_machines: int
    memory_in_use_mib: int
    public_network: bool

    @classmethod
    def from_proto(cls, r: pb.GetDaemonInfoResponse) -> DaemonInfo:
        return cls(max_machines=r.max_machines, max_memory_mib=r.max_memory_mib, max_cpus=r.max_cpus,
                   default_memory_mib=r.default_memory_mib, live_machines=r.live_machines,
                   memory_in_use_mib=r.memory_in_use_mib, public_network=r.public_network)

    @property
    def machines_that_fit(self) -> int:
        """How many machines of the default size the limits allow at once."""
        return max(1, min(self.max_machines, self.max_memory_mib // max(1, self.default_memory_mib)))


@dataclass(frozen=True)
class Stdout:
    """A chunk of the command's standard output."""

    data: bytes


@dataclass(frozen=True)
class Stderr:
    """A chunk of the command's standard error."""

    data: bytes


@dataclass(frozen=True)
class Exit:
    """The last event of an exec: ``exit_code`` if it exited, ``signal`` if it was killed."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_ms: int

    @property
    def returncode(self) -> int:
        """Shell convention: the exit code, or 128+N after signal N."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + (self.signal or 0)


ExecEvent = Stdout | Stderr | Exit


def exec_event_from_proto(msg: pb.ExecResponse) -> ExecEvent | None:
    which = msg.WhichOneof("event")
    if which == "stdout":
        return Stdout(msg.stdout)
    if which == "stderr":
        return Stderr(msg.stderr)
    if which == "exit":
        e = msg.exit
        return Exit(exit_code=e.exit_code if e.HasField("exit_code") else None,
                    signal=e.signal if e.HasField("signal") else None, timed_out=e.timed_out,
                    duration_ms=e.duration_ms)
    return None


@dataclass(frozen=True)
class ExecResult:
    """A command run to completion: all of its output and how it ended."""

    stdout: bytes
    stderr: bytes
    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def returncode(self) -> int:
        """Shell convention: the exit code, or 128+N after signal N."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + (self.signal or 0)


class ExecCollector:
    """Accumulates exec events into an ExecResult."""

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.exit: Exit | None = None

    def add(self, event: ExecEvent) -> None:
        if isinstance(event, Stdout):
            self.stdout += event.data
        elif isinstance(event, Stderr):
            self.stderr += event.data
        else:
            self.exit = event

    def result(self) -> ExecResult:
        from .errors import ExecStreamError
        if self.exit is None:
            raise ExecStreamError("the exec stream ended without an exit status")
        e = self.exit
        return ExecResult(bytes(self.stdout), bytes(self.stderr), e.exit_code, e.signal, e.timed_out, e.duration_ms)


@dataclass(frozen=True)
class CheckResult:
    """One verifier check's verdict and evidence."""

    name: str
    kind: str
    passed: bool
    exit_code: int | None
    output_tail: str
    detail: str
    timed_out: bool
    duration_ms: int
    error: bool = False          # the check could not be decided (guest protocol error, harness timeout)


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's verdict: passed iff there is at least one check and all passed."""

    passed: bool
    checks: list[CheckResult] = field(default_factory=list)
    image_digest: str = ""
    smolfile_digest: str = ""
    duration_ms: int = 0
    outcome: str = ""            # "pass", "fail" or "verifier_error" (docs/verifier.md, "Outcomes")
    outcome_detail: str = ""     # one line: why
    result_id: str = ""          # Verify: the stored result (Client.get_result)

    @classmethod
    def from_proto(cls, r: pb.VerifyResult) -> VerifyResult:
        checks = [CheckResult(name=c.name, kind=c.kind, passed=c.passed,
                              exit_code=c.evidence.exit_code if c.evidence.HasField("exit_code") else None,
                              output_tail=c.evidence.output_tail, detail=c.evidence.detail,
                              timed_out=c.evidence.timed_out, duration_ms=c.evidence.duration_ms, error=c.error)
                  for c in r.checks]
        outcome = OUTCOME_NAMES.get(r.outcome, "")
        return cls(passed=r.passed, checks=checks, image_digest=r.image_digest, smolfile_digest=r.smolfile_digest,
                   duration_ms=r.duration_ms, outcome=outcome, outcome_detail=r.outcome_detail,
                   result_id=r.result_id)


@dataclass(frozen=True)
class StepResult:
    """A setup step or the task as it ran during a one-shot Run."""

    name: str
    ok: bool
    exit_code: int | None
    output_tail: str
    detail: str
    timed_out: bool
    duration_ms: int


@dataclass(frozen=True)
class Artifact:
    """A file kept beside a stored Run (Client.get_artifact): "outputs.tar", "verifier-logs.tar"."""

    name: str
    size_bytes: int
    sha256: str
    kept: bool       # False: not kept, and note says why
    note: str = ""


@dataclass(frozen=True)
class RunResult:
    """A one-shot Run: the verifier's result, the steps' evidence, and why it stopped early (``error``)."""

    result: VerifyResult
    steps: list[StepResult]
    machine_id: str
    error: str
    duration_ms: int
    outcome: str = ""            # "pass", "fail", "verifier_error" or "infra_error" (docs/verifier.md)
    outcome_detail: str = ""
    result_id: str = ""          # the stored result (Client.get_result): kept even if the client had gone
    sealed: bool = False         # the checks ran in a pristine machine that got only the declared outputs
    verifier_machine_id: str = ""
    image_digest: str = ""       # of the image the task ran on; result.image_digest: the one the checks ran on
    artifacts: list[Artifact] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.result.passed

    @classmethod
    def from_proto(cls, r: pb.RunResponse) -> RunResult:
        steps = [StepResult(name=s.name, ok=s.ok,
                            exit_code=s.evidence.exit_code if s.evidence.HasField("exit_code") else None,
                            output_tail=s.evidence.output_tail, detail=s.evidence.detail,
                            timed_out=s.evidence.timed_out, duration_ms=s.evidence.duration_ms)
                 for s in r.steps]
        return cls(result=VerifyResult.from_proto(r.result), steps=steps, machine_id=r.machine_id, error=r.error,
                   duration_ms=r.duration_ms, outcome=OUTCOME_NAMES.get(r.outcome, ""),
                   outcome_detail=r.outcome_detail, result_id=r.result_id, sealed=r.sealed,
                   verifier_machine_id=r.verifier_machine_id, image_digest=r.image_digest,
                   artifacts=[Artifact(a.name, a.size_bytes, a.sha256, a.kept, a.note) for a in r.artifacts])


RESULT_STATE_NAMES = {v: k.removeprefix("RESULT_STATE_").lower() for k, v in pb.ResultState.items() if v}


@dataclass(frozen=True)
class StoredResult:
    """A Run or Verify result from the daemon's result store (docs/verifier.md, "Results")."""

    id: str
    kind: str                    # "run" or "verify"
    state: str                   # "running", "done" or "interrupted"
    outcome: str                 # "" while running; else "pass", "fail", "verifier_error", "infra_error", "interrupted"
    outcome_detail: str
    labels: dict[str, str]
    created_at: datetime
    finished_at: datetime | None
    machine_id: str
    run: RunResult | None = None        # kind "run", done (get_result only: list_results leaves it out)
    verify: VerifyResult | None = None  # kind "verify" (get_result only)

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    @classmethod
    def from_proto(cls, r: pb.StoredResult) -> StoredResult:
        return cls(id=r.id, kind=r.kind, state=RESULT_STATE_NAMES.get(r.state, ""),
                   outcome=OUTCOME_NAMES.get(r.outcome, ""), outcome_detail=r.outcome_detail, labels=dict(r.labels),
                   created_at=r.created_at.ToDatetime(tzinfo=UTC),
                   finished_at=r.finished_at.ToDatetime(tzinfo=UTC) if r.HasField("finished_at") else None,
                   machine_id=r.machine_id, run=RunResult.from_proto(r.run) if r.HasField("run") else None,
                   verify=VerifyResult.from_proto(r.verify) if r.HasField("verify") else None)
