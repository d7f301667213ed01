"""CPUID templates: what the guest is told about the CPU (KVM_GET_SUPPORTED_CPUID, filtered, per vCPU)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from smold.kvm import structs as s


class CpuTemplateError(ValueError):
    """An unknown template name."""


class CpuTemplate(enum.Enum):
    HOST = "host"        # everything KVM supports
    COMPAT = "compat"    # hides what the PVM emulator cannot execute at CPL0 (see docs/pvm-emulator.md)

    @classmethod
    def parse(cls, name: str) -> CpuTemplate:
        try:
            return cls(name)
        except ValueError:
            raise CpuTemplateError(f"unknown CPU template {name!r} (choose from: "
                                   f"{', '.join(t.value for t in cls)}, auto)") from None


@dataclass(frozen=True)
class Mask:
    """Bits to clear in one register of one leaf (subleaf None = every subleaf)."""

    leaf: int
    subleaf: int | None
    reg: str
    bits: int


def _bits(*positions: int) -> int:
    v = 0
    for p in positions:
        v |= 1 << p
    return v


# Leaf 1 ECX: FMA 12, CX16 13, PCID 17, MOVBE 22, XSAVE 26, OSXSAVE 27, AVX 28, F16C 29, RDRAND 30.
# Leaf 7.0 EBX: AVX2 5, AVX512F 16, DQ 17, RDSEED 18, IFMA 21, PF 26, ER 27, CD 28, SHA 29, BW 30, VL 31.
# Leaf 7.0 ECX: AVX512_VBMI 1, PKU 3, OSPKE 4, VBMI2 6, GFNI 8, VAES 9, VPCLMULQDQ 10, VNNI 11,
#               BITALG 12, VPOPCNTDQ 14. Leaf 7.0 EDX: AVX512_4VNNIW 2, 4FMAPS 3, AMX 22/24, AVX512_FP16 23.
# Leaf 7.1 EAX: AVX_VNNI 4, AVX512_BF16 5.
COMPAT_MASKS: tuple[Mask, ...] = (
    Mask(0x1, None, "ecx", _bits(12, 13, 22, 26, 27, 28, 29, 30)),
    Mask(0x7, 0, "ebx", _bits(5, 16, 17, 18, 21, 26, 27, 28, 30, 31)),
    Mask(0x7, 0, "ecx", _bits(1, 3, 4, 6, 8, 9, 10, 11, 12, 14)),
    Mask(0x7, 0, "edx", _bits(2, 3, 22, 23, 24)),
    Mask(0x7, 1, "eax", _bits(4, 5)),
)
# Leaves removed entirely by the compat template: 0xD (XSAVE state components).
COMPAT_DROPPED_LEAVES = (0xD,)

# Leaf 1 EDX bit 28: HTT; ECX bit 31: running under a hypervisor.
_HTT = 1 << 28


def _topology_shift(n: int) -> int:
    shift = 0
    while (1 << shift) < n:
        shift += 1
    return shift


def build_cpuid(supported: list[s.KvmCpuidEntry2], template: CpuTemplate, vcpu_index: int,
                vcpu_count: int) -> list[s.KvmCpuidEntry2]:
    """The CPUID table for one vCPU: template masks plus per-vCPU topology (APIC IDs)."""
    out: list[s.KvmCpuidEntry2] = []
    for entry in supported:
        e = s.KvmCpuidEntry2.from_buffer_copy(entry)
        if template is CpuTemplate.COMPAT:
            if e.function in COMPAT_DROPPED_LEAVES:
                continue
            for m in COMPAT_MASKS:
                if m.leaf == e.function and (m.subleaf is None or m.subleaf == e.index):
                    setattr(e, m.reg, getattr(e, m.reg) & ~m.bits & 0xFFFFFFFF)
        if e.function == 0x1:
            # EBX[31:24] initial APIC ID, [23:16] logical processors per package, [15:8] CLFLUSH size/8.
            e.ebx = (vcpu_index << 24) | (max(vcpu_count, 1) << 16) | (8 << 8) | (e.ebx & 0xFF)
            e.edx = (e.edx | _HTT) if vcpu_count > 1 else (e.edx & ~_HTT)
            e.ecx |= 1 << 31
        elif e.function == 0x4:
            # EAX[31:26]: cores per package - 1; [25:14]: logical processors sharing the cache - 1.
            e.eax = (e.eax & 0x3FFF) | ((vcpu_count - 1) << 26)
        elif e.function in (0xB, 0x1F):
            level = e.index
            if level == 0:
                e.eax, e.ebx, e.ecx = 0, 1, (1 << 8) | level
            elif level == 1:
                e.eax, e.ebx, e.ecx = _topology_shift(vcpu_count), vcpu_count, (2 << 8) | level
            else:
                e.eax, e.ebx, e.ecx = 0, 0, level
            e.edx = vcpu_index
        out.append(e)
    return out


# On PVM the guest's CPUID instruction at CPL0 returns the *host's* values: KVM_SET_CPUID2 does not
# reach it (measured: docs/pvm-emulator.md). So the compat template also hides features through the
# Linux command line, which clears them from boot_cpu_data before anything uses them:
#   noxsave          no XSAVE/XRSTOR (the emulator fails on xrstor); FPU state via FXSAVE
#   clearcpuid=N,..  X86_FEATURE_* numbers (word*32+bit, arch/x86/include/asm/cpufeatures.h) whose
#                    instructions the emulator cannot run at CPL0: 141 CX16 (cmpxchg16b in SLUB),
#                    150 MOVBE, 151 POPCNT (hweight alternatives), 158 RDRAND, 308 SMAP (stac/clac),
#                    534 RDPID
#   nopcid noinvpcid plain CR3 writes, no INVPCID
#   nopku nofsgsbase no PKRU writes and no RDFSBASE/WRFSBASE at CPL0
#   smol_cpl0_emulated  the guest kernel's own switch (guest-agent/kernel/patches/0001-*.patch): no
#                    INT3 self-test, no FWAIT, and user-mode SYSCALL completed from the #PF it
#                    raises on PVM (docs/pvm-emulator.md)
#   GLIBC_TUNABLES=  not a kernel parameter: Linux hands it to /init as an environment variable, and
#                    the agent passes it on to every command (docs/pvm-emulator.md, item 10). Guest user
#                    code runs natively on PVM, so glibc's CPUID sees the host's AVX/AVX2 and copies
#                    memory through 32-byte YMM registers, but with noxsave the kernel saves only the
#                    FXSAVE area: a process preempted inside such a copy gets the upper 16 bytes of its
#                    YMM registers back as zeros and writes zeros into the data. The tunable makes
#                    glibc pick its SSE2 string and memory functions.
# With more than one vCPU also:
#   nopv             no KVM paravirt features: the guest sees the *host's* hypervisor CPUID leaves,
#                    and with them a second vCPU hangs during bring-up (docs/pvm-emulator.md)
#   tsc_early_khz=N  without kvmclock the guest would calibrate the TSC against the emulated PIT,
#                    which is meaningless at emulation speed; N is the vCPU's KVM_GET_TSC_KHZ
#   lpj=N            likewise for the secondary CPUs' delay-loop calibration
# (SMP under PVM's emulator is still unreliable: see docs/pvm-emulator.md.)
COMPAT_GLIBC_TUNABLES = ("glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,"
                         "-AVX_Fast_Unaligned_Load,-FMA,-FMA4")
COMPAT_CMDLINE = ("noxsave clearcpuid=141,150,151,158,308,534 nopcid noinvpcid nopku nofsgsbase "
                  f"smol_cpl0_emulated GLIBC_TUNABLES={COMPAT_GLIBC_TUNABLES}")
COMPAT_SMP_CMDLINE = "nopv"
HZ = 100   # CONFIG_HZ of the guest kernel (guest-agent/kernel/microvm.config)


def template_cmdline(template: CpuTemplate, tsc_khz: int | None = None, cpus: int = 1) -> str:
    """Kernel command-line arguments that complete ``template`` inside the guest."""
    if template is not CpuTemplate.COMPAT:
        return ""
    parts = [COMPAT_CMDLINE]
    if cpus > 1:
        parts.append(COMPAT_SMP_CMDLINE)
        if tsc_khz:
            parts.append(f"tsc_early_khz={tsc_khz} lpj={tsc_khz * 1000 // HZ}")
    return " ".join(parts)


def default_vcpus(pvm: bool) -> int:
    """2 vCPUs, or 1 on PVM hosts where SMP under the CPL0 emulator is unreliable (docs/pvm-emulator.md)."""
    return 1 if pvm else 2


def resolve_template(name: str, pvm: bool) -> CpuTemplate:
    """``auto`` picks COMPAT on PVM hosts and HOST elsewhere."""
    if name == "auto":
        return CpuTemplate.COMPAT if pvm else CpuTemplate.HOST
    return CpuTemplate.parse(name)
