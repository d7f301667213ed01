"""The optional TCP listener's security: TLS material, the bearer token file, and the token-checking interceptor."""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .config import DaemonConfig, parse_tcp_address
from .errors import DaemonSetupError

MIN_TOKEN_CHARS = 32
MAX_SECRET_FILE = 1 << 20
AUTH_HEADER = "authorization"


@dataclass(frozen=True)
class TcpListener:
    """Where to listen, and what TCP callers must present: the server's TLS key pair and the bearer token."""

    host: str
    port: int
    cert_pem: bytes
    key_pem: bytes
    token: str

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _read(path: Path, what: str, *, private: bool) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise DaemonSetupError(f"{what} {path}: cannot open: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DaemonSetupError(f"{what} {path}: not a regular file")
        if private and st.st_mode & 0o077:
            raise DaemonSetupError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others "
                                   f"access it; chmod 600 it")
        data = f.read(MAX_SECRET_FILE + 1)
    if len(data) > MAX_SECRET_FILE:
        raise DaemonSetupError(f"{what} {path}: larger than {MAX_SECRET_FILE} bytes")
    return data


def load_tcp_listener(config: DaemonConfig) -> TcpListener | None:
    """The TCP listener the config asks for (None without --tcp); DaemonSetupError on unusable files."""
    if config.tcp is None:
        return None
    assert config.tls_cert is not None and config.tls_key is not None and config.token_file is not None
    host, port = parse_tcp_address(config.tcp)
    raw = _read(config.token_file, "--token-file", private=True)
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise DaemonSetupError(f"--token-file {config.token_file}: the token must be ASCII") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise DaemonSetupError(f"--token-file {config.token_file}: the token must be at least "
                               f"{MIN_TOKEN_CHARS} characters (got {len(token)})")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise DaemonSetupError(f"--token-file {config.token_file}: the token must be one word of printable ASCII")
    cert = _read(config.tls_cert, "--tls-cert", private=False)
    key = _read(config.tls_key, "--tls-key", private=True)
    for what, path, pem in (("--tls-cert", config.tls_cert, cert), ("--tls-key", config.tls_key, key)):
        if b"-----BEGIN " not in pem:
            raise DaemonSetupError(f"{what} {path}: not a PEM file")
    return TcpListener(host, port, cert, key, token)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answer UNAUTHENTICATED unless the call carries exactly one ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _refusal(self, metadata: Any) -> str | None:
        values = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
        if not values:
            return "missing bearer token: TCP calls need metadata 'authorization: Bearer <token>'"
        if len(values) > 1:
            return "more than one authorization header"
        value = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
        if not hmac.compare_digest(value, self._expected):
            return "invalid bearer token"
        return None

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        reason = self._refusal(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        if reason is None:
            return await continuation(handler_call_details)
        return _refusing_handler(reason)


def _refusing_handler(reason: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that rejects the call before its request is read (no deserializer: the bytes stay opaque)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    # Stream-stream never waits for a request message, whatever shape the method has; the status is the answer.
    return grpc.stream_stream_rpc_method_handler(refuse)
