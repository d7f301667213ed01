"""Structured verifier results: frozen dataclasses of plain values (converted to proto by smold.api.convert)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

OUTPUT_TAIL_BYTES = 4096


class Outcome(enum.StrEnum):
    """How a verification ended (proto: Outcome; docs/verifier.md, "Outcomes"). Only PASS is a pass."""

    PASS = "pass"
    FAIL = "fail"                      # the checks ran and at least one failed
    VERIFIER_ERROR = "verifier_error"  # the verifier could not decide (guest protocol errors, harness timeouts)
    INFRA_ERROR = "infra_error"        # smol could not run the attempt: a mount or setup step failed (or, stored, a boot)
    INTERRUPTED = "interrupted"        # stored results only: the daemon stopped or crashed during the Run


@dataclass(frozen=True)
class Evidence:
    """What a check saw: exit code (commands), the output's last 4 KiB, how long it took, and why."""

    exit_code: int | None = None
    output_tail: str = ""
    duration_ms: int = 0
    detail: str = ""
    timed_out: bool = False


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict with its evidence."""

    name: str
    kind: str
    passed: bool
    evidence: Evidence
    error: bool = False  # undecided: the guest agent failed or broke the protocol, or the harness timed out


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's verdict: passed iff there is at least one check and all of them passed."""

    passed: bool
    checks: tuple[CheckResult, ...]
    image_digest: str = ""
    smolfile_digest: str = ""
    duration_ms: int = 0

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if not c.passed)

    @property
    def outcome(self) -> Outcome:
        """PASS when every check passed; VERIFIER_ERROR when a check could not be decided; else FAIL."""
        if self.passed:
            return Outcome.PASS
        return Outcome.VERIFIER_ERROR if any(c.error for c in self.checks) else Outcome.FAIL

    @property
    def outcome_detail(self) -> str:
        """One line saying why."""
        if not self.checks:
            return "no checks ran"
        if self.passed:
            return f"all {len(self.checks)} checks passed"
        undecided = [c for c in self.checks if c.error]
        if undecided:
            return (f"{len(undecided)} of {len(self.checks)} checks could not be decided: "
                    + "; ".join(f"{c.name}: {c.evidence.detail}" for c in undecided))
        failed = self.failed
        return (f"{len(failed)} of {len(self.checks)} checks failed: "
                + "; ".join(f"{c.name}: {c.evidence.detail}" for c in failed))


def tail_text(data: bytes | bytearray, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The last `limit` bytes as text: UTF-8 with invalid bytes replaced, not starting mid-character."""
    tail = bytes(data[len(data) - limit :]) if len(data) > limit else bytes(data)
    return _decode_tail(tail, truncated=len(data) > limit)


def _decode_tail(tail: bytes, *, truncated: bool) -> str:
    if truncated:  # the cut may have split a character: drop its continuation bytes (at most 3)
        skip = 0
        while skip < 3 and skip < len(tail) and 0x80 <= tail[skip] <= 0xBF:
            skip += 1
        tail = tail[skip:]
    return tail.decode("utf-8", errors="replace")


class TailBuffer:
    """Keeps the last `limit` bytes of everything added (amortized O(1) per byte)."""

    def __init__(self, limit: int = OUTPUT_TAIL_BYTES) -> None:
        self.limit = limit
        self.total = 0
        self._buf = bytearray()

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self._buf += data[len(data) - self.limit :] if len(data) > self.limit else data
        if len(self._buf) > 2 * self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def text(self) -> str:
        tail = bytes(self._buf[len(self._buf) - self.limit :]) if len(self._buf) > self.limit else bytes(self._buf)
        return _decode_tail(tail, truncated=self.total > len(tail))
