"""Kernel loaders: ELF vmlinux and bzImage (Linux boot protocol, Documentation/arch/x86/boot.rst)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from smold.boot.layout import HIMEM_START, KERNEL_DEFAULT_LOAD
from smold.memory import GuestMemory, GuestMemoryError


class KernelLoadError(Exception):
    """The kernel image is not a loadable x86-64 vmlinux or bzImage, or does not fit in guest RAM."""


@dataclass(frozen=True)
class LoadedKernel:
    entry: int                    # guest-physical 64-bit entry point
    end: int                      # first byte after the loaded image
    setup_header: bytes | None    # bzImage setup header (0x1f1..), None for ELF


ELF_MAGIC = b"\x7fELF"
PT_LOAD = 1
# boot.rst "The real-mode kernel header": offsets inside the image / boot_params.
HDR_OFFSET = 0x1F1
JUMP_OFFSET = 0x201           # second byte of the 2-byte jump at 0x200; the header ends at 0x202 + it
HDR_MAGIC_OFFSET = 0x202
HDR_MAGIC = b"HdrS"
VERSION_OFFSET = 0x206
XLOADFLAGS_OFFSET = 0x236     # protocol 2.12+
PREF_ADDRESS_OFFSET = 0x258   # protocol 2.10+
INIT_SIZE_OFFSET = 0x260      # protocol 2.10+
HDR_MIN_END = INIT_SIZE_OFFSET + 4
HDR_MAX_END = 0x280           # never copy more than this into boot_params (zero-page.rst)
XLF_KERNEL_64 = 1 << 0
# The 64-bit entry is only discoverable through xloadflags.XLF_KERNEL_64, which boot.rst adds in 2.12
# (pref_address and init_size, also read below, come in 2.10).
MIN_BOOT_PROTOCOL = 0x020C
SECTOR = 512
DEFAULT_SETUP_SECTS = 4       # boot.rst: "If this field is 0, the real value is 4."


def load_kernel(mem: GuestMemory, image: bytes) -> LoadedKernel:
    if image[:4] == ELF_MAGIC:
        return load_elf(mem, image)
    if image[HDR_MAGIC_OFFSET:HDR_MAGIC_OFFSET + 4] == HDR_MAGIC:
        return load_bzimage(mem, image)
    raise KernelLoadError("kernel is neither an ELF vmlinux nor a bzImage (no ELF magic, no HdrS signature)")


def load_elf(mem: GuestMemory, image: bytes) -> LoadedKernel:
    """Copy PT_LOAD segments to their physical addresses; the entry is e_entry (phys_startup_64)."""
    if image[:4] != ELF_MAGIC:
        raise KernelLoadError("kernel is not an ELF file (bad magic)")
    if len(image) < 64:
        raise KernelLoadError("ELF header truncated")
    ei_class, ei_data = image[4], image[5]
    if ei_class != 2 or ei_data != 1:
        raise KernelLoadError("kernel ELF is not 64-bit little-endian")
    (e_type, e_machine, _ver, e_entry, e_phoff, _shoff, _flags, _ehsize, e_phentsize, e_phnum) = \
        struct.unpack_from("<HHIQQQIHHH", image, 16)
    if e_machine != 62:
        raise KernelLoadError(f"kernel ELF machine {e_machine} is not x86-64 (62)")
    if e_phentsize < 56 or e_phoff + e_phnum * e_phentsize > len(image):
        raise KernelLoadError("ELF program headers truncated")
    end = 0
    loaded = 0
    for i in range(e_phnum):
        p_type, _pflags, p_offset, _vaddr, p_paddr, p_filesz, p_memsz, _align = \
            struct.unpack_from("<IIQQQQQQ", image, e_phoff + i * e_phentsize)
        if p_type != PT_LOAD:
            continue
        if p_filesz > p_memsz or p_offset + p_filesz > len(image):
            raise KernelLoadError(f"ELF segment {i} exceeds the file")
        if p_paddr < HIMEM_START:
            raise KernelLoadError(f"ELF segment {i} at {p_paddr:#x} is below 1 MiB")
        try:
            mem.write(p_paddr, image[p_offset:p_offset + p_filesz])
            if p_memsz > p_filesz:
                mem.fill(p_paddr + p_filesz, p_memsz - p_filesz)
        except GuestMemoryError as e:
            raise KernelLoadError(f"ELF segment {i} does not fit in guest RAM: {e}") from e
        end = max(end, p_paddr + p_memsz)
        loaded += 1
    if not loaded:
        raise KernelLoadError("ELF has no PT_LOAD segment")
    if not mem.contains(e_entry):
        raise KernelLoadError(f"ELF entry {e_entry:#x} is outside guest RAM")
    return LoadedKernel(entry=e_entry, end=end, setup_header=None)


def load_bzimage(mem: GuestMemory, image: bytes) -> LoadedKernel:
    """Load the protected-mode part at its preferred address; 64-bit entry is load address + 0x200.

    boot.rst "The real-mode kernel header" and "64-bit boot protocol". Every field is bounds checked
    before it is read: a truncated or inconsistent image raises :class:`KernelLoadError`.
    """
    if image[HDR_MAGIC_OFFSET:HDR_MAGIC_OFFSET + 4] != HDR_MAGIC:
        raise KernelLoadError("kernel is not a bzImage (no HdrS signature at 0x202)")
    if len(image) < VERSION_OFFSET + 2:
        raise KernelLoadError("bzImage truncated before its boot protocol version")
    version = struct.unpack_from("<H", image, VERSION_OFFSET)[0]
    if version < MIN_BOOT_PROTOCOL:
        raise KernelLoadError(f"boot protocol {version:#x} is older than 2.12: the 64-bit entry needs "
                              "xloadflags (2.12), pref_address and init_size (2.10)")
    hdr_end = HDR_MAGIC_OFFSET + image[JUMP_OFFSET]   # boot.rst: the header ends at 0x202 + byte 0x201
    if hdr_end < HDR_MIN_END:
        raise KernelLoadError(f"bzImage setup header ends at {hdr_end:#x}, before init_size at "
                              f"{INIT_SIZE_OFFSET:#x}")
    setup_sects = image[HDR_OFFSET] or DEFAULT_SETUP_SECTS
    setup_end = (setup_sects + 1) * SECTOR            # boot sector + setup sectors: >= 1024 > any hdr_end
    if len(image) < setup_end:
        raise KernelLoadError(f"bzImage truncated: {len(image)} bytes, shorter than its "
                              f"{setup_sects} setup sectors ({setup_end} bytes)")
    xloadflags = struct.unpack_from("<H", image, XLOADFLAGS_OFFSET)[0]
    if not xloadflags & XLF_KERNEL_64:
        raise KernelLoadError("bzImage has no 64-bit entry point (XLF_KERNEL_64 unset)")
    pref_address = struct.unpack_from("<Q", image, PREF_ADDRESS_OFFSET)[0] or KERNEL_DEFAULT_LOAD
    init_size = struct.unpack_from("<I", image, INIT_SIZE_OFFSET)[0]
    payload = image[setup_end:]
    if not payload:
        raise KernelLoadError("bzImage has no protected-mode kernel")
    try:
        mem.write(pref_address, payload)
        mem.check_range(pref_address, max(init_size, len(payload)))
    except GuestMemoryError as e:
        raise KernelLoadError(f"bzImage does not fit in guest RAM: {e}") from e
    return LoadedKernel(entry=pref_address + 0x200, end=pref_address + max(init_size, len(payload)),
                        setup_header=image[HDR_OFFSET:min(hdr_end, HDR_MAX_END)])
