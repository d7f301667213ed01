"""The frozen dataclasses a VM snapshot is made of: vCPUs, in-kernel irqchip/PIT/clock, devices, memory map.

Plain values only (ints, bools, strings, bytes, tuples, nested frozen dataclasses). KVM structures whose
layout is fixed by the KVM ABI (sregs, fpu, lapic, vcpu events, xsave, xcrs, irqchip, PIT) are kept as
their raw bytes with the length checked; the general registers and MSRs are named values.
"""

from __future__ import annotations

from dataclasses import dataclass

from smold.devices.block.persist import BlockState
from smold.devices.net.persist import NetState
from smold.devices.rng.persist import RngState
from smold.devices.serial import SerialState
from smold.devices.virtio.persist import MmioState
from smold.devices.vsock.persist import VsockState

STATE_KIND = "smol-vm-snapshot"


@dataclass(frozen=True)
class Regs:
    """struct kvm_regs."""

    rax: int
    rbx: int
    rcx: int
    rdx: int
    rsi: int
    rdi: int
    rsp: int
    rbp: int
    r8: int
    r9: int
    r10: int
    r11: int
    r12: int
    r13: int
    r14: int
    r15: int
    rip: int
    rflags: int


@dataclass(frozen=True)
class MsrValue:
    index: int
    value: int


@dataclass(frozen=True)
class CpuidEntry:
    """struct kvm_cpuid_entry2 (padding dropped)."""

    function: int
    index: int
    flags: int
    eax: int
    ebx: int
    ecx: int
    edx: int


@dataclass(frozen=True)
class VcpuState:
    """Everything KVM holds for one vCPU, in the order it is restored (docs/snapshot.md)."""

    index: int
    cpuid: tuple[CpuidEntry, ...]
    sregs: bytes            # struct kvm_sregs (312 bytes)
    regs: Regs
    fpu: bytes              # struct kvm_fpu (416 bytes)
    xcrs: bytes | None      # struct kvm_xcrs (392 bytes), where KVM_CAP_XCRS
    xsave: bytes | None     # struct kvm_xsave (4096 bytes), where KVM_CAP_XSAVE
    msrs: tuple[MsrValue, ...]
    lapic: bytes            # struct kvm_lapic_state (1024 bytes)
    vcpu_events: bytes      # struct kvm_vcpu_events (64 bytes)
    mp_state: int
    tsc_khz: int


@dataclass(frozen=True)
class VmState:
    """The in-kernel devices and the KVM clock."""

    pic_master: bytes       # struct kvm_irqchip.chip (512 bytes) for KVM_IRQCHIP_PIC_MASTER
    pic_slave: bytes
    ioapic: bytes
    pit2: bytes             # struct kvm_pit_state2 (112 bytes)
    clock: int              # KVM_GET_CLOCK: kvmclock nanoseconds
    clock_flags: int


@dataclass(frozen=True)
class MemoryRegionState:
    """One guest-physical RAM range and where its bytes start in the memory file."""

    guest_addr: int
    size: int
    file_offset: int


@dataclass(frozen=True)
class MemoryState:
    """The raw memory file beside the state file (a sparse file: unwritten ranges read as zeros)."""

    file: str               # name relative to the snapshot directory
    size: int
    regions: tuple[MemoryRegionState, ...]
    sha256: str | None      # hex digest of the whole file, when it was computed at snapshot time


@dataclass(frozen=True)
class CmosState:
    index: int
    nvram: bytes


@dataclass(frozen=True)
class I8042State:
    """The i8042 holds no guest-visible state; the reset counter is kept for diagnostics."""

    resets: int


@dataclass(frozen=True)
class VirtioSlotState:
    """One virtio-mmio slot: the transport's registers and queues plus the device's own state."""

    slot: int
    mmio: MmioState
    device: BlockState | VsockState | RngState | NetState


@dataclass(frozen=True)
class DevicesState:
    serial: SerialState
    cmos: CmosState
    i8042: I8042State
    virtio: tuple[VirtioSlotState, ...]


@dataclass(frozen=True)
class DiskRef:
    """The root disk a snapshot expects: read-only, same size (its contents are not in the snapshot)."""

    path: str
    size: int
    mtime_ns: int
    read_only: bool


@dataclass(frozen=True)
class MachineSpec:
    """The configuration a restore rebuilds before loading state."""

    cpus: int
    memory_mib: int
    cpu_template: str
    vsock_cid: int
    hostname: str
    kernel_cmdline: str
    rootfs: DiskRef | None


@dataclass(frozen=True)
class HostInfo:
    """Where the snapshot was taken (a restore on a different CPU/KVM is refused or warned about)."""

    pvm: bool
    kernel: str
    tsc_khz: int


@dataclass(frozen=True)
class VmSnapshot:
    """The whole state file."""

    kind: str
    spec: MachineSpec
    host: HostInfo
    created_unix_ns: int    # host wall clock when the vCPUs were paused (guest clock correction)
    vm: VmState
    vcpus: tuple[VcpuState, ...]
    devices: DevicesState
    memory: MemoryState
