"""smold Fork end to end with a real microVM: one boot, three copy-on-write children restored from it.

Makes one VM (the default vCPUs, 512 MiB: booted, or restored from the run's base bake of that size, tests/conftest.py);
the children are restores (each well under a second of VMM work,
then seconds per guest process start on an emulated-KVM host).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from microvm import VM_CPUS, shared_bakes_args
from test_daemon_vm import vmm_processes

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.images.artifacts import Artifacts, default_artifacts

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800)]

SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
[timeouts]
boot = 900
"""
# A background process that needs no process per tick (an exec costs seconds of emulated kernel time).
START_BACKGROUND = ("echo forked > /root/shared; mkfifo /tmp/f /tmp/up; "
                    "setsid bash -c 'echo $$ > /tmp/bg.pid; echo up > /tmp/up; exec 3<>/tmp/f; "
                    "while :; do read -t 1 -u 3; done' </dev/null >/dev/null 2>&1 & "
                    # Wait until it has written its pid: starting bash takes seconds of emulated kernel work, and a
                    # fork taken before then would leave the children racing the probe below.
                    "read up < /tmp/up; echo started")
PROBE = ("read m < /root/shared; read p < /tmp/bg.pid; alive=no; kill -0 $p && alive=yes; "
         "read h < /proc/sys/kernel/hostname; c0=absent; [ -e /root/only-c0 ] && c0=present; echo $m $alive $h $c0")


@pytest.fixture(scope="module")
def artifacts() -> Artifacts:
    return default_artifacts(build=True)


@pytest.fixture
def daemon(artifacts: Artifacts) -> Iterator[tuple[pb_grpc.SmolStub, Path]]:
    with daemon_process() as served:
        yield served


@contextlib.contextmanager
def daemon_process(*extra: str) -> Iterator[tuple[pb_grpc.SmolStub, Path]]:
    """A smold process (``extra``: more flags, e.g. --jail) on a fresh state directory; on exit it must stop
    cleanly within 300 s of SIGTERM and leave no VM process behind."""
    d = Path(tempfile.mkdtemp(prefix="smfk-", dir="/tmp"))
    os.chmod(d, 0o755)
    sock, state, log = d / "smold.sock", d / "state", d / "smold.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "smold.daemon", "--socket", str(sock), "--state-dir",
                                 str(state), "--max-machines", "4", "--max-memory", "2048", "--log-level", "debug",
                                 *shared_bakes_args(), *extra],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            yield pb_grpc.SmolStub(channel), state
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0, log.read_text()[-4000:]
        assert vmm_processes(d) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def sh(stub: pb_grpc.SmolStub, machine: str, script: str) -> str:
    out, code = b"", None
    for msg in stub.Exec(pb.ExecRequest(machine_id=machine, argv=["sh", "-c", script], timeout_seconds=600),
                         timeout=900):
        which = msg.WhichOneof("event")
        if which == "stdout":
            out += msg.stdout
        elif which == "exit":
            code = msg.exit.exit_code
    assert code == 0, (machine, script, out)
    return out.decode().strip()


def file_exists(stub: pb_grpc.SmolStub, machine: str, path: str) -> bool:
    check = pb.Check(file_exists=pb.FileExistsCheck(path=path))
    return stub.Verify(pb.VerifyRequest(machine_id=machine, checks=[check]), timeout=600).result.passed


def test_fork_into_three_children(daemon: tuple[pb_grpc.SmolStub, Path]) -> None:
    stub, state = daemon
    t0 = time.monotonic()
    parent = stub.CreateMachine(pb.CreateMachineRequest(name="parent", smolfile=pb.Smolfile(
        toml=pb.SmolfileToml(text=SMOLFILE))), timeout=1500).machine
    t_boot = time.monotonic() - t0
    assert sh(stub, "parent", START_BACKGROUND) == "started"

    t1 = time.monotonic()
    children = list(stub.Fork(pb.ForkRequest(machine_id="parent", count=3), timeout=900).machines)
    t_fork = time.monotonic() - t1
    ids = [c.id for c in children]
    assert len(set(ids)) == 3 and parent.id not in ids
    assert all(c.state == pb.MACHINE_STATE_RUNNING and c.vmm_pid > 0 for c in children)
    assert len(list((state / "forks").iterdir())) == 1

    # Each child sees the file and the background process, under its own hostname; a write in c0 stays in c0.
    assert sh(stub, ids[0], PROBE + "; echo mine > /root/only-c0") == f"forked yes {ids[0]} absent"
    for cid in ids[1:]:
        assert sh(stub, cid, PROBE) == f"forked yes {cid} absent"
    assert sh(stub, "parent", PROBE) == "forked yes parent absent"

    # Verify each child independently.
    assert [file_exists(stub, c, "/root/only-c0") for c in ids] == [True, False, False]
    assert all(file_exists(stub, c, "/root/shared") for c in ids)

    stub.DestroyMachine(pb.DestroyMachineRequest(machine_id="parent"), timeout=300)
    for cid in ids:
        assert sh(stub, cid, "cat /root/shared") == "forked"
    for cid in ids:
        stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=cid), timeout=300)
    assert list((state / "forks").iterdir()) == []  # the last child took the private base with it
    print(f"\nboot {t_boot:.0f}s, fork of 3 {t_fork:.1f}s, whole test {time.monotonic() - t0:.0f}s")
