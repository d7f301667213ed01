"""The gRPC channel to smold, the Smolfile request message, and one-line error reporting."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/run/smold/smold.sock"
SMOLFILE_NAME = "Smolfile.toml"
MAX_MESSAGE = 512 * 1024 * 1024  # the daemon enforces its own copy cap; never refuse a reply it sends
ERROR_EXIT = 2


class CtlError(Exception):
    """A smolctl failure that ends the command with ``smolctl: error: <message>``."""

    def __init__(self, message: str, exit_code: int = ERROR_EXIT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def socket_path(arg: str | None) -> str:
    return arg or os.environ.get("SMOL_SOCKET") or DEFAULT_SOCKET


@dataclass(frozen=True)
class Endpoint:
    """Where smold is: its Unix socket, or a TCP address served with TLS (CA, bearer token file)."""

    socket: str = DEFAULT_SOCKET
    tcp: str | None = None
    ca: str | None = None          # PEM roots to trust; None: the system's
    token_file: str | None = None

    def __str__(self) -> str:
        return f"tcp {self.tcp}" if self.tcp else self.socket


def endpoint(socket: str | None = None, tcp: str | None = None, ca: str | None = None,
             token_file: str | None = None) -> Endpoint:
    """Options first, then $SMOL_TCP/$SMOL_CA/$SMOL_TOKEN_FILE, then $SMOL_SOCKET and the default socket."""
    if socket and tcp:
        fail("give --socket or --tcp, not both")
    if not socket:
        tcp = tcp or os.environ.get("SMOL_TCP") or None
    if not tcp:
        if ca or token_file:
            fail("--ca and --token-file only apply with --tcp (or $SMOL_TCP)")
        return Endpoint(socket=socket_path(socket))
    token_file = token_file or os.environ.get("SMOL_TOKEN_FILE") or None
    if not token_file:
        fail("--tcp needs --token-file (or $SMOL_TOKEN_FILE): smold's TCP listener wants a bearer token")
    return Endpoint(tcp=tcp, ca=ca or os.environ.get("SMOL_CA") or None, token_file=token_file)


def _read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        fail(f"{what} {path}: cannot read: {e.strerror}")


def connect(where: Endpoint | str) -> tuple[grpc.Channel, pb_grpc.SmolStub]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    if isinstance(where, str):
        where = Endpoint(socket=where)
    if where.tcp is None:
        channel = grpc.insecure_channel(f"unix:{os.path.abspath(where.socket)}", options=options)
        return channel, pb_grpc.SmolStub(channel)
    assert where.token_file is not None
    token = _read_file(where.token_file, "--token-file").decode("ascii", "replace").strip()
    if not token:
        fail(f"--token-file {where.token_file}: empty")
    roots = _read_file(where.ca, "--ca") if where.ca else None
    creds = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(root_certificates=roots),
                                               grpc.access_token_call_credentials(token))
    channel = grpc.secure_channel(where.tcp, creds, options=options)
    return channel, pb_grpc.SmolStub(channel)


def rpc_error_message(e: grpc.RpcError, socket: str | Endpoint) -> str:
    """One line: the daemon's reason, or why the daemon could not be reached."""
    code: grpc.StatusCode | None = e.code() if isinstance(e, grpc.Call) else None
    details = (e.details() if isinstance(e, grpc.Call) else "") or ""
    first = details.strip().splitlines()[0] if details.strip() else (code.name if code else str(e))
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:
        return f"cannot reach smold at {socket}: {first}; is the daemon running? (set --socket or SMOL_SOCKET, or --tcp)"
    return first


def fail(message: str, exit_code: int = ERROR_EXIT) -> NoReturn:
    raise CtlError(message, exit_code)


def smolfile_message(path_arg: str) -> pb.Smolfile:
    """A Smolfile request message from a file, or a directory holding Smolfile.toml."""
    path = Path(path_arg)
    if path.is_dir():
        path = path / SMOLFILE_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{path}: cannot read: {e}")
    base = path.absolute().parent
    return pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(base), filename=str(path)))


# C0 controls but newline and tab, DEL, C1 controls, and the bidirectional overrides and isolates (which can make
# a line read differently than it is): shown escaped, never interpreted by the terminal
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` (which may hold a guest's output: console tails, evidence, failure reasons) with every character
    that would steer a terminal (an escape sequence's ESC, a carriage return, a bidi override) written as
    ``\\xNN`` / ``\\uNNNN``; issue #19: guest text printed raw to terminals."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}",
                       text.replace("\r\n", "\n"))


def write_err(text: str) -> None:
    sys.stderr.write(terminal_safe(text.removesuffix("\n")) + ("\n" if text.endswith("\n") else ""))
    sys.stderr.flush()


def delete_each(names: list[str], delete: Callable[[str], object], socket: str | None) -> int:
    """Delete every name with one call each, printing the names deleted; an error is reported and the rest
    still go. Exit code 0, or ERROR_EXIT when any failed."""
    code = 0
    for name in names:
        try:
            delete(name)
        except grpc.RpcError as e:
            write_err(f"smolctl: error: {rpc_error_message(e, socket_path(socket))}\n")
            code = ERROR_EXIT
        else:
            print(name)
    return code
