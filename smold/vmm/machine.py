"""A microVM: guest memory, KVM objects, devices and vCPU threads, driven from one asyncio loop; snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from smold.boot import cpu as bootcpu
from smold.boot.layout import (
    CMDLINE_ADDR,
    CMDLINE_MAX,
    CMOS_PORT,
    EBDA_START,
    I8042_PORT,
    IDENTITY_MAP_ADDR,
    SERIAL_COM1_IRQ,
    SERIAL_COM1_PORT,
    TSS_ADDR,
    VIRTIO_MMIO_SIZE,
    ZERO_PAGE_ADDR,
    MiB,
    RamLayout,
    virtio_mmio_slot,
)
from smold.boot.loader import KernelLoadError, LoadedKernel, load_kernel
from smold.boot.mptable import build_mptable
from smold.boot.params import build_boot_params, initrd_addr_max
from smold.devices.block.backend import FileBackend
from smold.devices.block.device import Block
from smold.devices.bus import Bus
from smold.devices.cmos import Cmos
from smold.devices.i8042 import I8042
from smold.devices.irq import EventFdIrq
from smold.devices.net.backend import NetBackendError, TapBackend
from smold.devices.net.device import DEFAULT_MAC, Net, NetError, parse_mac
from smold.devices.net.persist import NetState
from smold.devices.rng.device import Rng
from smold.devices.serial import Serial
from smold.devices.virtio.device import VirtioDevice
from smold.devices.virtio.mmio import MmioTransport, kernel_cmdline_arg
from smold.devices.vsock.backend import VsockBackend
from smold.devices.vsock.device import Vsock
from smold.kvm import Kvm, KvmError, Vcpu, is_pvm
from smold.kvm.api import IoEventFdSpec
from smold.kvm.cpuid import CpuTemplate, build_cpuid, resolve_template, template_cmdline
from smold.kvm.structs import KvmCpuidEntry2
from smold.memory import GuestMemory, GuestMemoryError
from smold.snapshot import kvmstate
from smold.snapshot.errors import SnapshotCompatError, SnapshotError
from smold.snapshot.state import (
    STATE_KIND,
    CmosState,
    DevicesState,
    DiskRef,
    HostInfo,
    I8042State,
    MachineSpec,
    MemoryState,
    VirtioSlotState,
    VmSnapshot,
)
from smold.snapshot.store import memory_path, read_snapshot, write_snapshot
from smold.vmm.console import DEFAULT_CONSOLE_LOG_MAX, ConsoleLog
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

log = logging.getLogger(__name__)

VSOCK_FILE = "vsock.sock"    # the vsock Unix socket in the state dir (the daemon connects only there)
QUEUE_NOTIFY_OFFSET = 0x50   # virtio 1.2 §4.2.2: QueueNotify register
DEFAULT_CMDLINE = ("console=ttyS0 reboot=k panic=-1 nomodule i8042.noaux i8042.nomux i8042.dumbkbd "
                   "tsc=reliable no_timer_check noreplace-smp cryptomgr.notests rcupdate.rcu_expedited=1 "
                   "random.trust_cpu=on quiet loglevel=4")


DEFAULT_NET_GUEST = "172.16.0.2/30"
DEFAULT_NET_GATEWAY = "172.16.0.1"


class MachineError(Exception):
    """A configuration the VMM cannot build, or a failure while building the VM."""


@dataclass(frozen=True)
class NetConfig:
    """The guest's NIC: a TAP the caller created in the VMM's network namespace, and the addresses the guest's
    init configures from the kernel command line (``smol.net=<guest cidr>,<gateway>,<dns>``; docs/networking.md).
    """

    tap: str
    mac: str = DEFAULT_MAC
    guest: str = DEFAULT_NET_GUEST
    gateway: str = DEFAULT_NET_GATEWAY
    dns: str | None = None    # default: the gateway

    def validate(self) -> None:
        try:
            parse_mac(self.mac)
        except NetError as e:
            raise MachineError(f"--net-mac: {e}") from None
        try:
            guest = ipaddress.IPv4Interface(self.guest)
            gateway = ipaddress.IPv4Address(self.gateway)
            ipaddress.IPv4Address(self.dns_address)
        except ValueError as e:
            raise MachineError(f"network addresses: {e}") from None
        if "/" not in self.guest:
            raise MachineError(f"--net-guest {self.guest}: give the prefix length too (e.g. 172.16.0.2/30)")
        net = guest.network
        if net.prefixlen <= 30 and guest.ip in (net.network_address, net.broadcast_address):
            raise MachineError(f"--net-guest {self.guest} is the network's network or broadcast address")
        if gateway not in net or gateway == guest.ip:
            raise MachineError(f"--net-gateway {gateway} must be another address in {net}")

    @property
    def dns_address(self) -> str:
        return self.dns if self.dns is not None else self.gateway

    def cmdline_arg(self) -> str:
        return f"smol.net={self.guest},{self.gateway},{self.dns_address}"


@dataclass(frozen=True)
class MachineConfig:
    kernel: Path | None       # None only when restoring
    state_dir: Path
    initramfs: Path | None = None
    rootfs: Path | None = None
    rootfs_read_only: bool = True
    cpus: int = 2
    memory_mib: int = 512
    cpu_template: str = "auto"
    cmdline: str = DEFAULT_CMDLINE
    cmdline_extra: str = ""
    vsock_cid: int = 3
    hostname: str = "smol"
    console_log: Path | None = None
    console_stream: Callable[[bytes], None] | None = None
    console_log_max: int = DEFAULT_CONSOLE_LOG_MAX   # bytes per file; one rotated file is kept (console.py)
    restore_from: Path | None = None   # a snapshot directory: restore it instead of booting
    net: NetConfig | None = None       # None: no NIC at all (the guest has only lo)

    def validate(self) -> None:
        if self.net is not None:
            self.net.validate()
        if not 1 <= self.cpus <= 64:
            raise MachineError(f"cpus={self.cpus}: must be between 1 and 64")
        if self.console_log_max < 4096:
            raise MachineError(f"console log cap of {self.console_log_max} bytes: at least 4096")
        if self.memory_mib < 64:
            raise MachineError(f"memory={self.memory_mib} MiB: at least 64 MiB is needed")
        if self.memory_mib % 2:
            raise MachineError(f"memory={self.memory_mib} MiB: must be a multiple of 2 MiB")
        if self.vsock_cid < 3 or self.vsock_cid > 0xFFFFFFFF:
            raise MachineError(f"vsock cid {self.vsock_cid}: guest CIDs start at 3")
        if self.kernel is None and self.restore_from is None:
            raise MachineError("a kernel is needed to boot (or a snapshot to restore)")
        for name, path in (("kernel", self.kernel), ("initramfs", self.initramfs), ("rootfs", self.rootfs)):
            if path is not None and not Path(path).is_file():
                raise MachineError(f"{name} {path} does not exist or is not a file")

    @classmethod
    def for_restore(cls, snapshot_dir: Path, state_dir: Path, snap: VmSnapshot, *, rootfs: Path | None = None,
                    vsock_cid: int | None = None, hostname: str | None = None,
                    console_log: Path | None = None,
                    console_stream: Callable[[bytes], None] | None = None,
                    net_tap: str | None = None) -> MachineConfig:
        """The configuration that rebuilds ``snap``'s machine; CID, hostname and disk path may change.

        ``net_tap`` re-attaches the NIC to that TAP (each clone gets its own); the MAC and the guest's
        addresses are the snapshot's, already configured inside the guest."""
        spec = snap.spec
        disk = rootfs if rootfs is not None else (Path(spec.rootfs.path) if spec.rootfs else None)
        return cls(kernel=None, state_dir=state_dir, rootfs=disk, rootfs_read_only=True, cpus=spec.cpus,
                   memory_mib=spec.memory_mib, cpu_template=spec.cpu_template, cmdline=spec.kernel_cmdline,
                   vsock_cid=spec.vsock_cid if vsock_cid is None else vsock_cid,
                   hostname=spec.hostname if hostname is None else hostname, console_log=console_log,
                   console_stream=console_stream, restore_from=Path(snapshot_dir),
                   net=NetConfig(tap=net_tap) if net_tap is not None else None)


