"""Host side of the guest agent: the asyncio AgentClient and its typed errors (protocol: smol_agent.protocol)."""

from .client import (
    AgentClient,
    AgentHealth,
    ExecEvent,
    ExecExit,
    ExecResult,
    ExecStderr,
    ExecStdout,
    ExecStream,
    connect_unix,
    connect_vsock_uds,
    wait_ready,
)
from .errors import (
    AgentClosedError,
    AgentConnectError,
    AgentError,
    AgentFileTooLargeError,
    AgentProtocolError,
    AgentRequestError,
    AgentTimeoutError,
    AgentVersionError,
)

__all__ = [
    "AgentClient",
    "AgentClosedError",
    "AgentConnectError",
    "AgentError",
    "AgentFileTooLargeError",
    "AgentHealth",
    "AgentProtocolError",
    "AgentRequestError",
    "AgentTimeoutError",
    "AgentVersionError",
    "ExecEvent",
    "ExecExit",
    "ExecResult",
    "ExecStderr",
    "ExecStdout",
    "ExecStream",
    "connect_unix",
    "connect_vsock_uds",
    "wait_ready",
]
