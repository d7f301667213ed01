"""Tiny hand-assembled guests: long-mode setup, PIO and MMIO exits, ioeventfd and irqfd round trips."""

from __future__ import annotations

import os
import struct
import threading

import pytest

from smold.boot.cpu import APIC_LVT0, BOOT_CS, setup_long_mode
from smold.boot.layout import IDT_ADDR, IOAPIC_ADDR, TSS_ADDR
from smold.devices.bus import Bus
from smold.kvm import Kvm
from smold.kvm.api import IoEventFdSpec, is_pvm
from smold.kvm.cpuid import build_cpuid, resolve_template
from smold.kvm.structs import KVM_IRQCHIP_IOAPIC
from smold.memory import GuestMemory
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

pytestmark = [pytest.mark.kvm, pytest.mark.pvm_smoke]

CODE_ADDR = 0x100000

# g1 (GNU as, .code64):
#   mov $0x42,%al; out %al,$0x10          PIO write of 0x42 to port 0x10
#   in $0x11,%al; mov %al,%cl             PIO read from port 0x11
#   movabs $0xd0000000,%rbx
#   movl $0x12345678,(%rbx)               MMIO write
#   movl 4(%rbx),%eax                     MMIO read
#   add %ecx,%eax; mov $0x12,%dx; out %eax,%dx   report (mmio value + pio value) on port 0x12
#   hlt
GUEST_PIO_MMIO = bytes.fromhex(
    "b042e610e41188c148bb000000d000000000c703785634128b430401c866ba1200eff4")

# g2: enable the local APIC (SVR=0x1ff), route IOAPIC pin 5 to vector 0x30 on APIC 0, write 1 to an
# ioeventfd-backed MMIO address 0xd0000050, say "armed" on port 0x10, then sti; hlt loop.
# handler (offset 0x4a): out 0x77 to port 0x12, EOI to the local APIC, iretq.
GUEST_IRQ = bytes.fromhex(
    "48bbf000e0fe00000000c703ff01000048bb0000c0fe00000000c7031a000000c7431030000000c7031b000000"
    "c743100000000048bb500000d000000000c70301000000e610fbf4ebfdb077e61248bbb000e0fe00000000c703"
    "0000000048cf")
GUEST_IRQ_HANDLER = 0x4A
IRQ_PIN = 5
VECTOR = 0x30


class Recorder:
    """A bus device recording every access; reads answer from a table."""

    def __init__(self, answers: dict[int, bytes] | None = None) -> None:
        self.writes: list[tuple[int, bytes]] = []
        self.reads: list[int] = []
        self.answers = answers or {}
        self.on_write: dict[int, object] = {}

    def read(self, offset: int, size: int) -> bytes:
        self.reads.append(offset)
        return self.answers.get(offset, b"\x00" * size)[:size]

    def write(self, offset: int, data: bytes) -> None:
        self.writes.append((offset, data))
        cb = self.on_write.get(offset)
        if callable(cb):
            cb(data)


class TinyVm:
    """A VM with 2 MiB of RAM and one long-mode vCPU running a few bytes of code."""

    def __init__(self, code: bytes, *, irqchip: bool) -> None:
        self.kvm = Kvm()
        self.vm = self.kvm.create_vm()
        self.vm.set_tss_addr(TSS_ADDR)
        if irqchip:
            self.vm.create_irqchip()
        self.mem = GuestMemory([(0, 2 << 20)])
        region = self.mem.regions[0]
        self.vm.set_user_memory_region(0, region.size, self.mem.host_address(region))
        self.mem.write(CODE_ADDR, code)
        self.vcpu = self.vm.create_vcpu(0)
        cpuid = build_cpuid(self.kvm.supported_cpuid(), resolve_template("auto", is_pvm()), 0, 1)
        self.vcpu.set_cpuid(cpuid)
        setup_long_mode(self.vcpu, self.mem, entry=CODE_ADDR)
        self.pio = Bus("pio")
        self.mmio = Bus("mmio")
        self.exits: list[VcpuExit] = []
        self.done = threading.Event()

    def run(self, timeout: float = 60) -> VcpuExit:
        install_kick_handler()

        def finished(e: VcpuExit) -> None:
            self.exits.append(e)
            self.done.set()

        self.thread = VcpuThread(self.vcpu, self.pio, self.mmio, finished)
        self.thread.start()
        if not self.done.wait(timeout):
            self.thread.stop()
            self.thread.join(5)
            raise AssertionError("tiny guest did not finish in time")
        self.thread.join(5)
        return self.exits[0]

    def close(self) -> None:
        self.vm.close()
        self.mem.close()
        self.kvm.close()


