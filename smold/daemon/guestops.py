"""Operations in a guest through its agent: steps with evidence, mounts and tar copies, errors as DaemonErrors."""

from __future__ import annotations

import asyncio
import io
import os
import posixpath
import secrets
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from smold.agent import (
    AgentClient,
    AgentClosedError,
    AgentError,
    AgentFileTooLargeError,
    AgentRequestError,
    ExecStderr,
    ExecStdout,
)
from smold.api.machine import StepResult
from smold.verifier import Evidence, TailBuffer

from .errors import (
    DaemonError,
    GuestError,
    GuestUnavailableError,
    InvalidRequestError,
    LimitExceededError,
    Status,
)

MAX_GUEST_PATH = 4096
AGENT_GRACE_S = 5.0  # waited past a command's own timeout for an agent that stopped answering

# Agent error codes (errno names) -> gRPC status of the request that hit them.
_AGENT_STATUS: dict[str, Status] = {
    "ENOENT": Status.NOT_FOUND,
    "EACCES": Status.PERMISSION_DENIED,
    "EPERM": Status.PERMISSION_DENIED,
    "EFBIG": Status.RESOURCE_EXHAUSTED,
    "ENOSPC": Status.RESOURCE_EXHAUSTED,
    "EDQUOT": Status.RESOURCE_EXHAUSTED,
    "EISDIR": Status.FAILED_PRECONDITION,
    "ENOTDIR": Status.FAILED_PRECONDITION,
    "EEXIST": Status.FAILED_PRECONDITION,
    "EROFS": Status.FAILED_PRECONDITION,
    "EINVAL": Status.INVALID_ARGUMENT,
    "ENAMETOOLONG": Status.INVALID_ARGUMENT,
}


def guest_error(e: AgentError, machine_id: str) -> DaemonError:
    """An agent client error as the DaemonError the request fails with."""
    if isinstance(e, AgentRequestError):
        return GuestError(f"machine {machine_id}: {e.message} ({e.code})", _AGENT_STATUS.get(e.code, Status.INTERNAL))
    if isinstance(e, AgentClosedError):
        return GuestUnavailableError(f"machine {machine_id}: lost the connection to the guest agent ({e})")
    return GuestUnavailableError(f"machine {machine_id}: guest agent error: {e}")


def validate_guest_path(path: str, *, what: str = "path", allow_root: bool = False) -> str:
    """An absolute, normalized guest path without NUL bytes; InvalidRequestError naming `what` otherwise."""
    if not path:
        raise InvalidRequestError(f"{what}: a guest path is required")
    if "\0" in path:
        raise InvalidRequestError(f"{what}: must not contain NUL bytes")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_GUEST_PATH:
        raise InvalidRequestError(f"{what}: longer than {MAX_GUEST_PATH} bytes")
    if not path.startswith("/"):
        raise InvalidRequestError(f"{what}: must be an absolute guest path (got {path!r})")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise InvalidRequestError(f"{what}: must be normalized, without '.', '..' or '//' (got {path!r})")
    if path == "/" and not allow_root:
        raise InvalidRequestError(f"{what}: must not be '/'")
    return path


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


async def run_step(
    client: AgentClient,
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float,
) -> StepResult:
    """Run one command to completion; the result has its exit code, output tail, duration and verdict."""
    out = TailBuffer()
    start = time.monotonic()

    def result(ok: bool, detail: str, exit_code: int | None = None, timed_out: bool = False) -> StepResult:
        evidence = Evidence(exit_code=exit_code, output_tail=out.text(), duration_ms=_ms(time.monotonic() - start),
                            detail=detail, timed_out=timed_out)
        return StepResult(name, ok, evidence)

    if timeout <= 0:
        return result(False, "not run: the stage timeout was used up", timed_out=True)

    async def drive() -> StepResult:
        async with client.exec(list(argv), env=dict(env) if env else None, cwd=cwd, user=user,
                               timeout=timeout) as stream:
            async for event in stream:
                if isinstance(event, ExecStdout | ExecStderr):
                    out.add(event.data)
        done = stream.exit
        assert done is not None
        if done.timed_out:
            return result(False, f"timed out after {timeout:g}s", done.exit_code, timed_out=True)
        if done.signal is not None:
            return result(False, f"killed by signal {done.signal}", None)
        if done.exit_code != 0:
            return result(False, f"exit {done.exit_code}, expected 0", done.exit_code)
        return result(True, "exit 0", 0)

    try:
        return await asyncio.wait_for(drive(), timeout + AGENT_GRACE_S)
    except TimeoutError:
        return result(False, f"timed out after {timeout:g}s (the guest agent did not answer)", timed_out=True)
    except AgentRequestError as e:
        return result(False, f"cannot run {argv[0]!r}: {e.message} ({e.code})")
    except AgentError as e:
        return result(False, f"guest agent error: {e}")


