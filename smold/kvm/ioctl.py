"""ioctl request numbers computed from struct sizes (asm-generic/ioctl.h), and a GIL-releasing ioctl."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2

KVMIO = 0xAE


class KvmError(OSError):
    """A KVM ioctl failed; carries the errno and the ioctl's name."""


def _ioc(direction: int, type_: int, nr: int, size: int) -> int:
    if size >= 1 << _IOC_SIZEBITS:
        raise ValueError(f"ioctl argument of {size} bytes is too large")
    return (direction << _IOC_DIRSHIFT) | (type_ << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT)


def io(nr: int) -> int:
    return _ioc(_IOC_NONE, KVMIO, nr, 0)


def ior(nr: int, struct_type: Any) -> int:
    return _ioc(_IOC_READ, KVMIO, nr, ctypes.sizeof(struct_type))


def iow(nr: int, struct_type: Any) -> int:
    return _ioc(_IOC_WRITE, KVMIO, nr, ctypes.sizeof(struct_type))


def iowr(nr: int, struct_type: Any) -> int:
    return _ioc(_IOC_READ | _IOC_WRITE, KVMIO, nr, ctypes.sizeof(struct_type))


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int


def ioctl(fd: int, request: int, arg: Any = None, *, name: str = "ioctl") -> int:
    """Call ioctl(2) through ctypes (which releases the GIL, so KVM_RUN does not block other threads).

    ``arg`` is None, an int (passed by value) or a ctypes object (passed by reference).
    """
    if arg is None:
        ptr: Any = None
    elif isinstance(arg, int):
        ptr = ctypes.c_void_p(arg)
    else:
        ptr = ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p)
    ret = _libc.ioctl(fd, request, ptr)
    if ret < 0:
        err = ctypes.get_errno()
        raise KvmError(err, f"{name}: {os.strerror(err)}")
    return int(ret)
