"""What the sync and async clients share: where smold is, channel options, request messages."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from smold.api.v1 import smol_pb2 as pb

from .errors import DataLossError
from .types import MachineInfo

DEFAULT_SOCKET = "/run/smold/smold.sock"
SMOLFILE_NAME = "Smolfile.toml"
MAX_MESSAGE = 1024 * 1024 * 1024  # smold enforces its own copy cap; never refuse a reply it sends

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


def socket_path(socket: str | os.PathLike[str] | None) -> str:
    """The socket given, else $SMOL_SOCKET, else /run/smold/smold.sock."""
    return os.fspath(socket) if socket else os.environ.get("SMOL_SOCKET") or DEFAULT_SOCKET


def target(socket: str | os.PathLike[str] | None) -> str:
    return f"unix:{os.path.abspath(socket_path(socket))}"


def new_name() -> str:
    """A unique machine name, so a create interrupted before its reply can still be destroyed by name."""
    return f"sdk-{uuid.uuid4().hex[:16]}"


def smolfile_message(smolfile: str | os.PathLike[str] | None = None, *, toml: str | None = None,
                     base_dir: str | os.PathLike[str] | None = None) -> pb.Smolfile:
    """A Smolfile message from a path (a file, or a directory holding Smolfile.toml) or TOML text.

    With neither, the empty Smolfile: the default image, 2 CPUs, 1 GiB, no network, no verifier.
    """
    if smolfile is not None and toml is not None:
        raise ValueError("give a Smolfile path or TOML text, not both")
    if smolfile is not None:
        path = Path(smolfile)
        if path.is_dir():
            path = path / SMOLFILE_NAME
        text = path.read_text(encoding="utf-8")
        return pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(path.absolute().parent),
                                                filename=str(path)))
    base = Path(base_dir).absolute() if base_dir is not None else Path.cwd()
    return pb.Smolfile(toml=pb.SmolfileToml(text=toml or "", base_dir=str(base), filename="<sdk>"))


def exec_request(machine_id: str, argv: Sequence[str] | str, *, env: Mapping[str, str] | None, cwd: str | None,
                 user: str | None, stdin: bytes | str | None, timeout: float | None) -> pb.ExecRequest:
    """An ExecRequest; a string command runs with ``sh -c``."""
    args = ["sh", "-c", argv] if isinstance(argv, str) else list(argv)
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    req = pb.ExecRequest(machine_id=machine_id, argv=args, env=dict(env or {}), cwd=cwd or "", user=user or "",
                         stdin=data)
    if timeout is not None:
        req.timeout_seconds = float(timeout)
    return req


def copy_in_request(machine_id: str, path: str, content: bytes | str, *, mode: int | None, mkdirs: bool,
                    tar: bool) -> pb.CopyInRequest:
    data = content.encode() if isinstance(content, str) else bytes(content)
    req = pb.CopyInRequest(machine_id=machine_id, path=path, content=data,
                           format=pb.COPY_FORMAT_TAR if tar else pb.COPY_FORMAT_FILE, mkdirs=mkdirs)
    if mode is not None:
        req.mode = mode
    return req


def copy_out_request(machine_id: str, path: str, *, max_size: int, tar: bool) -> pb.CopyOutRequest:
    return pb.CopyOutRequest(machine_id=machine_id, path=path, max_size_bytes=max_size,
                             format=pb.COPY_FORMAT_TAR if tar else pb.COPY_FORMAT_FILE)


ClientT = TypeVar("ClientT")


class MachineHandle(Generic[ClientT]):
    """What Machine and AsyncMachine share: the client they call through and the machine's last known info."""

    def __init__(self, client: ClientT, info: MachineInfo) -> None:
        self.client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, name={self.name!r})"


def checked_artifact(resp: pb.GetArtifactResponse, result_id: str, name: str) -> bytes:
    """The artifact's content, if it matches the SHA-256 the daemon sent with it."""
    if hashlib.sha256(resp.content).hexdigest() != resp.sha256:
        raise DataLossError(f"result {result_id}: artifact {name} arrived damaged (SHA-256 mismatch)")
    return resp.content
