"""Snapshots end to end: a tiny guest paused mid-I/O, then the default Linux guest baked once and restored.

The Linux part boots ONE VM for the whole module (the default vCPUs: 2 on hardware KVM and in the KVM rig, 1 on PVM hosts, where
booting is emulated and costs minutes), snapshots it with --snapshot-on-ready after a setup command, and restores copies of it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from microvm import VM_CPUS, Microvm

from smold.agent import ExecResult, connect_vsock_uds
from smold.boot.cpu import setup_long_mode
from smold.boot.layout import TSS_ADDR
from smold.devices.bus import Bus
from smold.images.artifacts import Artifacts, default_artifacts
from smold.jail import seccomp
from smold.kvm import Kvm, Vcpu, Vm
from smold.kvm.api import is_pvm
from smold.kvm.cpuid import build_cpuid, resolve_template
from smold.memory import GuestMemory
from smold.snapshot import kvmstate
from smold.snapshot.store import MEMORY_FILE, STATE_FILE, read_snapshot
from smold.vmm.control import control_request
from smold.vmm.fork import fork_vm
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

pytestmark = [pytest.mark.kvm]

MiB = 1 << 20


# -- a tiny guest: pause completes an IN before the registers are read -----------------------------------
CODE_ADDR = 0x100000
# 1: in $0x11,%al ; out %al,$0x10 ; jmp 1b      (echo every value read from port 0x11 to port 0x10)
ECHO_LOOP = bytes.fromhex("e411e610ebfa")


class PortPair:
    """Port 0x11 answers 1, 2, 3...; port 0x10 records what the guest echoes; ``on_read`` hooks reads."""

    def __init__(self) -> None:
        self.next = 0
        self.echoed: list[int] = []
        self.on_read: object = None
        self.got = threading.Event()

    def read(self, offset: int, size: int) -> bytes:
        self.next += 1
        if callable(self.on_read):
            self.on_read(self.next)
        return bytes([self.next & 0xFF]) + bytes(size - 1)

    def write(self, offset: int, data: bytes) -> None:
        self.echoed.append(data[0])
        self.got.set()


def _tiny_vm(kvm: Kvm, mem: GuestMemory) -> tuple[Vm, Vcpu]:
    vm = kvm.create_vm()
    vm.set_tss_addr(TSS_ADDR)
    vm.create_irqchip()   # LAPIC, irqchip and PIT state are part of what is saved (the guest runs with IF=0)
    vm.create_pit2()
    region = mem.regions[0]
    vm.set_user_memory_region(0, region.size, mem.host_address(region))
    vcpu = vm.create_vcpu(0)
    vcpu.set_cpuid(build_cpuid(kvm.supported_cpuid(), resolve_template("auto", is_pvm()), 0, 1))
    return vm, vcpu


def test_tiny_guest_paused_mid_in_resumes_in_a_new_vm(tmp_path: Path) -> None:
    install_kick_handler()
    kvm = Kvm()
    mem = GuestMemory([(0, 2 * MiB)])
    vm, vcpu = _tiny_vm(kvm, mem)
    mem.write(CODE_ADDR, ECHO_LOOP)
    setup_long_mode(vcpu, mem, entry=CODE_ADDR)
    ports = PortPair()
    pio = Bus("pio")
    pio.insert(0x10, 2, ports)
    exits: list[VcpuExit] = []
    thread = VcpuThread(vcpu, pio, Bus("mmio"), exits.append)
    # Pause from inside the 5th IN: KVM has not written %al yet when the exit is handled, so the
    # registers are only right if the pause completes the instruction first.
    ports.on_read = lambda n: thread.pause() if n == 5 else None
    thread.start()
    try:
        assert thread.paused.wait(30), "vCPU did not park"
        assert ports.echoed == [1, 2, 3, 4]
        msrs = kvmstate.saveable_msrs(kvm, vcpu)
        xsave, xcrs = kvmstate.host_caps(kvm)
        cpuid = build_cpuid(kvm.supported_cpuid(), resolve_template("auto", is_pvm()), 0, 1)
        state = kvmstate.capture_vcpu(vcpu, cpuid, msrs, xsave=xsave, xcrs=xcrs)
        vm_state = kvmstate.capture_vm(vm)
        assert state.regs.rax & 0xFF == 5, "the paused IN was completed before the registers were read"
        with open(tmp_path / "mem", "wb") as f:
            mem.dump(f.fileno())
        # The original goes on from where it paused.
        ports.got.clear()
        thread.resume()
        assert ports.got.wait(30)
    finally:
        thread.stop()
        thread.join(10)
    assert ports.echoed[:5] == [1, 2, 3, 4, 5]

    # A new VM from the saved state and memory file continues with the echo of 5.
    mem2 = GuestMemory.from_file(tmp_path / "mem", [(0, 2 * MiB)])
    vm2, vcpu2 = _tiny_vm(kvm, mem2)
    kvmstate.restore_vm(vm2, vm_state)
    kvmstate.restore_vcpu(vcpu2, state, xsave=xsave, xcrs=xcrs)
    ports2 = PortPair()
    ports2.next = 100
    pio2 = Bus("pio")
    pio2.insert(0x10, 2, ports2)
    thread2 = VcpuThread(vcpu2, pio2, Bus("mmio"), exits.append)
    ports2.on_read = lambda n: thread2.pause() if n == 102 else None
    thread2.start()
    try:
        assert thread2.paused.wait(30)
    finally:
        thread2.stop()
        thread2.join(10)
    assert ports2.echoed == [5, 101], "restored vCPU continued right after the completed IN"
    for v in (vm, vm2):
        v.close()
    mem.close()
    mem2.close()
    kvm.close()


# -- the Linux guest: bake once, restore copies ----------------------------------------------------------
# A counter that needs no process per tick (bash builtins only: an exec costs seconds of emulated kernel
# time on PVM) and depends on guest timers (read -t 1 on an idle fifo).
SETUP = ("echo baked > /root/marker; mkfifo /tmp/f; "
         "setsid bash -c 'echo $$ > /tmp/counter.pid; exec 3<>/tmp/f; i=0; "
         "while :; do i=$((i+1)); echo $i > /tmp/c; read -t 1 -u 3; done' "
         "</dev/null >/dev/null 2>&1 & echo started")


# Probes use shell builtins only (read, echo, kill, [ ): each exec then spawns one process, the shell.
READ_COUNTER = "until read c < /tmp/c; do :; done"   # the counter may be caught between truncate and write


class RestoredVm(Microvm):
    """A VMM process started with --restore (the Microvm helpers, a different command line)."""

    def __init__(self, snapshot: Path, state_dir: Path, *extra: str) -> None:
        super().__init__(Artifacts(Path(), Path(), Path()), state_dir=state_dir,
                         console_log=state_dir.parent / f"{state_dir.name}-console.log")
        self.argv = [sys.executable, "-m", "smold.vmm", "--restore", str(snapshot), "--state-dir", str(state_dir),
                     "--console-log", str(self.console_log), "--seccomp", "on", *extra]


def rss_mib(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1]) / 1024
    return out


@dataclass
class Baked:
    snapshot: Path
    work: Path
    ready: dict[str, object]
    snapshot_line: str


@pytest.fixture(scope="module")
def artifacts() -> Artifacts:
    return default_artifacts(build=True)


@pytest.fixture(scope="module")
def baked(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baked]:
    work = tmp_path_factory.mktemp("snapshot")
    snap = work / "snap"
    vm = Microvm(artifacts, cpus=VM_CPUS, memory_mib=512, state_dir=work / "parent",
                 console_log=work / "parent-console.log",
                 extra_args=["--seccomp", "on", "--snapshot-on-ready", str(snap), "--", "sh", "-c", SETUP])
    vm.start()
    code = vm.wait(timeout=600)
    out = vm.stdout.decode(errors="replace")
    assert code == 0, f"bake failed ({code}):\n{out}\n{vm.stderr.decode(errors='replace')[-3000:]}"
    line = next((ln for ln in out.splitlines() if ln.startswith("SNAPSHOT ")), "")
    assert "started" in out and line, out
    yield Baked(snap, work, vm.ready, line)
    shutil.rmtree(work, ignore_errors=True)


@dataclass
class RestoredA:
    """The first restored copy and what its first two execs saw (run once for the module)."""

    vm: RestoredVm
    first: ExecResult
    first_exec_s: float
    second: ExecResult


@pytest.fixture(scope="module")
def restored(baked: Baked) -> Iterator[RestoredA]:
    vm = RestoredVm(baked.snapshot, baked.work / "a")
    vm.start(timeout=120)
    try:
        t0 = time.monotonic()
        first = vm.run(["bash", "-c", f"{READ_COUNTER}; read m < /root/marker; printf '%s %s %(%s)T' $c $m -1"],
                       timeout=300)
        first_exec_s = time.monotonic() - t0
        # The counter ticks once a guest second; on hardware KVM both execs can fall within one tick, so the
        # second waits (up to 10 s) for a value past the first one's instead of reading it once.
        words = first.stdout.decode().split()
        first_count = words[0] if words and words[0].isdigit() else "0"
        second = vm.run(["bash", "-c", f"for i in $(seq 100); do {READ_COUNTER}; [ $c -gt {first_count} ] && break; "
                                       "sleep 0.1; done; echo $c; echo only-a > /root/only-in-a"], timeout=300)
        yield RestoredA(vm, first, first_exec_s, second)
    finally:
        vm.kill()


pytest_linux = pytest.mark.linux


@pytest_linux
@pytest.mark.pvm_smoke
def test_bake_wrote_a_checked_snapshot(baked: Baked) -> None:
    snap = read_snapshot(baked.snapshot)
    assert snap.spec.cpus == VM_CPUS and snap.spec.memory_mib == 512
    assert snap.memory.sha256 is not None
    mem = baked.snapshot / MEMORY_FILE
    assert mem.stat().st_size == 512 * MiB
    assert mem.stat().st_blocks * 512 < 400 * MiB, "untouched guest RAM stays a hole in the memory file"
    print(f"\nbake: boot {baked.ready['boot_seconds']} s; {baked.snapshot_line}")


@pytest_linux
def test_restored_vm_runs_under_the_seccomp_filter(restored: RestoredA) -> None:
    # RestoredVm passes --seccomp on: the restore, execs and control-socket snapshots below run filtered.
    assert seccomp.filter_mode(restored.vm.pid) == 2
    assert restored.vm.proc is not None and restored.vm.proc.poll() is None


@pytest_linux
@pytest.mark.pvm_smoke
def test_restored_vm_execs_at_once_and_keeps_counting(restored: RestoredA) -> None:
    ready = restored.vm.ready
    assert ready["restored"] is True
    r = restored.first
    assert r.exit_code == 0, r.stderr
    count, marker, guest_now = r.stdout.decode().split()
    assert marker == "baked"
    assert abs(int(guest_now) - time.time()) < 30 + restored.first_exec_s, \
        "the guest wall clock was corrected after restore"
    assert restored.second.exit_code == 0, restored.second.stderr
    assert int(restored.second.stdout) > int(count) >= 1, "the counter started before the snapshot keeps counting"
    print(f"\nrestore -> agent ready {ready['boot_seconds']} s ({ready['timings']}); "
          f"first exec {restored.first_exec_s:.2f} s")


@pytest_linux
def test_second_restore_does_not_see_the_first_ones_writes_and_shares_memory(
        baked: Baked, restored: RestoredA) -> None:
    vm_b = RestoredVm(baked.snapshot, baked.work / "b")
    vm_b.start(timeout=120)
    try:
        r = vm_b.run(["sh", "-c", "read m < /root/marker; a=absent; [ -e /root/only-in-a ] && a=present; echo $m $a"],
                     timeout=300)
        assert r.stdout.decode().split() == ["baked", "absent"], r
        a, b = rss_mib(restored.vm.pid), rss_mib(vm_b.pid)
        print(f"\nRSS MiB: A {a}  B {b}")
        # Both map the one 512 MiB memory file copy-on-write and touched little of it.
        assert a["VmRSS"] + b["VmRSS"] < 512, (a, b)
        assert a["RssAnon"] + b["RssAnon"] < 256, (a, b)
    finally:
        vm_b.kill()


@pytest_linux
def test_snapshot_of_a_restored_vm_keeps_its_writes(baked: Baked, restored: RestoredA) -> None:
    assert restored.second.exit_code == 0
    again = baked.work / "snap-of-a"
    reply = asyncio.run(control_request(baked.work / "a" / "control.sock",
                                        {"op": "snapshot", "dir": str(again), "resume": True}))
    assert reply["ok"], reply
    vm_c = RestoredVm(again, baked.work / "c")
    vm_c.start(timeout=120)
    try:
        r = vm_c.run(["sh", "-c", "read a < /root/only-in-a; read m < /root/marker; echo $a $m"], timeout=300)
        assert r.stdout.decode().split() == ["only-a", "baked"], r
    finally:
        vm_c.kill()


@pytest_linux
def test_tampered_snapshot_is_refused(baked: Baked, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    os.link(baked.snapshot / MEMORY_FILE, bad / MEMORY_FILE)
    data = bytearray((baked.snapshot / STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0x20
    (bad / STATE_FILE).write_bytes(bytes(data))
    p = subprocess.run([sys.executable, "-m", "smold.vmm", "--restore", str(bad), "--state-dir", str(tmp_path / "s")],
                       capture_output=True, timeout=60)
    assert p.returncode != 0
    assert b"sha256 mismatch" in p.stderr and b"READY" not in p.stdout, p.stderr


@pytest_linux
def test_fork_children_share_the_parent_state_not_each_others_writes(baked: Baked, restored: RestoredA) -> None:
    """Issue 4's fork acceptance, with the restored VM A as the parent and two children."""
    assert restored.second.exit_code == 0   # A wrote /root/only-in-a before the fork
    parent = restored.vm
    result = asyncio.run(fork_vm(baked.work / "a" / "control.sock", baked.work / "fork", 2,
                                 hostname_prefix="kid", timeout=300))
    c0, c1 = result.children
    try:
        print(f"\nfork of 2: {result.timings}; RSS MiB parent {rss_mib(parent.pid)} "
              f"children {[rss_mib(c.pid) for c in result.children]}")
        ident = ("read h < /proc/sys/kernel/hostname; id=none; [ -s /etc/machine-id ] && read id < /etc/machine-id; "
                 "c0=absent; [ -e /root/from-c0 ] && c0=present")
        probe = (f"read m < /root/marker; read a < /root/only-in-a; {ident}; read u < /proc/sys/kernel/random/uuid; "
                 "read p < /tmp/counter.pid; alive=no; kill -0 $p && alive=yes; echo $m $a $h $id $u $alive $c0")
        r0 = _run_on(c0.vsock_path, ["sh", "-c", probe + "; echo c0 > /root/from-c0"])
        r1 = _run_on(c1.vsock_path, ["sh", "-c", probe])
        rp = parent.run(["sh", "-c", f"{ident}; echo $h $id $c0"], timeout=300)
        m0, m1, mp = r0.stdout.decode().split(), r1.stdout.decode().split(), rp.stdout.decode().split()
        assert m0[:3] == ["baked", "only-a", "kid-0"] and m1[:3] == ["baked", "only-a", "kid-1"], (r0, r1)
        assert m0[5:] == ["yes", "absent"] and m1[5:] == ["yes", "absent"], ("each child has the process", r0, r1)
        assert mp[0] != "kid-0" and mp[2] == "absent", ("a child's write is invisible to the parent", rp)
        assert len({m0[3], m1[3], mp[1]}) == 3, "every child has its own machine-id"
        assert m0[4] != m1[4], "the children's guest entropy was reseeded apart"
        # The parent and its snapshot can go away: the children keep running on their own mappings.
        parent.kill()
        shutil.rmtree(baked.work / "fork" / "base")
        r = _run_on(c0.vsock_path, ["sh", "-c", "read x < /root/from-c0; echo $x"])
        assert r.stdout == b"c0\n"
    finally:
        for c in result.children:
            c.kill()


