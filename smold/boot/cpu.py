"""vCPU state for the Linux 64-bit boot protocol: GDT, identity page tables, long mode, registers."""

from __future__ import annotations

import struct

from smold.boot.layout import BOOT_STACK_ADDR, GDT_ADDR, IDT_ADDR, PD_ADDR, PDPT_ADDR, PML4_ADDR
from smold.kvm import Vcpu
from smold.kvm import structs as s
from smold.memory import GuestMemory

# Control register / EFER bits (Intel SDM vol. 3, 2.5 and 2.2.1).
CR0_PE = 1 << 0
CR0_ET = 1 << 4
CR0_PG = 1 << 31
CR4_PAE = 1 << 5
EFER_LME = 1 << 8
EFER_LMA = 1 << 10

# Page-table entry bits.
PTE_PRESENT = 1 << 0
PTE_RW = 1 << 1
PTE_PS = 1 << 7

BOOT_CS = 0x10   # __BOOT_CS / __BOOT_DS as the 64-bit boot protocol requires (boot.rst, "64-bit BOOT PROTOCOL")
BOOT_DS = 0x18
BOOT_TSS = 0x20

# GDT: null, null, code64, data, tss (flags/access packed as in the descriptor's bits 40..55).
GDT_ENTRIES = ((0, 0, 0), (0, 0, 0), (0xA09B, 0, 0xFFFFF), (0xC093, 0, 0xFFFFF), (0x808B, 0, 0xFFFFF))
IDENTITY_MAP_GIB = 4


def gdt_entry(flags: int, base: int, limit: int) -> int:
    return (((base & 0xFF000000) << 32) | ((base & 0x00FFFFFF) << 16) | (limit & 0xFFFF)
            | ((limit & 0xF0000) << 32) | ((flags & 0xF0FF) << 40))


def segment_from_gdt(entry: int, selector: int) -> s.KvmSegment:
    seg = s.KvmSegment()
    seg.base = ((entry >> 16) & 0xFFFFFF) | (((entry >> 56) & 0xFF) << 24)
    limit = (entry & 0xFFFF) | (((entry >> 48) & 0xF) << 16)
    seg.g = (entry >> 55) & 1
    seg.limit = (limit << 12) | 0xFFF if seg.g else limit
    seg.selector = selector
    seg.type = (entry >> 40) & 0xF
    seg.s = (entry >> 44) & 1
    seg.dpl = (entry >> 45) & 3
    seg.present = (entry >> 47) & 1
    seg.avl = (entry >> 52) & 1
    seg.l = (entry >> 53) & 1
    seg.db = (entry >> 54) & 1
    seg.unusable = 0 if seg.present else 1
    return seg


def write_gdt_idt(mem: GuestMemory) -> list[int]:
    gdt = [gdt_entry(*e) for e in GDT_ENTRIES]
    mem.write(GDT_ADDR, b"".join(struct.pack("<Q", e) for e in gdt))
    mem.write_u64(IDT_ADDR, 0)
    return gdt


def write_identity_page_tables(mem: GuestMemory) -> None:
    """PML4 -> one PDPT -> four PDs of 2 MiB pages: the first 4 GiB identity mapped (covers the APICs)."""
    mem.fill(PML4_ADDR, 0x1000)
    mem.fill(PDPT_ADDR, 0x1000)
    mem.write_u64(PML4_ADDR, PDPT_ADDR | PTE_PRESENT | PTE_RW)
    for g in range(IDENTITY_MAP_GIB):
        pd = PD_ADDR + g * 0x1000
        mem.write_u64(PDPT_ADDR + 8 * g, pd | PTE_PRESENT | PTE_RW)
        mem.write(pd, b"".join(struct.pack("<Q", ((g << 30) + (i << 21)) | PTE_PRESENT | PTE_RW | PTE_PS)
                               for i in range(512)))


def setup_long_mode(vcpu: Vcpu, mem: GuestMemory, *, entry: int, rsi: int = 0) -> None:
    """Put ``vcpu`` in 64-bit mode with paging, flat segments, rip=entry and rsi=boot_params."""
    gdt = write_gdt_idt(mem)
    write_identity_page_tables(mem)
    sregs = vcpu.get_sregs()
    code = segment_from_gdt(gdt[2], BOOT_CS)
    data = segment_from_gdt(gdt[3], BOOT_DS)
    tss = segment_from_gdt(gdt[4], BOOT_TSS)
    sregs.cs = code
    sregs.ds = sregs.es = sregs.fs = sregs.gs = sregs.ss = data
    sregs.tr = tss
    sregs.gdt.base, sregs.gdt.limit = GDT_ADDR, len(gdt) * 8 - 1
    sregs.idt.base, sregs.idt.limit = IDT_ADDR, 7
    sregs.cr3 = PML4_ADDR
    sregs.cr4 |= CR4_PAE
    sregs.cr0 |= CR0_PE | CR0_PG | CR0_ET
    sregs.efer |= EFER_LME | EFER_LMA
    vcpu.set_sregs(sregs)
    regs = s.KvmRegs()
    regs.rflags = 0x2
    regs.rip = entry
    regs.rsp = regs.rbp = BOOT_STACK_ADDR
    regs.rsi = rsi
    vcpu.set_regs(regs)
    fpu = s.KvmFpu()
    fpu.fcw = 0x37F
    fpu.mxcsr = 0x1F80
    vcpu.set_fpu(fpu)


# Local APIC registers (Intel SDM vol. 3, 10.5.1): LVT LINT0 / LINT1 and their delivery modes.
APIC_LVT0 = 0x350
APIC_LVT1 = 0x360
APIC_MODE_NMI = 0x4
APIC_MODE_EXTINT = 0x7


def setup_lapic_lints(vcpu: Vcpu) -> None:
    """LINT0 delivers ExtINT (the 8259 PIC), LINT1 delivers NMI, as on a PC."""
    state = bytearray(vcpu.get_lapic())
    for reg, mode in ((APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)):
        value = struct.unpack_from("<I", state, reg)[0]
        value = (value & ~0x700) | (mode << 8)
        struct.pack_into("<I", state, reg, value)
    vcpu.set_lapic(bytes(state))


# MSRs initialised at boot (as a BIOS would leave them).
MSR_IA32_MISC_ENABLE = 0x1A0
MISC_ENABLE_FAST_STRING = 1


def setup_boot_msrs(vcpu: Vcpu) -> None:
    vcpu.set_msrs({MSR_IA32_MISC_ENABLE: MISC_ENABLE_FAST_STRING})
