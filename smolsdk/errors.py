"""Typed exceptions of the smol SDK, one per gRPC status code smold answers with."""

from __future__ import annotations

import re

import grpc

_GUEST_CODE = re.compile(r"\((E[A-Z0-9]+)\)\s*$")


class SmolError(Exception):
    """Base class: a smold request failed. ``code`` is the gRPC status, ``details`` smold's one-line reason."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    @property
    def guest_code(self) -> str | None:
        """The guest agent's errno name ("ENOENT", "EISDIR", ...) when the guest refused the request."""
        m = _GUEST_CODE.search(self.details)
        return m.group(1) if m else None


class InvalidArgumentError(SmolError):
    """A bad Smolfile or request (the message names file, key and reason)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(SmolError):
    """Unknown machine, image or checkpoint, or a guest path that does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(SmolError):
    """A machine or checkpoint name is taken."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(SmolError):
    """The machine is not running, or the guest path is of the wrong kind (a directory, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(SmolError):
    """A limit was hit: machines, memory, or a copy larger than the cap."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDeniedError(SmolError):
    """The guest refused the access (EACCES, EPERM)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceededError(SmolError):
    """A deadline passed (the call's own or one in the daemon)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(SmolError):
    """smold (or the machine's guest agent) cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class UnimplementedError(SmolError):
    """The daemon does not implement this call."""

    code = grpc.StatusCode.UNIMPLEMENTED


class CancelledError(SmolError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class InternalError(SmolError):
    """A daemon bug or an unexpected failure."""

    code = grpc.StatusCode.INTERNAL


class DataLossError(SmolError):
    """Stored data no longer matches what was kept (an artifact changed on disk)."""

    code = grpc.StatusCode.DATA_LOSS


class ExecStreamError(SmolError):
    """An exec stream ended without its exit event."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SmolError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
                ResourceExhaustedError, PermissionDeniedError, DeadlineExceededError, UnavailableError,
                UnimplementedError, CancelledError, InternalError, DataLossError)
}


def from_rpc_error(e: grpc.RpcError) -> SmolError:
    """The typed SmolError for a gRPC error raised by a sync or async stub call."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or (code.name if code else str(e))
    if isinstance(code, grpc.StatusCode):
        return _BY_CODE.get(code, SmolError)(details, code)
    return SmolError(details)
