"""Host I/O for virtio-net: a TAP interface opened through /dev/net/tun with a virtio-net header, on asyncio.

Linux Documentation/networking/tuntap.rst: TUNSETIFF attaches the fd to the named interface; with
IFF_VNET_HDR every read and write carries a struct virtio_net_hdr first, TUNSETVNETHDRSZ sets its size
(12: the VIRTIO_F_VERSION_1 layout), TUNSETOFFLOAD(0) keeps checksum and segmentation offloads off, so
the kernel hands us complete, checksummed frames no larger than the interface MTU.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Protocol

from smold.devices.net.request import MAX_FRAME_LEN, NET_HDR_SIZE, VIRTIO_NET_HDR_GSO_NONE, NetHeader

log = logging.getLogger(__name__)

TUN_DEVICE = "/dev/net/tun"
IFNAMSIZ = 16

# include/uapi/asm-generic/ioctl.h: _IOW(type, nr, size) = (1 << 30) | (size << 16) | (type << 8) | nr.
_IOC_WRITE = 1
_IOC_READ = 2


def _ioc(direction: int, type_: str, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord(type_) << 8) | nr


# include/uapi/linux/if_tun.h
TUNSETIFF = _ioc(_IOC_WRITE, "T", 202, ctypes.sizeof(ctypes.c_int))
TUNSETOFFLOAD = _ioc(_IOC_WRITE, "T", 208, ctypes.sizeof(ctypes.c_uint))
TUNGETIFF = _ioc(_IOC_READ, "T", 210, ctypes.sizeof(ctypes.c_uint))
TUNSETVNETHDRSZ = _ioc(_IOC_WRITE, "T", 216, ctypes.sizeof(ctypes.c_int))
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000

# struct ifreq: char ifr_name[IFNAMSIZ]; then a union whose largest member (struct ifmap) makes it 40 bytes.
_IFREQ = struct.Struct("16sH22x")
_TX_HEADER = NetHeader().pack()  # flags 0, GSO_NONE: a complete frame
_READ_SIZE = NET_HDR_SIZE + MAX_FRAME_LEN + 1  # one byte more than the largest frame we accept

assert _IFREQ.size == 40


class NetBackendError(Exception):
    """The TAP interface could not be opened or configured."""


class NetBackend(Protocol):
    """What the device needs from the host network. Called with the device lock held."""

    def recv(self) -> bytes | None:
        """One Ethernet frame, or None when none is waiting (never blocks). OSError on failure."""

    def send(self, frame: bytes) -> None:
        """Hand one Ethernet frame to the host. OSError on failure (the frame is lost)."""

    def want_rx(self, on: bool) -> None:
        """Start (True) or stop (False) telling the device that frames are waiting; any thread."""


def check_tap_name(name: str) -> str:
    """An interface name the kernel accepts (dev_valid_name): 1-15 bytes, no '/', ':' or whitespace."""
    raw = name.encode("utf-8", "replace")
    if not 0 < len(raw) < IFNAMSIZ or name in (".", "..") or any(c in name for c in "/: \t\n\r\x00"):
        raise NetBackendError(f"{name!r} is not a valid interface name")
    return name


def open_tap(name: str) -> int:
    """Attach to the existing TAP interface ``name`` in this process's network namespace; a non-blocking fd.

    The interface must exist already (the caller created and addressed it): TUNSETIFF would otherwise
    create a fresh, unconfigured one, so a missing name is an error here.
    """
    check_tap_name(name)
    try:
        socket.if_nametoindex(name)  # SIOCGIFINDEX: looks in the current network namespace
    except OSError as e:
        raise NetBackendError(f"no network interface {name!r} in this network namespace") from e
    try:
        fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise NetBackendError(f"cannot open {TUN_DEVICE}: {e.strerror}") from e
    try:
        req = bytearray(_IFREQ.pack(name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETIFF, req)
        fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", NET_HDR_SIZE))
        fcntl.ioctl(fd, TUNSETOFFLOAD, 0)
        got = bytearray(_IFREQ.size)
        fcntl.ioctl(fd, TUNGETIFF, got)
        _, flags = _IFREQ.unpack(got)
        if not flags & IFF_TAP or not flags & IFF_VNET_HDR:
            raise NetBackendError(f"{name} did not attach as a TAP with a vnet header (flags {flags:#x})")
    except OSError as e:
        os.close(fd)
        hint = " (is it a TUN rather than a TAP, or owned by another user?)" if e.errno in (errno.EINVAL,
                                                                                           errno.EPERM) else ""
        raise NetBackendError(f"cannot attach to TAP {name}: {e.strerror}{hint}") from e
    except NetBackendError:
        os.close(fd)
        raise
    return fd


class TapBackend:
    """A TAP fd serving one virtio-net device.

    ``start(loop, on_readable)`` watches the fd with ``loop.add_reader`` while the device wants frames
    (``want_rx``); ``on_readable`` runs on the loop and should take the device lock and call
    ``Net.backend_readable``. Frames the host sends while the guest has no receive buffers wait in the
    kernel's TAP queue (txqueuelen frames, beyond which the kernel drops them).
    """

    def __init__(self, name: str, *, fd: int | None = None) -> None:
        self.name = name
        self._fd = open_tap(name) if fd is None else fd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._on_readable: Callable[[], None] | None = None
        self._wanted = False
        self._watching = False
        self._guard = threading.Lock()
        self.bad_frames = 0  # frames from the host with offload metadata we did not ask for

    @property
    def fd(self) -> int:
        return self._fd

    # -- data -----------------------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return None
            if not data:
                return None
            if len(data) < NET_HDR_SIZE:
                self._bad("short read")
                continue
            header = NetHeader.unpack(data)
            frame = data[NET_HDR_SIZE:]
            if header.gso_type != VIRTIO_NET_HDR_GSO_NONE or len(frame) > MAX_FRAME_LEN:
                self._bad(f"gso_type {header.gso_type}, {len(frame)} bytes")
                continue  # offloads are off, so this should not happen; skip it and read on
            return frame

    def _bad(self, what: str) -> None:
        self.bad_frames += 1
        log.debug("tap %s: dropped a frame (%s)", self.name, what)

    def send(self, frame: bytes) -> None:
        os.writev(self._fd, [_TX_HEADER, frame])

    # -- readiness ------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_readable: Callable[[], None]) -> None:
        """Bind to ``loop`` (call on the loop's thread); applies the device's current ``want_rx``."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._on_readable = on_readable
        self._apply()

    def want_rx(self, on: bool) -> None:
        with self._guard:
            self._wanted = on
        loop = self._loop
        if loop is None:
            return  # applied by start()
        if threading.get_ident() == self._loop_thread:
            self._apply()
        else:
            try:
                loop.call_soon_threadsafe(self._apply)
            except RuntimeError:
                pass  # the loop is closed: the machine is going away

    def _apply(self) -> None:
        loop, cb = self._loop, self._on_readable
        if loop is None or cb is None or self._fd < 0:
            return
        with self._guard:
            wanted = self._wanted
        if wanted and not self._watching:
            loop.add_reader(self._fd, cb)
            self._watching = True
        elif not wanted and self._watching:
            loop.remove_reader(self._fd)
            self._watching = False

    def stop(self) -> None:
        """Stop watching the fd (on the loop's thread)."""
        if self._loop is not None and self._watching and self._fd >= 0:
            self._loop.remove_reader(self._fd)
        self._watching = False
        self._loop = None
        self._on_readable = None

    def close(self) -> None:
        self.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
