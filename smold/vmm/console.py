"""The serial console's output sink: a size-capped, rotating console log file plus an optional live stream."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# A guest may write to its UART without end; the host keeps at most the current file and one rotated one.
DEFAULT_CONSOLE_LOG_MAX = 8 << 20
TAIL_KEEP = 32768          # the in-memory tail (for failure reasons) is trimmed to this ...
TAIL_MAX = 65536           # ... once it exceeds this


class ConsoleLogError(Exception):
    """A bad console log configuration."""


class ConsoleLog:
    """Serial output sink: appends to ``path`` and an optional live stream, keeps an in-memory tail.

    Disk use is bounded: once ``path`` holds ``max_bytes`` it is renamed to ``path.1`` (replacing the
    previous one) and a fresh file is started, so the log never takes more than ``2 * max_bytes`` and
    always holds the newest ``max_bytes`` or more. A write error (the host disk full, say) never reaches
    the guest's vCPU: the file is given up, the bytes are counted in ``lost_bytes``, the tail still grows.
    """

    def __init__(self, path: Path | None, stream: Callable[[bytes], None] | None,
                 max_bytes: int = DEFAULT_CONSOLE_LOG_MAX) -> None:
        if max_bytes < 4096:
            raise ConsoleLogError(f"console log cap of {max_bytes} bytes: at least 4096")
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self._fd = -1
        self._size = 0
        self.rotations = 0
        self.lost_bytes = 0
        if self.path is not None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
            self._size = os.fstat(self._fd).st_size
        self._stream = stream
        self.tail = bytearray()

    def __call__(self, data: bytes) -> None:
        if self._fd >= 0:
            self._write(data)
        elif self.path is not None:
            self.lost_bytes += len(data)
        if self._stream is not None:
            self._stream(data)
        self.tail += data
        if len(self.tail) > TAIL_MAX:
            del self.tail[:-TAIL_KEEP]

    def _write(self, data: bytes) -> None:
        try:
            if self._size + len(data) > self.max_bytes and self._size > 0:
                self._rotate()
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                self._size += n
                view = view[n:]
        except OSError as e:
            log.warning("console log %s: %s; further console output is not logged", self.path, e)
            self.lost_bytes += len(data)
            self.close()

    def _rotate(self) -> None:
        assert self.path is not None
        old = self.path.with_name(self.path.name + ".1")
        os.replace(self.path, old)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o640)
        os.close(self._fd)
        self._fd, self._size = fd, 0
        self.rotations += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
