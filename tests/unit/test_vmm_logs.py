"""The VMM's log rate limit: a guest provoking device warnings in a loop cannot grow vmm.log without bound."""

from __future__ import annotations

import io
import logging

from virtio_driver import VirtioDriver

from smold.devices.irq import CountingIrq
from smold.devices.virtio.mmio import MmioTransport
from smold.devices.vsock import Vsock
from smold.memory import GuestMemory
from smold.vmm.logs import RateLimitFilter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def handler_with_limit(clock: Clock) -> tuple[logging.Handler, io.StringIO, RateLimitFilter]:
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("%(name)s %(message)s"))
    f = RateLimitFilter(rate=1.0, burst=5, clock=clock)
    h.addFilter(f)
    return h, out, f


def test_a_warning_flood_is_cut_to_the_rate_and_counted() -> None:
    clock = Clock()
    h, out, f = handler_with_limit(clock)
    log = logging.getLogger("smold.devices.test_flood")
    log.addHandler(h)
    log.propagate = False
    try:
        for i in range(100_000):
            log.warning("virtio device %d needs reset: %s", 19, f"rx queue: bad index {i}")
            clock.t += 0.0001               # 10 s in all, 10 000 records a second
        lines = out.getvalue().splitlines()
        assert 5 <= len(lines) <= 5 + 11      # the burst, then one a second
        assert f.suppressed == 100_000 - len(lines)
        assert "similar suppressed]" in lines[-1]
        logging.getLogger("smold.vmm.runner").addHandler(h)
        logging.getLogger("smold.vmm.runner").warning("host-side message")   # not guest-facing: passes
        assert out.getvalue().splitlines()[-1] == "smold.vmm.runner host-side message"
    finally:
        log.removeHandler(h)
        logging.getLogger("smold.vmm.runner").removeHandler(h)


def test_reset_and_break_loop_through_a_real_device_is_bounded() -> None:
    """A guest resetting the vsock device and breaking its rx ring again, 2000 times: each time the
    transport and device warn; the limited log stays a few lines."""
    clock = Clock()
    h, out, _f = handler_with_limit(clock)
    root = logging.getLogger("smold.devices")
    root.addHandler(h)
    try:
        with GuestMemory([(0, 1 << 20)]) as mem:
            dev = Vsock(guest_cid=3)
            t = MmioTransport(dev, mem, CountingIrq())
            for _ in range(2000):
                drv = VirtioDriver(t, mem)      # reset, renegotiate (rings at the same place each time)
                rxq, _tx, _ev = drv.negotiate()
                rxq.set_avail_idx(0x8000)       # a broken rx ring ...
                dev.connect_to_guest(1)         # ... that host-driven work runs into: NEEDS_RESET, warnings
                assert t.needs_reset
                clock.t += 0.001                # 2 s in all
            assert t.internal_errors == 0
        lines = out.getvalue().splitlines()
        assert len(lines) <= 2 * (5 + 3), lines       # two messages (device, transport), burst + 1/s each
        assert any("similar suppressed]" in line for line in lines)
    finally:
        root.removeHandler(h)
