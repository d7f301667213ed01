"""Memory of copy-on-write children: 8 children of a 1 GiB guest that each write a few pages add far less
than 8 GiB of host memory.

No Linux: a tiny hand-assembled guest with 1 GiB of RAM writes to every 4 KiB page above 2 MiB (so its
memfd really holds 1 GiB), then reports on port 0x10. The test pauses it there (``VcpuThread.pause``, which
completes the OUT), captures its vCPU and irqchip state, writes its RAM with ``store.write_memory`` (the
VMM's snapshot code) and starts 8 child processes (tiny_fork_child.py) that map the file MAP_PRIVATE with
``GuestMemory.from_file``, as a restored VMM does. Each child's guest goes on from the pause and writes 16
pages. The children's PSS and the anonymous memory of their guest-RAM mappings are read from
/proc/PID/smaps while all eight run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_fork_child import GUEST_RAM, STATE, TinySnapshot

from smold.boot.cpu import setup_long_mode
from smold.boot.layout import TSS_ADDR
from smold.devices.bus import Bus
from smold.kvm import Kvm
from smold.kvm.api import is_pvm
from smold.kvm.cpuid import build_cpuid, resolve_template
from smold.memory import GuestMemory
from smold.snapshot import kvmstate
from smold.snapshot.format import write_state_file
from smold.snapshot.store import MEMORY_FILE, write_memory
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

pytestmark = [pytest.mark.kvm, pytest.mark.timeout(1200)]

MiB = 1 << 20
CODE_ADDR = 0x100000
CHILDREN = 8
CHILD_PAGES = 16
# mov $0x200000,%rbx; mov $0x40000000,%rcx
# 1: mov %rbx,(%rbx); add $0x1000,%rbx; cmp %rcx,%rbx; jb 1b        one write in every page above 2 MiB
# mov $1,%al; out %al,$0x10                                           "RAM touched" (the parent pauses here)
# mov $0x200000,%rbx; mov $16,%rcx
# 2: movq $0x55,(%rbx); add $0x1000,%rbx; dec %rcx; jnz 2b           a child writes 16 pages
# mov $2,%al; out %al,$0x11; 3: hlt; jmp 3b                           "done"
GUEST = bytes.fromhex(
    "48c7c30000200048c7c10000004048891b4881c3001000004839cb72f1b001e61048c7c30000200048c7c110000000"
    "48c703550000004881c30010000048ffc975edb002e611f4ebfd")


class Touched:
    """Port 0x10: the guest has written all its RAM; pause its vCPU right there."""

    def __init__(self) -> None:
        self.thread: VcpuThread | None = None

    def read(self, offset: int, size: int) -> bytes:
        return bytes(size)

    def write(self, offset: int, data: bytes) -> None:
        assert self.thread is not None
        self.thread.pause()


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB values of /proc/PID/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        out[key] = int(value.split()[0])
    return out


def mapping_of(pid: int, path: Path) -> dict[str, int]:
    """kB values of the /proc/PID/smaps entry mapping ``path`` (the guest RAM)."""
    found: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=5)
        if len(first) >= 5 and "-" in first[0] and ":" not in first[0]:
            inside = len(first) == 6 and first[5].strip() == str(path)
            continue
        if inside and line.endswith(" kB"):
            key, _, value = line.partition(":")
            found[key] = found.get(key, 0) + int(value.split()[0])
    assert found, f"pid {pid} does not map {path}"
    return found


def test_eight_children_of_a_1gib_guest_share_its_memory(tmp_path: Path) -> None:
    install_kick_handler()
    kvm = Kvm()
    mem = GuestMemory([(0, GUEST_RAM)])
    vm = kvm.create_vm()
    vm.set_tss_addr(TSS_ADDR)
    vm.create_irqchip()
    vm.create_pit2()
    vm.set_user_memory_region(0, GUEST_RAM, mem.host_address(mem.regions[0]))
    vcpu = vm.create_vcpu(0)
    cpuid = build_cpuid(kvm.supported_cpuid(), resolve_template("auto", is_pvm()), 0, 1)
    vcpu.set_cpuid(cpuid)
    mem.write(CODE_ADDR, GUEST)
    setup_long_mode(vcpu, mem, entry=CODE_ADDR)
    touched = Touched()
    pio = Bus("pio")
    pio.insert(0x10, 1, touched)
    exits: list[VcpuExit] = []
    thread = VcpuThread(vcpu, pio, Bus("mmio"), exits.append)
    touched.thread = thread
    children: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    thread.start()
    try:
        assert thread.paused.wait(900), f"the guest did not write its RAM in time: {exits}"
        t_touch = time.monotonic() - t0
        parent_bytes = os.fstat(mem.fd).st_blocks * 512
        assert parent_bytes >= GUEST_RAM - 4 * MiB, f"the parent holds only {parent_bytes >> 20} MiB"
        xsave, xcrs = kvmstate.host_caps(kvm)
        state = TinySnapshot(vm=kvmstate.capture_vm(vm),
                             vcpu=kvmstate.capture_vcpu(vcpu, cpuid, kvmstate.saveable_msrs(kvm, vcpu), xsave=xsave,
                                                        xcrs=xcrs),
                             xsave=xsave, xcrs=xcrs)
        written = write_memory(tmp_path, mem).bytes_written
        assert written >= GUEST_RAM - 4 * MiB
        write_state_file(tmp_path / STATE, state)
        thread.stop()
        thread.join(10)

        child_py = Path(__file__).with_name("tiny_fork_child.py")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                              str(Path(__file__).resolve().parents[2])])}
        t1 = time.monotonic()
        for _ in range(CHILDREN):
            children.append(subprocess.Popen([sys.executable, str(child_py), str(tmp_path)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env=env))
        for c in children:
            assert c.stdout is not None
            line = c.stdout.readline()
            assert line == b"DONE\n", (line, c.poll())
        t_children = time.monotonic() - t1
        memfile = tmp_path / MEMORY_FILE
        rollups = [smaps_rollup(c.pid) for c in children]
        ram = [mapping_of(c.pid, memfile) for c in children]
        pss_total = sum(r["Pss"] for r in rollups) * 1024
        ram_anon = [r["Anonymous"] * 1024 for r in ram]
        ram_rss = [r["Rss"] * 1024 for r in ram]
        print(f"\nparent: wrote {parent_bytes >> 20} MiB of guest RAM in {t_touch:.1f}s; {CHILDREN} children "
              f"ready in {t_children:.1f}s; children PSS total {pss_total / MiB:.1f} MiB "
              f"(each: RSS {[r['Rss'] // 1024 for r in rollups]} MiB, anonymous "
              f"{[r['Anonymous'] // 1024 for r in rollups]} MiB); guest-RAM mapping per child: "
              f"RSS {[x // 1024 for x in ram_rss]} KiB, anonymous {[x // 1024 for x in ram_anon]} KiB")
        # Each child's guest wrote 16 pages: those, and little else of its 1 GiB, are its own copies.
        for anon in ram_anon:
            assert CHILD_PAGES * 4096 <= anon <= 4 * MiB, anon
        for rss in ram_rss:
            assert rss <= 64 * MiB, rss
        # All 8 together (Python interpreter and KVM included) cost far less than one more 1 GiB guest.
        assert pss_total < GUEST_RAM, pss_total
    finally:
        for c in children:
            if c.poll() is None:
                assert c.stdin is not None
                c.stdin.close()
        for c in children:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
        if thread.is_alive():
            thread.stop()
            thread.join(10)
        vm.close()
        mem.close()
        kvm.close()
