"""Host entropy for virtio-rng: the kernel CSPRNG via os.urandom (getrandom, /dev/urandom)."""

from __future__ import annotations

import os
from typing import Protocol


class RngBackendError(Exception):
    """The entropy source failed."""


class RngBackend(Protocol):
    def read(self, n: int) -> bytes: ...


class UrandomBackend:
    """Reads the host kernel's CSPRNG; never blocks once the host pool is initialised."""

    def read(self, n: int) -> bytes:
        if n < 0:
            raise RngBackendError(f"negative entropy request {n}")
        try:
            return os.urandom(n)
        except OSError as e:
            raise RngBackendError(str(e)) from e
