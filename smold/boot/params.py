"""struct boot_params (the zero page) for the 64-bit boot protocol (Documentation/x86/zero-page.rst)."""

from __future__ import annotations

import struct

from smold.boot.loader import LoadedKernel

ZERO_PAGE_SIZE = 4096
# zero-page.rst offsets
EXT_RAMDISK_IMAGE = 0x0C0
EXT_RAMDISK_SIZE = 0x0C4
EXT_CMD_LINE_PTR = 0x0C8
E820_ENTRIES = 0x1E8
HDR = 0x1F1
E820_TABLE = 0x2D0
E820_MAX = 128
# boot.rst setup header offsets (absolute within boot_params)
BOOT_FLAG = 0x1FE
HEADER = 0x202
VERSION = 0x206
TYPE_OF_LOADER = 0x210
LOADFLAGS = 0x211
RAMDISK_IMAGE = 0x218
RAMDISK_SIZE = 0x21C
HEAP_END_PTR = 0x224
CMD_LINE_PTR = 0x228
INITRD_ADDR_MAX = 0x22C
KERNEL_ALIGNMENT = 0x230
CMDLINE_SIZE = 0x238

LOADED_HIGH = 0x01
CAN_USE_HEAP = 0x80
DEFAULT_INITRD_ADDR_MAX = 0x37FFFFFF


class BootParamsError(ValueError):
    """An e820 table or command line that does not fit the zero page."""


def initrd_addr_max(kernel: LoadedKernel) -> int:
    if kernel.setup_header is not None and len(kernel.setup_header) >= INITRD_ADDR_MAX + 4 - HDR:
        return int(struct.unpack_from("<I", kernel.setup_header, INITRD_ADDR_MAX - HDR)[0])
    return DEFAULT_INITRD_ADDR_MAX


def build_boot_params(kernel: LoadedKernel, *, cmdline_addr: int, cmdline_len: int,
                      e820: list[tuple[int, int, int]], initrd: tuple[int, int] | None) -> bytes:
    """The zero page: setup header (from the bzImage, or synthesised for an ELF), e820, command line, initrd."""
    if len(e820) > E820_MAX:
        raise BootParamsError(f"{len(e820)} e820 entries exceed {E820_MAX}")
    zp = bytearray(ZERO_PAGE_SIZE)
    if kernel.setup_header is not None:
        zp[HDR:HDR + len(kernel.setup_header)] = kernel.setup_header
    else:
        struct.pack_into("<H", zp, BOOT_FLAG, 0xAA55)
        zp[HEADER:HEADER + 4] = b"HdrS"
        struct.pack_into("<H", zp, VERSION, 0x020F)
        struct.pack_into("<I", zp, KERNEL_ALIGNMENT, 0x1000000)
        struct.pack_into("<I", zp, INITRD_ADDR_MAX, DEFAULT_INITRD_ADDR_MAX)
    zp[TYPE_OF_LOADER] = 0xFF          # "undefined" boot loader id (boot.rst)
    zp[LOADFLAGS] |= LOADED_HIGH | CAN_USE_HEAP
    struct.pack_into("<H", zp, HEAP_END_PTR, 0xFE00)
    struct.pack_into("<I", zp, CMD_LINE_PTR, cmdline_addr & 0xFFFFFFFF)
    struct.pack_into("<I", zp, EXT_CMD_LINE_PTR, cmdline_addr >> 32)
    struct.pack_into("<I", zp, CMDLINE_SIZE, cmdline_len)
    if initrd is not None:
        addr, size = initrd
        struct.pack_into("<I", zp, RAMDISK_IMAGE, addr & 0xFFFFFFFF)
        struct.pack_into("<I", zp, RAMDISK_SIZE, size & 0xFFFFFFFF)
        struct.pack_into("<I", zp, EXT_RAMDISK_IMAGE, addr >> 32)
        struct.pack_into("<I", zp, EXT_RAMDISK_SIZE, size >> 32)
    zp[E820_ENTRIES] = len(e820)
    for i, (addr, size, kind) in enumerate(e820):
        struct.pack_into("<QQI", zp, E820_TABLE + 20 * i, addr, size, kind)
    return bytes(zp)
