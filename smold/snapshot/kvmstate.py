"""Capture and restore KVM's per-vCPU and per-VM state (regs, sregs, fpu/xsave, MSRs, LAPIC, irqchip, PIT, clock).

Restore order per vCPU (docs/snapshot.md): CPUID, sregs (EFER, APIC base), regs, fpu, xcrs, xsave,
MSRs except TSC_DEADLINE, LAPIC, TSC_DEADLINE (KVM drops it unless the LAPIC timer is already in
deadline mode), vcpu events, mp_state. The VM's irqchip, PIT and clock are restored by ``restore_vm``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import struct

from smold.kvm import KvmError, Vcpu, Vm
from smold.kvm import structs as s
from smold.kvm.api import KVM_CAP_XCRS, KVM_CAP_XSAVE, Kvm
from smold.snapshot.errors import SnapshotCompatError, SnapshotError, SnapshotFormatError
from smold.snapshot.state import CpuidEntry, MsrValue, Regs, VcpuState, VmState

log = logging.getLogger(__name__)

# MSRs (Intel SDM vol. 4; KVM's paravirtual MSRs in Documentation/virt/kvm/x86/msr.rst).
MSR_IA32_TSC = 0x10
MSR_IA32_APICBASE = 0x1B
MSR_IA32_TSC_ADJUST = 0x3B
MSR_IA32_SYSENTER_CS = 0x174
MSR_IA32_SYSENTER_ESP = 0x175
MSR_IA32_SYSENTER_EIP = 0x176
MSR_IA32_MISC_ENABLE = 0x1A0
MSR_IA32_CR_PAT = 0x277
MSR_IA32_TSC_DEADLINE = 0x6E0
MSR_EFER = 0xC0000080
MSR_STAR = 0xC0000081
MSR_LSTAR = 0xC0000082
MSR_CSTAR = 0xC0000083
MSR_SYSCALL_MASK = 0xC0000084
MSR_FS_BASE = 0xC0000100
MSR_GS_BASE = 0xC0000101
MSR_KERNEL_GS_BASE = 0xC0000102
MSR_TSC_AUX = 0xC0000103
MSR_KVM_WALL_CLOCK = 0x11
MSR_KVM_SYSTEM_TIME = 0x12
MSR_KVM_WALL_CLOCK_NEW = 0x4B564D00
MSR_KVM_SYSTEM_TIME_NEW = 0x4B564D01
MSR_KVM_ASYNC_PF_EN = 0x4B564D02
MSR_KVM_STEAL_TIME = 0x4B564D03
MSR_KVM_PV_EOI_EN = 0x4B564D04
MSR_KVM_POLL_CONTROL = 0x4B564D05
MSR_KVM_ASYNC_PF_INT = 0x4B564D06
MSR_KVM_ASYNC_PF_ACK = 0x4B564D07

# Always tried, whether or not KVM_GET_MSR_INDEX_LIST names them; kept only if KVM_GET_MSRS reads them.
REQUIRED_MSRS = (
    MSR_IA32_TSC, MSR_IA32_APICBASE, MSR_IA32_TSC_ADJUST, MSR_IA32_SYSENTER_CS, MSR_IA32_SYSENTER_ESP,
    MSR_IA32_SYSENTER_EIP, MSR_IA32_MISC_ENABLE, MSR_IA32_CR_PAT, MSR_IA32_TSC_DEADLINE, MSR_EFER, MSR_STAR,
    MSR_LSTAR, MSR_CSTAR, MSR_SYSCALL_MASK, MSR_FS_BASE, MSR_GS_BASE, MSR_KERNEL_GS_BASE, MSR_TSC_AUX,
    MSR_KVM_WALL_CLOCK, MSR_KVM_SYSTEM_TIME, MSR_KVM_WALL_CLOCK_NEW, MSR_KVM_SYSTEM_TIME_NEW,
    MSR_KVM_ASYNC_PF_EN, MSR_KVM_STEAL_TIME, MSR_KVM_PV_EOI_EN, MSR_KVM_POLL_CONTROL, MSR_KVM_ASYNC_PF_INT,
    MSR_KVM_ASYNC_PF_ACK,
)
# Set after the LAPIC (see the module docstring), and the async-PF ack is write-only in effect.
_LATE_MSRS = (MSR_IA32_TSC_DEADLINE,)

# struct kvm_vcpu_events: flags at offset 20 (Documentation/virt/kvm/api.rst, KVM_SET_VCPU_EVENTS).
_EVENTS_FLAGS_OFFSET = 20
KVM_VCPUEVENT_VALID_NMI_PENDING = 0x1
KVM_VCPUEVENT_VALID_SIPI_VECTOR = 0x2

_SIZES = {"sregs": ctypes.sizeof(s.KvmSregs), "fpu": ctypes.sizeof(s.KvmFpu),
          "lapic": ctypes.sizeof(s.KvmLapicState), "vcpu_events": ctypes.sizeof(s.KvmVcpuEvents),
          "xsave": ctypes.sizeof(s.KvmXsave), "xcrs": ctypes.sizeof(s.KvmXcrs)}
IRQCHIP_BYTES = 512
PIT_BYTES = ctypes.sizeof(s.KvmPitState2)
_REG_NAMES = tuple(field[0] for field in s.KvmRegs._fields_)


class KvmStateError(SnapshotError):
    """KVM refused to hand out or take back a piece of VM state."""


def saveable_msrs(kvm: Kvm, vcpu: Vcpu) -> list[int]:
    """MSRs this host's KVM both lists (or we require) and actually reads for ``vcpu``.

    KVM_GET_MSRS stops at the first MSR it cannot read and returns how many it read, so a failing
    index is dropped and the rest retried.
    """
    candidates = sorted(set(kvm.msr_index_list()) | set(REQUIRED_MSRS))
    good: list[int] = []
    while candidates:
        try:
            values = vcpu.get_msrs(candidates)
        except KvmError as e:
            raise KvmStateError(f"KVM_GET_MSRS failed: {e}") from e
        good += [i for i in candidates[:len(values)]]
        if len(values) == len(candidates):
            break
        skipped = candidates[len(values)]
        log.debug("MSR %#x is not readable on this host; not saved", skipped)
        candidates = candidates[len(values) + 1:]
    return good


def host_caps(kvm: Kvm) -> tuple[bool, bool]:
    """(xsave, xcrs) support, from KVM_CHECK_EXTENSION."""
    return kvm.check_extension(KVM_CAP_XSAVE) > 0, kvm.check_extension(KVM_CAP_XCRS) > 0


def _regs_to_state(regs: s.KvmRegs) -> Regs:
    return Regs(**{name: int(getattr(regs, name)) for name in _REG_NAMES})


def _regs_from_state(regs: Regs) -> s.KvmRegs:
    out = s.KvmRegs()
    for name in _REG_NAMES:
        setattr(out, name, getattr(regs, name))
    return out


def capture_vcpu(vcpu: Vcpu, cpuid: list[s.KvmCpuidEntry2], msr_indices: list[int], *, xsave: bool,
                 xcrs: bool) -> VcpuState:
    """Read one paused vCPU's state (its pending PIO/MMIO must have been completed: see VcpuThread)."""
    try:
        msrs = vcpu.get_msrs(msr_indices)
        if len(msrs) != len(msr_indices):
            missing = [hex(i) for i in msr_indices if i not in msrs]
            raise KvmStateError(f"vcpu{vcpu.index}: KVM_GET_MSRS read {len(msrs)} of {len(msr_indices)} "
                                f"MSRs (missing {', '.join(missing[:4])})")
        return VcpuState(
            index=vcpu.index,
            cpuid=tuple(CpuidEntry(int(e.function), int(e.index), int(e.flags), int(e.eax), int(e.ebx),
                                   int(e.ecx), int(e.edx)) for e in cpuid),
            sregs=bytes(vcpu.get_sregs()),
            regs=_regs_to_state(vcpu.get_regs()),
            fpu=bytes(vcpu.get_fpu()),
            xcrs=vcpu.get_xcrs() if xcrs else None,
            xsave=vcpu.get_xsave() if xsave else None,
            msrs=tuple(MsrValue(i, msrs[i]) for i in msr_indices),
            lapic=vcpu.get_lapic(),
            vcpu_events=vcpu.get_vcpu_events(),
            mp_state=vcpu.get_mp_state(),
            tsc_khz=vcpu.get_tsc_khz(),
        )
    except KvmError as e:
        raise KvmStateError(f"vcpu{vcpu.index}: cannot read state: {e}") from e


