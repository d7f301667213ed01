"""Network namespaces, veth pairs and persistent taps through pyroute2 (netlink) and /dev/net/tun.

Work inside a namespace runs in a fresh thread that has setns(2)-ed into it (setns moves only the calling
thread; the thread ends afterwards, so no other thread ever runs in a VM's namespace). Netlink and other
sockets created there stay bound to that namespace after the thread is gone (socket(7) keeps its netns).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pyroute2 import IPRoute, netns

from .errors import NetError

T = TypeVar("T")

# linux/if_tun.h: TUNSETIFF = _IOW('T', 202, int) etc.; struct ifreq is 40 bytes (name[16], flags short)
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNSETOWNER = 0x400454CC
TUNSETGROUP = 0x400454CE
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
IFNAMSIZ = 16
CLONE_NEWNET = 0x40000000


def netns_path(name: str) -> Path:
    return Path(netns.NETNS_RUN_DIR) / name


def list_namespaces() -> list[str]:
    return sorted(netns.listnetns())


def namespace_exists(name: str) -> bool:
    return netns_path(name).exists()


def create_namespace(name: str) -> None:
    if namespace_exists(name):
        raise NetError(f"network namespace {name} already exists")
    in_netns(None, _create_here, name)


def _create_here(name: str) -> None:
    """unshare(CLONE_NEWNET) in this (fresh, short-lived) thread and bind-mount its new namespace to
    /run/netns/<name>, as ``ip netns add`` does. No fork: forking a process with gRPC and event-loop threads
    is not safe (pyroute2's netns.create forks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetError(f"cannot create network namespace {name}: unshare: {os.strerror(err)}")
    try:
        netns._create(name, pid="thread-self")
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(netns_path(name))
        raise NetError(f"cannot create network namespace {name}: {e}") from None


def remove_namespace(name: str) -> None:
    if namespace_exists(name):
        try:
            netns.remove(name)
        except OSError as e:
            raise NetError(f"cannot remove network namespace {name}: {e}") from None


def in_netns(name: str | None, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` in a new thread that has entered namespace ``name`` (None: the caller's); its result
    or exception. (pyroute2's IPRoute must also not run on a thread with a running event loop.)"""
    result: list[Any] = []
    error: list[BaseException] = []

    def body() -> None:
        if name is None:
            try:
                result.append(fn(*args))
            except BaseException as e:
                error.append(e)
            return
        try:
            fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            error.append(NetError(f"network namespace {name}: {e}"))
            return
        try:
            if hasattr(os, "setns"):  # Python 3.12+
                os.setns(fd, os.CLONE_NEWNET)  # type: ignore[attr-defined,unused-ignore]
            else:
                netns.setns(fd, flags=0)
        except OSError as e:
            error.append(NetError(f"cannot enter network namespace {name}: {e}"))
            return
        finally:
            os.close(fd)
        try:
            result.append(fn(*args))
        except BaseException as e:  # handed to the caller's thread
            error.append(e)

    t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def create_tap(name: str, uid: int, gid: int) -> None:
    """A persistent tap (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR) in the calling thread's namespace, owned by uid/gid
    so the VMM may attach to it with TUNSETIFF (linux/Documentation/networking/tuntap.rst)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack(f"{IFNAMSIZ}sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        fcntl.ioctl(fd, TUNSETOWNER, uid)
        fcntl.ioctl(fd, TUNSETGROUP, gid)
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    except OSError as e:
        raise NetError(f"cannot create tap {name}: {e}") from None
    finally:
        os.close(fd)


def link_index(ipr: IPRoute, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def link_exists(name: str, namespace: str | None = None) -> bool:
    def look() -> bool:
        with IPRoute() as ipr:
            return link_index(ipr, name) is not None
    return in_netns(namespace, look)


def delete_link(name: str) -> bool:
    """Delete a link of the calling thread's namespace (both ends of a veth); False when it is not there."""
    return in_netns(None, _delete_link, name)


def _delete_link(name: str) -> bool:
    with IPRoute() as ipr:
        idx = link_index(ipr, name)
        if idx is None:
            return False
        try:
            ipr.link("del", index=idx)
        except Exception as e:
            if getattr(e, "code", None) == errno.ENODEV:
                return False
            raise NetError(f"cannot delete link {name}: {e}") from None
        return True


def list_links(prefix: str) -> list[str]:
    def names() -> list[str]:
        with IPRoute() as ipr:
            return [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    return sorted(n for n in in_netns(None, names) if n and n.startswith(prefix))


def host_addresses() -> list[ipaddress.IPv4Network]:
    """The IPv4 addresses of the daemon's own namespace (the host's), each as a /32."""
    def addrs() -> list[ipaddress.IPv4Network]:
        with IPRoute() as ipr:
            return [ipaddress.IPv4Network(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr(family=socket.AF_INET)
                    if a.get_attr("IFA_ADDRESS")]
    return sorted(set(in_netns(None, addrs)))


def write_sysctl(path: str, value: str) -> None:
    """Write /proc/sys/<path> (net.* keys are per namespace: of the calling thread)."""
    with open(f"/proc/sys/{path.replace('.', '/')}", "w") as f:
        f.write(value)


def read_sysctl(path: str) -> str:
    with open(f"/proc/sys/{path.replace('.', '/')}") as f:
        return f.read().strip()
