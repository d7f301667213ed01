"""Image references: ``[registry[:port]/]repository[:tag][@sha256:...]`` (distribution reference grammar)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .digest import check_digest
from .errors import BadReferenceError, FormatError

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
DEFAULT_TAG = "latest"
# distribution/reference: path components are lowercase alnum separated by '.', '_', '__' or '-'s.
_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_HOST_RE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                      r"|\[[0-9A-Fa-f:.]+\]")
_PORT_RE = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class Reference:
    """A parsed registry reference; ``str()`` gives its canonical form."""

    registry: str  # as written by the user ("docker.io" for Docker Hub)
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def api_host(self) -> str:
        """host[:port] that serves the v2 API (Docker Hub's API lives on another host)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def wanted(self) -> str:
        """What to ask the registry for: the digest if pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def _is_host(part: str) -> bool:
    if part == "localhost":
        return True
    if "." not in part and ":" not in part:
        return False
    host, _, port = part.rpartition(":") if not part.endswith("]") and ":" in part else (part, "", "")
    return bool(_HOST_RE.fullmatch(host)) and (not port or bool(_PORT_RE.fullmatch(port)))


def parse_reference(text: str) -> Reference:
    """Parse a reference; BadReferenceError explains what is wrong."""
    if not text or len(text) > 255 * 2 or text != text.strip():
        raise BadReferenceError(f"invalid image reference {text!r}")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        try:
            check_digest(digest)
        except FormatError as e:
            raise BadReferenceError(f"image reference {text!r}: {e}") from None
    tag = None
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG_RE.fullmatch(tag):
            raise BadReferenceError(f"image reference {text!r}: invalid tag {tag!r}")
    first, sep, remainder = rest.partition("/")
    if sep and _is_host(first):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not path or not all(_COMPONENT_RE.fullmatch(c) for c in path.split("/")):
        raise BadReferenceError(f"image reference {text!r}: invalid repository {path!r} "
                                "(lowercase letters, digits and . _ - separators)")
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return Reference(registry, path, tag, digest)