def _run_on(vsock_path: str, argv: list[str]) -> ExecResult:
    async def go() -> ExecResult:
        client = await connect_vsock_uds(vsock_path, 1024, timeout=30)
        try:
            return await client.run(argv, timeout=300)
        finally:
            await client.close()
    return asyncio.run(go())


JAIL_UID = 64000


@pytest_linux
@pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")
def test_jailed_restore_execs_and_sees_only_its_jail(baked: Baked, tmp_path: Path) -> None:
    """A restored VMM inside its jail (smold/jail/jailer.py) with seccomp on: it runs and snapshots, and the
    host sees it as an unprivileged, cgroup-limited process whose root holds only the jail."""
    state = tmp_path / "jailed"
    state.mkdir()
    rootfs = read_snapshot(baked.snapshot).spec.rootfs
    assert rootfs is not None
    vm = RestoredVm(baked.snapshot, state)
    vm.console_log = state / "console.log"           # inside the state dir: nothing else is writable
    vm.argv = [sys.executable, "-m", "smold.jail", "--name", "itest-jail", "--uid", str(JAIL_UID),
               "--gid", str(JAIL_UID), "--state-dir", str(state), "--jail-base", str(tmp_path / "jails"),
               "--ro", str(baked.snapshot), "--ro", rootfs.path, "--memory-bytes", str((512 + 256) << 20),
               "--cpus", str(VM_CPUS), "--cgroup-parent", "smol-test", "--",
               sys.executable, "-m", "smold.vmm", "--restore", str(baked.snapshot), "--state-dir", str(state),
               "--console-log", str(vm.console_log), "--seccomp", "on"]
    vm.start(timeout=120)
    try:
        kids = Path(f"/proc/{vm.pid}/task/{vm.pid}/children").read_text().split()
        assert len(kids) == 1
        vmm = int(kids[0])
        assert os.stat(f"/proc/{vmm}").st_uid == JAIL_UID
        assert seccomp.filter_mode(vmm) == 2
        seen = set(os.listdir(f"/proc/{vmm}/root"))
        assert {"dev", "proc", "usr", "tmp"} <= seen and "home" not in seen and "var" not in seen, seen
        assert not os.path.exists(f"/proc/{vmm}/root{baked.work / 'parent'}")   # another VM's state dir
        assert sorted(os.listdir(f"/proc/{vmm}/root/dev")) in (["kvm", "net", "null", "urandom"],
                                                               ["kvm", "null", "urandom"])
        from smold.jail.cgroup import Cgroup
        cg = Cgroup("itest-jail", "smol-test")
        assert cg.memory_limit() == (512 + 256) << 20 and vmm in cg.procs()
        r = vm.run(["sh", "-c", "read m < /root/marker; echo $m"], timeout=300)
        assert (r.exit_code, r.stdout) == (0, b"baked\n"), r
        reply = asyncio.run(control_request(state / "control.sock",
                                            {"op": "snapshot", "dir": str(state / "snapshot.out"), "resume": True},
                                            timeout=120))
        assert reply.get("ok"), reply
        assert read_snapshot(state / "snapshot.out").spec.memory_mib == 512
        assert os.stat(state / "snapshot.out" / STATE_FILE).st_uid == JAIL_UID
        r = vm.run(["true"], timeout=300)
        assert r.exit_code == 0
        os.kill(vm.pid, signal.SIGTERM)                  # the jailer forwards it; the VMM ends cleanly
        assert vm.wait(60) == 0, vm.stderr.decode(errors="replace")[-2000:]
    finally:
        vm.kill()
    assert not cg.dirs["" if cg.v2 else "memory"].exists()   # the jailer removed the cgroup
    assert not (tmp_path / "jails" / "itest-jail").exists()
