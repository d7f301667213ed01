"""Interrupt lines injected into device models (irqfd in the VMM, counters in tests)."""

from __future__ import annotations

import os
from typing import Protocol


class IrqLine(Protocol):
    """Something a device raises to interrupt the guest (edge-triggered)."""

    def trigger(self) -> None: ...


class EventFdIrq:
    """An interrupt line backed by an eventfd registered with KVM_IRQFD."""

    def __init__(self, gsi: int) -> None:
        self.gsi = gsi
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def trigger(self) -> None:
        os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        os.close(self.fd)


class CountingIrq:
    """Test double: counts triggers."""

    def __init__(self) -> None:
        self.count = 0

    def trigger(self) -> None:
        self.count += 1
