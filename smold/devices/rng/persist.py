"""Snapshot state of a virtio-rng device: plain values only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from smold.devices.virtio.persist import PersistError

if TYPE_CHECKING:
    from smold.devices.rng.device import Rng


@dataclass(frozen=True)
class RngState:
    """Negotiated features; queue positions live in the transport's MmioState."""

    acked_features: int
    max_request_bytes: int


def save_rng(rng: Rng) -> RngState:
    return RngState(acked_features=rng.acked_features, max_request_bytes=rng.max_request_bytes)


def restore_rng(rng: Rng, state: RngState) -> None:
    if rng.activated:
        raise PersistError("restore into an active rng device")
    if state.max_request_bytes <= 0:
        raise PersistError(f"bad rng request cap {state.max_request_bytes}")
    rng.acked_features = state.acked_features
    rng.max_request_bytes = state.max_request_bytes
