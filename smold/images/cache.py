"""Content-addressed cache of guest artifacts (~/.cache/smol) with lock-protected atomic publishing."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from smold.images.errors import ImageBuildError

CACHE_ENV = "SMOL_CACHE_DIR"
MANIFEST = "manifest.json"
KEY_LENGTH = 20

Builder = Callable[[Path, Path, Path], None]
"""``build(out_dir, work_dir, log)`` writes its artifact into ``out_dir``, may use ``work_dir`` as
scratch (deleted afterwards) and appends command output to ``log`` (kept, for error reports)."""


class CacheError(ImageBuildError):
    """The cache is unusable, or a builder did not produce its artifact."""


def default_cache_root() -> Path:
    """``$SMOL_CACHE_DIR`` if set, else ``~/.cache/smol``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "smol"


def content_key(parts: Mapping[str, bytes | str]) -> str:
    """Stable hash of named inputs; framing makes ({"a": "bc"}) and ({"ab": "c"}) differ."""
    h = hashlib.sha256()
    for name in sorted(parts):
        value = parts[name]
        data = value.encode() if isinstance(value, str) else value
        name_b = name.encode()
        h.update(len(name_b).to_bytes(8, "little") + name_b + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:KEY_LENGTH]


def tree_digest(root: Path, *, skip_dirs: frozenset[str] = frozenset({"__pycache__"}),
                skip_suffixes: tuple[str, ...] = (".pyc", ".pyo")) -> str:
    """Hash relative paths, modes (exec bit), symlink targets and bytes of every file under ``root``."""
    h = hashlib.sha256()
    for path in sorted(iter_tree(root, skip_dirs=skip_dirs, skip_suffixes=skip_suffixes)):
        rel = path.relative_to(root).as_posix().encode()
        if path.is_symlink():
            kind, data = b"L", os.readlink(path).encode()
        elif path.is_dir():
            kind, data = b"D", b""
        else:
            kind = b"X" if os.access(path, os.X_OK) else b"F"
            data = path.read_bytes()
        h.update(kind + len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def iter_tree(root: Path, *, skip_dirs: frozenset[str] = frozenset({"__pycache__"}),
              skip_suffixes: tuple[str, ...] = (".pyc", ".pyo")) -> Iterator[Path]:
    """Every directory, file and symlink below ``root`` (not ``root`` itself), minus build litter."""
    if not root.is_dir():
        raise CacheError(f"input directory {root} does not exist")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        base = Path(dirpath)
        for d in dirnames:
            yield base / d
        for f in sorted(filenames):
            if not f.endswith(skip_suffixes):
                yield base / f


class ArtifactCache:
    """Artifacts live at ``<root>/<name>-<key>/<filename>``; a directory appears only when complete."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def entry_dir(self, name: str, key: str) -> Path:
        return self.root / f"{name}-{key}"

    def lookup(self, name: str, key: str, filename: str) -> Path | None:
        """The cached artifact path, or None when it is not (completely) there."""
        d = self.entry_dir(name, key)
        path = d / filename
        if (d / MANIFEST).is_file() and path.is_file():
            return path
        return None

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        locks = self.root / ".locks"
        try:
            locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CacheError(f"cannot create cache lock under {locks}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _sweep(self, name: str) -> None:
        # Called with the name's lock held: any .tmp-/.old- dir for it is a crashed build's leftover.
        for stale in list(self.root.glob(f".tmp-{name}-*")) + list(self.root.glob(f".old-{name}-*")):
            shutil.rmtree(stale, ignore_errors=True)

    def publish(self, name: str, key: str, filename: str, build: Builder, *,
                manifest: Mapping[str, str] | None = None, force: bool = False) -> Path:
        """Return the cached artifact, building it first if absent (or ``force``); never half-published."""
        if not force and (hit := self.lookup(name, key, filename)) is not None:
            return hit
        with self._lock(name):
            if not force and (hit := self.lookup(name, key, filename)) is not None:
                return hit  # another process built it while we waited for the lock
            self._sweep(name)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{key}-", dir=self.root))
            try:
                out, work = tmp / "out", tmp / "work"
                out.mkdir()
                work.mkdir()
                log = self.root / "logs" / f"{name}-{key}.log"
                log.parent.mkdir(exist_ok=True)
                log.write_bytes(b"")
                build(out, work, log)
                artifact = out / filename
                if not artifact.is_file() or artifact.stat().st_size == 0:
                    raise CacheError(f"builder for {name} did not produce {filename}")
                shutil.rmtree(work)
                doc = {"name": name, "key": key, "filename": filename, "inputs": dict(manifest or {})}
                (out / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
                for p in out.iterdir():
                    with open(p, "rb") as fh:
                        os.fsync(fh.fileno())
                final = self.entry_dir(name, key)
                old: Path | None = None
                if final.exists():
                    old = self.root / f".old-{name}-{key}-{os.getpid()}"
                    os.rename(final, old)
                os.rename(out, final)  # atomic: readers see nothing or the complete directory
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        path = final / filename
        return path
