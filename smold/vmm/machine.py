"""A microVM: guest memory, KVM objects, devices and vCPU threads, driven from one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from smold.devices.rng.device import Rng
from smold.devices.serial import Serial
from smold.devices.virtio.device import VirtioDevice
from smold.devices.virtio.mmio import MmioTransport, kernel_cmdline_arg
from smold.devices.vsock.backend import VsockBackend
from smold.devices.vsock.device import Vsock
from smold.kvm import Kvm, Vcpu, is_pvm
from smold.kvm.api import IoEventFdSpec
from smold.kvm.cpuid import CpuTemplate, build_cpuid, resolve_template, template_cmdline
from smold.memory import GuestMemory
from smold.vmm.vcpu import VcpuExit, VcpuThread, install_kick_handler

log = logging.getLogger(__name__)

QUEUE_NOTIFY_OFFSET = 0x50   # virtio 1.2 §4.2.2: QueueNotify register
DEFAULT_CMDLINE = ("console=ttyS0 reboot=k panic=-1 nomodule i8042.noaux i8042.nomux i8042.dumbkbd "
                   "tsc=reliable no_timer_check noreplace-smp cryptomgr.notests rcupdate.rcu_expedited=1 "
                   "random.trust_cpu=on quiet loglevel=4")


class MachineError(Exception):
    """A configuration the VMM cannot build, or a failure while building the VM."""


@dataclass(frozen=True)
class MachineConfig:
    kernel: Path
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

    def validate(self) -> None:
        if not 1 <= self.cpus <= 64:
            raise MachineError(f"cpus={self.cpus}: must be between 1 and 64")
        if self.memory_mib < 64:
            raise MachineError(f"memory={self.memory_mib} MiB: at least 64 MiB is needed")
        if self.memory_mib % 2:
            raise MachineError(f"memory={self.memory_mib} MiB: must be a multiple of 2 MiB")
        if self.vsock_cid < 3 or self.vsock_cid > 0xFFFFFFFF:
            raise MachineError(f"vsock cid {self.vsock_cid}: guest CIDs start at 3")
        for name, path in (("kernel", self.kernel), ("initramfs", self.initramfs), ("rootfs", self.rootfs)):
            if path is not None and not Path(path).is_file():
                raise MachineError(f"{name} {path} does not exist or is not a file")


@dataclass
class MachineExit:
    """How the VM ended."""

    kind: str             # "poweroff" (guest reset/poweroff), "stopped" (host asked), "error", "crash"
    detail: str = ""
    vcpu_exits: list[VcpuExit] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.kind in ("poweroff", "stopped")


class ConsoleLog:
    """Serial output sink: appends to the console log file and an optional live stream."""

    def __init__(self, path: Path | None, stream: Callable[[bytes], None] | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640) if path else -1
        self._stream = stream
        self.tail = bytearray()

    def __call__(self, data: bytes) -> None:
        if self._fd >= 0:
            os.write(self._fd, data)
        if self._stream is not None:
            self._stream(data)
        self.tail += data
        if len(self.tail) > 65536:
            del self.tail[:-32768]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Machine:
    """One microVM. Build with the constructor, then ``await run()`` until the guest ends."""

    def __init__(self, config: MachineConfig) -> None:
        config.validate()
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.vsock_path = self.state_dir / "vsock.sock"
        self._closers: list[Callable[[], None]] = []
        self._exit: MachineExit | None = None
        self._exit_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self.started_at = 0.0
        try:
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
        self.mem = GuestMemory(list(layout.regions))
        self._closers.append(self.mem.close)
        for region in self.mem.regions:
            self.vm.set_user_memory_region(region.guest_addr, region.size, self.mem.host_address(region))

        self.pio = Bus("pio")
        self.mmio = Bus("mmio")
        self.console = ConsoleLog(cfg.console_log, cfg.console_stream)
        self._closers.append(self.console.close)
        serial_irq = self._irq(SERIAL_COM1_IRQ)
        self.serial = Serial(serial_irq, self.console)
        self.pio.insert(SERIAL_COM1_PORT, 8, self.serial)
        self.i8042 = I8042(self._on_guest_reset)
        self.pio.insert(I8042_PORT, 5, self.i8042)
        self.pio.insert(CMOS_PORT, 2, Cmos())

        self.template: CpuTemplate = resolve_template(cfg.cpu_template, is_pvm())
        self.transports: list[MmioTransport] = []
        self.virtio_cmdline: list[str] = []
        self._notify_fds: list[tuple[int, MmioTransport, int]] = []
        if cfg.rootfs is not None:
            backend = FileBackend(cfg.rootfs, read_only=cfg.rootfs_read_only)
            self._closers.append(backend.close)
            self._add_virtio(Block(backend, read_only=cfg.rootfs_read_only, serial=b"smol-root"))
        self.vsock = Vsock(guest_cid=cfg.vsock_cid)
        self._add_virtio(self.vsock)
        self._add_virtio(Rng())

        kernel = self._load_kernel()
        self._write_boot_data(kernel)
        supported = self.kvm.supported_cpuid()
        self.vcpus: list[Vcpu] = []
        for i in range(cfg.cpus):
            vcpu = self.vm.create_vcpu(i)
            vcpu.set_cpuid(build_cpuid(supported, self.template, i, cfg.cpus))
            bootcpu.setup_boot_msrs(vcpu)
            bootcpu.setup_lapic_lints(vcpu)
            if i == 0:
                bootcpu.setup_long_mode(vcpu, self.mem, entry=kernel.entry, rsi=ZERO_PAGE_ADDR)
            self.vcpus.append(vcpu)

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
        parts = [cfg.cmdline, template_cmdline(self.template), *self.virtio_cmdline]
        if cfg.hostname:
            parts.append(f"smol.hostname={cfg.hostname}")
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
        self._finish(MachineExit("poweroff", "guest reset through the i8042 controller"))

    def _on_vcpu_exit(self, e: VcpuExit) -> None:
        kind = {"stopped": "stopped", "reset": "poweroff", "shutdown": "poweroff"}.get(e.kind, e.kind)
        self._finish(MachineExit(kind, f"vcpu{e.vcpu}: {e.detail}" if e.detail else f"vcpu{e.vcpu} {e.kind}"))

    def _on_notify(self, fd: int, transport: MmioTransport, queue: int) -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            return
        with self.mmio.lock:
            transport.notify(queue)

    def stop(self, reason: str = "stopped by the host") -> None:
        self._finish(MachineExit("stopped", reason))

    def describe_fault(self, vcpu: Vcpu) -> str:
        regs = vcpu.get_regs()
        sregs = vcpu.get_sregs()
        text = f"rip={regs.rip:#x} rsp={regs.rsp:#x} cr0={sregs.cr0:#x} cr3={sregs.cr3:#x} cs.l={sregs.cs.l}"
        if self.mem.contains(regs.rip, 16):
            text += f" code@rip={self.mem.read(regs.rip, 16).hex()}"
        return text

    async def run(self, on_started: Callable[[], None] | None = None) -> MachineExit:
        """Start the devices and vCPUs; return when the guest powers off, faults, or ``stop`` is called."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._done = asyncio.Event()
        self.vsock_backend = VsockBackend(self.vsock, str(self.vsock_path), loop=loop, lock=self.mmio.lock)
        await self.vsock_backend.start()
        for fd, transport, queue in self._notify_fds:
            loop.add_reader(fd, self._on_notify, fd, transport, queue)
        install_kick_handler()
        self.threads = [VcpuThread(v, self.pio, self.mmio, self._on_vcpu_exit, describe_fault=self.describe_fault)
                        for v in self.vcpus]
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
        for t in self.threads:
            t.stop()
        for t in self.threads:
            await asyncio.to_thread(t.join, 5)
        loop = asyncio.get_running_loop()
        for fd, _t, _q in self._notify_fds:
            loop.remove_reader(fd)
        await self.vsock_backend.close()

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