def test_long_mode_pio_and_mmio_exits() -> None:
    vm = TinyVm(GUEST_PIO_MMIO, irqchip=False)
    try:
        ports = Recorder({1: b"\x05"})
        vm.pio.insert(0x10, 8, ports)
        dev = Recorder({4: struct.pack("<I", 0x1000)})
        vm.mmio.insert(0xD0000000, 0x1000, dev)
        result = vm.run()
        assert result.kind == "shutdown", result
        # The guest executed 64-bit code (movabs of a 64-bit immediate) and every access reached its device.
        assert ports.writes[0] == (0, b"\x42")
        assert ports.reads == [1]
        assert dev.writes == [(0, struct.pack("<I", 0x12345678))]
        assert dev.reads == [4]
        assert ports.writes[1] == (2, struct.pack("<I", 0x1005))
        sregs = vm.vcpu.get_sregs()
        assert sregs.efer & (1 << 10), "long mode active"
        assert sregs.cs.l == 1 and sregs.cs.selector == BOOT_CS
    finally:
        vm.close()


def test_ioeventfd_and_irqfd_round_trip() -> None:
    vm = TinyVm(GUEST_IRQ, irqchip=True)
    notify_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    irq_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        # IDT entry for VECTOR: a 64-bit interrupt gate to the handler.
        handler = CODE_ADDR + GUEST_IRQ_HANDLER
        gate = struct.pack("<HHBBHII", handler & 0xFFFF, BOOT_CS, 0, 0x8E, (handler >> 16) & 0xFFFF,
                           handler >> 32, 0)
        vm.mem.write(IDT_ADDR + 16 * VECTOR, gate)
        sregs = vm.vcpu.get_sregs()
        sregs.idt.base, sregs.idt.limit = IDT_ADDR, 16 * 256 - 1
        vm.vcpu.set_sregs(sregs)
        # KVM resets the BSP's LINT0 to ExtINT (the 8259 PIC), which would also deliver IRQ 5 through the
        # unprogrammed PIC at a vector with no IDT entry; mask LINT0 so only the IOAPIC route is tested.
        lapic = bytearray(vm.vcpu.get_lapic())
        struct.pack_into("<I", lapic, APIC_LVT0, struct.unpack_from("<I", lapic, APIC_LVT0)[0] | (1 << 16))
        vm.vcpu.set_lapic(bytes(lapic))

        vm.vm.register_ioeventfd(IoEventFdSpec(0xD0000050, 4, notify_fd, datamatch=1, pio=False))
        vm.vm.register_irqfd(irq_fd, IRQ_PIN)
        mmio_dev = Recorder()
        vm.mmio.insert(0xD0000000, 0x1000, mmio_dev)
        seen: dict[str, int] = {}
        ports = Recorder()

        def armed(_data: bytes) -> None:
            seen["notify"] = os.eventfd_read(notify_fd)
            os.eventfd_write(irq_fd, 1)

        def interrupted(data: bytes) -> None:
            seen["handler"] = data[0]
            vm.thread.stop()

        ports.on_write = {0: armed, 2: interrupted}
        vm.pio.insert(0x10, 8, ports)
        result = vm.run()
        assert result.kind == "stopped", result
        assert seen.get("notify") == 1, "the guest's MMIO write was delivered through the ioeventfd"
        assert mmio_dev.writes == [], "an ioeventfd write must not exit to userspace"
        assert seen.get("handler") == 0x77, "the irqfd interrupt reached the guest's handler"
        # The IOAPIC redirection entry the guest programmed is in the in-kernel irqchip state.
        ioapic = vm.vm.get_irqchip(KVM_IRQCHIP_IOAPIC)
        # struct kvm_ioapic_state: base_address u64, ioregsel u32, id u32, irr u32, pad u32, redirtbl[24] u64
        entry = struct.unpack_from("<Q", ioapic, 24 + 8 * IRQ_PIN)[0]
        assert entry & 0xFF == VECTOR and not entry & (1 << 16)
        assert struct.unpack_from("<Q", ioapic, 0)[0] == IOAPIC_ADDR
    finally:
        os.close(notify_fd)
        os.close(irq_fd)
        vm.close()
