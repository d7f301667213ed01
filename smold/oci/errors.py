"""Typed exceptions of the OCI image pipeline."""

from __future__ import annotations


class OciError(Exception):
    """An OCI image could not be imported, pulled, unpacked or found."""


class DigestError(OciError):
    """A blob's bytes do not match its digest or size (tampered or truncated content)."""


class FormatError(OciError):
    """A manifest, index, config or archive is malformed or of an unsupported media type."""


class PlatformError(OciError):
    """An index has no manifest for the wanted platform."""


class UnsafePathError(OciError):
    """A layer entry would write outside the root (absolute path, '..', or a symlink escape)."""


class UnsupportedError(OciError):
    """A layer uses a feature this host cannot handle (e.g. zstd without the zstandard module)."""


class RegistryError(OciError):
    """The registry refused a request, or answered something that is not the distribution protocol."""


class BadReferenceError(OciError):
    """An image reference is not of the form [registry/]repository[:tag][@digest]."""


class ImageNotCachedError(OciError):
    """The image is not in the local cache."""
