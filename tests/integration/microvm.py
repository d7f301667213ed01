"""Microvm: a test fixture class that runs ``python -m smold.vmm`` as a child process and talks to its agent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from smold.agent import AgentClient, ExecResult, connect_vsock_uds
from smold.images.artifacts import Artifacts
from smold.kvm import is_pvm
from smold.kvm.cpuid import default_vcpus

T = TypeVar("T")

# The vCPUs of the tests' machines: the hardware-KVM default (2) in the KVM rig and on real hosts, 1 on PVM
# hosts, where SMP under the CPL0 emulator is unreliable (docs/pvm-emulator.md). Every daemon module uses it, so
# they share one base bake of the default image (tests/conftest.py).
VM_CPUS = default_vcpus(is_pvm())


def shared_bakes_args() -> list[str]:
    """``--bakes-dir`` of the run's shared bake store (tests/conftest.py) for a test's smold, if there is one."""
    path = os.environ.get("SMOL_TEST_BAKES")
    return ["--bakes-dir", path] if path else []


class MicrovmError(Exception):
    """The VMM process failed to start or become ready."""


class Microvm:
    """One VMM process per VM, as the daemon runs them. Synchronous helpers for tests."""

    def __init__(self, artifacts: Artifacts, *, cpus: int = 2, memory_mib: int = 512,
                 state_dir: Path | None = None, console_log: Path | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "smold.vmm", "--kernel", str(artifacts.kernel),
                     "--initramfs", str(artifacts.initramfs), "--rootfs", str(artifacts.rootfs),
                     "--cpus", str(cpus), "--memory", str(memory_mib)]
        if state_dir is not None:
            self.argv += ["--state-dir", str(state_dir)]
        if console_log is not None:
            self.argv += ["--console-log", str(console_log)]
        self.argv += extra_args or []
        self.console_log = console_log
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.stdout = b""
        self.stderr = b""

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> dict[str, Any]:
        """Spawn the VMM and wait for its ``READY {json}`` line."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        sel.register(self.proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        try:
            while sel.get_map() and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=1.0):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.fileobj is self.proc.stderr:
                        self.stderr += chunk
                    else:
                        buf += chunk
                        for line in buf.splitlines():
                            if line.startswith(b"READY ") and line.endswith(b"}"):
                                self.ready = json.loads(line[6:])
                                return self.ready
            if not sel.get_map():   # both pipes closed: the VMM is gone; its status (a signal?) says how
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
            raise MicrovmError(f"VMM not ready (exit {self.proc.poll()}); stderr:\n"
                               f"{self.stderr.decode(errors='replace')[-4000:]}\nconsole:\n{self.console_tail()}")
        finally:
            sel.close()
            self.stdout = buf

    def console_tail(self, limit: int = 4000) -> str:
        if self.console_log is None or not self.console_log.exists():
            return "(no console log)"
        return self.console_log.read_bytes()[-limit:].decode(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def vsock_path(self) -> str:
        return str(self.ready["vsock_path"])

    def wait(self, timeout: float = 120.0) -> int:
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise MicrovmError(f"VMM {self.pid} still running after {timeout}s") from e
        self.stdout += out
        self.stderr += err
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    # -- talking to the guest agent ---------------------------------------------------------------------
    def with_agent(self, fn: Callable[[AgentClient], Awaitable[T]], timeout: float = 300.0) -> T:
        async def go() -> T:
            client = await connect_vsock_uds(self.vsock_path, int(self.ready["agent_port"]), timeout=30)
            try:
                return await asyncio.wait_for(fn(client), timeout)
            finally:
                await client.close()
        return asyncio.run(go())

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> ExecResult:
        return self.with_agent(lambda c: c.run(argv, stdin=stdin, timeout=timeout))
