"""Human-readable rendering of machines, verifier results and Run results."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from smold.api.v1 import smol_pb2 as pb

STATE_NAMES = {v: k.removeprefix("MACHINE_STATE_").lower() for k, v in pb.MachineState.items()}


def to_json(msg: Message) -> str:
    data: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    return json.dumps(data, indent=2, sort_keys=True)


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, str(state))


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def machines_table(machines: list[pb.Machine]) -> str:
    rows = [("ID", "NAME", "STATE", "CPUS", "MEMORY", "IMAGE", "AGE", "PID")]
    now = time.time()
    for m in machines:
        age = _age(max(0.0, now - m.created_at.ToSeconds())) if m.HasField("created_at") else "-"
        rows.append((m.id, m.name or "-", state_name(m.state), str(m.cpus), f"{m.memory_mib}M", m.image, age,
                     str(m.vmm_pid or "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for m in machines:
        if m.failure_reason:
            lines.append(f"{m.id}: failed: {m.failure_reason}")
        lines += [f"{m.id}: {line}" for line in forwarded_ports(m)]
    return "\n".join(lines)


def forwarded_ports(m: pb.Machine) -> list[str]:
    """One line per port forward: where on the host to connect to reach the guest's port."""
    return [f"forward {f.host_address}:{f.host_port} -> guest port {f.guest_port}" for f in m.forwarded_ports]


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f}M"


def bakes_table(bakes: list[pb.Bake]) -> str:
    rows: list[tuple[str, ...]] = [("KEY", "IMAGE", "CPUS", "MEMORY", "DISK", "BAKED IN", "AGE", "MACHINES")]
    now = time.time()
    for b in bakes:
        age = _age(max(0.0, now - b.created_at.ToSeconds())) if b.HasField("created_at") else "-"
        rows.append((b.key.removeprefix("sha256:")[:12], b.image or "-", str(b.cpus), f"{b.memory_mib}M",
                     _mib(b.size_bytes), f"{b.bake_seconds:.0f}s", age, str(len(b.machine_ids))))
    lines = _table(rows)
    lines += [f"{b.key.removeprefix('sha256:')[:12]}: refused: {b.error}" for b in bakes if b.error]
    return "\n".join(lines)


def checkpoints_table(checkpoints: list[pb.Checkpoint]) -> str:
    rows: list[tuple[str, ...]] = [("NAME", "FROM", "DISK", "AGE", "MACHINES")]
    now = time.time()
    for c in checkpoints:
        age = _age(max(0.0, now - c.created_at.ToSeconds())) if c.HasField("created_at") else "-"
        rows.append((c.name, c.machine_id or "-", _mib(c.size_bytes), age, str(len(c.machine_ids))))
    return "\n".join(_table(rows))


def _indent_tail(text: str, prefix: str, lines: int = 20) -> list[str]:
    tail = text.rstrip("\n").splitlines()[-lines:]
    return [f"{prefix}| {line}" for line in tail]


def _evidence_line(ev: pb.Evidence) -> str:
    bits = [f"{ev.duration_ms / 1000:7.2f}s"]
    if ev.HasField("exit_code") and "exit" not in ev.detail:
        bits.append(f"exit {ev.exit_code}")
    if ev.timed_out:
        bits.append("timed out")
    if ev.detail:
        bits.append(ev.detail)
    return "  ".join(bits)


UNDECIDED = {pb.OUTCOME_VERIFIER_ERROR: "VERIFIER_ERROR", pb.OUTCOME_INFRA_ERROR: "INFRA_ERROR",
             pb.OUTCOME_INTERRUPTED: "INTERRUPTED"}


def verdict(result: pb.VerifyResult | pb.RunResponse) -> str:
    """PASS, FAIL, VERIFIER_ERROR (a check could not be decided) or INFRA_ERROR (a Run's mount or setup step
    failed); docs/verifier.md, "Outcomes"."""
    if result.outcome in UNDECIDED:
        return UNDECIDED[result.outcome]
    passed = result.passed if isinstance(result, pb.VerifyResult) else result.result.passed
    return "PASS" if passed else "FAIL"


# smolctl's exit status per verdict (docs/verifier.md, "Outcomes"); 2 stays "the request failed": a harness can
# retry INFRA_ERROR (smol could not run the attempt) and keep VERIFIER_ERROR as evidence about the agent's work
VERDICT_EXIT = {"PASS": 0, "FAIL": 1, "VERIFIER_ERROR": 3, "INFRA_ERROR": 4, "INTERRUPTED": 5, "RUNNING": 6}


def verdict_exit(result: pb.VerifyResult | pb.RunResponse) -> int:
    """smolctl's exit status for a verdict: 0 pass, 1 fail, 3 verifier error, 4 infra error."""
    return VERDICT_EXIT[verdict(result)]


RESULT_STATES = {v: k.removeprefix("RESULT_STATE_").lower() for k, v in pb.ResultState.items()}


def stored_verdict(r: pb.StoredResult) -> str:
    """A stored result's verdict word: RUNNING while it runs, else as verdict() (INTERRUPTED included)."""
    if r.state == pb.RESULT_STATE_RUNNING:
        return "RUNNING"
    if r.outcome in UNDECIDED:
        return UNDECIDED[r.outcome]
    return "PASS" if r.outcome == pb.OUTCOME_PASS else "FAIL"


