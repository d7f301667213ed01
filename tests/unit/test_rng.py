"""virtio-rng through the real transport (virtio 1.2 §5.4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from virtio_driver import VirtioDriver

from smold.devices.irq import CountingIrq
from smold.devices.rng import Rng, UrandomBackend
from smold.devices.rng.backend import RngBackendError
from smold.devices.rng.device import RngError
from smold.devices.rng.request import MAX_REQUEST_BYTES
from smold.devices.virtio.device import VIRTIO_F_VERSION_1, VIRTIO_ID_RNG
from smold.devices.virtio.mmio import MmioTransport, Reg
from smold.memory import GuestMemory


class Rig:
    def __init__(self, mem: GuestMemory, rng: Rng | None = None) -> None:
        self.rng = rng or Rng()
        self.irq = CountingIrq()
        self.transport = MmioTransport(self.rng, mem, self.irq)
        self.drv = VirtioDriver(self.transport, mem)
        (self.q,) = self.drv.negotiate()


@pytest.fixture
def mem() -> Iterator[GuestMemory]:
    with GuestMemory([(0, 1 << 20)]) as m:
        yield m


@pytest.fixture
def rig(mem: GuestMemory) -> Rig:
    return Rig(mem)


def test_identity(rig: Rig) -> None:
    assert rig.drv.read32(Reg.DEVICE_ID) == VIRTIO_ID_RNG
    assert rig.drv.device_features() == VIRTIO_F_VERSION_1
    assert rig.drv.read_config(0, 4) == bytes(4)
    assert len(rig.transport.queues) == 1


@pytest.mark.parametrize("n", [1, 16, 1000, 4096])
def test_returns_requested_bytes(rig: Rig, n: int) -> None:
    used, data = rig.drv.request(0, writable=[n])
    assert used.length == n
    assert len(data) == n
    assert rig.irq.count == 1


def test_different_across_requests(rig: Rig) -> None:
    seen = {rig.drv.request(0, writable=[32])[1] for _ in range(8)}
    assert len(seen) == 8
    assert b"\xa5" * 32 not in seen  # the driver's poison was overwritten


def test_multiple_descriptors_all_filled(rig: Rig) -> None:
    used, data = rig.drv.request(0, writable=[10, 20, 30])
    assert used.length == 60
    assert data[:10] != b"\xa5" * 10 and data[10:30] != b"\xa5" * 20 and data[30:] != b"\xa5" * 30


def test_cap_per_request(mem: GuestMemory) -> None:
    r = Rig(mem, Rng(max_request_bytes=100))
    used, data = r.drv.request(0, writable=[64, 64])
    assert used.length == 100
    assert data[100:] == b"\xa5" * 28


def test_default_cap(rig: Rig) -> None:
    used, _ = rig.drv.request(0, writable=[MAX_REQUEST_BYTES // 2, MAX_REQUEST_BYTES // 2, 4096])
    assert used.length == MAX_REQUEST_BYTES == 64 * 1024


def test_readable_only_chain_gets_nothing(rig: Rig) -> None:
    used, data = rig.drv.request(0, readable=[b"ignored"])
    assert used.length == 0 and data == b""
    used, data = rig.drv.request(0, readable=[b"ignored"], writable=[8])
    assert used.length == 8


def test_zero_length_writable(rig: Rig) -> None:
    used, _ = rig.drv.request(0, writable=[0])
    assert used.length == 0


class ShortBackend:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def read(self, n: int) -> bytes:
        self.calls.append(n)
        return b"\x01" * (n // 2)


class BrokenBackend:
    def read(self, n: int) -> bytes:
        raise RngBackendError("entropy source gone")


def test_short_backend_reports_what_was_written(mem: GuestMemory) -> None:
    be = ShortBackend()
    r = Rig(mem, Rng(be))
    used, data = r.drv.request(0, writable=[10, 10])
    assert be.calls == [20]
    assert used.length == 10 and data[:10] == b"\x01" * 10 and data[10:] == b"\xa5" * 10


def test_backend_failure_completes_with_zero(mem: GuestMemory) -> None:
    r = Rig(mem, Rng(BrokenBackend()))
    used, _ = r.drv.request(0, writable=[10])
    assert used.length == 0
    assert not r.transport.needs_reset


def test_backend_validation() -> None:
    with pytest.raises(RngBackendError):
        UrandomBackend().read(-1)
    assert len(UrandomBackend().read(5)) == 5
    with pytest.raises(RngError):
        Rng(max_request_bytes=0)