# --- tar archives ------------------------------------------------------------------------------------------
def pack_tree(src: Path, cap: int) -> bytes:
    """A tar archive of a host directory's contents (symlinks kept as links); LimitExceededError over cap."""
    total = 0

    def count(info: tarfile.TarInfo) -> tarfile.TarInfo:
        nonlocal total
        total += 512 + info.size
        if total > cap:
            raise LimitExceededError(f"{src}: larger than the copy cap of {cap} bytes")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(src, arcname=".", recursive=True, filter=count)
    return buf.getvalue()


def check_tar(content: bytes) -> int:
    """Validate an archive sent by a client; returns its member count. InvalidRequestError if unreadable."""
    try:
        with tarfile.open(fileobj=io.BytesIO(content), mode="r:*") as tar:
            return len(tar.getmembers())
    except (tarfile.TarError, EOFError, OSError) as e:
        raise InvalidRequestError(f"content is not a readable tar archive: {e}") from None


async def _archive_into_guest(client: AgentClient, machine_id: str, archive: bytes, script: str, args: Sequence[str],
                              what: str) -> None:
    """Write the archive to a temporary guest file, then run ``sh -c script sh TMP ARGS...`` (which unpacks it and
    removes it); GuestError(FAILED_PRECONDITION) naming ``what`` when that fails."""
    tmp = f"/tmp/.smol-copy-{secrets.token_hex(8)}.tar"
    try:
        await client.write_file(tmp, archive, mode=0o600, mkdirs=True)
        res = await client.run(["sh", "-c", script, "sh", tmp, *args], timeout=600)
    except AgentError as e:
        raise guest_error(e, machine_id) from None
    if res.exit_code != 0:
        detail = (res.stderr or res.stdout).decode(errors="replace").strip()[-1000:]
        raise GuestError(f"machine {machine_id}: {what} failed: {detail or res.exit_code}", Status.FAILED_PRECONDITION)


async def unpack_in_guest(client: AgentClient, machine_id: str, archive: bytes, dest: str) -> None:
    """Write the archive to a temporary guest file and unpack it into dest (created if missing)."""
    script = 'mkdir -p -- "$2" && tar -x --no-same-owner -f "$1" -C "$2"; rc=$?; rm -f -- "$1"; exit $rc'
    await _archive_into_guest(client, machine_id, archive, script, [dest], f"unpacking into {dest}")


async def pack_in_guest(client: AgentClient, machine_id: str, path: str, cap: int) -> bytes:
    """A tar archive of a guest directory, read from `tar -c` in the guest; LimitExceededError over cap."""
    try:  # READ_FILE with max_size 0 says whether the path exists and what it is, without reading it
        await client.read_file(path, 0)
        raise InvalidRequestError(f"{path} is a file in machine {machine_id}: copy it with the FILE format")
    except AgentFileTooLargeError:
        raise InvalidRequestError(f"{path} is a file in machine {machine_id}: copy it with the FILE format") from None
    except AgentRequestError as e:
        if e.code != "EISDIR":
            raise guest_error(e, machine_id) from None
    except AgentError as e:
        raise guest_error(e, machine_id) from None
    return await _archive_from_guest(client, machine_id, ["tar", "-c", "-f", "-", "-C", path, "."], cap,
                                     what=path, too_large=f"{path} in machine {machine_id}: the archive is larger "
                                                          f"than {cap} bytes")


