"""Typed exceptions of the daemon; each carries the gRPC status it is answered with (mapped by the servicer)."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """The gRPC status an error is reported with (names as grpc.StatusCode; no grpc import here)."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    FAILED_PRECONDITION = "failed_precondition"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    PERMISSION_DENIED = "permission_denied"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ABORTED = "aborted"
    UNAVAILABLE = "unavailable"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    DATA_LOSS = "data_loss"


class DaemonError(Exception):
    """Base class: a request failed; ``status`` says how, the message says why (one line, for humans)."""

    status: Status = Status.INTERNAL


class InvalidRequestError(DaemonError):
    """The request is malformed: a bad guest path, an empty argv, an unreadable archive."""

    status = Status.INVALID_ARGUMENT


class MachineNotFoundError(DaemonError):
    """No machine has that id or name."""

    status = Status.NOT_FOUND


class CheckpointNotFoundError(DaemonError):
    """No checkpoint has that name."""

    status = Status.NOT_FOUND


class CheckpointExistsError(DaemonError):
    """A checkpoint of that name already exists (or is being written)."""

    status = Status.ALREADY_EXISTS


class CheckpointFailedError(DaemonError):
    """The machine's VMM could not write a snapshot (no control socket, refused, I/O error)."""

    status = Status.INTERNAL


class CheckpointNoSpaceError(CheckpointFailedError):
    """The snapshot did not fit on the host's disk (ENOSPC/EDQUOT); nothing of it is kept, the machine runs on."""

    status = Status.RESOURCE_EXHAUSTED


class ImageNotFoundError(DaemonError):
    """The Smolfile names an image this daemon does not have."""

    status = Status.NOT_FOUND


class ImagePullError(DaemonError):
    """An OCI image could not be pulled or imported (registry unreachable or refusing, bad content)."""

    status = Status.UNAVAILABLE


class NameTakenError(DaemonError):
    """Another live machine already has the requested name."""

    status = Status.ALREADY_EXISTS


class WrongPhaseError(DaemonError):
    """The machine exists but is not in a phase that allows the call (creating, failed, destroyed)."""

    status = Status.FAILED_PRECONDITION


class LimitExceededError(DaemonError):
    """A configured limit would be exceeded: machines, total memory, copy size."""

    status = Status.RESOURCE_EXHAUSTED


class RefusedByPolicyError(DaemonError):
    """The daemon's operator has turned off what the request asks for (--no-public-network)."""

    status = Status.FAILED_PRECONDITION


class UnsupportedError(DaemonError):
    """The request asks for something this daemon does not implement (yet): networking."""

    status = Status.UNIMPLEMENTED


class ShuttingDownError(DaemonError):
    """The daemon is shutting down and takes no new machines."""

    status = Status.UNAVAILABLE


class GuestError(DaemonError):
    """The guest agent refused or failed one request (missing file, permission, ...): status per errno."""

    def __init__(self, message: str, status: Status) -> None:
        super().__init__(message)
        self.status = status


class GuestUnavailableError(DaemonError):
    """The guest agent could not be reached, or the connection to it broke mid-request."""

    status = Status.UNAVAILABLE


class CreateFailedError(DaemonError):
    """A machine could not be created: its VMM died, boot timed out, or a mount or setup step failed.

    The machine is kept in the FAILED phase (console log and reason) until it is destroyed.
    """

    def __init__(self, message: str, status: Status = Status.ABORTED) -> None:
        super().__init__(message)
        self.status = status
        self.machine_id = ""  # set once the machine exists


class DestroyIncompleteError(DaemonError):
    """Destroying a machine left something behind (a process, a socket, a file); the machine stays FAILED."""

    status = Status.INTERNAL


class LaunchError(Exception):
    """A launcher could not start a VM process, or it did not become ready (internal to the controller)."""

    def __init__(self, message: str, *, timed_out: bool = False, no_space: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.no_space = no_space   # a write failed for want of disk space (ENOSPC, EDQUOT)


class DaemonSetupError(Exception):
    """The daemon cannot start: socket in use, state directory locked or unusable, bad configuration."""