def check_vcpu_state(state: VcpuState) -> None:
    """Reject byte blobs of the wrong size before they reach an ioctl."""
    for name, size in _SIZES.items():
        blob = getattr(state, name)
        if blob is not None and len(blob) != size:
            raise SnapshotFormatError(f"vcpu{state.index}: {name} is {len(blob)} bytes, KVM's struct is {size}")
    if not state.cpuid:
        raise SnapshotFormatError(f"vcpu{state.index}: empty CPUID table")


def cpuid_entries(state: VcpuState) -> list[s.KvmCpuidEntry2]:
    out = []
    for e in state.cpuid:
        out.append(s.KvmCpuidEntry2(function=e.function, index=e.index, flags=e.flags, eax=e.eax, ebx=e.ebx,
                                    ecx=e.ecx, edx=e.edx))
    return out


def restore_vcpu(vcpu: Vcpu, state: VcpuState, *, xsave: bool, xcrs: bool) -> None:
    """Load ``state`` into a freshly created vCPU (never run), in the documented order."""
    check_vcpu_state(state)
    step = "CPUID"
    try:
        vcpu.set_cpuid(cpuid_entries(state))
        step = "sregs"
        vcpu.set_sregs(s.KvmSregs.from_buffer_copy(state.sregs))
        step = "regs"
        vcpu.set_regs(_regs_from_state(state.regs))
        step = "fpu"
        vcpu.set_fpu(s.KvmFpu.from_buffer_copy(state.fpu))
        if state.xcrs is not None:
            if not xcrs:
                raise SnapshotCompatError("the snapshot has XCRs but this host lacks KVM_CAP_XCRS")
            step = "xcrs"
            vcpu.set_xcrs(state.xcrs)
        if state.xsave is not None:
            if not xsave:
                raise SnapshotCompatError("the snapshot has XSAVE state but this host lacks KVM_CAP_XSAVE")
            step = "xsave"
            vcpu.set_xsave(state.xsave)
        step = "MSRs"
        early = {m.index: m.value for m in state.msrs if m.index not in _LATE_MSRS}
        late = {m.index: m.value for m in state.msrs if m.index in _LATE_MSRS}
        if early:
            vcpu.set_msrs(early)
        step = "LAPIC"
        vcpu.set_lapic(state.lapic)
        if late:
            step = "TSC deadline"
            vcpu.set_msrs(late)
        step = "vcpu events"
        events = bytearray(state.vcpu_events)
        flags = struct.unpack_from("<I", events, _EVENTS_FLAGS_OFFSET)[0]
        flags |= KVM_VCPUEVENT_VALID_NMI_PENDING | KVM_VCPUEVENT_VALID_SIPI_VECTOR
        struct.pack_into("<I", events, _EVENTS_FLAGS_OFFSET, flags)
        vcpu.set_vcpu_events(bytes(events))
        step = "mp_state"
        vcpu.set_mp_state(state.mp_state)
    except KvmError as e:
        raise KvmStateError(f"vcpu{vcpu.index}: KVM refused the saved {step}: {e}") from e


