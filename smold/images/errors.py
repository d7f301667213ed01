"""Base exception for the guest-artifact pipeline."""

from __future__ import annotations


class ImageBuildError(Exception):
    """A guest artifact (kernel, initramfs, rootfs) could not be built or found."""
