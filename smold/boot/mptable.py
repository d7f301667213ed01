"""Intel MultiProcessor Specification 1.4 tables, so Linux finds every vCPU and the IOAPIC without ACPI."""

from __future__ import annotations

import struct

from smold.boot.layout import IOAPIC_ADDR, IOAPIC_PINS, LAPIC_ADDR

# MP spec §4.3 entry types.
MP_PROCESSOR, MP_BUS, MP_IOAPIC, MP_INTSRC, MP_LINTSRC = 0, 1, 2, 3, 4
CPU_ENABLED, CPU_BSP = 1, 2
MP_IRQ_INT, MP_IRQ_EXTINT, MP_IRQ_NMI = 0, 3, 1
APIC_VERSION = 0x14
MPTABLE_MAX_CPUS = 254


class MpTableError(ValueError):
    """Too many vCPUs for an MP table."""


def _checksum(data: bytes) -> int:
    return (-sum(data)) & 0xFF


def build_mptable(base: int, ncpus: int) -> bytes:
    """Floating pointer (§4.1) followed by the configuration table (§4.2) at guest address ``base``."""
    if not 1 <= ncpus <= MPTABLE_MAX_CPUS:
        raise MpTableError(f"{ncpus} vCPUs: an MP table describes 1 to {MPTABLE_MAX_CPUS}")
    ioapic_id = ncpus + 1
    entries = bytearray()
    for cpu in range(ncpus):
        flags = CPU_ENABLED | (CPU_BSP if cpu == 0 else 0)
        # type, lapic id, lapic version, cpu flags, signature (family 6), feature flags (FPU|APIC), reserved
        entries += struct.pack("<BBBBII8x", MP_PROCESSOR, cpu, APIC_VERSION, flags, 0x600, 0x201)
    entries += struct.pack("<BB6s", MP_BUS, 0, b"ISA   ")
    entries += struct.pack("<BBBBI", MP_IOAPIC, ioapic_id, APIC_VERSION, 1, IOAPIC_ADDR)
    for pin in range(IOAPIC_PINS):
        # I/O interrupt assignment: ISA bus 0, irq `pin` -> ioapic pin `pin`; flags 0 = conforms to bus.
        entries += struct.pack("<BBHBBBB", MP_INTSRC, MP_IRQ_INT, 0, 0, pin, ioapic_id, pin)
    entries += struct.pack("<BBHBBBB", MP_LINTSRC, MP_IRQ_EXTINT, 0, 0, 0, 0xFF, 0)
    entries += struct.pack("<BBHBBBB", MP_LINTSRC, MP_IRQ_NMI, 0, 0, 0, 0xFF, 1)
    count = ncpus + 1 + 1 + IOAPIC_PINS + 2
    table_addr = base + 16
    header_len = 44
    header = bytearray(struct.pack("<4sHBB8s12sIHHIHBB", b"PCMP", header_len + len(entries), 4, 0,
                                   b"SMOL    ", b"MICROVM     ", 0, 0, count, LAPIC_ADDR, 0, 0, 0))
    table = header + entries
    table[7] = _checksum(bytes(table))
    fp = bytearray(struct.pack("<4sIBBBB4x", b"_MP_", table_addr, 1, 4, 0, 0))
    fp[10] = _checksum(bytes(fp))
    return bytes(fp) + bytes(table)
