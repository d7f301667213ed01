"""virtio-mmio transport, modern register layout only (virtio 1.2 section 4.2.2, Version 2)."""

from __future__ import annotations

import logging
import struct
from enum import IntEnum

from smold.devices.irq import IrqLine
from smold.devices.virtio.device import (
    INT_CONFIG_CHANGE,
    INT_USED_RING,
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FAILED,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    InterruptSink,
    VirtioDevice,
)
from smold.devices.virtio.persist import MmioState, PersistError
from smold.devices.virtio.queue import Queue, QueueError
from smold.memory import GuestMemory

log = logging.getLogger(__name__)

MAGIC_VALUE = 0x74726976  # "virt", little-endian (§4.2.2)
VERSION = 2  # modern (non-legacy) interface (§4.2.2)
VENDOR_ID = 0x534D4F4C  # "SMOL"
CONFIG_OFFSET = 0x100  # device-specific configuration space starts here (§4.2.2)
WINDOW_SIZE = 0x200  # registers + config space this transport decodes
MMIO_SIZE = 0x1000  # bus window per device, as announced on the kernel command line
NOTIFY_OFFSET = 0x50  # QueueNotify: the VMM puts an ioeventfd here and calls notify()
_U32 = 0xFFFFFFFF


class Reg(IntEnum):
    """virtio 1.2 §4.2.2, table "MMIO Device Register Layout"."""

    MAGIC_VALUE = 0x000
    VERSION = 0x004
    DEVICE_ID = 0x008
    VENDOR_ID = 0x00C
    DEVICE_FEATURES = 0x010
    DEVICE_FEATURES_SEL = 0x014
    DRIVER_FEATURES = 0x020
    DRIVER_FEATURES_SEL = 0x024
    QUEUE_SEL = 0x030
    QUEUE_NUM_MAX = 0x034
    QUEUE_NUM = 0x038
    QUEUE_READY = 0x044
    QUEUE_NOTIFY = 0x050
    INTERRUPT_STATUS = 0x060
    INTERRUPT_ACK = 0x064
    STATUS = 0x070
    QUEUE_DESC_LOW = 0x080
    QUEUE_DESC_HIGH = 0x084
    QUEUE_DRIVER_LOW = 0x090
    QUEUE_DRIVER_HIGH = 0x094
    QUEUE_DEVICE_LOW = 0x0A0
    QUEUE_DEVICE_HIGH = 0x0A4
    SHM_SEL = 0x0AC
    SHM_LEN_LOW = 0x0B0
    SHM_LEN_HIGH = 0x0B4
    SHM_BASE_LOW = 0x0B8
    SHM_BASE_HIGH = 0x0BC
    QUEUE_RESET = 0x0C0
    CONFIG_GENERATION = 0x0FC


_QUEUE_ADDR_REGS = {
    Reg.QUEUE_DESC_LOW: ("desc_addr", 0), Reg.QUEUE_DESC_HIGH: ("desc_addr", 32),
    Reg.QUEUE_DRIVER_LOW: ("avail_addr", 0), Reg.QUEUE_DRIVER_HIGH: ("avail_addr", 32),
    Reg.QUEUE_DEVICE_LOW: ("used_addr", 0), Reg.QUEUE_DEVICE_HIGH: ("used_addr", 32),
}
# §4.2.2: no shared memory regions; SHMLen/SHMBase read as -1 for a non-existent region.
_SHM_REGS = (Reg.SHM_LEN_LOW, Reg.SHM_LEN_HIGH, Reg.SHM_BASE_LOW, Reg.SHM_BASE_HIGH)


def kernel_cmdline_arg(base: int, irq: int) -> str:
    """Linux virtio-mmio command-line discovery: ``virtio_mmio.device=<size>@<base>:<irq>``."""
    if base < 0 or base % MMIO_SIZE or irq < 0:
        raise ValueError(f"virtio-mmio device at {base:#x} irq {irq}: base must be 4 KiB aligned")
    return f"virtio_mmio.device=4K@{base:#x}:{irq}"


class _Sink(InterruptSink):
    """The InterruptSink handed to the device at activation; stale after a reset (epoch changes)."""

    def __init__(self, transport: MmioTransport, epoch: int) -> None:
        self._transport = transport
        self._epoch = epoch

    def _live(self) -> bool:
        return self._transport._epoch == self._epoch

    def signal_used(self, queue_index: int) -> None:
        if self._live():
            self._transport._signal_used(queue_index)

    def signal_config(self) -> None:
        if self._live():
            self._transport._signal_config()

    def signal_needs_reset(self, reason: str) -> None:
        if self._live():
            self._transport._mark_needs_reset(reason)


