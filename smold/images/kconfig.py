"""Kconfig fragment parsing and verification that every requested option reached the final .config."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from smold.images.errors import ImageBuildError

_SET = re.compile(r"^(CONFIG_[A-Za-z0-9_]+)=(.*)$")
_UNSET = re.compile(r"^# (CONFIG_[A-Za-z0-9_]+) is not set$")

Options = dict[str, str | None]
"""Option name -> value as written in .config (``y``, ``32``, ``"str"``), None for "is not set"."""


class KconfigError(ImageBuildError):
    """A fragment is malformed, or the generated .config lacks requested options."""


def parse_config(text: str) -> Options:
    """Parse .config text: ``CONFIG_X=v`` and ``# CONFIG_X is not set`` lines; other comments ignored."""
    opts: Options = {}
    for line in text.splitlines():
        line = line.strip()
        if m := _SET.match(line):
            opts[m[1]] = m[2]
        elif m := _UNSET.match(line):
            opts[m[1]] = None
    return opts


def parse_fragment(text: str, source: str = "<fragment>") -> Options:
    """Strictly parse a fragment: every non-blank line is an option, an unset marker or a ``#`` comment."""
    opts: Options = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if m := _SET.match(line):
            name, value = m[1], m[2]
            if value == "n":
                value = None
            if value == "m":
                raise KconfigError(f"{source}:{lineno}: {name}=m but the guest kernel has no modules")
        elif m := _UNSET.match(line):
            name, value = m[1], None
        elif line.startswith("#"):
            continue
        else:
            raise KconfigError(f"{source}:{lineno}: not a Kconfig line: {raw!r}")
        if name in opts:
            raise KconfigError(f"{source}:{lineno}: {name} given twice")
        opts[name] = value
    if not opts:
        raise KconfigError(f"{source}: fragment requests no options")
    return opts


def load_fragment(path: Path) -> Options:
    try:
        return parse_fragment(path.read_text(), str(path))
    except OSError as exc:
        raise KconfigError(f"cannot read kernel config fragment {path}: {exc}") from exc


def mismatches(requested: Mapping[str, str | None], actual: Mapping[str, str | None]) -> list[str]:
    """Human-readable list of requested options whose final value differs (empty when all match)."""
    out = []
    for name, want in requested.items():
        have = actual.get(name)
        if want != have:
            out.append(f"{name}: requested {'is not set' if want is None else want!r}, "
                       f"got {'is not set' if have is None else have!r}")
    return out


def verify_config(requested: Mapping[str, str | None], config_text: str) -> None:
    """Raise KconfigError naming every requested option Kconfig dropped or changed."""
    bad = mismatches(requested, parse_config(config_text))
    if bad:
        raise KconfigError("kernel .config does not honour the fragment (missing dependency?):\n  "
                           + "\n  ".join(bad))
