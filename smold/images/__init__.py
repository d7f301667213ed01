"""Reproducible guest artifacts (kernel, initramfs, rootfs), cached by content hash of their inputs."""

from smold.images.artifacts import ArtifactMissingError, Artifacts, default_artifacts, resolve
from smold.images.errors import ImageBuildError

__all__ = ["ArtifactMissingError", "Artifacts", "ImageBuildError", "default_artifacts", "resolve"]
