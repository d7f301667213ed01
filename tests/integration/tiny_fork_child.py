"""A copy-on-write child of test_fork_memory's 1 GiB tiny guest: one VM restored from its snapshot.

``python tiny_fork_child.py DIR``: maps ``DIR/memory.raw`` MAP_PRIVATE through ``GuestMemory.from_file`` (the
product's restore path), loads the saved irqchip/PIT and vCPU state, runs the guest until it reports on port
0x11 that it wrote its few pages, prints ``DONE``, and keeps the VM until its stdin closes (so the parent test
can measure every child's memory while all of them are alive).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from smold.boot.layout import TSS_ADDR
from smold.devices.bus import Bus
from smold.kvm import Kvm
from smold.memory import GuestMemory
from smold.snapshot import kvmstate
from smold.snapshot.format import read_state_file
from smold.snapshot.state import VcpuState, VmState
from smold.snapshot.store import MEMORY_FILE
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

GUEST_RAM = 1 << 30
STATE = "tiny.state"


@dataclass(frozen=True)
class TinySnapshot:
    """A tiny guest's saved state: irqchip/PIT/clock and its one vCPU (its RAM is the memory file)."""

    vm: VmState
    vcpu: VcpuState
    xsave: bool
    xcrs: bool


class Reporter:
    """Port 0x11: the guest finished writing its pages."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def read(self, offset: int, size: int) -> bytes:
        return bytes(size)

    def write(self, offset: int, data: bytes) -> None:
        self.done.set()


def main(directory: Path) -> int:
    install_kick_handler()
    snap = read_state_file(directory / STATE, TinySnapshot)
    kvm = Kvm()
    mem = GuestMemory.from_file(directory / MEMORY_FILE, [(0, GUEST_RAM)])
    vm = kvm.create_vm()
    vm.set_tss_addr(TSS_ADDR)
    vm.create_irqchip()
    vm.create_pit2()
    region = mem.regions[0]
    vm.set_user_memory_region(0, region.size, mem.host_address(region))
    vcpu = vm.create_vcpu(0)
    kvmstate.restore_vm(vm, snap.vm)
    kvmstate.restore_vcpu(vcpu, snap.vcpu, xsave=snap.xsave, xcrs=snap.xcrs)
    pio = Bus("pio")
    reporter = Reporter()
    pio.insert(0x11, 1, reporter)
    exits: list[VcpuExit] = []
    thread = VcpuThread(vcpu, pio, Bus("mmio"), exits.append)
    thread.start()
    if not reporter.done.wait(600):
        print(f"TIMEOUT {exits}", flush=True)
        return 1
    print("DONE", flush=True)
    sys.stdin.read()
    thread.stop()
    thread.join(10)
    vm.close()
    mem.close()
    kvm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
