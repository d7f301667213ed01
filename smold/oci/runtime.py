"""A self-contained Python runtime injected into OCI root disks, so the guest agent runs without the image's python3.

The host's interpreter (the same Debian python3 the default guest uses), its stdlib and every shared
library it and its extension modules need, plus the dynamic loader, go to ``/.smol/runtime`` in the
image. /init starts the agent through that loader (``ld.so --library-path``), so neither the image's
libc (glibc, musl or none) nor any environment variable is involved, and commands the agent runs use
the image's own binaries unchanged. See docs/images.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import OciError

DEST = ".smol/runtime"
LOADER = "ld-linux-x86-64.so.2"
RUNTIME_VERSION = "1"
# Stdlib parts the agent never imports; they are most of the stdlib's size.
SYSTEM_PYTHON = "/usr/bin/python3"
# Extension modules the agent never imports (and their libraries: X11/Tk, ncurses, sqlite, ...).
SKIP_EXT = ("_tkinter", "_curses", "readline", "_sqlite3", "_dbm", "_gdbm", "nis", "spwd", "ossaudiodev",
            "_test", "_xx", "xxlimited", "_ctypes_test", "audioop", "_crypt")
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                       "distutils", "venv", "site-packages", "dist-packages"})
_LDD_RE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x", re.M)


class RuntimeError_(OciError):
    """The host's Python runtime cannot be packaged (not found, not dynamically linked as expected)."""


@functools.cache
def interpreter() -> tuple[Path, Path, str]:
    """(binary, stdlib dir, "3.11.2") of the interpreter to ship: the system python3 (the one the default
    guest has), else the one running this code."""
    candidate = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
    probe = ("import os, sys, sysconfig; print(os.path.realpath(sys.executable)); "
             "print(sysconfig.get_paths()['stdlib']); print(sys.version.split()[0])")
    try:
        out = subprocess.run([candidate, "-S", "-c", probe], capture_output=True, text=True, check=True,
                             timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError_(f"cannot run {candidate} to locate its runtime: {e}") from None
    return Path(out[0]), Path(out[1]), out[2]


def _needed_libs(binaries: list[Path]) -> set[Path]:
    """Every shared object (and the loader) that ``ldd`` reports for ``binaries``."""
    libs: set[Path] = set()
    for b in binaries:
        out = subprocess.run(["ldd", str(b)], capture_output=True, text=True, check=False).stdout
        for m in _LDD_RE.finditer(out):
            libs.add(Path(m.group(1)))
    return libs


def _skip(rel: Path) -> bool:
    if any(p in SKIP_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
        return True
    name = rel.name
    if name.endswith(".so") and name.startswith(SKIP_EXT):
        return True
    return ".opt-1." in name or ".opt-2." in name


@functools.cache
def runtime_key() -> str:
    """Changes whenever the injected bytes would: runtime format, interpreter build, stdlib location."""
    exe, stdlib, version = interpreter()
    h = hashlib.sha256()
    h.update(RUNTIME_VERSION.encode() + b"\0" + version.encode() + b"\0" + str(stdlib).encode())
    with open(exe, "rb") as fh:
        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def inject_runtime(tree: Path) -> dict[str, object]:
    """Copy interpreter, stdlib and libraries into ``tree/.smol/runtime``; returns a summary for metadata."""
    exe, stdlib, version = interpreter()
    dest = tree / DEST
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    ver = "python" + ".".join(version.split(".")[:2])
    shutil.copy2(exe, dest / "bin" / ver)
    os.symlink(ver, dest / "bin" / "python3")
    lib_std = dest / "lib" / ver
    files = 0
    extensions: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = Path(dirpath).relative_to(stdlib)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        (lib_std / rel_dir).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            rel = rel_dir / f
            if _skip(rel):
                continue
            src = Path(dirpath) / f
            if src.is_symlink() and not src.exists():
                continue
            shutil.copy2(src, lib_std / rel)
            files += 1
            if f.endswith(".so"):
                extensions.append(src)
    libs = _needed_libs([exe, *extensions])
    loader = [p for p in libs if p.name == LOADER]
    if not loader:
        raise RuntimeError_(f"ldd reports no {LOADER} for {exe}; cannot build a relocatable runtime")
    for lib in sorted(libs):
        shutil.copy2(os.path.realpath(lib), dest / "lib" / lib.name)
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            os.chown(p, 0, 0, follow_symlinks=False)
    return {"python": version, "files": files, "libs": sorted(p.name for p in libs),
            "key": runtime_key()}


def agent_command(root: str = "/") -> list[str]:
    """argv that starts the injected interpreter inside a root where the runtime was injected."""
    base = os.path.join(root, DEST)
    return [f"{base}/lib/{LOADER}", "--library-path", f"{base}/lib", f"{base}/bin/python3"]
