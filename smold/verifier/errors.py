"""Typed exceptions of the verifier (internal: a failing check is a result, never an exception to callers)."""

from __future__ import annotations


class VerifierError(Exception):
    """Base class of verifier errors."""


class CheckFailed(VerifierError):
    """A check could not pass; the message is the check's evidence detail."""

    def __init__(
        self, detail: str, *, output_tail: str = "", exit_code: int | None = None, timed_out: bool = False
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.output_tail = output_tail
        self.exit_code = exit_code
        self.timed_out = timed_out


class RewardFormatError(VerifierError):
    """A reward file's content is not a reward (not a finite number / JSON of numbers)."""