async def _archive_from_guest(client: AgentClient, machine_id: str, argv: list[str], cap: int, *, what: str,
                              too_large: str, timeout: float = 600) -> bytes:
    """The stdout of a packing command in the guest, at most ``cap`` bytes (LimitExceededError(too_large) over it);
    GuestError if it fails."""
    data = bytearray()
    err = TailBuffer(1000)
    try:
        async with client.exec(argv, timeout=timeout) as stream:
            async for event in stream:
                if isinstance(event, ExecStdout):
                    data += event.data
                    if len(data) > cap:
                        raise LimitExceededError(too_large)
                elif isinstance(event, ExecStderr):
                    err.add(event.data)
    except AgentError as e:
        raise guest_error(e, machine_id) from None
    done = stream.exit
    if done is None or done.exit_code != 0:
        code = "no exit status" if done is None else f"exit {done.exit_code}"
        raise GuestError(f"machine {machine_id}: packing {what} failed ({code}): {err.text().strip()[-500:]}",
                         Status.INTERNAL)
    return bytes(data)


def host_file_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


# --- long command lines ------------------------------------------------------------------------------------
ARGV_SPILL_BYTES = 512 * 1024  # argv larger than this does not fit an EXEC frame (1 MiB of JSON) safely
_TRAMPOLINE = ("import os,sys\np=sys.argv[1]\na=open(p,'rb').read().split(b'\\0')[:-1]\n"
               "try:\n os.unlink(p)\nexcept OSError:\n pass\nos.execvp(a[0],a)\n")


def argv_size(argv: Sequence[str]) -> int:
    return sum(len(a.encode("utf-8", "surrogateescape")) + 8 for a in argv)


async def spill_argv(client: AgentClient, machine_id: str, argv: Sequence[str]) -> list[str]:
    """An argv too large for one EXEC frame, written to a guest file and re-exec'd by a python3 trampoline.

    The file is NUL-separated, mode 0644 (the command may run as another user) and removed by the
    trampoline before it execs the command (left behind if that user may not remove it).
    """
    path = f"/tmp/.smol-argv-{secrets.token_hex(8)}"
    data = b"".join(a.encode("utf-8", "surrogateescape") + b"\0" for a in argv)
    try:
        await client.write_file(path, data, mode=0o644, mkdirs=True)
    except AgentError as e:
        raise guest_error(e, machine_id) from None
    return ["python3", "-S", "-c", _TRAMPOLINE, path]


# --- sealed verification: the declared outputs out of the task's guest, into the verifier's ------------------------
# In the task's guest (hostile: what comes back is re-packed on the host, smold.verifier.outputs): an archive of
# the outputs that exist, relative to /; none existing gives an empty archive.
_PACK_OUTPUTS = ('cd / || exit 1; for p do shift; if [ -e "$p" ] || [ -h "$p" ]; then set -- "$@" "$p"; fi; done; '
                 '[ $# -gt 0 ] || exec tar -c -f - -T /dev/null; exec tar -c -f - -- "$@"')
# In the verifier's (pristine) guest: what it has at the outputs' paths goes, then the archive is extracted at /.
_PLACE_OUTPUTS = 'a=$1; shift; rm -rf -- "$@" && tar -x -f "$a" -C /; rc=$?; rm -f -- "$a"; exit $rc'


async def kill_task_processes(client: AgentClient, machine_id: str) -> str:
    """Kill every process of the guest but its agent (KILL_ALL), so that what the task left running cannot change
    or forge what is taken next; a note for the evidence. An agent that cannot (not PID 1: the host stand-in of
    the unit tests) is noted, not an error; a guest that breaks the request is GuestError."""
    try:
        killed = await client.kill_all()
    except AgentRequestError as e:
        return f"the task's processes were not killed ({e.code}: {e.message})"
    except AgentError as e:
        raise guest_error(e, machine_id) from None
    return f"{killed} processes the task left were killed"


async def pack_outputs(client: AgentClient, machine_id: str, outputs: Sequence[str], cap: int, *,
                       what: str = "the outputs", timeout: float = 600) -> bytes:
    """The guest's archive of ``outputs`` (absolute paths), at most ``cap`` bytes; DaemonError otherwise."""
    rel = [o.lstrip("/") for o in outputs]
    return await _archive_from_guest(client, machine_id, ["sh", "-c", _PACK_OUTPUTS, "sh", *rel], cap,
                                     what=what, too_large=f"machine {machine_id}: the archive of {what} is larger "
                                                          f"than the cap of {cap} bytes", timeout=timeout)


async def place_outputs(client: AgentClient, machine_id: str, outputs: Sequence[str], archive: bytes) -> None:
    """Replace what the verifier's guest has at ``outputs`` with the (re-packed) archive's content."""
    await _archive_into_guest(client, machine_id, archive, _PLACE_OUTPUTS, outputs, "placing the outputs")
