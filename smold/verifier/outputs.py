"""The agent's declared outputs as the verifier receives them: a hostile tar from the task's guest, re-packed.

Sealed verification (docs/verifier.md) copies only the paths a Smolfile declares in ``verifier.outputs`` from the
task's machine into a fresh verifier machine. The archive comes from the task's guest, where the agent was root:
its agent, its ``tar`` and every byte of it may be forged. ``repack`` reads it on the host as data and writes a new
archive that the verifier machine's (trusted) agent can extract at ``/`` without surprises:

- only regular files, directories and symbolic links, each inside one declared output (``app/x`` for ``/app``);
  a hard link becomes a copy of the regular file it links to (when that was kept); anything else (devices,
  fifos, dangling hard links, names with ``..``, absolute names) is left out and counted;
- no member below a symbolic link of the archive (a link ``/app/l -> /usr/bin`` then ``/app/l/python3`` would
  write through the link): such members are left out; links themselves come last, after every file;
- permission bits kept, setuid, setgid and sticky bits dropped; numeric owners kept;
- a cap on the total size and on the number of members (OutputsError over them).

What is left out is reported, never silently: ``Repacked.dropped`` names the reasons and counts.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from collections import Counter
from dataclasses import dataclass, field

MAX_MEMBERS = 200_000


class OutputsError(Exception):
    """The outputs archive cannot be used: unreadable, or over a cap."""


@dataclass(frozen=True)
class Repacked:
    """The archive to extract at / in the verifier machine, and what was left out of the agent's."""

    archive: bytes
    files: int
    bytes: int  # file content bytes
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> members
    present: frozenset[str] = frozenset()  # the declared outputs the archive has (as absolute paths)

    def describe(self) -> str:
        text = f"{self.files} files, {self.bytes} bytes"
        if self.dropped:
            text += "; left out: " + ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items()))
        return text


def _relative(outputs: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(o.strip("/") for o in outputs)


def _inside(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + "/") for r in roots)


def _normalize(raw: str) -> str | None:
    """A member name relative to /, or None if it is absolute, escapes, or is empty."""
    name = raw
    while name.startswith("./"):
        name = name[2:]
    if not name or name.startswith("/") or "\0" in name:
        return None
    norm = posixpath.normpath(name)
    if norm in (".", "") or norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
        return None
    return norm


def repack(raw: bytes, outputs: tuple[str, ...], *, cap: int) -> Repacked:
    """Re-pack the task guest's archive of ``outputs`` (names relative to /). OutputsError if unusable."""
    roots = _relative(outputs)
    dropped: Counter[str] = Counter()
    dirs: list[tarfile.TarInfo] = []
    files: list[tuple[tarfile.TarInfo, bytes]] = []
    links: list[tarfile.TarInfo] = []
    seen: set[str] = set()
    link_names: set[str] = set()
    file_data: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for count, member in enumerate(tar):
                if count >= MAX_MEMBERS:
                    raise OutputsError(f"the outputs archive has more than {MAX_MEMBERS} members")
                name = _normalize(member.name)
                if name is None:
                    dropped["names outside the outputs"] += 1
                    continue
                if not _inside(name, roots):
                    dropped["names outside the outputs"] += 1
                    continue
                if name in seen:
                    dropped["duplicate names"] += 1
                    continue
                info = tarfile.TarInfo(name)
                info.mode = member.mode & 0o777
                info.uid, info.gid = member.uid, member.gid
                info.mtime = member.mtime
                if member.isreg():
                    total += member.size
                    if total > cap:
                        raise OutputsError(f"the outputs are larger than the cap of {cap} bytes")
                    fobj = tar.extractfile(member)
                    data = fobj.read() if fobj is not None else b""
                    if len(data) != member.size:
                        raise OutputsError(f"the outputs archive is truncated at {member.name!r}")
                    info.size = len(data)
                    files.append((info, data))
                    file_data[name] = data
                elif member.isdir():
                    info.type = tarfile.DIRTYPE
                    dirs.append(info)
                elif member.issym():
                    info.type = tarfile.SYMTYPE
                    info.linkname = member.linkname
                    links.append(info)
                    link_names.add(name)
                elif member.islnk():  # kept as a copy of the file it links to, if that came earlier and was kept
                    target = _normalize(member.linkname)
                    if target is None or target not in file_data:
                        dropped["hard links"] += 1
                        continue
                    data = file_data[target]
                    total += len(data)
                    if total > cap:
                        raise OutputsError(f"the outputs are larger than the cap of {cap} bytes")
                    info.size = len(data)
                    files.append((info, data))
                    file_data[name] = data
                else:
                    dropped["devices, fifos and other special files"] += 1
                    continue
                seen.add(name)
    except OutputsError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise OutputsError(f"the outputs archive is unreadable: {e}") from None
    # Nothing is extracted through a link of the archive, wherever the link stood in it.
    kept_files = [(i, d) for i, d in files if not _below_link(i.name, link_names)]
    kept_dirs = [d for d in dirs if not _below_link(d.name, link_names)]
    kept_links = [ln for ln in links if not _below_link(ln.name, link_names)]
    below = len(files) + len(dirs) + len(links) - len(kept_files) - len(kept_dirs) - len(kept_links)
    if below:
        dropped["entries below a symbolic link"] += below
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in sorted(kept_dirs, key=lambda i: i.name):
            tar.addfile(info)
        for info, data in kept_files:
            tar.addfile(info, io.BytesIO(data))
        for info in kept_links:  # last: no member after a link can pass through it
            tar.addfile(info)
    kept = {i.name for i, _ in kept_files} | {d.name for d in kept_dirs} | {ln.name for ln in kept_links}
    present = frozenset("/" + r for r in roots if any(_inside(k, (r,)) for k in kept))
    return Repacked(out.getvalue(), len(kept_files), sum(len(d) for _, d in kept_files),
                    {k: v for k, v in dropped.items() if v}, present)


def _below_link(name: str, link_names: set[str]) -> bool:
    parts = name.split("/")
    return any("/".join(parts[:i]) in link_names for i in range(1, len(parts)))
