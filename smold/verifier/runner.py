"""Run a verifier's checks in order against a guest and collect a VerifyResult; checks fail, never raise."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from smold.agent import AgentError
from smold.smolfile import Check, Smolfile, digest

from .checks import run_check
from .errors import CheckFailed
from .guest import Guest
from .result import CheckResult, Evidence, TailBuffer, VerifyResult

log = logging.getLogger("smold.verifier")

# How long past a check's own timeout the host waits for the agent before giving up on it (the agent
# enforces exec timeouts itself; this only catches an agent that stopped answering).
AGENT_GRACE_S = 5.0
DEFAULT_VERIFY_TIMEOUT_S = 600.0


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


async def run_one(
    guest: Guest,
    check: Check,
    timeout: float,
    env: Mapping[str, str] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> CheckResult:
    """Run one check with a timeout; agent errors and timeouts become a failed CheckResult."""
    output = TailBuffer()
    start = clock()

    def failed(
        detail: str, *, exit_code: int | None = None, tail: str | None = None, timed_out: bool = False,
        error: bool = False,
    ) -> CheckResult:
        evidence = Evidence(
            exit_code=exit_code,
            output_tail=output.text() if tail is None else tail,
            duration_ms=_ms(clock() - start),
            detail=detail,
            timed_out=timed_out,
        )
        return CheckResult(check.name, check.kind, False, evidence, error)

    # A check that ran and did not pass is a failure; one the harness could not decide (the agent stopped
    # answering or broke the protocol) is an error: the verdict is then verifier_error, never a pass or an
    # INTERNAL error of the daemon (docs/verifier.md, "Outcomes").
    try:
        ok = await asyncio.wait_for(run_check(guest, check, timeout, env, output), timeout + AGENT_GRACE_S)
    except CheckFailed as e:
        return failed(
            e.detail, exit_code=e.exit_code, tail=e.output_tail or None, timed_out=e.timed_out
        )
    except TimeoutError:
        return failed(f"timed out after {timeout:g}s (the agent did not answer)", timed_out=True, error=True)
    except AgentError as e:
        return failed(f"agent error: {e}", error=True)
    except OSError as e:
        return failed(f"connection to the agent failed: {e!r}", error=True)
    except Exception as e:  # anything else a hostile guest provoked: undecided, and said so
        log.warning("check %r could not be decided: %r", check.name, e)
        return failed(f"the verifier could not decide this check: {e!r}", error=True)
    evidence = Evidence(
        exit_code=ok.exit_code, output_tail=ok.output_tail, duration_ms=_ms(clock() - start), detail=ok.detail
    )
    return CheckResult(check.name, check.kind, True, evidence)


async def verify(
    guest: Guest,
    checks: Sequence[Check],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_VERIFY_TIMEOUT_S,
    image_digest: str = "",
    smolfile_digest: str = "",
    clock: Callable[[], float] = time.monotonic,
) -> VerifyResult:
    """Run the checks one after another (they may depend on each other's side effects) within `timeout`.

    Each check gets min(its own timeout, what is left of the total); once the total is spent the
    remaining checks fail without running. passed = at least one check, and every check passed.
    """
    start = clock()
    deadline = start + timeout
    results: list[CheckResult] = []
    for check in checks:
        left = deadline - clock()
        if left <= 0:
            evidence = Evidence(detail=f"not run: the verify timeout ({timeout:g}s) was used up", timed_out=True)
            results.append(CheckResult(check.name, check.kind, False, evidence))
            continue
        budget = min(check.timeout, left) if check.timeout is not None else left
        results.append(await run_one(guest, check, budget, env, clock=clock))
    passed = bool(results) and all(r.passed for r in results)
    return VerifyResult(
        passed=passed,
        checks=tuple(results),
        image_digest=image_digest,
        smolfile_digest=smolfile_digest,
        duration_ms=_ms(clock() - start),
    )


async def verify_smolfile(
    guest: Guest, smolfile: Smolfile, *, image_digest: str = "", clock: Callable[[], float] = time.monotonic
) -> VerifyResult:
    """Run a Smolfile's verifier with its env and verify timeout; the result carries its digest."""
    return await verify(
        guest,
        smolfile.checks,
        env=smolfile.environ or None,
        timeout=smolfile.timeouts.verify,
        image_digest=image_digest,
        smolfile_digest=digest(smolfile),
        clock=clock,
    )
