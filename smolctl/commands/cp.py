"""smolctl cp SRC DST: copy a file or directory between the host and a machine (MACHINE:/path on one side)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import stat
import tarfile
from pathlib import Path

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smolsdk.untar import UnsafeArchiveError, extract

from ..client import fail

NAME = "cp"
HELP = "copy files: HOST_PATH MACHINE:/GUEST_PATH or MACHINE:/GUEST_PATH HOST_PATH (-r for directories)"
_REMOTE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,62}):(/.*)", re.S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--recursive", action="store_true",
                   help="copy a directory (as a tar archive): its contents go into the destination directory")
    p.add_argument("--json", action="store_true", help='print {"src", "dst", "size_bytes"} as JSON')
    p.add_argument("src")
    p.add_argument("dst")


def remote(spec: str) -> tuple[str, str] | None:
    """(machine, guest path) for MACHINE:/path, None for a host path (write ./a:b for a local 'a:b')."""
    m = _REMOTE.fullmatch(spec)
    return (m.group(1), m.group(2)) if m else None


def _pack(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(src, arcname=".", recursive=True)
    return buf.getvalue()


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    src, dst = remote(args.src), remote(args.dst)
    if (src is None) == (dst is None):
        fail("cp: exactly one of SRC and DST must be MACHINE:/path")
    if dst is not None:
        size = _copy_in(Path(args.src), *dst, stub=stub)
    else:
        assert src is not None
        size = _copy_out(*src, Path(args.dst), recursive=args.recursive, stub=stub)
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, "size_bytes": size}))
    return 0


def _copy_in(host: Path, machine: str, guest: str, *, stub: pb_grpc.SmolStub) -> int:
    try:
        st = host.stat()
    except OSError as e:
        fail(f"cp: {host}: {e.strerror}")
    if stat.S_ISDIR(st.st_mode):
        req = pb.CopyInRequest(machine_id=machine, path=guest.rstrip("/") or "/", content=_pack(host),
                               format=pb.COPY_FORMAT_TAR)
    else:
        if guest.endswith("/"):
            guest += host.name
        try:
            data = host.read_bytes()
        except OSError as e:
            fail(f"cp: {host}: {e.strerror}")
        req = pb.CopyInRequest(machine_id=machine, path=guest, content=data, format=pb.COPY_FORMAT_FILE,
                               mode=stat.S_IMODE(st.st_mode), mkdirs=True)
    return int(stub.CopyIn(req).size_bytes)


def _copy_out(machine: str, guest: str, host: Path, *, recursive: bool, stub: pb_grpc.SmolStub) -> int:
    if recursive:
        resp = stub.CopyOut(pb.CopyOutRequest(machine_id=machine, path=guest.rstrip("/") or "/",
                                              format=pb.COPY_FORMAT_TAR))
        host.mkdir(parents=True, exist_ok=True)
        try:
            extract(resp.content, host)   # the guest made this archive: nothing of it lands outside host
        except (tarfile.TarError, OSError, UnsafeArchiveError) as e:
            fail(f"cp: cannot unpack into {host}: {e}")
        return len(resp.content)
    resp = stub.CopyOut(pb.CopyOutRequest(machine_id=machine, path=guest, format=pb.COPY_FORMAT_FILE))
    if host.is_dir():
        host = host / os.path.basename(guest)
    try:
        host.write_bytes(resp.content)
    except OSError as e:
        fail(f"cp: {host}: {e.strerror}")
    return len(resp.content)
