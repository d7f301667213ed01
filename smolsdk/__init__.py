"""smol: the Python SDK over smold's gRPC API (sync ``Client``, asyncio ``AsyncClient``)."""

from .aio import AsyncClient, AsyncMachine
from .client import Client, Machine
from .errors import (
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    ExecStreamError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SmolError,
    UnavailableError,
    UnimplementedError,
)
from .types import (
    Artifact,
    CheckResult,
    DaemonInfo,
    ExecEvent,
    ExecResult,
    Exit,
    MachineInfo,
    RunResult,
    Stderr,
    Stdout,
    StepResult,
    StoredResult,
    VerifyResult,
)

__all__ = [
    "AlreadyExistsError", "Artifact", "AsyncClient", "AsyncMachine", "CancelledError", "CheckResult", "Client", "DaemonInfo",
    "DataLossError", "DeadlineExceededError", "ExecEvent", "ExecResult", "ExecStreamError", "Exit", "FailedPreconditionError",
    "InternalError", "InvalidArgumentError", "Machine", "MachineInfo", "NotFoundError", "PermissionDeniedError",
    "ResourceExhaustedError", "RunResult", "SmolError", "Stderr", "Stdout", "StepResult", "StoredResult",
    "UnavailableError", "UnimplementedError", "VerifyResult",
]