def results_table(results: list[pb.StoredResult]) -> str:
    rows: list[tuple[str, ...]] = [("ID", "KIND", "VERDICT", "AGE", "SECONDS", "MACHINE", "LABELS")]
    now = time.time()
    for r in results:
        start = r.created_at.ToSeconds()
        took = f"{r.finished_at.ToSeconds() - start:.0f}" if r.HasField("finished_at") else "-"
        labels = ",".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "-"
        rows.append((r.id, r.kind, stored_verdict(r), _age(max(0.0, now - start)), took, r.machine_id or "-",
                     labels))
    return "\n".join(_table(rows))


def stored_result(r: pb.StoredResult, *, verbose: bool = False) -> str:
    """One stored result: its verdict line, then the Run's or Verify's evidence as `run`/`verify` print it."""
    labels = ", ".join(f"{k}={v}" for k, v in sorted(r.labels.items()))
    lines = [f"{r.id}  {r.kind}  {stored_verdict(r)}" + (f"  ({labels})" if labels else "")]
    if r.outcome_detail and r.outcome != pb.OUTCOME_PASS:
        lines.append(f"{stored_verdict(r).lower()}: {r.outcome_detail}")
    if r.HasField("run"):
        lines.append(run_result(r.run, verbose=verbose))
    elif r.HasField("verify"):
        lines += [verify_summary(r.verify), *verify_result(r.verify, verbose=verbose)]
    return "\n".join(lines)


def verify_result(result: pb.VerifyResult, *, verbose: bool = False) -> list[str]:
    lines = ["checks:"]
    if not result.checks:
        lines.append("  (no checks ran)")
    width = max((len(c.name) for c in result.checks), default=0)
    for c in result.checks:
        mark = "pass" if c.passed else "ERROR" if c.error else "FAIL"
        lines.append(f"  {mark}  {c.name.ljust(width)}  {_evidence_line(c.evidence)}")
        if (not c.passed or verbose) and c.evidence.output_tail.strip():
            lines += _indent_tail(c.evidence.output_tail, "        ")
    if result.outcome_detail and not result.passed:
        lines.append(f"{verdict(result).lower()}: {result.outcome_detail}")
    lines.append(f"image {result.image_digest or '-'}  smolfile {result.smolfile_digest or '-'}")
    return lines


def verify_summary(result: pb.VerifyResult) -> str:
    passed = sum(c.passed for c in result.checks)
    stored = f", result {result.result_id}" if result.result_id else ""
    return f"{verdict(result)}  {passed}/{len(result.checks)} checks passed ({result.duration_ms / 1000:.2f}s{stored})"


def run_result(resp: pb.RunResponse, *, verbose: bool = False) -> str:
    passed = sum(c.passed for c in resp.result.checks)
    lines = [f"{verdict(resp)}  {passed}/{len(resp.result.checks)} checks passed  "
             f"(machine {resp.machine_id or '-'}, {resp.duration_ms / 1000:.1f}s"
             + (f", result {resp.result_id})" if resp.result_id else ")")]
    if resp.sealed:
        lines.append(f"sealed: the checks ran in machine {resp.verifier_machine_id or '-'}, a pristine one given only "
                     "the declared outputs")
    if resp.error:
        lines.append(f"stopped before the verifier: {resp.error}")
    lines.append("steps:")
    width = max((len(s.name) for s in resp.steps), default=0)
    for s in resp.steps:
        lines.append(f"  {'ok  ' if s.ok else 'FAIL'}  {s.name.ljust(width)}  {_evidence_line(s.evidence)}")
        if (not s.ok or verbose) and s.evidence.output_tail.strip():
            lines += _indent_tail(s.evidence.output_tail, "        ")
    lines += verify_result(resp.result, verbose=verbose)
    if resp.HasField("network"):
        lines += network_report(resp.network)
    if resp.artifacts:
        lines.append("artifacts:" + (f" (smolctl results {resp.result_id} --artifact NAME)" if resp.result_id else ""))
        for a in resp.artifacts:
            lines.append(f"  {a.name}  {a.size_bytes} bytes" + ("" if a.kept else "  (not kept)")
                         + (f"  {a.note}" if a.note else ""))
    return "\n".join(lines)


def network_report(r: pb.NetworkReport, limit: int = 20) -> list[str]:
    """What the machine's network policy refused (docs/networking.md, "Report")."""
    denied = sum(c.packets for c in r.counters if c.name.startswith("denied_"))
    lines = [f"network: {denied} packets denied, {r.denied_dns_queries} DNS queries refused"]
    for d in list(r.denied)[:limit]:
        where = f"{d.address}:{d.port}" if d.port else d.address
        lines.append(f"  denied  {d.protocol} {where}  ({d.packets} packets)")
    for n in list(r.denied_names)[:limit]:
        lines.append(f"  denied  dns {n.name}  ({n.queries} queries)")
    return lines


class Progress:
    """A one-line "what ... 12s" ticker on stderr while a long call runs (image pull, bake, create, run).

    Only on a terminal: redirected or piped stderr (scripts, --json consumers) gets nothing. The line is
    erased when the call ends, whatever its outcome."""

    def __init__(self, what: str, *, stream: Any = None, interval: float = 0.5) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="smolctl-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _tick(self) -> None:
        start = time.monotonic()
        frames = "|/-\\"
        i = 0
        while True:
            self.stream.write(f"\r\x1b[K{frames[i % 4]} {self.what} {time.monotonic() - start:.0f}s")
            self.stream.flush()
            i += 1
            if self._stop.wait(self.interval):
                return
