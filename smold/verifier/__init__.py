"""The verifier: run a Smolfile's checks inside a guest via the agent and report pass/fail with evidence."""

from .errors import CheckFailed, RewardFormatError, VerifierError
from .guest import ExecEvents, Guest
from .http_probe import PROBE_SCRIPT
from .result import OUTPUT_TAIL_BYTES, CheckResult, Evidence, Outcome, TailBuffer, VerifyResult, tail_text
from .reward import parse_reward
from .runner import AGENT_GRACE_S, run_one, verify, verify_smolfile

__all__ = [
    "AGENT_GRACE_S",
    "OUTPUT_TAIL_BYTES",
    "PROBE_SCRIPT",
    "CheckFailed",
    "CheckResult",
    "Evidence",
    "ExecEvents",
    "Guest",
    "Outcome",
    "RewardFormatError",
    "TailBuffer",
    "VerifierError",
    "VerifyResult",
    "parse_reward",
    "run_one",
    "tail_text",
    "verify",
    "verify_smolfile",
]
