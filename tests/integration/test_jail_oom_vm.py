"""A real microVM exceeding its memory limit, through the daemon with ``--jail`` (issue 7).

One boot (the bake, inside its jail), then two machines restored from it, each jailed in its own cgroup.
The victim's cgroup limit is lowered to what it uses now plus a little, and its guest fills /dev/shm: the
kernel's OOM killer takes its VMM, the daemon reports the machine FAILED with the reason, and the neighbour
keeps running and executing. Destroy leaves no process, cgroup or jail behind.

Why lower the limit at run time instead of creating a small machine: the jail's limit is the guest's RAM plus
the VMM's own overhead, so a guest cannot pass it by filling its RAM; only a VMM that grows (or an operator
who shrinks the limit) can. And on an emulated-KVM host a guest dirties memory at well under 1 MiB/s
(each page is emulated guest kernel work: docs/pvm-emulator.md), so a margin of tens of MiB is what a test
can afford to fill.
"""

from __future__ import annotations

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
from test_daemon_fork_vm import artifacts, sh  # noqa: F401  (fixtures)
from test_daemon_vm import vmm_processes

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.images.artifacts import Artifacts
from smold.jail.cgroup import Cgroup

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")]

MiB = 1 << 20
MARGIN = 24 * MiB    # what the victim may still add once its limit is lowered
SMOLFILE = """
image = "default"
cpus = 1
memory = "256M"
[timeouts]
boot = 900
"""
FILL = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=120 2>&1; echo filled"


@pytest.fixture(scope="module")
def jailed_daemon(artifacts: Artifacts) -> Iterator[tuple[pb_grpc.SmolStub, Path, Path]]:  # noqa: F811
    d = Path(tempfile.mkdtemp(prefix="smjl-", dir="/tmp"))
    os.chmod(d, 0o755)
    sock, state, log = d / "smold.sock", d / "state", d / "smold.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "smold.daemon", "--socket", str(sock), "--state-dir",
                                 str(state), "--max-machines", "4", "--max-memory", "2048", "--log-level", "debug",
                                 "--jail", "--jail-uid", "64071", "--jail-gid", "64071"],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            yield pb_grpc.SmolStub(channel), state, log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0, log.read_text()[-4000:]
        assert vmm_processes(d) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def wait_state(stub: pb_grpc.SmolStub, mid: str, state: int, timeout: float) -> pb.Machine:
    deadline = time.monotonic() + timeout
    while True:
        m = stub.GetMachine(pb.GetMachineRequest(machine_id=mid)).machine
        if m.state == state:
            return m
        assert time.monotonic() < deadline, f"machine {mid} is {pb.MachineState.Name(m.state)}: {m.failure_reason}"
        time.sleep(0.5)


def test_vm_over_its_memory_limit_is_stopped_and_reported_while_its_neighbour_runs(
        jailed_daemon: tuple[pb_grpc.SmolStub, Path, Path], tmp_path: Path) -> None:
    stub, state, log = jailed_daemon
    (tmp_path / "Smolfile.toml").write_text(SMOLFILE)
    smolfile = pb.Smolfile(toml=pb.SmolfileToml(text=SMOLFILE, base_dir=str(tmp_path)))
    stub.BakeImage(pb.BakeImageRequest(smolfile=smolfile), timeout=1500)
    victim = stub.CreateMachine(pb.CreateMachineRequest(name="victim", smolfile=smolfile), timeout=600).machine
    neighbour = stub.CreateMachine(pb.CreateMachineRequest(name="neighbour", smolfile=smolfile),
                                   timeout=600).machine
    assert victim.restored_from.startswith("bake:") and neighbour.restored_from == victim.restored_from

    cgroups = {m.id: Cgroup(m.id, "smol") for m in (victim, neighbour)}
    for m in (victim, neighbour):   # each VMM runs jailed in its own cgroup, limited to guest RAM + overhead
        cg = cgroups[m.id]
        assert cg.memory_limit() == (256 + 256) * MiB and cg.procs(), (m.id, cg.procs())
        assert os.stat(f"/proc/{cg.procs()[0]}").st_uid == 64071
    assert sh(stub, "victim", "echo up") == "up"

    cg = cgroups[victim.id]
    cg.set_memory_limit(cg.memory_usage() + MARGIN)
    limit_mib = cg.memory_limit() // MiB
    t0 = time.monotonic()
    events, error = [], None
    try:
        for msg in stub.Exec(pb.ExecRequest(machine_id="victim", argv=["sh", "-c", FILL], timeout_seconds=900),
                             timeout=1000):
            events.append(msg.WhichOneof("event"))
    except grpc.RpcError as e:
        error = e
    # The exec does not complete: its machine died under it (an error, or at most an exit that is not 0).
    assert error is not None or "exit" not in events, events
    failed = wait_state(stub, victim.id, pb.MACHINE_STATE_FAILED, timeout=120)
    t_oom = time.monotonic() - t0
    reason = failed.failure_reason
    assert "exited with status 137" in reason and "out of memory" in reason, reason
    assert f"limit of {limit_mib} MiB" in reason, reason
    assert cg.procs() == []

    # The neighbour never noticed: it is RUNNING and executes.
    assert stub.GetMachine(pb.GetMachineRequest(machine_id="neighbour")).machine.state == pb.MACHINE_STATE_RUNNING
    assert sh(stub, "neighbour", "echo alive; cat /proc/sys/kernel/hostname") == "alive\nneighbour"

    for m in (victim, neighbour):
        stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id), timeout=300)
    assert stub.ListMachines(pb.ListMachinesRequest()).machines == []
    for mid, c in cgroups.items():   # nothing of either VM is left: no cgroup, no jail root, no state dir
        assert not any(d.exists() for d in c.dirs.values()), mid
        assert not (Path("/run/smol-jail") / mid).exists() and not (state / "machines" / mid).exists()
    print(f"\nOOM after {t_oom:.0f}s with a {limit_mib} MiB limit: {reason}")
