"""Snapshot state of a virtio-net device: plain values only; the TAP is a restore argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from smold.devices.virtio.persist import PersistError

if TYPE_CHECKING:
    from smold.devices.net.device import Net


@dataclass(frozen=True)
class NetState:
    """The MAC address the guest read, the link status and the negotiated features; queue positions live in
    the transport's MmioState.

    Frames in flight are not state: a frame read from the TAP but not yet placed in a receive buffer is
    dropped at snapshot time, like any frame a busy NIC drops (TCP retransmits it).
    """

    mac: bytes
    link_up: bool
    acked_features: int


def save_net(net: Net) -> NetState:
    return NetState(mac=net.mac, link_up=net.link_up, acked_features=net.acked_features)


def restore_net(net: Net, state: NetState) -> None:
    """Load ``state`` into a freshly constructed Net (before the transport restore re-activates it)."""
    if net.activated:
        raise PersistError("restore into an active net device")
    if len(state.mac) != 6:
        raise PersistError(f"snapshot MAC address has {len(state.mac)} bytes, not 6")
    net.mac = state.mac
    net.link_up = state.link_up
    net.acked_features = state.acked_features
