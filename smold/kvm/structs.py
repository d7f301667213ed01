"""ctypes layouts of the KVM API structures (include/uapi/linux/kvm.h, arch/x86/include/uapi/asm/kvm.h)."""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_uint8, c_uint16, c_uint32, c_uint64

# pylint: disable=too-few-public-methods


class KvmRegs(ctypes.Structure):
    _fields_ = [(n, c_uint64) for n in (
        "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip", "rflags")]


class KvmSegment(ctypes.Structure):
    _fields_ = [("base", c_uint64), ("limit", c_uint32), ("selector", c_uint16), ("type", c_uint8),
                ("present", c_uint8), ("dpl", c_uint8), ("db", c_uint8), ("s", c_uint8), ("l", c_uint8),
                ("g", c_uint8), ("avl", c_uint8), ("unusable", c_uint8), ("padding", c_uint8)]


class KvmDtable(ctypes.Structure):
    _fields_ = [("base", c_uint64), ("limit", c_uint16), ("padding", c_uint16 * 3)]


class KvmSregs(ctypes.Structure):
    _fields_ = [("cs", KvmSegment), ("ds", KvmSegment), ("es", KvmSegment), ("fs", KvmSegment),
                ("gs", KvmSegment), ("ss", KvmSegment), ("tr", KvmSegment), ("ldt", KvmSegment),
                ("gdt", KvmDtable), ("idt", KvmDtable),
                ("cr0", c_uint64), ("cr2", c_uint64), ("cr3", c_uint64), ("cr4", c_uint64),
                ("cr8", c_uint64), ("efer", c_uint64), ("apic_base", c_uint64),
                ("interrupt_bitmap", c_uint64 * 4)]


class KvmFpu(ctypes.Structure):
    _fields_ = [("fpr", c_uint8 * 128), ("fcw", c_uint16), ("fsw", c_uint16), ("ftwx", c_uint8),
                ("pad1", c_uint8), ("last_opcode", c_uint16), ("last_ip", c_uint64), ("last_dp", c_uint64),
                ("xmm", c_uint8 * 256), ("mxcsr", c_uint32), ("pad2", c_uint32)]


class KvmCpuidEntry2(ctypes.Structure):
    _fields_ = [("function", c_uint32), ("index", c_uint32), ("flags", c_uint32), ("eax", c_uint32),
                ("ebx", c_uint32), ("ecx", c_uint32), ("edx", c_uint32), ("padding", c_uint32 * 3)]


KVM_CPUID_FLAG_SIGNIFCANT_INDEX = 1


class KvmCpuid2Header(ctypes.Structure):
    _fields_ = [("nent", c_uint32), ("padding", c_uint32)]


def cpuid2(n: int) -> type[ctypes.Structure]:
    class KvmCpuid2(ctypes.Structure):
        _fields_ = [("nent", c_uint32), ("padding", c_uint32), ("entries", KvmCpuidEntry2 * n)]
    return KvmCpuid2


class KvmMsrEntry(ctypes.Structure):
    _fields_ = [("index", c_uint32), ("reserved", c_uint32), ("data", c_uint64)]


class KvmMsrsHeader(ctypes.Structure):
    _fields_ = [("nmsrs", c_uint32), ("pad", c_uint32)]


def msrs(n: int) -> type[ctypes.Structure]:
    class KvmMsrs(ctypes.Structure):
        _fields_ = [("nmsrs", c_uint32), ("pad", c_uint32), ("entries", KvmMsrEntry * n)]
    return KvmMsrs


class KvmMsrListHeader(ctypes.Structure):
    _fields_ = [("nmsrs", c_uint32)]


def msr_list(n: int) -> type[ctypes.Structure]:
    class KvmMsrList(ctypes.Structure):
        _fields_ = [("nmsrs", c_uint32), ("indices", c_uint32 * n)]
    return KvmMsrList


class KvmUserspaceMemoryRegion(ctypes.Structure):
    _fields_ = [("slot", c_uint32), ("flags", c_uint32), ("guest_phys_addr", c_uint64),
                ("memory_size", c_uint64), ("userspace_addr", c_uint64)]


class KvmIrqfd(ctypes.Structure):
    _fields_ = [("fd", c_uint32), ("gsi", c_uint32), ("flags", c_uint32), ("resamplefd", c_uint32),
                ("pad", c_uint8 * 16)]


KVM_IRQFD_FLAG_DEASSIGN = 1


class KvmIoeventfd(ctypes.Structure):
    _fields_ = [("datamatch", c_uint64), ("addr", c_uint64), ("len", c_uint32), ("fd", c_int32),
                ("flags", c_uint32), ("pad", c_uint8 * 36)]


