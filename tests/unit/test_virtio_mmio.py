"""virtio-mmio transport: registers, negotiation, queue setup, interrupts and reset (virtio 1.2 §4.2.2)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from virtio_driver import DriverError, VirtioDriver

from smold.devices.bus import Bus
from smold.devices.irq import CountingIrq
from smold.devices.virtio.device import (
    INT_CONFIG_CHANGE,
    INT_USED_RING,
    STATUS_ACKNOWLEDGE,
    STATUS_DEVICE_NEEDS_RESET,
    STATUS_DRIVER,
    STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
    VIRTIO_F_VERSION_1,
    InterruptSink,
    VirtioDevice,
)
from smold.devices.virtio.mmio import (
    MAGIC_VALUE,
    MMIO_SIZE,
    NOTIFY_OFFSET,
    VENDOR_ID,
    MmioTransport,
    Reg,
    kernel_cmdline_arg,
)
from smold.devices.virtio.queue import VIRTQ_AVAIL_F_NO_INTERRUPT, Queue, QueueError
from smold.memory import GuestMemory

FEATURE_A = 1 << 0
FEATURE_HIGH = 1 << 40


class FakeDevice(VirtioDevice):
    """Two queues; completes every chain with its writable length and records what happened."""

    device_type = 42
    queue_max_sizes: tuple[int, ...] = (16, 8)

    def __init__(self) -> None:
        super().__init__()
        self.config = bytearray(b"\x01\x02\x03\x04\x05\x06\x07\x08")
        self.notified: list[int] = []
        self.activations = 0
        self.resets = 0
        self.fail_with: Exception | None = None

    def device_features(self) -> int:
        return FEATURE_A | FEATURE_HIGH

    def config_space(self) -> bytes:
        return bytes(self.config)

    def write_config(self, offset: int, data: bytes) -> None:
        self.config[offset:offset + len(data)] = data
        del self.config[8:]

    def on_activate(self) -> None:
        self.activations += 1

    def on_reset(self) -> None:
        self.resets += 1

    def queue_notify(self, index: int) -> None:
        self.notified.append(index)
        if self.fail_with is not None:
            raise self.fail_with
        assert self.mem is not None and self.interrupt is not None
        q = self.queues[index]
        while (chain := q.pop(self.mem)) is not None:
            q.add_used(self.mem, chain.head, chain.writable_len)
            self.interrupt.signal_used(index)


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 1 << 20)]) as m:
        yield m


@pytest.fixture
def irq() -> CountingIrq:
    return CountingIrq()


@pytest.fixture
def dev() -> FakeDevice:
    return FakeDevice()


@pytest.fixture
def transport(dev: FakeDevice, mem: GuestMemory, irq: CountingIrq) -> MmioTransport:
    return MmioTransport(dev, mem, irq)


@pytest.fixture
def drv(transport: MmioTransport, mem: GuestMemory) -> VirtioDriver:
    return VirtioDriver(transport, mem)


def test_identification_registers(drv: VirtioDriver) -> None:
    assert drv.read32(Reg.MAGIC_VALUE) == MAGIC_VALUE == 0x74726976
    assert drv.transport.read(0, 4) == b"virt"
    assert drv.read32(Reg.VERSION) == 2
    assert drv.read32(Reg.DEVICE_ID) == 42
    assert drv.read32(Reg.VENDOR_ID) == VENDOR_ID
    assert drv.read32(Reg.SHM_LEN_LOW) == drv.read32(Reg.SHM_LEN_HIGH) == 0xFFFFFFFF  # no SHM region


def test_offered_features_include_version_1(drv: VirtioDriver) -> None:
    assert drv.device_features() == FEATURE_A | FEATURE_HIGH | VIRTIO_F_VERSION_1
    drv.write32(Reg.DEVICE_FEATURES_SEL, 2)
    assert drv.read32(Reg.DEVICE_FEATURES) == 0
    drv.write32(Reg.DEVICE_FEATURES_SEL, 0xFFFFFFFF)
    assert drv.read32(Reg.DEVICE_FEATURES) == 0


def test_full_negotiation(drv: VirtioDriver, dev: FakeDevice, transport: MmioTransport) -> None:
    queues = drv.negotiate(VIRTIO_F_VERSION_1 | FEATURE_HIGH)
    assert [q.index for q in queues] == [0, 1]
    assert [q.size for q in queues] == [16, 8]
    assert drv.status == STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK
    assert dev.activated and dev.activations == 1
    assert dev.acked_features == VIRTIO_F_VERSION_1 | FEATURE_HIGH
    assert dev.queues is transport.queues
    q0 = transport.queues[0]
    assert (q0.desc_addr, q0.avail_addr, q0.used_addr) == (queues[0].desc_addr, queues[0].avail_addr,
                                                           queues[0].used_addr)
    assert q0.ready and q0.size == 16


def test_queue_setup_with_smaller_size(drv: VirtioDriver, transport: MmioTransport) -> None:
    drv.negotiate(sizes={0: 4})
    assert transport.queues[0].size == 4
    used, _ = drv.request(0, writable=[10])
    assert used.length == 10


def test_features_ok_rejected_without_version_1(drv: VirtioDriver, dev: FakeDevice) -> None:
    assert not drv.negotiate_features(FEATURE_A, check=False)
    assert not drv.status & STATUS_FEATURES_OK
    drv.add_status(STATUS_DRIVER_OK)
    assert not drv.status & STATUS_DRIVER_OK and not dev.activated


def test_features_ok_rejected_for_unoffered_bits(drv: VirtioDriver) -> None:
    assert not drv.negotiate_features(VIRTIO_F_VERSION_1 | (1 << 7), check=False)
    assert drv.negotiate_features(VIRTIO_F_VERSION_1 | FEATURE_A)


def test_features_ok_rejected_for_bits_beyond_64(drv: VirtioDriver) -> None:
    drv.reset()
    drv.add_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER)
    drv.write_driver_features(VIRTIO_F_VERSION_1)
    drv.write32(Reg.DRIVER_FEATURES_SEL, 5)
    drv.write32(Reg.DRIVER_FEATURES, 1)
    drv.add_status(STATUS_FEATURES_OK)
    assert not drv.status & STATUS_FEATURES_OK


def test_driver_features_masked_and_frozen_after_features_ok(drv: VirtioDriver,
                                                             transport: MmioTransport) -> None:
    drv.negotiate_features(VIRTIO_F_VERSION_1)
    drv.write_driver_features(VIRTIO_F_VERSION_1 | FEATURE_A | (1 << 9))  # after FEATURES_OK: ignored
    assert transport.acked_features == VIRTIO_F_VERSION_1
    transport.driver_features |= 1 << 9
    assert transport.acked_features == VIRTIO_F_VERSION_1  # masked to what was offered


def test_driver_ok_without_features_ok_not_latched(drv: VirtioDriver, dev: FakeDevice) -> None:
    drv.add_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER)
    drv.setup_queue(0)
    drv.add_status(STATUS_DRIVER_OK)
    assert not drv.status & STATUS_DRIVER_OK
    assert not dev.activated


def test_status_bits_cannot_be_cleared(drv: VirtioDriver) -> None:
    drv.negotiate()
    before = drv.status
    drv.write32(Reg.STATUS, STATUS_ACKNOWLEDGE)
    assert drv.status == before


def test_queue_registers_for_missing_queue(drv: VirtioDriver) -> None:
    drv.write32(Reg.QUEUE_SEL, 2)
    assert drv.read32(Reg.QUEUE_NUM_MAX) == 0
    drv.write32(Reg.QUEUE_READY, 1)
    assert drv.read32(Reg.QUEUE_READY) == 0
    with pytest.raises(DriverError):
        drv.setup_queue(7)


def test_queue_registers_frozen_once_ready(drv: VirtioDriver, transport: MmioTransport) -> None:
    drv.negotiate_features()
    q = drv.setup_queue(0)
    drv.write32(Reg.QUEUE_NUM, 2)
    drv.write32(Reg.QUEUE_DESC_LOW, 0x5000)
    assert transport.queues[0].size == 16 and transport.queues[0].desc_addr == q.desc_addr
    assert drv.read32(Reg.QUEUE_READY) == 1


def test_queue_registers_frozen_after_driver_ok(drv: VirtioDriver, transport: MmioTransport) -> None:
    drv.negotiate(queues=[0])
    drv.write32(Reg.QUEUE_SEL, 1)
    drv.write32(Reg.QUEUE_NUM, 4)
    drv.write32(Reg.QUEUE_DESC_LOW, 0x8000)
    drv.write32(Reg.QUEUE_READY, 1)
    q1 = transport.queues[1]
    assert (q1.size, q1.desc_addr, q1.ready) == (8, 0, False)


def test_queue_addresses_are_64_bit(drv: VirtioDriver, transport: MmioTransport) -> None:
    drv.write32(Reg.QUEUE_SEL, 0)
    drv.write32(Reg.QUEUE_DESC_LOW, 0x1000)
    drv.write32(Reg.QUEUE_DESC_HIGH, 0x2)
    drv.write32(Reg.QUEUE_DRIVER_HIGH, 0xFFFFFFFF)
    drv.write32(Reg.QUEUE_DEVICE_LOW, 0xABCD0000)
    q = transport.queues[0]
    assert q.desc_addr == 0x2_0000_1000
    assert q.avail_addr == 0xFFFFFFFF_00000000
    assert q.used_addr == 0xABCD0000
    for reg in (Reg.QUEUE_NUM, Reg.QUEUE_DESC_LOW, Reg.QUEUE_NOTIFY, Reg.INTERRUPT_ACK):
        assert drv.read32(reg) == 0  # write-only registers read as 0


def test_non_32_bit_register_access_ignored(drv: VirtioDriver, transport: MmioTransport) -> None:
    assert transport.read(Reg.MAGIC_VALUE, 2) == b"\x00\x00"
    assert transport.read(Reg.MAGIC_VALUE, 1) == b"\x00"
    assert transport.read(Reg.MAGIC_VALUE, 8) == bytes(8)
    assert transport.read(Reg.MAGIC_VALUE + 1, 4) == bytes(4)
    transport.write(Reg.STATUS, b"\x01")
    transport.write(Reg.STATUS, b"\x01\x00")
    transport.write(Reg.STATUS - 1, b"\x00\x01\x00\x00")
    transport.write(Reg.STATUS, b"")
    assert drv.status == 0
    assert not transport.needs_reset


def test_config_space_byte_granular(drv: VirtioDriver, dev: FakeDevice) -> None:
    assert drv.read_config(0, 1) == b"\x01"
    assert drv.read_config(3, 2) == b"\x04\x05"
    assert drv.read_config(0, 8) == bytes(range(1, 9))
    assert drv.read_config(6, 4) == b"\x00" * 4  # crosses the end of config space
    assert drv.read_config(0x100, 4) == b"\x00" * 4  # beyond the 0x200 window's config space
    drv.write_config(1, b"\xff")
    assert dev.config[1] == 0xFF
    assert drv.read32(Reg.CONFIG_GENERATION) == 0


def test_request_and_used_interrupt(drv: VirtioDriver, irq: CountingIrq, dev: FakeDevice) -> None:
    drv.negotiate()
    used, _ = drv.request(0, readable=[b"abc"], writable=[7, 5])
    assert used.length == 12
    assert irq.count == 1
    assert drv.interrupt_status() == INT_USED_RING
    assert drv.ack_interrupts() == INT_USED_RING
    assert drv.interrupt_status() == 0
    used, _ = drv.request(1, writable=[3], ioeventfd=True)
    assert used.length == 3 and irq.count == 2
    assert dev.notified == [0, 1]


def test_no_interrupt_flag_honoured(drv: VirtioDriver, irq: CountingIrq) -> None:
    (q0, _) = drv.negotiate()
    q0.set_avail_flags(VIRTQ_AVAIL_F_NO_INTERRUPT)
    used, _ = drv.request(0, writable=[4])
    assert used.length == 4
    assert irq.count == 0 and drv.interrupt_status() == 0


def test_notify_ignored_before_activation_and_for_bad_index(drv: VirtioDriver, dev: FakeDevice,
                                                             transport: MmioTransport) -> None:
    transport.notify(0)
    drv.write32(Reg.QUEUE_NOTIFY, 0)
    assert dev.notified == []
    drv.negotiate(queues=[0])
    for bad in (1, 2, -1, 0xFFFF, 0xFFFFFFFF):
        transport.notify(bad)
        drv.write32(Reg.QUEUE_NOTIFY, bad)
    assert dev.notified == []  # queue 1 exists but was never made ready
    transport.notify(0)
    assert dev.notified == [0]


def test_reset_clears_device_queues_and_registers(drv: VirtioDriver, dev: FakeDevice,
                                                  transport: MmioTransport, irq: CountingIrq) -> None:
    drv.negotiate()
    drv.request(0, writable=[4])
    drv.write32(Reg.QUEUE_SEL, 1)
    sink = dev.interrupt
    assert sink is not None
    resets = dev.resets
    drv.reset()
    assert drv.status == 0 and drv.interrupt_status() == 0
    assert dev.resets == resets + 1 and not dev.activated and dev.acked_features == 0
    for q in transport.queues:
        assert not q.ready and q.next_avail == 0 and q.next_used == 0 and q.desc_addr == 0
    assert transport.queue_sel == 0
    # A sink handed out before the reset is stale: late completions don't interrupt the new driver.
    count = irq.count
    sink.signal_used(0)
    sink.signal_config()
    assert irq.count == count and drv.interrupt_status() == 0
    # And the device can be brought up again.
    drv.negotiate()
    used, _ = drv.request(0, writable=[9])
    assert used.length == 9 and dev.activations == 2


def test_activation_with_broken_queue_sets_needs_reset(drv: VirtioDriver, transport: MmioTransport,
                                                       dev: FakeDevice, irq: CountingIrq) -> None:
    drv.negotiate_features()
    drv.setup_queue(0)
    drv.write32(Reg.QUEUE_SEL, 1)
    drv.write32(Reg.QUEUE_NUM, 3)  # not a power of two
    drv.write32(Reg.QUEUE_READY, 1)
    drv.add_status(STATUS_DRIVER_OK)
    assert drv.status & STATUS_DEVICE_NEEDS_RESET
    assert not dev.activated
    assert drv.interrupt_status() & INT_CONFIG_CHANGE and irq.count == 1
    assert drv.read32(Reg.CONFIG_GENERATION) == 1
    assert drv.read32(Reg.MAGIC_VALUE) == MAGIC_VALUE  # still answering


def test_activation_with_queue_outside_ram(drv: VirtioDriver, transport: MmioTransport) -> None:
    drv.negotiate_features()
    drv.setup_queue(0)
    drv.write32(Reg.QUEUE_SEL, 1)
    drv.write32(Reg.QUEUE_DEVICE_HIGH, 0x10)
    drv.write32(Reg.QUEUE_READY, 1)
    drv.add_status(STATUS_DRIVER_OK)
    assert transport.needs_reset


def test_queue_error_during_processing_sets_needs_reset(drv: VirtioDriver, dev: FakeDevice,
                                                        irq: CountingIrq) -> None:
    drv.negotiate()
    dev.fail_with = QueueError("ring broken")
    drv.kick(0)
    assert drv.status & STATUS_DEVICE_NEEDS_RESET
    assert drv.interrupt_status() == INT_CONFIG_CHANGE and irq.count == 1
    # Driver writing the status back (virtio_add_status style) keeps NEEDS_RESET; notifies are dropped.
    drv.add_status(STATUS_DRIVER_OK)
    assert drv.status & STATUS_DEVICE_NEEDS_RESET
    dev.fail_with = None
    drv.kick(0)
    assert dev.notified == [0]
    drv.reset()
    assert drv.status == 0
    drv.negotiate()
    assert drv.request(0, writable=[1])[0].length == 1


def test_device_bug_does_not_escape(drv: VirtioDriver, dev: FakeDevice, transport: MmioTransport) -> None:
    drv.negotiate()
    dev.fail_with = ZeroDivisionError("device bug")
    transport.notify(0)
    assert transport.needs_reset


def test_sink_needs_reset_hook(drv: VirtioDriver, dev: FakeDevice, irq: CountingIrq) -> None:
    drv.negotiate()
    assert isinstance(dev.interrupt, InterruptSink)
    dev.interrupt.signal_needs_reset("rx ring broken")
    assert drv.status & STATUS_DEVICE_NEEDS_RESET and irq.count == 1


def test_signal_config_bumps_generation(drv: VirtioDriver, dev: FakeDevice, irq: CountingIrq) -> None:
    drv.negotiate()
    assert dev.interrupt is not None
    dev.interrupt.signal_config()
    assert drv.read32(Reg.CONFIG_GENERATION) == 1
    assert drv.ack_interrupts() == INT_CONFIG_CHANGE and irq.count == 1


def test_interrupt_ack_clears_only_acked_bits(drv: VirtioDriver, dev: FakeDevice) -> None:
    drv.negotiate()
    assert dev.interrupt is not None
    dev.interrupt.signal_config()
    drv.request(0, writable=[1])
    assert drv.interrupt_status() == INT_USED_RING | INT_CONFIG_CHANGE
    drv.write32(Reg.INTERRUPT_ACK, INT_USED_RING)
    assert drv.interrupt_status() == INT_CONFIG_CHANGE


def test_through_a_bus(mem: GuestMemory, irq: CountingIrq) -> None:
    bus = Bus("mmio")
    base = 0xD000_0000
    t = MmioTransport(FakeDevice(), mem, irq)
    bus.insert(base, MMIO_SIZE, t)
    assert struct.unpack("<I", bus.read(base, 4))[0] == MAGIC_VALUE
    assert bus.read(base + 0xFFC, 4) == bytes(4)
    bus.write(base + NOTIFY_OFFSET, b"\x00\x00\x00\x00")  # inactive: ignored, no exception


def test_kernel_cmdline_arg() -> None:
    assert kernel_cmdline_arg(0xD0000000, 5) == "virtio_mmio.device=4K@0xd0000000:5"
    assert NOTIFY_OFFSET == Reg.QUEUE_NOTIFY == 0x50
    with pytest.raises(ValueError):
        kernel_cmdline_arg(0xD0000100, 5)


def test_queue_ready_zero_stops_processing(drv: VirtioDriver, dev: FakeDevice) -> None:
    (q0, _) = drv.negotiate()
    drv.write32(Reg.QUEUE_SEL, 0)
    drv.write32(Reg.QUEUE_READY, 0)
    q0.add(writable=[4])
    drv.kick(0)
    assert q0.used() == [] and dev.notified == []
    drv.write32(Reg.QUEUE_READY, 1)  # cannot come back after DRIVER_OK
    assert drv.read32(Reg.QUEUE_READY) == 0


def test_transport_rejects_bad_queue_sizes(mem: GuestMemory, irq: CountingIrq) -> None:
    class Bad(FakeDevice):
        queue_max_sizes = (3,)

    with pytest.raises(QueueError):
        MmioTransport(Bad(), mem, irq)
    assert Queue(8).max_size == 8
