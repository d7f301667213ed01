"""Canonical form and content digest of a validated Smolfile (what results record as smolfile_digest)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .model import Check, Command, CommandCheck, FileExistsCheck, FileMatchesCheck, HttpCheck, Smolfile

# Bumped whenever the meaning of the canonical form changes, so that old and new digests never collide.
CANONICAL_VERSION = 1


def _run(run: str | tuple[str, ...]) -> str | list[str]:
    return run if isinstance(run, str) else list(run)


def _command(cmd: Command) -> dict[str, Any]:
    out: dict[str, Any] = {"run": _run(cmd.run)}
    if cmd.timeout is not None:
        out["timeout"] = cmd.timeout
    if cmd.cwd is not None:
        out["cwd"] = cmd.cwd
    if cmd.user is not None:
        out["user"] = cmd.user
    return out


def _check(check: Check) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": check.kind, "name": check.name}
    if check.timeout is not None:
        out["timeout"] = check.timeout
    if isinstance(check, CommandCheck):
        out["run"] = _run(check.run)
        out["expect_exit"] = check.expect_exit
        if check.cwd is not None:
            out["cwd"] = check.cwd
        if check.user is not None:
            out["user"] = check.user
    elif isinstance(check, FileExistsCheck):
        out["path"] = check.path
    elif isinstance(check, FileMatchesCheck):
        out["path"] = check.path
        for key in ("content", "regex", "sha256"):
            if getattr(check, key) is not None:
                out[key] = getattr(check, key)
    elif isinstance(check, HttpCheck):
        out["url"] = check.url
        out["expect_status"] = check.expect_status
        if check.contains is not None:
            out["contains"] = check.contains
    else:
        if check.path is not None:
            out["path"] = check.path
        out["threshold"] = check.threshold
    return out


def _network(smolfile: Smolfile) -> dict[str, Any]:
    out: dict[str, Any] = {"allow": [str(r) for r in smolfile.network.allow]}
    if smolfile.network.forward:  # absent when empty: digests of Smolfiles without forwards are unchanged
        out["forward"] = [str(f) for f in smolfile.network.forward]
    if smolfile.network.public:  # likewise
        out["public"] = True
    return out


def to_mapping(smolfile: Smolfile) -> dict[str, Any]:
    """The Smolfile as a TOML-shaped mapping with every default explicit.

    parse_mapping(to_mapping(s), base_dir=s.base_dir) == s. The base directory is not included.
    """
    out: dict[str, Any] = {
        "image": smolfile.image,
        "cpus": smolfile.cpus,
        "memory": smolfile.memory_mib,
        "network": ("closed" if smolfile.network.closed else _network(smolfile)) if smolfile.network.enabled
        else "off",
        "mounts": {m.host: m.guest for m in smolfile.mounts},
        "env": dict(smolfile.env),
        "setup": [_command(c) for c in smolfile.setup],
        "timeouts": {
            "boot": smolfile.timeouts.boot,
            "setup": smolfile.timeouts.setup,
            "task": smolfile.timeouts.task,
            "verify": smolfile.timeouts.verify,
        },
        "verifier": {"checks": [_check(c) for c in smolfile.checks]},
    }
    if smolfile.verifier_mounts:  # absent when empty: digests of Smolfiles without them are unchanged
        out["verifier"]["mounts"] = {m.host: m.guest for m in smolfile.verifier_mounts}
    if smolfile.verifier_outputs:  # likewise
        out["verifier"]["outputs"] = list(smolfile.verifier_outputs)
    if smolfile.verifier_image:  # likewise
        out["verifier"]["image"] = smolfile.verifier_image
    if smolfile.task is not None:
        out["task"] = _command(smolfile.task)
    return out


def canonical_bytes(smolfile: Smolfile) -> bytes:
    """Deterministic JSON of the canonical mapping: sorted keys, no whitespace, UTF-8."""
    doc = {"smolfile_canonical_version": CANONICAL_VERSION, "spec": to_mapping(smolfile)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


# The parts of a Smolfile that shape a machine's state once it is created (booted, mounts copied, setup run):
# what a pre-baked snapshot must agree on (smold/daemon/bakes.py). Timeouts, task and verifier do not.
BOOT_STATE_KEYS = ("image", "cpus", "memory", "network", "mounts", "env", "setup")


def boot_state_mapping(smolfile: Smolfile) -> dict[str, Any]:
    """The canonical mapping restricted to BOOT_STATE_KEYS."""
    full = to_mapping(smolfile)
    return {k: full[k] for k in BOOT_STATE_KEYS}


def boot_state_digest(smolfile: Smolfile, *extra: str) -> str:
    """"sha256:<hex>" of the boot-state part of the canonical form plus ``extra`` strings (the image's
    digest, the mounts' content digest): equal Smolfiles that differ only in timeouts, task or verifier
    share it. Mount contents are not read here; callers pass a digest of them in ``extra``."""
    doc = {"smolfile_canonical_version": CANONICAL_VERSION, "boot_state": boot_state_mapping(smolfile),
           "extra": list(extra)}
    data = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest(smolfile: Smolfile) -> str:
    """"sha256:<hex>" of the canonical form: equal for Smolfiles that mean the same (comments, key order,
    defaults written out or not, "2G" vs 2048), different for any change in meaning. Mount *contents*
    are not included; the base directory is not either, so the digest is the same on every host."""
    return "sha256:" + hashlib.sha256(canonical_bytes(smolfile)).hexdigest()
