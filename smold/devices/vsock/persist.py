"""Snapshot state of a virtio-vsock device: plain values only; connections are not persisted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from smold.devices.virtio.persist import PersistError
from smold.devices.vsock.packet import is_guest_cid

if TYPE_CHECKING:
    from smold.devices.vsock.device import Vsock


@dataclass(frozen=True)
class VsockState:
    """The guest's CID and the negotiated features; queue positions live in the transport's MmioState.

    Host sockets cannot survive a snapshot, so a restored device tells the guest its connections are
    gone with VIRTIO_VSOCK_EVENT_TRANSPORT_RESET (virtio 1.2 §5.10.6.7) when it is activated again.
    """

    guest_cid: int
    acked_features: int


def save_vsock(vsock: Vsock) -> VsockState:
    return VsockState(guest_cid=vsock.guest_cid, acked_features=vsock.acked_features)


def restore_vsock(vsock: Vsock, state: VsockState) -> None:
    """Load ``state`` into a freshly constructed Vsock (before the transport restore re-activates it)."""
    if vsock.activated:
        raise PersistError("restore into an active vsock device")
    if not is_guest_cid(state.guest_cid):
        raise PersistError(f"snapshot guest CID {state.guest_cid!r} is reserved or out of range")
    vsock.guest_cid = state.guest_cid
    vsock.acked_features = state.acked_features
    vsock.send_transport_reset()  # delivered on activation: the guest drops connections it thought live
