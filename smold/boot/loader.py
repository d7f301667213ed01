"""Kernel loaders: uncompressed ELF vmlinux and bzImage (Linux boot protocol, Documentation/x86/boot.rst)."""

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
HDR_MAGIC_OFFSET = 0x202
XLF_KERNEL_64 = 1 << 0
MIN_BOOT_PROTOCOL = 0x0206


def load_kernel(mem: GuestMemory, image: bytes) -> LoadedKernel:
    if image[:4] == ELF_MAGIC:
        return load_elf(mem, image)
    if len(image) > HDR_MAGIC_OFFSET + 4 and image[HDR_MAGIC_OFFSET:HDR_MAGIC_OFFSET + 4] == b"HdrS":
        return load_bzimage(mem, image)
    raise KernelLoadError("kernel is neither an ELF vmlinux nor a bzImage (no ELF magic, no HdrS signature)")


def load_elf(mem: GuestMemory, image: bytes) -> LoadedKernel:
    """Copy PT_LOAD segments to their physical addresses; the entry is e_entry (phys_startup_64)."""
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
    """Load the protected-mode part at its preferred address; 64-bit entry is load address + 0x200."""
    version = struct.unpack_from("<H", image, 0x206)[0]
    if version < MIN_BOOT_PROTOCOL:
        raise KernelLoadError(f"boot protocol {version:#x} is older than 2.06")
    setup_sects = image[HDR_OFFSET] or 4
    xloadflags = struct.unpack_from("<H", image, 0x236)[0]
    if not xloadflags & XLF_KERNEL_64:
        raise KernelLoadError("bzImage has no 64-bit entry point (XLF_KERNEL_64 unset)")
    pref_address = struct.unpack_from("<Q", image, 0x258)[0] or KERNEL_DEFAULT_LOAD
    init_size = struct.unpack_from("<I", image, 0x260)[0]
    payload = image[(setup_sects + 1) * 512:]
    if not payload:
        raise KernelLoadError("bzImage has no protected-mode kernel")
    try:
        mem.write(pref_address, payload)
        mem.check_range(pref_address, max(init_size, len(payload)))
    except GuestMemoryError as e:
        raise KernelLoadError(f"bzImage does not fit in guest RAM: {e}") from e
    hdr_end = 0x202 + image[0x201] + 2  # the setup header runs to 0x202 + the jump's offset byte
    return LoadedKernel(entry=pref_address + 0x200, end=pref_address + max(init_size, len(payload)),
                        setup_header=image[HDR_OFFSET:min(hdr_end, 0x280)])
