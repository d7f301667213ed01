"""The gRPC channel to smold, the Smolfile request message, and one-line error reporting."""

from __future__ import annotations

import os
import sys
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


def connect(path: str) -> tuple[grpc.Channel, pb_grpc.SmolStub]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    channel = grpc.insecure_channel(f"unix:{os.path.abspath(path)}", options=options)
    return channel, pb_grpc.SmolStub(channel)


def rpc_error_message(e: grpc.RpcError, socket: str) -> str:
    """One line: the daemon's reason, or why the daemon could not be reached."""
    code: grpc.StatusCode | None = e.code() if isinstance(e, grpc.Call) else None
    details = (e.details() if isinstance(e, grpc.Call) else "") or ""
    first = details.strip().splitlines()[0] if details.strip() else (code.name if code else str(e))
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:
        return f"cannot reach smold at {socket}: {first}; is the daemon running? (set --socket or SMOL_SOCKET)"
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


def write_err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
