"""Pure conversions between the project's dataclasses and smol.v1 proto messages.

Inbound Smolfile content (an inline spec, or checks in a VerifyRequest) is turned into the Smolfile's
TOML-shaped mapping and validated by the same parser as a Smolfile.toml, so both paths accept and
reject exactly the same things; errors are SmolfileError naming the TOML key. Conversions here never
touch the file system (mount sources are checked by smold.smolfile.check_mount_sources).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from smold.agent import ExecEvent, ExecExit, ExecStderr, ExecStdout
from smold.smolfile import (
    Check,
    Command,
    CommandCheck,
    FileExistsCheck,
    FileMatchesCheck,
    HttpCheck,
    Limits,
    NetworkPolicy,
    PortForward,
    Smolfile,
    SmolfileError,
    parse_mapping,
    parse_smolfile,
)
from smold.smolfile.errors import KeyPath
from smold.verifier import CheckResult, Evidence, Outcome, VerifyResult

from .machine import (
    Artifact,
    BakeInfo,
    CheckpointInfo,
    DeniedDestination,
    MachineInfo,
    MachineState,
    NetworkReport,
    ResultState,
    RunResult,
    StepResult,
    StoredResult,
)
from .v1 import smol_pb2 as pb

INLINE_SPEC = "<inline spec>"
INLINE_CHECKS = "<request checks>"


class ConversionError(ValueError):
    """A proto message cannot be turned into its dataclass (a required field is unset or out of range)."""


# --- machines ---------------------------------------------------------------------------------------------
_STATE_TO_PROTO: dict[MachineState, pb.MachineState] = {
    MachineState.CREATING: pb.MACHINE_STATE_CREATING,
    MachineState.RUNNING: pb.MACHINE_STATE_RUNNING,
    MachineState.PAUSED: pb.MACHINE_STATE_PAUSED,
    MachineState.STOPPING: pb.MACHINE_STATE_STOPPING,
    MachineState.STOPPED: pb.MACHINE_STATE_STOPPED,
    MachineState.FAILED: pb.MACHINE_STATE_FAILED,
}
_STATE_FROM_PROTO: dict[int, MachineState] = {int(v): k for k, v in _STATE_TO_PROTO.items()}


def machine_state_to_proto(state: MachineState) -> pb.MachineState:
    return _STATE_TO_PROTO[state]


def machine_state_from_proto(state: int) -> MachineState:
    try:
        return _STATE_FROM_PROTO[state]
    except KeyError:
        raise ConversionError(f"machine state {state} is unspecified or unknown") from None


def machine_to_proto(m: MachineInfo) -> pb.Machine:
    if m.created_at.tzinfo is None:
        raise ConversionError("created_at must be timezone-aware")
    msg = pb.Machine(
        id=m.id,
        name=m.name,
        state=machine_state_to_proto(m.state),
        cpus=m.cpus,
        memory_mib=m.memory_mib,
        image=m.image,
        image_digest=m.image_digest,
        smolfile_digest=m.smolfile_digest,
        failure_reason=m.failure_reason,
        console_tail=m.console_tail,
        vmm_pid=m.vmm_pid,
        restored_from=m.restored_from,
        forwarded_ports=[pb.ForwardedPort(guest_port=f.guest_port, host_address=f.host_address,
                                          host_port=f.host_port) for f in m.forwarded_ports],
    )
    msg.created_at.FromDatetime(m.created_at)
    if m.network is not None:
        msg.network.CopyFrom(network_report_to_proto(m.network))
    return msg


def network_report_to_proto(r: NetworkReport) -> pb.NetworkReport:
    return pb.NetworkReport(
        counters=[pb.NetworkCounter(name=n, packets=p) for n, p in r.counters],
        denied=[pb.DeniedDestination(address=d.address, protocol=d.protocol, port=d.port, packets=d.packets)
                for d in r.denied],
        denied_names=[pb.DeniedName(name=n, queries=q) for n, q in r.denied_names],
        denied_dns_queries=r.denied_dns_queries)


def network_report_from_proto(msg: pb.NetworkReport) -> NetworkReport:
    return NetworkReport(
        counters=tuple((c.name, c.packets) for c in msg.counters),
        denied=tuple(DeniedDestination(d.address, d.protocol, d.port, d.packets) for d in msg.denied),
        denied_names=tuple((d.name, d.queries) for d in msg.denied_names),
        denied_dns_queries=msg.denied_dns_queries)


def checkpoint_to_proto(c: CheckpointInfo) -> pb.Checkpoint:
    if c.created_at.tzinfo is None:
        raise ConversionError("created_at must be timezone-aware")
    msg = pb.Checkpoint(name=c.name, path=c.path, size_bytes=c.size_bytes, machine_id=c.machine_id,
                        machine_ids=list(c.machine_ids))
    msg.created_at.FromDatetime(c.created_at)
    return msg


def image_to_proto(e: Any) -> pb.Image:
    """A smold.oci.images.ImageEntry (names, manifest, size, created epoch seconds) as a proto Image."""
    msg = pb.Image(names=list(e.names), manifest_digest=e.manifest, size_bytes=e.size)
    msg.created_at.FromDatetime(datetime.fromtimestamp(e.created, UTC))
    return msg


def checkpoint_from_proto(msg: pb.Checkpoint) -> CheckpointInfo:
    if not msg.HasField("created_at"):
        raise ConversionError("checkpoint has no created_at")
    return CheckpointInfo(name=msg.name, path=msg.path, size_bytes=msg.size_bytes,
                          created_at=msg.created_at.ToDatetime(tzinfo=UTC), machine_id=msg.machine_id,
                          machine_ids=tuple(msg.machine_ids))


def bake_to_proto(b: BakeInfo) -> pb.Bake:
    if b.created_at.tzinfo is None:
        raise ConversionError("created_at must be timezone-aware")
    msg = pb.Bake(key=b.key, path=b.path, image=b.image, image_digest=b.image_digest, cpus=b.cpus,
                  memory_mib=b.memory_mib, size_bytes=b.size_bytes, bake_seconds=b.bake_seconds,
                  smolfile_digest=b.smolfile_digest, error=b.error, machine_ids=list(b.machine_ids))
    msg.created_at.FromDatetime(b.created_at)
    return msg


def bake_from_proto(msg: pb.Bake) -> BakeInfo:
    if not msg.HasField("created_at"):
        raise ConversionError("bake has no created_at")
    return BakeInfo(key=msg.key, path=msg.path, image=msg.image, image_digest=msg.image_digest, cpus=msg.cpus,
                    memory_mib=msg.memory_mib, size_bytes=msg.size_bytes,
                    created_at=msg.created_at.ToDatetime(tzinfo=UTC), bake_seconds=msg.bake_seconds,
                    smolfile_digest=msg.smolfile_digest, error=msg.error, machine_ids=tuple(msg.machine_ids))


def machine_from_proto(msg: pb.Machine) -> MachineInfo:
    if not msg.HasField("created_at"):
        raise ConversionError("machine has no created_at")
    return MachineInfo(
        id=msg.id,
        name=msg.name,
        state=machine_state_from_proto(msg.state),
        cpus=msg.cpus,
        memory_mib=msg.memory_mib,
        image=msg.image,
        created_at=msg.created_at.ToDatetime(tzinfo=UTC),
        image_digest=msg.image_digest,
        smolfile_digest=msg.smolfile_digest,
        failure_reason=msg.failure_reason,
        console_tail=msg.console_tail,
        vmm_pid=msg.vmm_pid,
        restored_from=msg.restored_from,
        network=network_report_from_proto(msg.network) if msg.HasField("network") else None,
        forwarded_ports=tuple(PortForward(f.guest_port, f.host_port, f.host_address) for f in msg.forwarded_ports),
    )


# --- verifier results -------------------------------------------------------------------------------------
def evidence_to_proto(e: Evidence) -> pb.Evidence:
    msg = pb.Evidence(
        output_tail=e.output_tail, duration_ms=e.duration_ms, detail=e.detail, timed_out=e.timed_out
    )
    if e.exit_code is not None:
        msg.exit_code = e.exit_code
    return msg


def evidence_from_proto(msg: pb.Evidence) -> Evidence:
    return Evidence(
        exit_code=msg.exit_code if msg.HasField("exit_code") else None,
        output_tail=msg.output_tail,
        duration_ms=msg.duration_ms,
        detail=msg.detail,
        timed_out=msg.timed_out,
    )


OUTCOME_TO_PROTO = {Outcome.PASS: pb.OUTCOME_PASS, Outcome.FAIL: pb.OUTCOME_FAIL,
                    Outcome.VERIFIER_ERROR: pb.OUTCOME_VERIFIER_ERROR, Outcome.INFRA_ERROR: pb.OUTCOME_INFRA_ERROR,
                    Outcome.INTERRUPTED: pb.OUTCOME_INTERRUPTED}
OUTCOME_FROM_PROTO = {v: k for k, v in OUTCOME_TO_PROTO.items()}


def check_result_to_proto(r: CheckResult) -> pb.CheckResult:
    return pb.CheckResult(name=r.name, kind=r.kind, passed=r.passed, evidence=evidence_to_proto(r.evidence),
                          error=r.error)


def check_result_from_proto(msg: pb.CheckResult) -> CheckResult:
    return CheckResult(msg.name, msg.kind, msg.passed, evidence_from_proto(msg.evidence), msg.error)


def verify_result_to_proto(r: VerifyResult, result_id: str = "") -> pb.VerifyResult:
    return pb.VerifyResult(
        result_id=result_id,
        passed=r.passed,
        checks=[check_result_to_proto(c) for c in r.checks],
        image_digest=r.image_digest,
        smolfile_digest=r.smolfile_digest,
        duration_ms=r.duration_ms,
        outcome=OUTCOME_TO_PROTO[r.outcome],
        outcome_detail=r.outcome_detail,
    )


def verify_result_from_proto(msg: pb.VerifyResult) -> VerifyResult:
    return VerifyResult(
        passed=msg.passed,
        checks=tuple(check_result_from_proto(c) for c in msg.checks),
        image_digest=msg.image_digest,
        smolfile_digest=msg.smolfile_digest,
        duration_ms=msg.duration_ms,
    )


def step_result_to_proto(r: StepResult) -> pb.StepResult:
    return pb.StepResult(name=r.name, ok=r.ok, evidence=evidence_to_proto(r.evidence))


def step_result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(msg.name, msg.ok, evidence_from_proto(msg.evidence))


def run_result_to_proto(r: RunResult, result_id: str = "") -> pb.RunResponse:
    return pb.RunResponse(
        result_id=result_id,
        state=pb.RESULT_STATE_DONE,
        result=verify_result_to_proto(r.result),
        steps=[step_result_to_proto(s) for s in r.steps],
        machine_id=r.machine_id,
        error=r.error,
        duration_ms=r.duration_ms,
        network=network_report_to_proto(r.network) if r.network is not None else None,
        outcome=OUTCOME_TO_PROTO[r.outcome],
        outcome_detail=r.outcome_detail,
        sealed=r.sealed,
        verifier_machine_id=r.verifier_machine_id,
        image_digest=r.image_digest,
        artifacts=[pb.Artifact(name=a.name, size_bytes=a.size_bytes, sha256=a.sha256, kept=a.kept, note=a.note)
                   for a in r.artifacts],
        smolfile=smolfile_to_spec_proto(r.smolfile) if r.smolfile is not None else None,
    )


def run_result_from_proto(msg: pb.RunResponse) -> RunResult:
    return RunResult(
        result=verify_result_from_proto(msg.result),
        steps=tuple(step_result_from_proto(s) for s in msg.steps),
        machine_id=msg.machine_id,
        error=msg.error,
        duration_ms=msg.duration_ms,
        network=network_report_from_proto(msg.network) if msg.HasField("network") else None,
        error_outcome=OUTCOME_FROM_PROTO.get(msg.outcome, Outcome.INFRA_ERROR) if msg.error else Outcome.INFRA_ERROR,
        sealed=msg.sealed,
        verifier_machine_id=msg.verifier_machine_id,
        image_digest=msg.image_digest,
        artifacts=tuple(Artifact(name=a.name, size_bytes=a.size_bytes, sha256=a.sha256, kept=a.kept, note=a.note)
                        for a in msg.artifacts),
    )


RESULT_STATE_TO_PROTO = {ResultState.RUNNING: pb.RESULT_STATE_RUNNING, ResultState.DONE: pb.RESULT_STATE_DONE,
                         ResultState.INTERRUPTED: pb.RESULT_STATE_INTERRUPTED}


def stored_result_to_proto(r: StoredResult) -> pb.StoredResult:
    """A stored row; its payload (RunResponse or VerifyResult bytes) goes into ``run`` or ``verify``."""
    msg = pb.StoredResult(id=r.id, kind=r.kind, state=RESULT_STATE_TO_PROTO[r.state],
                          outcome=OUTCOME_TO_PROTO[r.outcome] if r.outcome is not None else pb.OUTCOME_UNSPECIFIED,
                          outcome_detail=r.outcome_detail, labels=dict(r.labels), machine_id=r.machine_id)
    msg.created_at.FromDatetime(datetime.fromtimestamp(r.created_at, UTC))
    if r.finished_at is not None:
        msg.finished_at.FromDatetime(datetime.fromtimestamp(r.finished_at, UTC))
    if r.payload:
        if r.kind == "run":
            msg.run.ParseFromString(r.payload)
        else:
            msg.verify.ParseFromString(r.payload)
    return msg


# --- exec events ------------------------------------------------------------------------------------------
def exec_event_to_proto(event: ExecEvent) -> pb.ExecResponse:
    """One agent exec event as one streamed ExecResponse."""
    if isinstance(event, ExecStdout):
        return pb.ExecResponse(stdout=event.data)
    if isinstance(event, ExecStderr):
        return pb.ExecResponse(stderr=event.data)
    exit_msg = pb.ExecExit(timed_out=event.timed_out, duration_ms=max(0, round(event.duration * 1000)))
    if event.exit_code is not None:
        exit_msg.exit_code = event.exit_code
    if event.signal is not None:
        exit_msg.signal = event.signal
    return pb.ExecResponse(exit=exit_msg)


def exec_event_from_proto(msg: pb.ExecResponse) -> ExecEvent:
    which = msg.WhichOneof("event")
    if which == "stdout":
        return ExecStdout(msg.stdout)
    if which == "stderr":
        return ExecStderr(msg.stderr)
    if which == "exit":
        e = msg.exit
        return ExecExit(
            exit_code=e.exit_code if e.HasField("exit_code") else None,
            signal=e.signal if e.HasField("signal") else None,
            timed_out=e.timed_out,
            duration=e.duration_ms / 1000,
        )
    raise ConversionError("ExecResponse has no event")


# --- Smolfile: dataclass -> proto -------------------------------------------------------------------------
def _set_run(msg: pb.Command | pb.CommandCheck, run: str | tuple[str, ...]) -> None:
    if isinstance(run, str):
        msg.shell = run
    else:
        msg.argv.extend(run)


def command_to_proto(cmd: Command) -> pb.Command:
    msg = pb.Command(cwd=cmd.cwd or "", user=cmd.user or "")
    _set_run(msg, cmd.run)
    if cmd.timeout is not None:
        msg.timeout_seconds = cmd.timeout
    return msg


def check_to_proto(check: Check) -> pb.Check:
    msg = pb.Check(name=check.name)
    if check.timeout is not None:
        msg.timeout_seconds = check.timeout
    if isinstance(check, CommandCheck):
        msg.command.expect_exit = check.expect_exit
        msg.command.cwd = check.cwd or ""
        msg.command.user = check.user or ""
        _set_run(msg.command, check.run)
    elif isinstance(check, FileExistsCheck):
        msg.file_exists.path = check.path
    elif isinstance(check, FileMatchesCheck):
        msg.file_matches.path = check.path
        if check.content is not None:
            msg.file_matches.content = check.content
        elif check.regex is not None:
            msg.file_matches.regex = check.regex
        elif check.sha256 is not None:
            msg.file_matches.sha256 = check.sha256
    elif isinstance(check, HttpCheck):
        msg.http.url = check.url
        msg.http.expect_status = check.expect_status
        msg.http.contains = check.contains or ""
    else:
        msg.reward.path = check.path or ""
        msg.reward.threshold = check.threshold
    return msg


def smolfile_to_spec_proto(s: Smolfile) -> pb.SmolfileSpec:
    """A validated Smolfile as an inline spec (every default explicit)."""
    msg = pb.SmolfileSpec(
        image=s.image,
        cpus=s.cpus,
        memory_mib=s.memory_mib,
        network=pb.NetworkPolicy(allow=[str(r) for r in s.network.allow],
                                 forward=[str(f) for f in s.network.forward], public=s.network.public,
                                 closed=s.network.closed),
        mounts=[pb.Mount(host_path=m.host, guest_path=m.guest) for m in s.mounts],
        env=dict(s.env),
        setup=[command_to_proto(c) for c in s.setup],
        timeouts=pb.Timeouts(
            boot_seconds=s.timeouts.boot,
            setup_seconds=s.timeouts.setup,
            task_seconds=s.timeouts.task,
            verify_seconds=s.timeouts.verify,
        ),
        checks=[check_to_proto(c) for c in s.checks],
        base_dir=s.base_dir or "",
        verifier_mounts=[pb.Mount(host_path=m.host, guest_path=m.guest) for m in s.verifier_mounts],
        verifier_outputs=list(s.verifier_outputs),
        verifier_image=s.verifier_image,
    )
    if s.task is not None:
        msg.task.CopyFrom(command_to_proto(s.task))
    return msg


# --- Smolfile: proto -> dataclass (validated) -------------------------------------------------------------
def _run_value(msg: pb.Command | pb.CommandCheck, file: str, path: KeyPath) -> str | list[str]:
    if msg.shell and len(msg.argv):
        raise SmolfileError.at(file, path, "set only one of 'shell' and 'argv'")
    return msg.shell if msg.shell or not len(msg.argv) else list(msg.argv)


def _command_mapping(msg: pb.Command, file: str, path: KeyPath) -> dict[str, Any]:
    out: dict[str, Any] = {"run": _run_value(msg, file, [*path, "run"])}
    if msg.HasField("timeout_seconds"):
        out["timeout"] = msg.timeout_seconds
    if msg.cwd:
        out["cwd"] = msg.cwd
    if msg.user:
        out["user"] = msg.user
    return out


def _check_mapping(msg: pb.Check, file: str, path: KeyPath) -> dict[str, Any]:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise SmolfileError.at(file, [*path, "kind"], "no check kind set")
    out: dict[str, Any] = {"kind": kind}
    if msg.name:
        out["name"] = msg.name
    if msg.HasField("timeout_seconds"):
        out["timeout"] = msg.timeout_seconds
    if kind == "command":
        out["run"] = _run_value(msg.command, file, [*path, "run"])
        out["expect_exit"] = msg.command.expect_exit
        if msg.command.cwd:
            out["cwd"] = msg.command.cwd
        if msg.command.user:
            out["user"] = msg.command.user
    elif kind == "file_exists":
        out["path"] = msg.file_exists.path
    elif kind == "file_matches":
        out["path"] = msg.file_matches.path
        match = msg.file_matches.WhichOneof("match")
        if match is not None:
            out[match] = getattr(msg.file_matches, match)
    elif kind == "http":
        out["url"] = msg.http.url
        if msg.http.HasField("expect_status"):
            out["expect_status"] = msg.http.expect_status
        if msg.http.contains:
            out["contains"] = msg.http.contains
    else:
        if msg.reward.path:
            out["path"] = msg.reward.path
        if msg.reward.HasField("threshold"):
            out["threshold"] = msg.reward.threshold
    return out


def _checks_mapping(checks: Iterable[pb.Check], file: str) -> list[dict[str, Any]]:
    return [_check_mapping(c, file, ["verifier", "checks", i]) for i, c in enumerate(checks)]


def network_policy_from_proto(msg: pb.NetworkPolicy) -> NetworkPolicy:
    """A SetNetworkPolicy request's policy, validated as a Smolfile's network table (SmolfileError names the
    entry); nothing allowed, or closed alone: a closed policy."""
    given = bool(len(msg.allow) or len(msg.forward) or msg.public)
    if msg.closed and given:
        raise SmolfileError.at(INLINE_SPEC, ["network", "closed"], "takes no allow, forward or public")
    if not given:
        return NetworkPolicy(closed=True)
    table: dict[str, Any] = {"allow": list(msg.allow), "public": msg.public}
    if len(msg.forward):
        table["forward"] = list(msg.forward)
    return parse_mapping({"network": table}, base_dir=None, filename=INLINE_SPEC).network


def spec_mapping(msg: pb.SmolfileSpec, file: str = INLINE_SPEC) -> dict[str, Any]:
    """The inline spec as the TOML-shaped mapping smold.smolfile.parse_mapping validates."""
    out: dict[str, Any] = {}
    if msg.image:
        out["image"] = msg.image
    if msg.HasField("cpus"):
        out["cpus"] = msg.cpus
    if msg.HasField("memory_mib"):
        out["memory"] = msg.memory_mib
    if msg.network.closed:   # the string form; with other fields the parser names the mistake
        out["network"] = "closed" if not (len(msg.network.allow) or len(msg.network.forward) or msg.network.public) \
            else {"closed": True}
    elif len(msg.network.allow) or len(msg.network.forward) or msg.network.public:
        out["network"] = {"allow": list(msg.network.allow)}
        if len(msg.network.forward):
            out["network"]["forward"] = list(msg.network.forward)
        if msg.network.public:
            out["network"]["public"] = True
    if len(msg.mounts):
        out["mounts"] = _mounts_mapping(msg.mounts, file, ["mounts"])
    if len(msg.env):
        out["env"] = dict(msg.env)
    if len(msg.setup):
        out["setup"] = [_command_mapping(c, file, ["setup", i]) for i, c in enumerate(msg.setup)]
    if msg.HasField("task"):
        out["task"] = _command_mapping(msg.task, file, ["task"])
    if msg.HasField("timeouts"):
        timeouts = {
            key: getattr(msg.timeouts, f"{key}_seconds")
            for key in ("boot", "setup", "task", "verify")
            if msg.timeouts.HasField(f"{key}_seconds")
        }
        if timeouts:
            out["timeouts"] = timeouts
    if len(msg.checks):
        out["verifier"] = {"checks": _checks_mapping(msg.checks, file)}
    if len(msg.verifier_mounts):
        out.setdefault("verifier", {})["mounts"] = _mounts_mapping(msg.verifier_mounts, file, ["verifier", "mounts"])
    if len(msg.verifier_outputs):
        out.setdefault("verifier", {})["outputs"] = list(msg.verifier_outputs)
    if msg.verifier_image:
        out.setdefault("verifier", {})["image"] = msg.verifier_image
    return out


def _mounts_mapping(msgs: Iterable[pb.Mount], file: str, path: list[str]) -> dict[str, str]:
    mounts: dict[str, str] = {}
    for m in msgs:
        if m.host_path in mounts:
            raise SmolfileError.at(file, [*path, m.host_path], "duplicate host path")
        mounts[m.host_path] = m.guest_path
    return mounts


def smolfile_from_spec_proto(
    msg: pb.SmolfileSpec, *, limits: Limits | None = None, filename: str = INLINE_SPEC
) -> Smolfile:
    """Validate an inline spec exactly like a Smolfile.toml. Raises SmolfileError."""
    return parse_mapping(
        spec_mapping(msg, filename), base_dir=msg.base_dir or None, filename=filename, limits=limits
    )


def smolfile_from_proto(msg: pb.Smolfile, *, limits: Limits | None = None) -> Smolfile:
    """A request's Smolfile, TOML text or inline spec, validated. Raises SmolfileError."""
    which = msg.WhichOneof("source")
    if which == "toml":
        filename = msg.toml.filename or "Smolfile.toml"
        return parse_smolfile(msg.toml.text, base_dir=msg.toml.base_dir or None, filename=filename, limits=limits)
    if which == "spec":
        return smolfile_from_spec_proto(msg.spec, limits=limits)
    raise SmolfileError("<request>", "smolfile", "no Smolfile given (set toml or spec)")


def checks_from_proto(checks: Iterable[pb.Check], *, filename: str = INLINE_CHECKS) -> tuple[Check, ...]:
    """Checks sent with a VerifyRequest, validated like a Smolfile's [[verifier.checks]]."""
    mapping = {"verifier": {"checks": _checks_mapping(checks, filename)}}
    return parse_mapping(mapping, base_dir=None, filename=filename).checks


__all__ = [
    "INLINE_CHECKS",
    "INLINE_SPEC",
    "ConversionError",
    "check_result_from_proto",
    "check_result_to_proto",
    "check_to_proto",
    "checks_from_proto",
    "command_to_proto",
    "evidence_from_proto",
    "evidence_to_proto",
    "exec_event_from_proto",
    "exec_event_to_proto",
    "machine_from_proto",
    "machine_state_from_proto",
    "machine_state_to_proto",
    "machine_to_proto",
    "run_result_from_proto",
    "run_result_to_proto",
    "smolfile_from_proto",
    "smolfile_from_spec_proto",
    "smolfile_to_spec_proto",
    "spec_mapping",
    "step_result_from_proto",
    "step_result_to_proto",
    "verify_result_from_proto",
    "verify_result_to_proto",
]
