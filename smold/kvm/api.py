"""The KVM fd hierarchy: Kvm (/dev/kvm) -> Vm -> Vcpu, each object owning its file descriptor."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import dataclass

from smold.kvm import structs as s
from smold.kvm.ioctl import KvmError, io, ioctl, ior, iow, iowr

KVM_API_VERSION = 12

# /dev/kvm ioctls
KVM_GET_API_VERSION = io(0x00)
KVM_CREATE_VM = io(0x01)
KVM_GET_MSR_INDEX_LIST = iowr(0x02, s.KvmMsrListHeader)
KVM_CHECK_EXTENSION = io(0x03)
KVM_GET_VCPU_MMAP_SIZE = io(0x04)
KVM_GET_SUPPORTED_CPUID = iowr(0x05, s.KvmCpuid2Header)
# VM ioctls
KVM_CREATE_VCPU = io(0x41)
KVM_SET_USER_MEMORY_REGION = iow(0x46, s.KvmUserspaceMemoryRegion)
KVM_SET_TSS_ADDR = io(0x47)
KVM_SET_IDENTITY_MAP_ADDR = iow(0x48, ctypes.c_uint64)
KVM_CREATE_IRQCHIP = io(0x60)
KVM_IRQ_LINE = iow(0x61, s.KvmIrqLevel)
KVM_GET_IRQCHIP = iowr(0x62, s.KvmIrqchip)
KVM_SET_IRQCHIP = ior(0x63, s.KvmIrqchip)
KVM_IRQFD = iow(0x76, s.KvmIrqfd)
KVM_CREATE_PIT2 = iow(0x77, s.KvmPitConfig)
KVM_IOEVENTFD = iow(0x79, s.KvmIoeventfd)
KVM_SET_CLOCK = iow(0x7B, s.KvmClockData)
KVM_GET_CLOCK = ior(0x7C, s.KvmClockData)
KVM_GET_PIT2 = ior(0x9F, s.KvmPitState2)
KVM_SET_PIT2 = iow(0xA0, s.KvmPitState2)
# vCPU ioctls
KVM_RUN = io(0x80)
KVM_GET_REGS = ior(0x81, s.KvmRegs)
KVM_SET_REGS = iow(0x82, s.KvmRegs)
KVM_GET_SREGS = ior(0x83, s.KvmSregs)
KVM_SET_SREGS = iow(0x84, s.KvmSregs)
KVM_GET_MSRS = iowr(0x88, s.KvmMsrsHeader)
KVM_SET_MSRS = iow(0x89, s.KvmMsrsHeader)
KVM_GET_FPU = ior(0x8C, s.KvmFpu)
KVM_SET_FPU = iow(0x8D, s.KvmFpu)
KVM_GET_LAPIC = ior(0x8E, s.KvmLapicState)
KVM_SET_LAPIC = iow(0x8F, s.KvmLapicState)
KVM_SET_CPUID2 = iow(0x90, s.KvmCpuid2Header)
KVM_GET_MP_STATE = ior(0x98, s.KvmMpState)
KVM_SET_MP_STATE = iow(0x99, s.KvmMpState)
KVM_GET_VCPU_EVENTS = ior(0x9F, s.KvmVcpuEvents)
KVM_SET_VCPU_EVENTS = iow(0xA0, s.KvmVcpuEvents)
KVM_SET_TSC_KHZ = io(0xA2)
KVM_GET_TSC_KHZ = io(0xA3)
KVM_GET_XSAVE = ior(0xA4, s.KvmXsave)
KVM_SET_XSAVE = iow(0xA5, s.KvmXsave)
KVM_GET_XCRS = ior(0xA6, s.KvmXcrs)
KVM_SET_XCRS = iow(0xA7, s.KvmXcrs)
KVM_KVMCLOCK_CTRL = io(0xAD)

# KVM_CHECK_EXTENSION capabilities
KVM_CAP_IRQCHIP = 0
KVM_CAP_USER_MEMORY = 3
KVM_CAP_SET_TSS_ADDR = 4
KVM_CAP_EXT_CPUID = 7
KVM_CAP_NR_VCPUS = 9
KVM_CAP_MP_STATE = 14
KVM_CAP_IOEVENTFD = 36
KVM_CAP_IRQFD = 32
KVM_CAP_PIT2 = 33
KVM_CAP_MAX_VCPUS = 66
KVM_CAP_XSAVE = 55
KVM_CAP_XCRS = 56

REQUIRED_CAPS = {
    "KVM_CAP_IRQCHIP": KVM_CAP_IRQCHIP, "KVM_CAP_USER_MEMORY": KVM_CAP_USER_MEMORY,
    "KVM_CAP_SET_TSS_ADDR": KVM_CAP_SET_TSS_ADDR, "KVM_CAP_EXT_CPUID": KVM_CAP_EXT_CPUID,
    "KVM_CAP_IOEVENTFD": KVM_CAP_IOEVENTFD, "KVM_CAP_IRQFD": KVM_CAP_IRQFD, "KVM_CAP_PIT2": KVM_CAP_PIT2,
}


class KvmUnavailable(KvmError):
    """/dev/kvm is missing, inaccessible, or lacks a capability the VMM needs."""


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Kvm:
    """The /dev/kvm system fd."""

    def __init__(self, path: str = "/dev/kvm") -> None:
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise KvmUnavailable(e.errno or errno.ENODEV, f"cannot open {path}: {e.strerror}") from e
        version = ioctl(self.fd, KVM_GET_API_VERSION, name="KVM_GET_API_VERSION")
        if version != KVM_API_VERSION:
            _close(self.fd)
            raise KvmUnavailable(errno.EINVAL, f"KVM API version {version}, expected {KVM_API_VERSION}")
        for cap_name, cap in REQUIRED_CAPS.items():
            if self.check_extension(cap) <= 0:
                _close(self.fd)
                raise KvmUnavailable(errno.ENOTSUP, f"{path} lacks {cap_name}")

    def check_extension(self, cap: int) -> int:
        return ioctl(self.fd, KVM_CHECK_EXTENSION, cap, name="KVM_CHECK_EXTENSION")

    def vcpu_mmap_size(self) -> int:
        return ioctl(self.fd, KVM_GET_VCPU_MMAP_SIZE, name="KVM_GET_VCPU_MMAP_SIZE")

    def max_vcpus(self) -> int:
        return self.check_extension(KVM_CAP_MAX_VCPUS) or self.check_extension(KVM_CAP_NR_VCPUS) or 4

    def supported_cpuid(self) -> list[s.KvmCpuidEntry2]:
        n = 64
        while True:
            buf = s.cpuid2(n)()
            buf.nent = n
            try:
                ioctl(self.fd, KVM_GET_SUPPORTED_CPUID, buf, name="KVM_GET_SUPPORTED_CPUID")
            except KvmError as e:
                if e.errno == errno.E2BIG and n < 4096:
                    n *= 2
                    continue
                raise
            return [s.KvmCpuidEntry2.from_buffer_copy(buf.entries[i]) for i in range(buf.nent)]

    def msr_index_list(self) -> list[int]:
        n = 256
        while True:
            buf = s.msr_list(n)()
            buf.nmsrs = n
            try:
                ioctl(self.fd, KVM_GET_MSR_INDEX_LIST, buf, name="KVM_GET_MSR_INDEX_LIST")
            except KvmError as e:
                if e.errno == errno.E2BIG and n < 16384:
                    n *= 4
                    continue
                raise
            return [int(buf.indices[i]) for i in range(buf.nmsrs)]

    def create_vm(self) -> Vm:
        fd = ioctl(self.fd, KVM_CREATE_VM, 0, name="KVM_CREATE_VM")
        return Vm(self, fd)

    def close(self) -> None:
        _close(self.fd)

    def __enter__(self) -> Kvm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_pvm() -> bool:
    """True when /dev/kvm is provided by PVM (a shadow-paging, partly emulating KVM)."""
    return os.path.isdir("/sys/module/kvm_pvm")


@dataclass(frozen=True)
class IoEventFdSpec:
    addr: int
    length: int
    fd: int
    datamatch: int | None
    pio: bool


class Vm:
    """A VM fd: memory slots, irqchip, PIT, irqfds, ioeventfds, clock; creates vCPUs."""

    def __init__(self, kvm: Kvm, fd: int) -> None:
        self.kvm = kvm
        self.fd = fd
        self.vcpus: list[Vcpu] = []
        self._slots = 0

    def set_tss_addr(self, addr: int) -> None:
        # The argument is an unsigned long passed by value (the brief notes a C int through fcntl).
        ioctl(self.fd, KVM_SET_TSS_ADDR, addr, name="KVM_SET_TSS_ADDR")

    def set_identity_map_addr(self, addr: int) -> None:
        v = ctypes.c_uint64(addr)
        ioctl(self.fd, KVM_SET_IDENTITY_MAP_ADDR, v, name="KVM_SET_IDENTITY_MAP_ADDR")

    def set_user_memory_region(self, guest_addr: int, size: int, host_addr: int, *, flags: int = 0) -> int:
        region = s.KvmUserspaceMemoryRegion(slot=self._slots, flags=flags, guest_phys_addr=guest_addr,
                                            memory_size=size, userspace_addr=host_addr)
        ioctl(self.fd, KVM_SET_USER_MEMORY_REGION, region, name="KVM_SET_USER_MEMORY_REGION")
        self._slots += 1
        return region.slot

    def create_irqchip(self) -> None:
        ioctl(self.fd, KVM_CREATE_IRQCHIP, name="KVM_CREATE_IRQCHIP")

    def create_pit2(self) -> None:
        cfg = s.KvmPitConfig(flags=s.KVM_PIT_SPEAKER_DUMMY)
        ioctl(self.fd, KVM_CREATE_PIT2, cfg, name="KVM_CREATE_PIT2")

    def irq_line(self, irq: int, level: int) -> None:
        ioctl(self.fd, KVM_IRQ_LINE, s.KvmIrqLevel(irq=irq, level=level), name="KVM_IRQ_LINE")

    def register_irqfd(self, fd: int, gsi: int) -> None:
        ioctl(self.fd, KVM_IRQFD, s.KvmIrqfd(fd=fd, gsi=gsi), name="KVM_IRQFD")

    def unregister_irqfd(self, fd: int, gsi: int) -> None:
        ioctl(self.fd, KVM_IRQFD, s.KvmIrqfd(fd=fd, gsi=gsi, flags=s.KVM_IRQFD_FLAG_DEASSIGN),
              name="KVM_IRQFD(deassign)")

    def register_ioeventfd(self, spec: IoEventFdSpec, *, deassign: bool = False) -> None:
        flags = 0
        if spec.datamatch is not None:
            flags |= s.KVM_IOEVENTFD_FLAG_DATAMATCH
        if spec.pio:
            flags |= s.KVM_IOEVENTFD_FLAG_PIO
        if deassign:
            flags |= s.KVM_IOEVENTFD_FLAG_DEASSIGN
        arg = s.KvmIoeventfd(datamatch=spec.datamatch or 0, addr=spec.addr, len=spec.length, fd=spec.fd,
                             flags=flags)
        ioctl(self.fd, KVM_IOEVENTFD, arg, name="KVM_IOEVENTFD")

    def get_irqchip(self, chip_id: int) -> bytes:
        chip = s.KvmIrqchip(chip_id=chip_id)
        ioctl(self.fd, KVM_GET_IRQCHIP, chip, name="KVM_GET_IRQCHIP")
        return bytes(chip.chip)

    def set_irqchip(self, chip_id: int, data: bytes) -> None:
        chip = s.KvmIrqchip(chip_id=chip_id)
        ctypes.memmove(chip.chip, data, min(len(data), 512))
        ioctl(self.fd, KVM_SET_IRQCHIP, chip, name="KVM_SET_IRQCHIP")

    def get_pit2(self) -> bytes:
        st = s.KvmPitState2()
        ioctl(self.fd, KVM_GET_PIT2, st, name="KVM_GET_PIT2")
        return bytes(st)

    def set_pit2(self, data: bytes) -> None:
        st = s.KvmPitState2.from_buffer_copy(data)
        ioctl(self.fd, KVM_SET_PIT2, st, name="KVM_SET_PIT2")

    def get_clock(self) -> s.KvmClockData:
        st = s.KvmClockData()
        ioctl(self.fd, KVM_GET_CLOCK, st, name="KVM_GET_CLOCK")
        return st

    def set_clock(self, clock: int) -> None:
        ioctl(self.fd, KVM_SET_CLOCK, s.KvmClockData(clock=clock), name="KVM_SET_CLOCK")

    def create_vcpu(self, index: int) -> Vcpu:
        fd = ioctl(self.fd, KVM_CREATE_VCPU, index, name="KVM_CREATE_VCPU")
        vcpu = Vcpu(self, index, fd, self.kvm.vcpu_mmap_size())
        self.vcpus.append(vcpu)
        return vcpu

    def close(self) -> None:
        for vcpu in self.vcpus:
            vcpu.close()
        self.vcpus.clear()
        _close(self.fd)


class Vcpu:
    """A vCPU fd with its mmapped kvm_run page; register accessors for boot and snapshots."""

    def __init__(self, vm: Vm, index: int, fd: int, mmap_size: int) -> None:
        self.vm = vm
        self.index = index
        self.fd = fd
        self._map = mmap.mmap(fd, mmap_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.run_struct = s.KvmRun.from_buffer(self._map)
        self._run_base = ctypes.addressof(self.run_struct)

    def run(self) -> int:
        """KVM_RUN; returns the exit reason. EINTR surfaces as KvmError(errno=EINTR)."""
        ioctl(self.fd, KVM_RUN, name="KVM_RUN")
        return int(self.run_struct.exit_reason)

    def run_data(self, offset: int, length: int) -> bytes:
        """Bytes of the kvm_run page (PIO data lives at io.data_offset)."""
        return ctypes.string_at(self._run_base + offset, length)

    def set_run_data(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self._run_base + offset, data, len(data))

    def get_regs(self) -> s.KvmRegs:
        r = s.KvmRegs()
        ioctl(self.fd, KVM_GET_REGS, r, name="KVM_GET_REGS")
        return r

    def set_regs(self, regs: s.KvmRegs) -> None:
        ioctl(self.fd, KVM_SET_REGS, regs, name="KVM_SET_REGS")

    def get_sregs(self) -> s.KvmSregs:
        r = s.KvmSregs()
        ioctl(self.fd, KVM_GET_SREGS, r, name="KVM_GET_SREGS")
        return r

    def set_sregs(self, sregs: s.KvmSregs) -> None:
        ioctl(self.fd, KVM_SET_SREGS, sregs, name="KVM_SET_SREGS")

    def get_fpu(self) -> s.KvmFpu:
        r = s.KvmFpu()
        ioctl(self.fd, KVM_GET_FPU, r, name="KVM_GET_FPU")
        return r

    def set_fpu(self, fpu: s.KvmFpu) -> None:
        ioctl(self.fd, KVM_SET_FPU, fpu, name="KVM_SET_FPU")

    def set_cpuid(self, entries: list[s.KvmCpuidEntry2]) -> None:
        buf = s.cpuid2(len(entries))()
        buf.nent = len(entries)
        for i, e in enumerate(entries):
            buf.entries[i] = e
        ioctl(self.fd, KVM_SET_CPUID2, buf, name="KVM_SET_CPUID2")

    def get_msrs(self, indices: list[int]) -> dict[int, int]:
        buf = s.msrs(len(indices))()
        buf.nmsrs = len(indices)
        for i, idx in enumerate(indices):
            buf.entries[i].index = idx
        n = ioctl(self.fd, KVM_GET_MSRS, buf, name="KVM_GET_MSRS")
        return {int(buf.entries[i].index): int(buf.entries[i].data) for i in range(n)}

    def set_msrs(self, values: dict[int, int]) -> int:
        buf = s.msrs(len(values))()
        buf.nmsrs = len(values)
        for i, (idx, val) in enumerate(values.items()):
            buf.entries[i].index = idx
            buf.entries[i].data = val
        n = ioctl(self.fd, KVM_SET_MSRS, buf, name="KVM_SET_MSRS")
        if n != len(values):
            bad = list(values)[n]
            raise KvmError(errno.EINVAL, f"KVM_SET_MSRS: MSR {bad:#x} was rejected ({n}/{len(values)} set)")
        return n

    def get_lapic(self) -> bytes:
        st = s.KvmLapicState()
        ioctl(self.fd, KVM_GET_LAPIC, st, name="KVM_GET_LAPIC")
        return bytes(st)

    def set_lapic(self, data: bytes) -> None:
        ioctl(self.fd, KVM_SET_LAPIC, s.KvmLapicState.from_buffer_copy(data), name="KVM_SET_LAPIC")

    def get_mp_state(self) -> int:
        st = s.KvmMpState()
        ioctl(self.fd, KVM_GET_MP_STATE, st, name="KVM_GET_MP_STATE")
        return int(st.mp_state)

    def set_mp_state(self, state: int) -> None:
        ioctl(self.fd, KVM_SET_MP_STATE, s.KvmMpState(mp_state=state), name="KVM_SET_MP_STATE")

    def get_vcpu_events(self) -> bytes:
        st = s.KvmVcpuEvents()
        ioctl(self.fd, KVM_GET_VCPU_EVENTS, st, name="KVM_GET_VCPU_EVENTS")
        return bytes(st)

    def set_vcpu_events(self, data: bytes) -> None:
        ioctl(self.fd, KVM_SET_VCPU_EVENTS, s.KvmVcpuEvents.from_buffer_copy(data), name="KVM_SET_VCPU_EVENTS")

    def get_xsave(self) -> bytes:
        st = s.KvmXsave()
        ioctl(self.fd, KVM_GET_XSAVE, st, name="KVM_GET_XSAVE")
        return bytes(st)

    def set_xsave(self, data: bytes) -> None:
        ioctl(self.fd, KVM_SET_XSAVE, s.KvmXsave.from_buffer_copy(data), name="KVM_SET_XSAVE")

    def get_xcrs(self) -> bytes:
        st = s.KvmXcrs()
        ioctl(self.fd, KVM_GET_XCRS, st, name="KVM_GET_XCRS")
        return bytes(st)

    def set_xcrs(self, data: bytes) -> None:
        ioctl(self.fd, KVM_SET_XCRS, s.KvmXcrs.from_buffer_copy(data), name="KVM_SET_XCRS")

    def get_tsc_khz(self) -> int:
        return ioctl(self.fd, KVM_GET_TSC_KHZ, name="KVM_GET_TSC_KHZ")

    def set_tsc_khz(self, khz: int) -> None:
        ioctl(self.fd, KVM_SET_TSC_KHZ, khz, name="KVM_SET_TSC_KHZ")

    def kvmclock_ctrl(self) -> None:
        """KVM_KVMCLOCK_CTRL: flag the guest's kvmclock page PVCLOCK_GUEST_STOPPED (host paused it)."""
        ioctl(self.fd, KVM_KVMCLOCK_CTRL, name="KVM_KVMCLOCK_CTRL")

    def request_exit(self) -> None:
        """Ask the next (or current, with a signal) KVM_RUN to return at once."""
        self.run_struct.immediate_exit = 1

    def clear_exit_request(self) -> None:
        self.run_struct.immediate_exit = 0

    def close(self) -> None:
        try:
            del self.run_struct
            self._map.close()
        except (BufferError, AttributeError):
            pass
        _close(self.fd)
