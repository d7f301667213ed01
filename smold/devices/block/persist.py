"""Snapshot state of a virtio-blk device: plain values; the backend is a restore argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from smold.devices.virtio.persist import PersistError

if TYPE_CHECKING:
    from smold.devices.block.device import Block


@dataclass(frozen=True)
class BlockState:
    """What a fresh Block needs to continue: negotiated features plus a check of the disk it serves.

    Queue positions live in the transport's MmioState (the transport owns the queues).
    """

    acked_features: int
    capacity: int
    read_only: bool
    serial: bytes


def save_block(block: Block) -> BlockState:
    return BlockState(acked_features=block.acked_features, capacity=block.capacity,
                      read_only=block.read_only, serial=block.serial)


def restore_block(block: Block, state: BlockState) -> None:
    """Load ``state`` into a freshly constructed Block over the same image (before transport restore)."""
    if block.activated:
        raise PersistError("restore into an active block device")
    if state.capacity != block.capacity:
        raise PersistError(f"snapshot disk has {state.capacity} sectors, backend has {block.capacity}")
    if state.read_only != block.read_only:
        raise PersistError("snapshot and device disagree on read-only")
    block.serial = state.serial
    block.acked_features = state.acked_features
