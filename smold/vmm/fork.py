"""Fork a running VM into N copy-on-write children: snapshot it through its control socket, then start one
``--restore`` VMM process per child, each with its own state dir, vsock socket and identity.

The parent resumes as soon as the snapshot is written. The children map the snapshot's memory file
MAP_PRIVATE, so they share its page cache and copy only the pages they write; each gets a new hostname,
/etc/machine-id and reseeded guest entropy (the agent's IDENTITY request, ``--new-identity``). A child is
an ordinary VMM process: it outlives the parent and can be forked in turn. docs/snapshot.md, "Fork".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smold.vmm.control import control_request
from smold.vmm.runner import READY_FILE

BASE_DIR = "base"          # the snapshot inside the fork directory


class ForkError(Exception):
    """The parent could not be snapshotted or a child did not become ready."""


@dataclass
class Child:
    """One forked VM: its VMM process and what its READY line said."""

    index: int
    state_dir: Path
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def vsock_path(self) -> str:
        return str(self.ready["vsock_path"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class ForkResult:
    snapshot: dict[str, Any]              # the control socket's snapshot reply (sizes, timings)
    children: list[Child]
    timings: dict[str, float]             # snapshot, spawn, ready (all children), total; seconds


def spawn_child(snapshot_dir: Path, state_dir: Path, index: int, *, hostname: str, cid: int | None = None,
                extra_args: tuple[str, ...] = ()) -> Child:
    """Start ``python -m smold.vmm --restore`` for one child (its own session: it outlives the caller's group)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    out = open(state_dir / "vmm.out", "wb")   # the child inherits it; closed here after the spawn
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smold.vmm", "--restore", str(snapshot_dir), "--state-dir", str(state_dir),
             "--hostname", hostname, "--new-identity", *(["--cid", str(cid)] if cid is not None else []),
             *extra_args],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()
    return Child(index, state_dir, proc)


async def wait_ready(child: Child, timeout: float) -> None:
    """Until the child's runner wrote ready.json (after its agent answered and the clock and identity were set)."""
    path = child.state_dir / READY_FILE
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            with contextlib.suppress(OSError, ValueError):
                child.ready = json.loads(path.read_text())
                return
        if child.proc.poll() is not None:
            tail = (child.state_dir / "vmm.out").read_bytes()[-2000:].decode(errors="replace")
            raise ForkError(f"child {child.index} exited with {child.proc.returncode} before ready:\n{tail}")
        if time.monotonic() > deadline:
            raise ForkError(f"child {child.index} not ready after {timeout:.0f}s")
        await asyncio.sleep(0.02)


async def fork_vm(control_socket: Path, directory: Path, count: int, *, hostname_prefix: str = "smol-fork",
                  first_cid: int | None = None, timeout: float = 300.0,
                  extra_args: tuple[str, ...] = ()) -> ForkResult:
    """Snapshot the VM behind ``control_socket`` into ``directory/base`` and start ``count`` children
    (state dirs ``directory/child-<i>``). On failure every child already started is killed.

    Children keep the parent's vsock CID unless ``first_cid`` is given (child i gets first_cid + i): each
    VMM has its own vsock device and Unix socket, so a CID is only visible inside its guest, and a new
    one costs the first host connection a retry (the guest answers it from the old CID before it has
    handled the transport reset).
    """
    if count < 1:
        raise ForkError("count must be at least 1")
    directory = Path(directory)
    t0 = time.monotonic()
    reply = await control_request(control_socket, {"op": "snapshot", "dir": str(directory / BASE_DIR),
                                                   "resume": True})
    if not reply.get("ok"):
        raise ForkError(f"parent snapshot failed: {reply.get('error')}")
    t_snap = time.monotonic()
    children: list[Child] = []
    try:
        for i in range(count):
            children.append(spawn_child(directory / BASE_DIR, directory / f"child-{i}", i,
                                        hostname=f"{hostname_prefix}-{i}",
                                        cid=None if first_cid is None else first_cid + i, extra_args=extra_args))
        t_spawn = time.monotonic()
        await asyncio.gather(*(wait_ready(c, timeout) for c in children))
    except BaseException:
        for c in children:
            c.kill()
        raise
    t_end = time.monotonic()
    return ForkResult(snapshot=reply["snapshot"], children=children,
                      timings={"snapshot": t_snap - t0, "spawn": t_spawn - t_snap, "ready": t_end - t_spawn,
                               "total": t_end - t0})