class MmioTransport:
    """One virtio-mmio register window (a BusDevice) in front of a VirtioDevice.

    Every guest access goes through ``read``/``write``; ``notify`` is the QueueNotify path the
    VMM's ioeventfd handler calls. Nothing the guest does raises out of these three methods:
    protocol violations are ignored, broken rings set DEVICE_NEEDS_RESET (§2.1.2).
    Callers serialise access (the bus lock).
    """

    def __init__(self, device: VirtioDevice, mem: GuestMemory, irq: IrqLine) -> None:
        self.device = device
        self.mem = mem
        self.irq = irq
        self.queues = [Queue(size) for size in device.queue_max_sizes]
        self.device_features = device.device_features() | VIRTIO_F_VERSION_1
        self.config_generation = 0
        self.internal_errors = 0  # unexpected exceptions caught (device bugs), not guest protocol errors
        self._epoch = 0
        self._clear_registers()

    def _clear_registers(self) -> None:
        self.status = 0
        self.device_features_sel = 0
        self.driver_features = 0
        self.driver_features_sel = 0
        self.driver_features_unoffered = False  # nonzero write to a feature word beyond bit 63
        self.queue_sel = 0
        self.interrupt_status = 0

    # -- BusDevice ------------------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        try:
            if offset >= CONFIG_OFFSET:
                return self._read_config(offset - CONFIG_OFFSET, size)
            # §4.2.2.2: the driver MUST use only 32-bit wide, aligned accesses to the registers.
            if size != 4 or offset % 4:
                return bytes(max(size, 0))
            return struct.pack("<I", self._read_reg(offset) & _U32)
        except Exception as e:  # hostile guest: never raise into the vCPU loop
            self.internal_errors += 1
            log.exception("virtio-mmio read at %#x failed", offset)
            self._mark_needs_reset(f"read at {offset:#x}: {e}")
            return bytes(max(size, 0))

    def write(self, offset: int, data: bytes) -> None:
        try:
            if offset >= CONFIG_OFFSET:
                self._write_config(offset - CONFIG_OFFSET, bytes(data))
            elif len(data) == 4 and offset % 4 == 0:
                self._write_reg(offset, int.from_bytes(data, "little"))
        except Exception as e:
            self.internal_errors += 1
            log.exception("virtio-mmio write at %#x failed", offset)
            self._mark_needs_reset(f"write at {offset:#x}: {e}")

    # -- queue notification ---------------------------------------------------------------------------
    def notify(self, queue_index: int) -> None:
        """QueueNotify (§4.2.2, §4.2.3.3): kick queue ``queue_index``; ignored unless the device runs."""
        if not self._running() or not 0 <= queue_index < len(self.queues):
            return
        if not self.queues[queue_index].ready:
            return
        try:
            self.device.queue_notify(queue_index)
        except QueueError as e:
            self._mark_needs_reset(f"queue {queue_index}: {e}")
        except Exception as e:
            self.internal_errors += 1
            log.exception("virtio device %d failed on queue %d", self.device.device_type, queue_index)
            self._mark_needs_reset(f"queue {queue_index}: {e}")

    def _running(self) -> bool:
        return (self.device.activated and self.status & STATUS_DRIVER_OK != 0
                and not self.status & STATUS_DEVICE_NEEDS_RESET)

    @property
    def needs_reset(self) -> bool:
        return bool(self.status & STATUS_DEVICE_NEEDS_RESET)

    # -- registers ----------------------------------------------------------------------------------
    def _selected_queue(self) -> Queue | None:
        if 0 <= self.queue_sel < len(self.queues):
            return self.queues[self.queue_sel]
        return None

    def _read_reg(self, offset: int) -> int:
        q = self._selected_queue()
        if offset == Reg.MAGIC_VALUE:
            return MAGIC_VALUE
        if offset == Reg.VERSION:
            return VERSION
        if offset == Reg.DEVICE_ID:
            return self.device.device_type
        if offset == Reg.VENDOR_ID:
            return VENDOR_ID
        if offset == Reg.DEVICE_FEATURES:
            # §4.2.2: 32 feature bits selected by DeviceFeaturesSel (0: bits 0-31, 1: bits 32-63, ...).
            sel = self.device_features_sel
            return (self.device_features >> (32 * sel)) & _U32 if sel < 2 else 0
        if offset == Reg.QUEUE_NUM_MAX:
            return q.max_size if q is not None else 0  # 0: queue not available
        if offset == Reg.QUEUE_READY:
            return int(q.ready) if q is not None else 0
        if offset == Reg.INTERRUPT_STATUS:
            return self.interrupt_status
        if offset == Reg.STATUS:
            return self.status
        if offset in _SHM_REGS:
            return _U32
        if offset == Reg.CONFIG_GENERATION:
            return self.config_generation & _U32
        return 0  # write-only and reserved registers

    def _write_reg(self, offset: int, value: int) -> None:
        if offset == Reg.DEVICE_FEATURES_SEL:
            self.device_features_sel = value
        elif offset == Reg.DRIVER_FEATURES:
            self._write_driver_features(value)
        elif offset == Reg.DRIVER_FEATURES_SEL:
            self.driver_features_sel = value
        elif offset == Reg.QUEUE_SEL:
            self.queue_sel = value
        elif offset == Reg.QUEUE_NUM:
            q = self._configurable_queue()
            if q is not None:
                q.size = value  # checked by Queue.validate at DRIVER_OK
        elif offset == Reg.QUEUE_READY:
            self._write_queue_ready(value)
        elif offset in _QUEUE_ADDR_REGS:
            q = self._configurable_queue()
            if q is not None:
                attr, shift = _QUEUE_ADDR_REGS[Reg(offset)]
                old = getattr(q, attr)
                setattr(q, attr, (old & ~(_U32 << shift)) | (value << shift))
        elif offset == Reg.QUEUE_NOTIFY:
            # §4.2.3.3: without VIRTIO_F_NOTIFICATION_DATA the value is the queue index.
            self.notify(value)
        elif offset == Reg.INTERRUPT_ACK:
            self.interrupt_status &= ~value
        elif offset == Reg.STATUS:
            self._write_status(value & 0xFF)
        else:
            log.debug("virtio-mmio: ignored write %#x to %#x", value, offset)

    def _write_driver_features(self, value: int) -> None:
        # §3.1.1: features are negotiated before FEATURES_OK; later writes are ignored.
        if self.status & (STATUS_FEATURES_OK | STATUS_DRIVER_OK):
            return
        sel = self.driver_features_sel
        if sel < 2:
            shift = 32 * sel
            self.driver_features = (self.driver_features & ~(_U32 << shift)) | (value << shift)
        elif value:
            self.driver_features_unoffered = True

    @property
    def acked_features(self) -> int:
        """Driver features masked to what this transport offered."""
        return self.driver_features & self.device_features

    def _features_acceptable(self) -> bool:
        # §2.2.1 / §6.1: the device may refuse FEATURES_OK; we need VERSION_1 and nothing unoffered.
        return (self.driver_features & VIRTIO_F_VERSION_1 != 0
                and not self.driver_features & ~self.device_features
                and not self.driver_features_unoffered)

    def _configurable_queue(self) -> Queue | None:
        # §4.2.3.2: queue layout is written while QueueReady is 0, before DRIVER_OK.
        q = self._selected_queue()
        if q is None or q.ready or self.status & STATUS_DRIVER_OK:
            return None
        return q

    def _write_queue_ready(self, value: int) -> None:
        q = self._selected_queue()
        if q is None:
            return
        if value == 0:
            q.ready = False  # the queue stops being processed; harmless at any time
        elif value == 1 and not self.status & STATUS_DRIVER_OK:
            q.ready = True

    def _write_status(self, value: int) -> None:
        if value == 0:
            self.reset()  # §2.4 / §4.2.3.1: writing 0 resets the device
            return
        old = self.status
        # DEVICE_NEEDS_RESET is device-owned: keep it as it is whatever the driver writes.
        new = (value & ~STATUS_DEVICE_NEEDS_RESET) | (old & STATUS_DEVICE_NEEDS_RESET)
        if old & ~new:
            # §2.1.2: the driver MUST NOT clear a device status bit.
            log.debug("virtio-mmio: status write %#x clears bits of %#x; ignored", value, old)
            return
        if new & STATUS_FEATURES_OK and not old & STATUS_FEATURES_OK:
            # §3.1.1 step 5/6: FEATURES_OK is only latched if the device accepts the features.
            if not new & STATUS_DRIVER or not self._features_acceptable():
                new &= ~STATUS_FEATURES_OK
            else:
                self.device.acked_features = self.acked_features
        if new & STATUS_DRIVER_OK and not old & STATUS_DRIVER_OK:
            if not new & STATUS_FEATURES_OK or new & (STATUS_FAILED | STATUS_DEVICE_NEEDS_RESET):
                new &= ~STATUS_DRIVER_OK
        self.status = new
        if new & STATUS_DRIVER_OK and not old & STATUS_DRIVER_OK:
            self._activate()

    def _activate(self) -> None:
        try:
            for q in self.queues:
                if q.ready:
                    q.validate(self.mem)
            self._epoch += 1
            self.device.activate(self.mem, self.queues, _Sink(self, self._epoch))
        except QueueError as e:
            self._mark_needs_reset(f"activation: {e}")
        except Exception as e:
            self.internal_errors += 1
            log.exception("virtio device %d failed to activate", self.device.device_type)
            self._mark_needs_reset(f"activation: {e}")

    def reset(self) -> None:
        """Device reset (§2.4): device, queues and registers back to their initial state."""
        self._epoch += 1  # sinks handed out before the reset go stale
        try:
            self.device.reset()
        except Exception:
            self.internal_errors += 1
            log.exception("virtio device %d failed to reset", self.device.device_type)
        for q in self.queues:
            q.reset()
        self._clear_registers()

    # -- config space -------------------------------------------------------------------------------
    def _read_config(self, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        data = bytes(self.device.read_config(offset, size))
        return (data + bytes(size))[:size]

    def _write_config(self, offset: int, data: bytes) -> None:
        if data:
            self.device.write_config(offset, data)

    # -- interrupts ---------------------------------------------------------------------------------
    def _raise(self, bit: int) -> None:
        self.interrupt_status |= bit
        try:
            self.irq.trigger()
        except OSError:
            log.exception("virtio-mmio: interrupt trigger failed")

    def _signal_used(self, queue_index: int) -> None:
        if 0 <= queue_index < len(self.queues) and not self.queues[queue_index].needs_interrupt(self.mem):
            return  # §2.7.7: the driver set VIRTQ_AVAIL_F_NO_INTERRUPT
        self._raise(INT_USED_RING)

    def _signal_config(self) -> None:
        self.config_generation = (self.config_generation + 1) & _U32
        self._raise(INT_CONFIG_CHANGE)

    def _mark_needs_reset(self, reason: str) -> None:
        if self.status & STATUS_DEVICE_NEEDS_RESET:
            return
        log.warning("virtio device %d needs reset: %s", self.device.device_type, reason)
        self.status |= STATUS_DEVICE_NEEDS_RESET
        for q in self.queues:
            q.broken = True
        if self.status & STATUS_DRIVER_OK:
            # §2.1.2: with DRIVER_OK set, DEVICE_NEEDS_RESET comes with a config change notification.
            self._signal_config()

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> MmioState:
        return MmioState(
            device_type=self.device.device_type, status=self.status,
            device_features_sel=self.device_features_sel, driver_features=self.driver_features,
            driver_features_sel=self.driver_features_sel,
            driver_features_unoffered=self.driver_features_unoffered, queue_sel=self.queue_sel,
            interrupt_status=self.interrupt_status, config_generation=self.config_generation,
            queues=tuple(q.save() for q in self.queues))

    def restore(self, state: MmioState) -> None:
        """Load registers and queues into a fresh transport; re-activates the device if it was running.

        The device's own state must be restored first. Work the guest queued but the device had not
        taken yet is picked up on the next notification (the VMM may call ``notify`` per queue).
        """
        if state.device_type != self.device.device_type:
            raise PersistError(f"snapshot is of device type {state.device_type}, "
                               f"not {self.device.device_type}")
        if len(state.queues) != len(self.queues):
            raise PersistError(f"snapshot has {len(state.queues)} queues, device has {len(self.queues)}")
        if self.device.activated:
            raise PersistError("restore into a transport whose device is already active")
        self._epoch += 1
        for q, qs in zip(self.queues, state.queues, strict=True):
            q.restore(qs)
        self.status = state.status
        self.device_features_sel = state.device_features_sel
        self.driver_features = state.driver_features
        self.driver_features_sel = state.driver_features_sel
        self.driver_features_unoffered = state.driver_features_unoffered
        self.queue_sel = state.queue_sel
        self.interrupt_status = state.interrupt_status
        self.config_generation = state.config_generation
        if self.status & STATUS_FEATURES_OK:
            self.device.acked_features = self.acked_features
        # Queue sizes and addresses are guest-written values: _activate validates the ready ones.
        if self.status & STATUS_DEVICE_NEEDS_RESET:
            for q in self.queues:
                q.broken = True
        elif self.status & STATUS_DRIVER_OK:
            self._activate()
