"""A minimal i8042 keyboard controller: enough for the guest's reset (reboot=k) to end the VM."""

from __future__ import annotations

from collections.abc import Callable

DATA = 0      # port 0x60
COMMAND = 4   # port 0x64
CMD_RESET_CPU = 0xFE   # pulse the CPU reset line (8042 command, used by Linux reboot=k)
STATUS_SYSTEM_FLAG = 0x04


class I8042:
    """Ports 0x60-0x64. A write of 0xFE to the command port calls ``on_reset``."""

    def __init__(self, on_reset: Callable[[], None]) -> None:
        self.on_reset = on_reset
        self.resets = 0

    def read(self, offset: int, size: int) -> bytes:
        # Status: output buffer empty, input buffer empty (so Linux's kb_wait() returns at once).
        value = STATUS_SYSTEM_FLAG if offset == COMMAND else 0
        return bytes([value]) + b"\x00" * (size - 1)

    def write(self, offset: int, data: bytes) -> None:
        if offset == COMMAND and data[:1] == bytes([CMD_RESET_CPU]):
            self.resets += 1
            self.on_reset()
