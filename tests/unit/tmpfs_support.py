"""A tiny tmpfs mounted for one test, to fill a file system for real (needs root; skips otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_tmpfs(size: str, at: Path | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=``) at ``at`` (default: a new temporary directory)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = at if at is not None else Path(tempfile.mkdtemp(prefix="smol-tiny-"))
    d.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)], check=True)
        try:
            yield d
        finally:
            subprocess.run(["umount", "-l", str(d)], check=True)
    finally:
        if at is None:
            d.rmdir()
