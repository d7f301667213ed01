"""virtio-blk device (virtio 1.2 section 5.2): device model, request parser, file backend, snapshot state."""

from smold.devices.block.backend import BackendError, BlockBackend, FileBackend
from smold.devices.block.device import Block, BlockError
from smold.devices.block.persist import BlockState

__all__ = ["BackendError", "Block", "BlockBackend", "BlockError", "BlockState", "FileBackend"]