def capture_vm(vm: Vm) -> VmState:
    try:
        clock = vm.get_clock()
        return VmState(pic_master=vm.get_irqchip(s.KVM_IRQCHIP_PIC_MASTER),
                       pic_slave=vm.get_irqchip(s.KVM_IRQCHIP_PIC_SLAVE),
                       ioapic=vm.get_irqchip(s.KVM_IRQCHIP_IOAPIC), pit2=vm.get_pit2(),
                       clock=int(clock.clock), clock_flags=int(clock.flags))
    except KvmError as e:
        raise KvmStateError(f"cannot read the VM's irqchip/PIT/clock: {e}") from e


def restore_vm(vm: Vm, state: VmState) -> None:
    """Irqchip and PIT (before any device can raise an interrupt)."""
    for name in ("pic_master", "pic_slave", "ioapic"):
        if len(getattr(state, name)) != IRQCHIP_BYTES:
            raise SnapshotFormatError(f"irqchip {name} state is {len(getattr(state, name))} bytes, "
                                      f"expected {IRQCHIP_BYTES}")
    if len(state.pit2) != PIT_BYTES:
        raise SnapshotFormatError(f"PIT state is {len(state.pit2)} bytes, expected {PIT_BYTES}")
    step = "irqchip"
    try:
        vm.set_irqchip(s.KVM_IRQCHIP_PIC_MASTER, state.pic_master)
        vm.set_irqchip(s.KVM_IRQCHIP_PIC_SLAVE, state.pic_slave)
        vm.set_irqchip(s.KVM_IRQCHIP_IOAPIC, state.ioapic)
        step = "PIT"
        vm.set_pit2(state.pit2)
    except KvmError as e:
        raise KvmStateError(f"KVM refused the saved {step} state: {e}") from e


def restore_clock(vm: Vm, state: VmState) -> None:
    """KVM_SET_CLOCK with the saved kvmclock value: guest monotonic time continues where it paused."""
    try:
        vm.set_clock(state.clock)
    except KvmError as e:
        raise KvmStateError(f"KVM_SET_CLOCK failed: {e}") from e


def mark_guest_stopped(vcpu: Vcpu) -> bool:
    """KVM_KVMCLOCK_CTRL: tell the guest's watchdogs the vCPU was paused. False where the guest has no
    kvmclock registered (EINVAL) or the host lacks the ioctl."""
    try:
        vcpu.kvmclock_ctrl()
    except KvmError as e:
        if e.errno in (errno.EINVAL, errno.ENOTTY, errno.EOPNOTSUPP):
            return False
        raise KvmStateError(f"vcpu{vcpu.index}: KVM_KVMCLOCK_CTRL failed: {e}") from e
    return True
