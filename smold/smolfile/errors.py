"""Typed exceptions of Smolfile parsing: each names the file, the key and the reason."""

from __future__ import annotations

import re
from collections.abc import Sequence

KeyPath = Sequence[str | int]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _segment(key: str) -> str:
    """A TOML key as written in a dotted path: bare if possible, else a quoted string."""
    if _BARE_KEY.fullmatch(key):
        return key
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dotted(path: KeyPath) -> str:
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            out += ("." if out else "") + _segment(seg)
    return out


def render_key(path: KeyPath) -> str:
    """Render a key path the way the error messages show it.

    The last key (with any indices after it) is the leaf; whatever comes before it is the enclosing
    table, in brackets as a TOML table header would name it:

        ("cpus",)                            -> cpus
        ("setup", 1)                         -> setup[1]
        ("timeouts", "boot")                 -> [timeouts].boot
        ("verifier", "checks", 2)            -> [verifier].checks[2]
        ("verifier", "checks", 2, "path")    -> [verifier.checks[2]].path
    """
    path = list(path)
    last_key = max((i for i, seg in enumerate(path) if isinstance(seg, str)), default=-1)
    if last_key <= 0:
        return _dotted(path)
    return f"[{_dotted(path[:last_key])}].{_dotted(path[last_key:])}"


class SmolfileError(Exception):
    """A Smolfile is malformed or invalid: `file: key: reason` (key empty for whole-file errors)."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        self.file = file
        self.key = key
        self.reason = reason
        super().__init__(f"{file}: {key}: {reason}" if key else f"{file}: {reason}")

    @classmethod
    def at(cls, file: str, path: KeyPath, reason: str) -> SmolfileError:
        """An error about the value at a key path (rendered with render_key)."""
        return cls(file, render_key(path), reason)