KVM_IOEVENTFD_FLAG_DATAMATCH = 1 << 0
KVM_IOEVENTFD_FLAG_PIO = 1 << 1
KVM_IOEVENTFD_FLAG_DEASSIGN = 1 << 2


class KvmPitConfig(ctypes.Structure):
    _fields_ = [("flags", c_uint32), ("pad", c_uint32 * 15)]


KVM_PIT_SPEAKER_DUMMY = 1


class KvmIrqLevel(ctypes.Structure):
    _fields_ = [("irq", c_uint32), ("level", c_uint32)]


class KvmIrqchip(ctypes.Structure):
    _fields_ = [("chip_id", c_uint32), ("pad", c_uint32), ("chip", c_uint8 * 512)]


KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQCHIP_IOAPIC = 0, 1, 2


class KvmPitState2(ctypes.Structure):
    _fields_ = [("raw", c_uint8 * 112)]


class KvmClockData(ctypes.Structure):
    _fields_ = [("clock", c_uint64), ("flags", c_uint32), ("pad0", c_uint32), ("realtime", c_uint64),
                ("host_tsc", c_uint64), ("pad", c_uint32 * 4)]


class KvmLapicState(ctypes.Structure):
    _fields_ = [("regs", c_uint8 * 1024)]


class KvmMpState(ctypes.Structure):
    _fields_ = [("mp_state", c_uint32)]


class KvmVcpuEvents(ctypes.Structure):
    _fields_ = [("raw", c_uint8 * 64)]


class KvmXsave(ctypes.Structure):
    _fields_ = [("region", c_uint32 * 1024)]


class KvmXcr(ctypes.Structure):
    _fields_ = [("xcr", c_uint32), ("reserved", c_uint32), ("value", c_uint64)]


class KvmXcrs(ctypes.Structure):
    _fields_ = [("nr_xcrs", c_uint32), ("flags", c_uint32), ("xcrs", KvmXcr * 16), ("padding", c_uint64 * 16)]


# struct kvm_run: the shared page mapped from the vCPU fd.
class KvmRunIo(ctypes.Structure):
    _fields_ = [("direction", c_uint8), ("size", c_uint8), ("port", c_uint16), ("count", c_uint32),
                ("data_offset", c_uint64)]


class KvmRunMmio(ctypes.Structure):
    _fields_ = [("phys_addr", c_uint64), ("data", c_uint8 * 8), ("len", c_uint32), ("is_write", c_uint8)]


class KvmRunInternal(ctypes.Structure):
    _fields_ = [("suberror", c_uint32), ("ndata", c_uint32), ("data", c_uint64 * 16)]


class KvmRunSystemEvent(ctypes.Structure):
    _fields_ = [("type", c_uint32), ("ndata", c_uint32), ("data", c_uint64 * 16)]


class KvmRunFailEntry(ctypes.Structure):
    _fields_ = [("hardware_entry_failure_reason", c_uint64), ("cpu", c_uint32)]


class KvmRunException(ctypes.Structure):
    _fields_ = [("exception", c_uint32), ("error_code", c_uint32)]


class KvmRunUnion(ctypes.Union):
    _fields_ = [("io", KvmRunIo), ("mmio", KvmRunMmio), ("internal", KvmRunInternal),
                ("system_event", KvmRunSystemEvent), ("fail_entry", KvmRunFailEntry),
                ("ex", KvmRunException), ("padding", c_uint8 * 256)]


class KvmRun(ctypes.Structure):
    _fields_ = [("request_interrupt_window", c_uint8), ("immediate_exit", c_uint8), ("padding1", c_uint8 * 6),
                ("exit_reason", c_uint32), ("ready_for_interrupt_injection", c_uint8), ("if_flag", c_uint8),
                ("flags", c_uint16), ("cr8", c_uint64), ("apic_base", c_uint64), ("u", KvmRunUnion)]


def _check_sizes() -> None:
    expected = {KvmRegs: 144, KvmSegment: 24, KvmSregs: 312, KvmFpu: 416, KvmCpuidEntry2: 40,
                KvmUserspaceMemoryRegion: 32, KvmIrqfd: 32, KvmIoeventfd: 64, KvmPitConfig: 64,
                KvmIrqchip: 520, KvmPitState2: 112, KvmClockData: 48, KvmXcrs: 392, KvmVcpuEvents: 64}
    for struct_type, size in expected.items():
        if ctypes.sizeof(struct_type) != size:
            raise AssertionError(f"{struct_type.__name__} is {ctypes.sizeof(struct_type)} bytes, expected {size}")
    if KvmRun.u.offset != 32:
        raise AssertionError("kvm_run union must start at offset 32")


_check_sizes()
