"""Guest-physical memory layout of a smol microVM (x86-64)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# Low memory used by the direct-boot path.
GDT_ADDR = 0x500
IDT_ADDR = 0x540               # after the five GDT entries at 0x500
ZERO_PAGE_ADDR = 0x7000            # struct boot_params
BOOT_STACK_ADDR = 0x8FF0
PML4_ADDR = 0x9000
PDPT_ADDR = 0xA000
PD_ADDR = 0xB000                   # four page directories: identity map of the first 4 GiB with 2 MiB pages
CMDLINE_ADDR = 0x20000
CMDLINE_MAX = 4096
EBDA_START = 0x9FC00               # MP table lives here (Intel MP spec 1.4 §4: last KiB of base memory)
HIMEM_START = 0x100000             # kernel and everything above 1 MiB
KERNEL_DEFAULT_LOAD = 0x1000000    # bzImage default load address (16 MiB)

# The 32-bit MMIO hole: RAM below it, devices inside it, more RAM above 4 GiB.
MMIO_HOLE_START = 3 * GiB
MMIO_HOLE_END = 4 * GiB
VIRTIO_MMIO_BASE = 0xD0000000
VIRTIO_MMIO_SIZE = 0x1000
IOAPIC_ADDR = 0xFEC00000
LAPIC_ADDR = 0xFEE00000
TSS_ADDR = 0xFFFBD000              # KVM_SET_TSS_ADDR: three pages inside the hole, never RAM
IDENTITY_MAP_ADDR = 0xFFFBC000

# Legacy PC I/O ports and IRQs.
SERIAL_COM1_PORT = 0x3F8
SERIAL_COM1_IRQ = 4
I8042_PORT = 0x60
CMOS_PORT = 0x70
VIRTIO_IRQ_BASE = 5                # virtio-mmio device n uses IRQ 5 + n
IOAPIC_PINS = 24


class LayoutError(ValueError):
    """Guest memory too small or too large for the layout."""


@dataclass(frozen=True)
class RamLayout:
    """RAM regions for a guest of ``mem_size`` bytes, split around the MMIO hole."""

    regions: tuple[tuple[int, int], ...]

    @classmethod
    def for_size(cls, mem_size: int) -> RamLayout:
        if mem_size < 64 * MiB:
            raise LayoutError(f"guest memory {mem_size // MiB} MiB is below the 64 MiB minimum")
        if mem_size % (2 * MiB):
            raise LayoutError("guest memory must be a multiple of 2 MiB")
        if mem_size > 1 << 40:
            raise LayoutError("guest memory above 1 TiB is not supported")
        if mem_size <= MMIO_HOLE_START:
            return cls(((0, mem_size),))
        return cls(((0, MMIO_HOLE_START), (MMIO_HOLE_END, mem_size - MMIO_HOLE_START)))

    @property
    def low_end(self) -> int:
        return self.regions[0][1]

    def e820(self) -> list[tuple[int, int, int]]:
        """(addr, size, type) entries: 1 = usable RAM, 2 = reserved (Linux boot protocol, zero-page e820)."""
        entries = [(0, EBDA_START, 1), (EBDA_START, HIMEM_START - EBDA_START, 2),
                   (HIMEM_START, self.low_end - HIMEM_START, 1)]
        for start, size in self.regions[1:]:
            entries.append((start, size, 1))
        return entries


def virtio_mmio_slot(n: int) -> tuple[int, int]:
    """(base address, IRQ) of the n-th virtio-mmio device."""
    if not 0 <= n < IOAPIC_PINS - VIRTIO_IRQ_BASE:
        raise LayoutError(f"no IRQ left for virtio device {n}")
    return VIRTIO_MMIO_BASE + n * VIRTIO_MMIO_SIZE, VIRTIO_IRQ_BASE + n
