"""Inspect's sandbox self-check against the "smol" provider on one real microVM (shared by every check).

Every check costs tens of seconds of emulated guest work on a PVM host, so by default a cross-section of
the self-check runs here (files, errors, exec output, exit codes, timeouts, env, stdin, large transfers,
users, cwd); SMOL_INSPECT_FULL=1 runs all of it. tests/unit/test_inspect_sandbox.py runs the whole
self-check against the guest agent on the host.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from inspect_ai.util._sandbox.self_check import *  # noqa: F403
from microvm import VM_CPUS
from test_daemon_vm import Daemon, vmm_processes

import smolsdk
from smold.kvm.api import is_pvm
from smolsdk.inspect_sandbox import SmolSandboxEnvironment

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(3600)]

SUBSET = {
    "test_read_and_write_file_text", "test_read_file_not_found", "test_read_file_is_directory",
    "test_write_text_file_without_permissions", "test_exec_output", "test_exec_stderr_utf", "test_exec_returncode",
    "test_exec_timeout_kills_child_processes", "test_exec_env_vars", "test_exec_input_binary",
    "test_exec_large_command", "test_exec_as_nonexistent_user", "test_cwd_relative",
}
# Left out by default, measured on the 2-core PVM host (2026-12-03): test_read_and_write_large_file_binary
# (550 s) and test_exec_input_large (50 MiB of stdin, 370 s) move data at ~0.15 MiB/s through the emulated
# guest kernel; test_exec_as_user's adduser (a Perl script) needs more than the check's 10 s there.
SLOW_HERE = {"test_exec_as_user": "adduser takes longer than the check's 10 s timeout under an emulating KVM"}
if not os.environ.get("SMOL_INSPECT_FULL"):
    for _name in [n for n in globals() if n.startswith("test_") and n not in SUBSET]:
        del globals()[_name]

# The size of the other daemon tests' machines: this one restores the base bake they share (tests/conftest.py).
SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
[timeouts]
boot = 900
"""

STARTED = time.monotonic()


@pytest.fixture(scope="module")
def vm() -> Iterator[tuple[Path, str]]:
    d = Path(tempfile.mkdtemp(prefix="smins-", dir="/tmp"))
    daemon = Daemon(d).start()
    try:
        with smolsdk.Client(daemon.socket) as client:
            t0 = time.monotonic()
            m = client.create(toml=SMOLFILE, base_dir=d)
            print(f"\nboot: {time.monotonic() - t0:.1f}s")
            try:
                yield daemon.socket, m.id
            finally:
                m.destroy()
                print(f"\nself-check on a VM: {time.monotonic() - STARTED:.1f}s in all")
    finally:
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def sandbox_env(vm: tuple[Path, str], request: pytest.FixtureRequest) -> AsyncIterator[SmolSandboxEnvironment]:
    reason = SLOW_HERE.get(request.node.originalname)
    if reason and is_pvm():
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    sock, machine_id = vm
    env = SmolSandboxEnvironment(smolsdk.AsyncClient(sock), machine_id, "/")
    try:
        yield env
    finally:
        await env.client.close()
