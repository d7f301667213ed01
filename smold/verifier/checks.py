"""One coroutine per check kind: look at the guest through the agent, return evidence or raise CheckFailed."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from smold.agent import AgentFileTooLargeError, AgentRequestError, ExecExit, ExecStderr, ExecStdout
from smold.smolfile import (
    Check,
    CommandCheck,
    FileExistsCheck,
    FileMatchesCheck,
    HttpCheck,
    RewardCheck,
)

from .errors import CheckFailed, RewardFormatError
from .guest import Guest
from .http_probe import parse_report, probe_argv
from .result import TailBuffer, tail_text
from .reward import MAX_REWARD_FILE_BYTES, parse_reward

MAX_MATCH_FILE_BYTES = 64 << 20  # file_matches reads the whole file into the host's memory
MISSING = ("ENOENT", "ENOTDIR")


@dataclass(frozen=True)
class Passed:
    """A passing check's evidence (the runner adds the duration)."""

    detail: str
    output_tail: str = ""
    exit_code: int | None = None


@dataclass(frozen=True)
class CommandOutcome:
    """How a command ended, and the tail of its interleaved stdout+stderr."""

    exit: ExecExit | None
    output: TailBuffer
    stdout: bytes  # only collected when asked for (bounded by the caller)


async def run_command(
    guest: Guest,
    argv: list[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float,
    output: TailBuffer,
    keep_stdout: int = 0,
) -> CommandOutcome:
    """Run argv to completion (the agent kills it at `timeout`), feeding its output into `output`."""
    stream = guest.exec(argv, dict(env) if env else None, cwd, user, None, timeout)
    exit_event: ExecExit | None = None
    stdout = bytearray()
    try:
        async for event in stream:
            if isinstance(event, ExecStdout | ExecStderr):
                output.add(event.data)
                if keep_stdout and isinstance(event, ExecStdout) and len(stdout) < keep_stdout:
                    stdout += event.data[: keep_stdout - len(stdout)]
            elif isinstance(event, ExecExit):
                exit_event = event
    finally:
        await stream.aclose()
    return CommandOutcome(exit_event, output, bytes(stdout))


def _describe_end(exit_event: ExecExit | None, timeout: float) -> str:
    if exit_event is None:
        return "the command ended without an exit status"
    if exit_event.timed_out:
        return f"timed out after {timeout:g}s (killed)"
    if exit_event.signal is not None:
        return f"killed by signal {exit_event.signal}"
    return f"exit {exit_event.exit_code}"


async def check_command(
    guest: Guest, check: CommandCheck, timeout: float, env: Mapping[str, str] | None, output: TailBuffer
) -> Passed:
    outcome = await run_command(
        guest, list(check.argv), env=env, cwd=check.cwd, user=check.user, timeout=timeout, output=output
    )
    end = outcome.exit
    code = end.exit_code if end is not None else None
    if end is None or end.timed_out or end.signal is not None or code != check.expect_exit:
        what = _describe_end(end, timeout)
        detail = f"expected exit {check.expect_exit}, got {what}" if code is not None else what
        timed_out = end is not None and end.timed_out
        raise CheckFailed(detail, output_tail=output.text(), exit_code=code, timed_out=timed_out)
    return Passed(f"exit {code} as expected", output.text(), code)


async def check_file_exists(guest: Guest, check: FileExistsCheck) -> Passed:
    # READ_FILE with max_size 0 answers without sending content: EFBIG (a non-empty regular file),
    # EISDIR (a directory), EINVAL (another kind of file), an empty result (an empty regular file),
    # or ENOENT/ENOTDIR when nothing is there (dangling symlinks included).
    try:
        await guest.read_file(check.path, 0)
        return Passed(f"{check.path} exists (empty regular file)")
    except AgentFileTooLargeError:
        return Passed(f"{check.path} exists (regular file)")
    except AgentRequestError as e:
        if e.code == "EISDIR":
            return Passed(f"{check.path} exists (directory)")
        if e.code == "EINVAL":
            return Passed(f"{check.path} exists (not a regular file)")
        if e.code in MISSING:
            raise CheckFailed(f"{check.path} does not exist") from None
        raise CheckFailed(f"cannot tell whether {check.path} exists: {e}") from None


async def _read(guest: Guest, path: str, max_size: int) -> bytes:
    try:
        return await guest.read_file(path, max_size)
    except AgentFileTooLargeError:
        raise CheckFailed(f"{path} is larger than {max_size} bytes") from None
    except AgentRequestError as e:
        if e.code in MISSING:
            raise CheckFailed(f"{path} does not exist") from None
        raise CheckFailed(f"cannot read {path}: {e}") from None


async def check_file_matches(guest: Guest, check: FileMatchesCheck) -> Passed:
    data = await _read(guest, check.path, MAX_MATCH_FILE_BYTES)
    shown = tail_text(data)
    if check.content is not None:
        expected = check.content.encode()
        if data != expected:
            at = next((i for i, (a, b) in enumerate(zip(data, expected, strict=False)) if a != b), None)
            where = f"first difference at byte {at}" if at is not None else "one is a prefix of the other"
            raise CheckFailed(
                f"{check.path} differs from the expected content ({len(data)} bytes, expected "
                f"{len(expected)}; {where})",
                output_tail=shown,
            )
        return Passed(f"{check.path} has the expected content ({len(data)} bytes)", shown)
    if check.regex is not None:
        text = data.decode("utf-8", errors="replace")
        m = re.search(check.regex, text, re.MULTILINE)
        if m is None:
            raise CheckFailed(f"no match for regex {check.regex!r} in {check.path}", output_tail=shown)
        return Passed(f"regex {check.regex!r} matched {m.group(0)[:200]!r} at offset {m.start()}", shown)
    assert check.sha256 is not None  # the parser guarantees exactly one matcher
    got = hashlib.sha256(data).hexdigest()
    if got != check.sha256:
        raise CheckFailed(f"{check.path} has sha256 {got}, expected {check.sha256}", output_tail=shown)
    return Passed(f"{check.path} has sha256 {got}", shown)


async def check_http(
    guest: Guest, check: HttpCheck, timeout: float, env: Mapping[str, str] | None, output: TailBuffer
) -> Passed:
    # The probe's own socket timeout fires a little before the agent's kill, so it can still report.
    argv = probe_argv(check.url, max(timeout * 0.9, timeout - 2.0), check.contains)
    outcome = await run_command(
        guest, argv, env=env, cwd=None, user=None, timeout=timeout, output=output, keep_stdout=1 << 20
    )
    end = outcome.exit
    if end is None or end.exit_code != 0:
        raise CheckFailed(
            f"the http probe failed: {_describe_end(end, timeout)}",
            output_tail=output.text(),
            timed_out=end is not None and end.timed_out,
        )
    report = parse_report(outcome.stdout)
    got = f"status {report.status}"
    if report.status != check.expect_status:
        raise CheckFailed(f"{check.url}: expected status {check.expect_status}, got {got}", output_tail=report.body_tail)
    if check.contains is not None and not report.found:
        raise CheckFailed(
            f"{check.url}: {got}, but the body does not contain {check.contains!r}",
            output_tail=report.body_tail,
        )
    extra = f", body contains {check.contains!r}" if check.contains is not None else ""
    return Passed(f"{check.url}: {got}{extra}", report.body_tail)


async def check_reward(guest: Guest, check: RewardCheck) -> Passed:
    for path in check.candidate_paths:
        try:
            data = await guest.read_file(path, MAX_REWARD_FILE_BYTES)
        except AgentFileTooLargeError:
            raise CheckFailed(f"reward file {path} is larger than {MAX_REWARD_FILE_BYTES} bytes") from None
        except AgentRequestError as e:
            if e.code in MISSING:
                continue
            raise CheckFailed(f"cannot read reward file {path}: {e}") from None
        shown = tail_text(data)
        try:
            reward = parse_reward(path, data)
        except RewardFormatError as e:
            raise CheckFailed(f"{path}: {e}", output_tail=shown) from None
        if reward < check.threshold:
            raise CheckFailed(f"reward {reward:g} < threshold {check.threshold:g} ({path})", output_tail=shown)
        return Passed(f"reward {reward:g} >= threshold {check.threshold:g} ({path})", shown)
    raise CheckFailed("no reward file (looked for " + ", ".join(check.candidate_paths) + ")")


async def run_check(
    guest: Guest, check: Check, timeout: float, env: Mapping[str, str] | None, output: TailBuffer
) -> Passed:
    """Dispatch on the check's kind. Raises CheckFailed (or an agent/timeout error) when it does not pass."""
    if isinstance(check, CommandCheck):
        return await check_command(guest, check, timeout, env, output)
    if isinstance(check, FileExistsCheck):
        return await check_file_exists(guest, check)
    if isinstance(check, FileMatchesCheck):
        return await check_file_matches(guest, check)
    if isinstance(check, HttpCheck):
        return await check_http(guest, check, timeout, env, output)
    return await check_reward(guest, check)
