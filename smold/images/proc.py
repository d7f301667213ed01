"""Subprocess and Debian-package helpers that report the failing command and its output tail."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from smold.images.errors import ImageBuildError

TAIL_LINES = 40


class CommandError(ImageBuildError):
    """A build command exited non-zero (or could not be started)."""

    def __init__(self, cmd: Sequence[str], returncode: int | None, tail: str, log: Path | None = None) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.tail = tail
        self.log = log
        where = f" (full log: {log})" if log is not None else ""
        status = "could not start" if returncode is None else f"exited {returncode}"
        super().__init__(f"command {status}: {shlex.join(self.cmd)}{where}\n--- output tail ---\n{tail}")


class PackageError(ImageBuildError):
    """A required Debian package is missing and cannot be installed."""


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    input_bytes: bytes | None = None,
) -> str:
    """Run ``cmd``; return its stdout. With ``log``, stdout+stderr go to that file instead (returns "")."""
    argv = [os.fspath(c) for c in cmd]
    full_env = None if env is None else {**os.environ, **env}
    try:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as fh:
                fh.write(f"$ {shlex.join(argv)}\n".encode())
                fh.flush()
                proc = subprocess.run(argv, cwd=cwd, env=full_env, input=input_bytes, stdout=fh,
                                      stderr=subprocess.STDOUT, check=False)
            if proc.returncode != 0:
                text = log.read_bytes()[-64 * 1024:].decode("utf-8", "replace")
                raise CommandError(argv, proc.returncode, _tail(text), log)
            return ""
        proc = subprocess.run(argv, cwd=cwd, env=full_env, input=input_bytes, capture_output=True, check=False)
    except OSError as exc:
        raise CommandError(argv, None, str(exc), log) from exc
    if proc.returncode != 0:
        text = (proc.stdout + proc.stderr).decode("utf-8", "replace")
        raise CommandError(argv, proc.returncode, _tail(text))
    return proc.stdout.decode("utf-8", "replace")


def package_version(package: str) -> str | None:
    """Installed version of a Debian package, or None if it is not installed."""
    try:
        proc = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Status} ${Version}", package],
                              capture_output=True, check=False)
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    status, _, version = proc.stdout.decode().partition(" ")
    return version if status == "installed" and version else None


def package_versions(packages: Sequence[str]) -> dict[str, str]:
    """Map each package to its installed version ("absent" when not installed)."""
    return {p: package_version(p) or "absent" for p in packages}


def ensure_packages(packages: Sequence[str], *, log: Path | None = None) -> None:
    """Install missing Debian packages with apt-get (needs root); no-op when all are present."""
    missing = [p for p in packages if package_version(p) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise PackageError(f"missing build packages {missing}; run: sudo apt-get install -y {' '.join(missing)}")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update"], env=env, log=log)
    run(["apt-get", "install", "-y", "--no-install-recommends", *missing], env=env, log=log)
    still = [p for p in missing if package_version(p) is None]
    if still:
        raise PackageError(f"apt-get reported success but {still} are still not installed")
