"""A rate limit for log records a guest can provoke (device warnings), so it cannot grow the VMM's log without bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

GUEST_FACING = ("smold.devices",)   # loggers whose records a guest can cause, one per request or reset
DEFAULT_RATE = 1.0                  # records per second per message, after ...
DEFAULT_BURST = 20                  # ... this many at once
MAX_KEYS = 1024                     # distinct (logger, message) buckets remembered


class RateLimitFilter(logging.Filter):
    """Token bucket per (logger, message template) for records of ``prefixes``; other records pass.

    A record let through after some were dropped says how many (``[N similar suppressed]``), so the
    log shows that a flood happened without holding it.
    """

    def __init__(self, rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 prefixes: tuple[str, ...] = GUEST_FACING, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.rate, self.burst, self.prefixes, self.clock = rate, burst, prefixes, clock
        self._buckets: dict[tuple[str, str], list[float]] = {}   # key -> [tokens, last time, suppressed]
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_KEYS:
                self._buckets.clear()
            bucket = self._buckets[key] = [float(self.burst), now, 0.0]
        bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if bucket[0] < 1.0:
            bucket[2] += 1
            self.suppressed += 1
            return False
        bucket[0] -= 1.0
        if bucket[2]:
            record.msg = f"{record.msg} [{int(bucket[2])} similar suppressed]"
            bucket[2] = 0
        return True


def install(handler_owner: logging.Logger | None = None) -> RateLimitFilter:
    """Put a RateLimitFilter on every handler of ``handler_owner`` (default: the root logger)."""
    f = RateLimitFilter()
    for h in (handler_owner or logging.getLogger()).handlers:
        h.addFilter(f)
    return f