@dataclass(frozen=True)
class SnapshotResult:
    """What ``Machine.snapshot`` wrote and how long each step took (seconds)."""

    directory: Path
    state_bytes: int
    memory_bytes: int          # guest RAM size
    memory_written: int        # non-zero chunks written (the rest of the file is holes)
    timings: dict[str, float]


@dataclass
class MachineExit:
    """How the VM ended."""

    kind: str             # "poweroff" (guest reset/poweroff), "stopped" (host asked), "error", "crash"
    detail: str = ""
    vcpu_exits: list[VcpuExit] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.kind in ("poweroff", "stopped")


class Machine:
    """One microVM. Build with the constructor, then ``await run()`` until the guest ends."""

    def __init__(self, config: MachineConfig, *, snapshot: VmSnapshot | None = None) -> None:
        """Boot ``config``'s kernel, or restore ``config.restore_from`` (``snapshot``: its state, if
        already read)."""
        config.validate()
        self.config = config
        self.restored = config.restore_from is not None
        self.timings: dict[str, float] = {}
        self.threads: list[VcpuThread] = []
        self._snapshot_lock = asyncio.Lock()
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.vsock_path = self.state_dir / VSOCK_FILE
        self._closers: list[Callable[[], None]] = []
        self._exit: MachineExit | None = None
        self._exit_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self.started_at = 0.0
        try:
            if config.restore_from is not None:
                t0 = time.monotonic()
                try:
                    snap = snapshot if snapshot is not None else read_snapshot(config.restore_from)
                except SnapshotError as e:
                    raise MachineError(f"cannot restore {config.restore_from}: {e}") from e
                self.timings["read_state"] = time.monotonic() - t0
                self._snapshot_state: VmSnapshot | None = snap
                self.restored_spec: MachineSpec | None = snap.spec
            else:
                self._snapshot_state = None
                self.restored_spec = None
            self._build()
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.config
        self.kvm = Kvm()
        self._closers.append(self.kvm.close)
        self.vm = self.kvm.create_vm()
        self._closers.append(self.vm.close)
        self.vm.set_tss_addr(TSS_ADDR)
        self.vm.set_identity_map_addr(IDENTITY_MAP_ADDR)
        self.vm.create_irqchip()
        self.vm.create_pit2()

        layout = RamLayout.for_size(cfg.memory_mib * MiB)
        self.layout = layout
        snap = self._snapshot_state
        if snap is None:
            self.mem = GuestMemory(list(layout.regions))
        else:
            self._check_restorable(snap)
            assert cfg.restore_from is not None
            try:
                self.mem = GuestMemory.from_file(memory_path(cfg.restore_from, snap), list(layout.regions))
            except GuestMemoryError as e:
                raise MachineError(f"cannot map the snapshot's memory: {e}") from e
        self._closers.append(self.mem.close)
        for region in self.mem.regions:
            self.vm.set_user_memory_region(region.guest_addr, region.size, self.mem.host_address(region))

        self.pio = Bus("pio")
        self.mmio = Bus("mmio")
        self.console = ConsoleLog(cfg.console_log, cfg.console_stream, cfg.console_log_max)
        self._closers.append(self.console.close)
        serial_irq = self._irq(SERIAL_COM1_IRQ)
        self.serial = Serial(serial_irq, self.console)
        self.pio.insert(SERIAL_COM1_PORT, 8, self.serial)
        self.i8042 = I8042(self._on_guest_reset)
        self.pio.insert(I8042_PORT, 5, self.i8042)
        self.cmos = Cmos()
        self.pio.insert(CMOS_PORT, 2, self.cmos)

        self.template: CpuTemplate = resolve_template(cfg.cpu_template, is_pvm())
        self.transports: list[MmioTransport] = []
        self.virtio_cmdline: list[str] = []
        self._notify_fds: list[tuple[int, MmioTransport, int]] = []
        self.block: Block | None = None
        if cfg.rootfs is not None:
            backend = FileBackend(cfg.rootfs, read_only=cfg.rootfs_read_only)
            self._closers.append(backend.close)
            self.block = Block(backend, read_only=cfg.rootfs_read_only, serial=b"smol-root")
            self._add_virtio(self.block)
        self.vsock = Vsock(guest_cid=cfg.vsock_cid)
        self._add_virtio(self.vsock)
        self.rng = Rng()
        self._add_virtio(self.rng)
        self.net: Net | None = None
        self.net_backend: TapBackend | None = None
        if cfg.net is not None:  # last, so machines without a NIC keep their slot layout
            try:
                self.net_backend = TapBackend(cfg.net.tap)
            except NetBackendError as e:
                raise MachineError(f"--net-tap: {e}") from e
            self._closers.append(self.net_backend.close)
            self.net = Net(cfg.net.mac, self.net_backend)
            self._add_virtio(self.net)
        self.vcpus: list[Vcpu] = []
        self._cpuid: list[list[KvmCpuidEntry2]] = []
        self._msr_indices: list[int] = []
        self._xsave, self._xcrs = kvmstate.host_caps(self.kvm)
        if snap is not None:
            self._restore(snap)
            return

        kernel = self._load_kernel()
        supported = self.kvm.supported_cpuid()
        for i in range(cfg.cpus):
            vcpu = self.vm.create_vcpu(i)
            table = build_cpuid(supported, self.template, i, cfg.cpus)
            self._cpuid.append(table)
            vcpu.set_cpuid(table)
            bootcpu.setup_boot_msrs(vcpu)
            bootcpu.setup_lapic_lints(vcpu)
            if i == 0:
                bootcpu.setup_long_mode(vcpu, self.mem, entry=kernel.entry, rsi=ZERO_PAGE_ADDR)
            self.vcpus.append(vcpu)
        # After the vCPUs exist: the compat template's command line carries the vCPU TSC rate.
        self._write_boot_data(kernel)

    # -- restore --------------------------------------------------------------------------------------
    def _check_restorable(self, snap: VmSnapshot) -> None:
        cfg, spec = self.config, snap.spec
        if (cfg.cpus, cfg.memory_mib) != (spec.cpus, spec.memory_mib):
            raise MachineError(f"snapshot is of a {spec.cpus}-vCPU {spec.memory_mib} MiB machine, the "
                               f"configuration asks for {cfg.cpus} vCPUs and {cfg.memory_mib} MiB")
        layout = tuple((r.guest_addr, r.size) for r in snap.memory.regions)
        if layout != tuple(self.layout.regions):
            raise MachineError("snapshot memory regions do not match this VMM's RAM layout")
        if snap.host.pvm != is_pvm():
            raise MachineError(f"snapshot taken on a {'PVM' if snap.host.pvm else 'hardware'} KVM host; "
                               f"this host is {'PVM' if is_pvm() else 'hardware'} KVM")
        snap_net = any(isinstance(v.device, NetState) for v in snap.devices.virtio)
        if snap_net and cfg.net is None:
            raise MachineError("the snapshot has a network interface: restore it with --net-tap")
        if cfg.net is not None and not snap_net:
            raise MachineError("the snapshot has no network interface: restore it without --net-tap")
        if (spec.rootfs is None) != (cfg.rootfs is None):
            raise MachineError("snapshot and configuration disagree on whether there is a root disk")
        if spec.rootfs is not None and cfg.rootfs is not None:
            try:
                st = Path(cfg.rootfs).stat()
            except OSError as e:
                raise MachineError(f"root disk {cfg.rootfs}: {e.strerror}") from e
            if st.st_size != spec.rootfs.size:
                raise MachineError(f"root disk {cfg.rootfs} is {st.st_size} bytes; the snapshot was taken "
                                   f"with a {spec.rootfs.size}-byte disk")
            if st.st_mtime_ns != spec.rootfs.mtime_ns:
                log.warning("root disk %s was modified after the snapshot was taken (mtime differs)", cfg.rootfs)

    def _restore(self, snap: VmSnapshot) -> None:
        """Load ``snap`` into the freshly built VM: irqchip/PIT, vCPUs, then devices (which may interrupt)."""
        t0 = time.monotonic()
        self.template = CpuTemplate(snap.spec.cpu_template)
        try:
            kvmstate.restore_vm(self.vm, snap.vm)
            host_khz = 0
            for state in snap.vcpus:
                vcpu = self.vm.create_vcpu(state.index)
                self.vcpus.append(vcpu)
                self._cpuid.append(kvmstate.cpuid_entries(state))
                host_khz = host_khz or vcpu.get_tsc_khz()
                if state.tsc_khz and host_khz and abs(state.tsc_khz - host_khz) > host_khz // 1000:
                    try:
                        vcpu.set_tsc_khz(state.tsc_khz)
                    except KvmError as e:
                        raise SnapshotCompatError(f"snapshot TSC runs at {state.tsc_khz} kHz, this host's at "
                                                  f"{host_khz} kHz and KVM cannot scale it ({e})") from e
                kvmstate.restore_vcpu(vcpu, state, xsave=self._xsave, xcrs=self._xcrs)
            self._restore_devices(snap)
        except SnapshotError as e:
            raise MachineError(f"cannot restore {self.config.restore_from}: {e}") from e
        self.timings["restore_state"] = time.monotonic() - t0

    def _restore_devices(self, snap: VmSnapshot) -> None:
        dev = snap.devices
        self.serial.restore(dev.serial)
        if len(dev.cmos.nvram) != len(self.cmos.nvram):
            raise SnapshotCompatError(f"CMOS NVRAM of {len(dev.cmos.nvram)} bytes, expected {len(self.cmos.nvram)}")
        self.cmos.index = dev.cmos.index & 0x7F
        self.cmos.nvram[:] = dev.cmos.nvram
        self.i8042.resets = dev.i8042.resets
        kinds = [type(t.device).__name__ for t in self.transports]
        saved = [type(v.device).__name__.removesuffix("State") for v in dev.virtio]
        if kinds != saved or [v.slot for v in dev.virtio] != list(range(len(dev.virtio))):
            raise SnapshotCompatError(f"snapshot virtio devices {saved} do not match this machine's {kinds}")
        for transport, slot in zip(self.transports, dev.virtio, strict=True):
            device = transport.device
            if isinstance(device, (Block, Vsock, Rng, Net)):
                device.restore(slot.device)  # type: ignore[arg-type]  # kinds were checked above
            transport.restore(slot.mmio)
        if self.vsock.guest_cid != self.config.vsock_cid:
            # The transport reset queued by the restore makes the guest re-read guest_cid (virtio 1.2
            # §5.10.6.7), so a restored copy can take a new CID.
            self.vsock.guest_cid = self.config.vsock_cid

    def _kick_after_restore(self) -> None:
        """Pick up work the guest queued before the snapshot and re-raise interrupts it had not taken:
        notifications and irqfd injections in flight at pause time are not part of any state."""
        with self.mmio.lock:
            for transport in self.transports:
                for q in range(len(transport.queues)):
                    transport.notify(q)
                if transport.interrupt_status:
                    transport.irq.trigger()
        st = self.serial.save()
        if (st.ier & 0x02 and st.thre_pending) or (st.ier & 0x01 and st.rx):
            self.serial.irq.trigger()

    def _irq(self, gsi: int) -> EventFdIrq:
        irq = EventFdIrq(gsi)
        self._closers.append(irq.close)
        self.vm.register_irqfd(irq.fd, gsi)
        return irq

    def _add_virtio(self, device: VirtioDevice) -> None:
        base, irq_no = virtio_mmio_slot(len(self.transports))
        transport = MmioTransport(device, self.mem, self._irq(irq_no))
        self.mmio.insert(base, VIRTIO_MMIO_SIZE, transport)
        self.transports.append(transport)
        self.virtio_cmdline.append(kernel_cmdline_arg(base, irq_no))
        for q in range(len(device.queue_max_sizes)):
            fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._closers.append(functools.partial(os.close, fd))
            self.vm.register_ioeventfd(IoEventFdSpec(base + QUEUE_NOTIFY_OFFSET, 4, fd, datamatch=q, pio=False))
            self._notify_fds.append((fd, transport, q))

    def _load_kernel(self) -> LoadedKernel:
        if self.config.kernel is None:
            raise MachineError("no kernel to boot")
        try:
            image = Path(self.config.kernel).read_bytes()
        except OSError as e:
            raise MachineError(f"cannot read kernel {self.config.kernel}: {e.strerror}") from e
        try:
            return load_kernel(self.mem, image)
        except KernelLoadError as e:
            raise MachineError(f"kernel {self.config.kernel}: {e}") from e

    def kernel_cmdline(self) -> str:
        cfg = self.config
        tsc_khz = self.vcpus[0].get_tsc_khz() if self.vcpus else None
        parts = [cfg.cmdline, template_cmdline(self.template, tsc_khz, cfg.cpus), *self.virtio_cmdline]
        if cfg.hostname:
            parts.append(f"smol.hostname={cfg.hostname}")
        if cfg.net is not None:
            parts.append(cfg.net.cmdline_arg())
        if cfg.cmdline_extra:
            parts.append(cfg.cmdline_extra)
        return " ".join(p for p in parts if p)

    def _write_boot_data(self, kernel: LoadedKernel) -> None:
        cmdline = self.kernel_cmdline().encode() + b"\x00"
        if len(cmdline) > CMDLINE_MAX:
            raise MachineError(f"kernel command line is {len(cmdline)} bytes, limit {CMDLINE_MAX}")
        self.mem.write(CMDLINE_ADDR, cmdline)
        initrd = None
        if self.config.initramfs is not None:
            data = Path(self.config.initramfs).read_bytes()
            top = min(self.layout.low_end, initrd_addr_max(kernel) + 1)
            addr = (top - len(data)) & ~0xFFF
            if addr < kernel.end:
                raise MachineError(f"initramfs of {len(data)} bytes does not fit above the kernel "
                                   f"in {self.config.memory_mib} MiB")
            self.mem.write(addr, data)
            initrd = (addr, len(data))
        zero_page = build_boot_params(kernel, cmdline_addr=CMDLINE_ADDR, cmdline_len=len(cmdline) - 1,
                                      e820=self.layout.e820(), initrd=initrd)
        self.mem.write(ZERO_PAGE_ADDR, zero_page)
        self.mem.write(EBDA_START, build_mptable(EBDA_START, self.config.cpus))

    # -- running --------------------------------------------------------------------------------------
    def _finish(self, outcome: MachineExit) -> None:
        """Record the first reason the VM ends and wake the loop (callable from any thread)."""
        with self._exit_lock:
            if self._exit is None:
                self._exit = outcome
        loop, done = self._loop, self._done
        if loop is not None and done is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set)

    def _on_guest_reset(self) -> None:
        self._finish(self._classify_reset())

    # The guest reboots (reboot=k, panic=-1) both when asked to power off and when it fails: tell them
    # apart by the last thing the console said.
    _CRASH_MARKERS = (b"Kernel panic - not syncing", b"smol-init: FATAL")

    def _classify_reset(self) -> MachineExit:
        tail = bytes(self.console.tail[-8192:])
        for marker in self._CRASH_MARKERS:
            at = tail.rfind(marker)
            if at >= 0:
                line = tail[at:].split(b"\n", 1)[0].decode("utf-8", "replace").strip()
                return MachineExit("crash", f"guest failed: {line}")
        return MachineExit("poweroff", "guest reset through the i8042 controller")

    def _on_vcpu_exit(self, e: VcpuExit) -> None:
        if e.kind != "stopped":
            log.info("vcpu%d ended %.3f s after the vCPUs started: %s %s", e.vcpu,
                     time.monotonic() - (self.started_at or time.monotonic()), e.kind, e.detail)
        kind = {"stopped": "stopped", "reset": "poweroff", "shutdown": "poweroff"}.get(e.kind, e.kind)
        self._finish(MachineExit(kind, f"vcpu{e.vcpu}: {e.detail}" if e.detail else f"vcpu{e.vcpu} {e.kind}"))

    def _on_notify(self, fd: int, transport: MmioTransport, queue: int) -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            return
        with self.mmio.lock:
            transport.notify(queue)

    def _on_tap_readable(self) -> None:
        if self.net is not None:
            with self.mmio.lock:
                self.net.backend_readable()

    def stop(self, reason: str = "stopped by the host") -> None:
        self._finish(MachineExit("stopped", reason))

    @property
    def exit(self) -> MachineExit | None:
        """The first reason the VM ended, as soon as it is known (before its vCPUs and devices are stopped)."""
        return self._exit

    async def wait_ended(self) -> MachineExit:
        """Until the first reason the VM ends is known (``run`` then stops the vCPUs and devices)."""
        if self._done is None:
            raise MachineError("the machine is not running")
        await self._done.wait()
        assert self._exit is not None
        return self._exit

    def describe_fault(self, vcpu: Vcpu) -> str:
        regs = vcpu.get_regs()
        sregs = vcpu.get_sregs()
        text = f"rip={regs.rip:#x} rsp={regs.rsp:#x} cr0={sregs.cr0:#x} cr3={sregs.cr3:#x} cs.l={sregs.cs.l}"
        if self.mem.contains(regs.rip, 16):
            text += f" code@rip={self.mem.read(regs.rip, 16).hex()}"
        return text

    async def run(self, on_started: Callable[[], None] | None = None,
                  before_vcpus: Callable[[], None] | None = None) -> MachineExit:
        """Start the devices and vCPUs; return when the guest powers off, faults, or ``stop`` is called.

        ``before_vcpus`` runs once every fd is open and before any vCPU runs guest code (the seccomp filter,
        smold/jail/seccomp.py); if it raises, no vCPU starts and the machine ends with an error."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._done = asyncio.Event()
        self.vsock_backend = VsockBackend(self.vsock, str(self.vsock_path), loop=loop, lock=self.mmio.lock)
        await self.vsock_backend.start()
        if self.net_backend is not None:
            self.net_backend.start(loop, self._on_tap_readable)
        for fd, transport, queue in self._notify_fds:
            loop.add_reader(fd, self._on_notify, fd, transport, queue)
        install_kick_handler()
        if before_vcpus is not None:
            try:
                before_vcpus()
            except Exception as e:
                self._finish(MachineExit("error", f"cannot confine the VMM before its vCPUs run: {e}"))
        self.threads = [] if self._exit is not None else [
            VcpuThread(v, self.pio, self.mmio, self._on_vcpu_exit, describe_fault=self.describe_fault)
            for v in self.vcpus]
        if self._snapshot_state is not None:
            self._kick_after_restore()
            try:
                # Last, so the guest's clocks lose no more than the moment until its vCPUs run.
                kvmstate.restore_clock(self.vm, self._snapshot_state.vm)
            except SnapshotError as e:
                self._finish(MachineExit("error", f"restore: {e}"))
            for v in self.vcpus:
                with contextlib.suppress(SnapshotError):
                    kvmstate.mark_guest_stopped(v)
            self._snapshot_state = None   # the state is loaded; let it be freed
        self.started_at = time.monotonic()
        for t in self.threads:
            t.start()
        if on_started is not None:
            on_started()
        try:
            if self._exit is None:
                await self._done.wait()
        finally:
            await self._shutdown()
        assert self._exit is not None
        return self._exit

    async def _shutdown(self) -> None:
        t0 = time.monotonic()
        for t in self.threads:
            t.stop()
        for t in self.threads:
            await asyncio.to_thread(t.join, 5)
            if t.is_alive():
                log.warning("vcpu%d did not stop within 5 s of the request (stuck in KVM_RUN?)", t.vcpu.index)
        loop = asyncio.get_running_loop()
        for fd, _t, _q in self._notify_fds:
            loop.remove_reader(fd)
        if self.net_backend is not None:
            self.net_backend.stop()
        await self.vsock_backend.close()
        took = time.monotonic() - t0
        if took > 2:
            log.warning("stopping the devices and vCPUs took %.1f s", took)

    # -- pause, resume, snapshot ---------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return bool(self.threads) and all(t.paused.is_set() for t in self.threads)

    async def pause(self, timeout: float = 10.0) -> None:
        """Park every vCPU thread outside KVM_RUN at an instruction boundary (I/O exits completed)."""
        if not self.threads:
            raise MachineError("the machine is not running")
        for t in self.threads:
            t.pause()
        deadline = time.monotonic() + timeout
        while not all(t.paused.is_set() or not t.is_alive() for t in self.threads):
            if time.monotonic() > deadline:
                self.resume()
                raise MachineError(f"vCPUs did not pause within {timeout}s")
            await asyncio.sleep(0.001)
        if not all(t.is_alive() for t in self.threads):
            raise MachineError("a vCPU thread ended while pausing")

    def resume(self) -> None:
        for t in self.threads:
            t.resume()

    def capture(self) -> VmSnapshot:
        """The state of a paused machine; its ``memory`` is a placeholder until the memory file is written."""
        if not self.paused:
            raise MachineError("capture needs a paused machine")
        cfg = self.config
        if self.block is not None and not self.block.read_only:
            raise SnapshotError("a machine with a writable root disk cannot be snapshotted: the disk's "
                                "contents are not part of the snapshot")
        if not self._msr_indices:
            self._msr_indices = kvmstate.saveable_msrs(self.kvm, self.vcpus[0])
        now_ns = time.time_ns()
        vcpus = tuple(kvmstate.capture_vcpu(v, self._cpuid[i], self._msr_indices, xsave=self._xsave,
                                            xcrs=self._xcrs) for i, v in enumerate(self.vcpus))
        vm_state = kvmstate.capture_vm(self.vm)
        with self.mmio.lock:
            slots = []
            for i, transport in enumerate(self.transports):
                device = transport.device
                if not isinstance(device, (Block, Vsock, Rng, Net)):
                    raise SnapshotError(f"virtio device {type(device).__name__} has no snapshot support")
                slots.append(VirtioSlotState(slot=i, mmio=transport.save(), device=device.save()))
            devices = DevicesState(serial=self.serial.save(),
                                   cmos=CmosState(index=self.cmos.index, nvram=bytes(self.cmos.nvram)),
                                   i8042=I8042State(resets=self.i8042.resets), virtio=tuple(slots))
        disk = None
        if cfg.rootfs is not None:
            st = Path(cfg.rootfs).stat()
            disk = DiskRef(path=str(Path(cfg.rootfs).resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns,
                           read_only=True)
        spec = MachineSpec(cpus=cfg.cpus, memory_mib=cfg.memory_mib, cpu_template=self.template.value,
                           vsock_cid=self.vsock.guest_cid, hostname=cfg.hostname, kernel_cmdline=cfg.cmdline,
                           rootfs=disk)
        host = HostInfo(pvm=is_pvm(), kernel=os.uname().release, tsc_khz=vcpus[0].tsc_khz)
        return VmSnapshot(kind=STATE_KIND, spec=spec, host=host, created_unix_ns=now_ns, vm=vm_state,
                          vcpus=vcpus, devices=devices, memory=MemoryState(file="", size=0, regions=(), sha256=None))

    async def snapshot(self, directory: Path, *, resume: bool = True, digest: bool = False,
                       durable: bool = False) -> SnapshotResult:
        """Pause, write state + memory to ``directory`` (docs/snapshot.md), then resume unless told not to.

        Runs on the event loop thread, which also runs every device, so no device can change guest
        memory or its own state while the files are written.
        """
        async with self._snapshot_lock:
            directory = Path(directory)
            t0 = time.monotonic()
            await self.pause()
            t_paused = time.monotonic()
            try:
                state = self.capture()
                t_state = time.monotonic()
                parts: dict[str, float] = {}
                size, mem = write_snapshot(directory, self.mem, state, digest=digest, durable=durable,
                                           timings=parts)
                t_end = time.monotonic()
            finally:
                if resume:
                    self.resume()
            timings = {"pause": t_paused - t0, "capture": t_state - t_paused, "memory": parts["memory"],
                       "state": parts["state"], "total": t_end - t0}
            log.info("snapshot %s: %s", directory, timings)
            return SnapshotResult(directory, size, self.mem.size, mem.bytes_written, timings)

    def console_tail(self, limit: int = 4096) -> str:
        return bytes(self.console.tail[-limit:]).decode("utf-8", "replace")

    def close(self) -> None:
        """Release every fd and mapping; idempotent."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:  # keep releasing the rest
                log.exception("while closing the machine")
