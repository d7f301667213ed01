"""Typed exceptions of the host-side guest-agent client."""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every guest-agent client error."""


class AgentConnectError(AgentError):
    """Could not reach the agent: socket connect failed or the vsock `CONNECT <port>` handshake was refused."""


class AgentClosedError(AgentError):
    """The connection to the agent closed (or broke) while a request was in flight."""


class AgentTimeoutError(AgentError):
    """The agent did not become ready (or answer) before the deadline."""


class AgentProtocolError(AgentError):
    """The peer violated the wire protocol, or the agent rejected our framing (EPROTO, EMSGSIZE)."""

    def __init__(self, message: str, code: str = "EPROTO") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AgentVersionError(AgentProtocolError):
    """Protocol major versions of host and agent differ (EVERSION)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "EVERSION")


class AgentRequestError(AgentError):
    """The agent failed one request with a structured error (code is e.g. ENOENT, EACCES, EINVAL)."""

    def __init__(self, code: str, message: str, errno: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.errno = errno


class AgentFileTooLargeError(AgentRequestError):
    """READ_FILE: the file is larger than the max_size the host asked for (EFBIG)."""


def error_from_payload(payload: dict[str, object]) -> AgentError:
    """Build the matching exception from an ERROR frame's JSON payload."""
    code = str(payload.get("code", "EINTERNAL"))
    message = str(payload.get("message", "unspecified agent error"))
    errno = payload.get("errno")
    errno_value = errno if isinstance(errno, int) and not isinstance(errno, bool) else None
    if code == "EVERSION":
        return AgentVersionError(message)
    if code in ("EPROTO", "EMSGSIZE"):
        return AgentProtocolError(message, code)
    if code == "EFBIG":
        return AgentFileTooLargeError(code, message, errno_value)
    return AgentRequestError(code, message, errno_value)
