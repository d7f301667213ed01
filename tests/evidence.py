"""What a failed VM test leaves for its report: its daemons' logs and its machines' consoles, copied out of the rig.

The KVM rig's /tmp is a tmpfs that vanishes with it; a failed test's daemon log and the console of the machine
that failed are the evidence (docs/kvm-rig.md, "Flakes seen"). When ``SMOL_VM_TIER_OUT`` names the VM tier's shared
output folder (scripts/vm-tier sets it), every such file written during the failed test is copied there, under
``evidence/<test>/``, each cut to its last 256 KiB.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

OUT_ENV = "SMOL_VM_TIER_OUT"
TAIL_BYTES = 256 * 1024
MAX_FILES = 40
# Daemons of the VM tests keep their logs and state under a temp dir of /tmp (tests/integration/test_daemon_vm.py
# Daemon, test_daemon_fork_vm.py, microvm.py).
PATTERNS = ("*/smold.log", "*/*/smold.log", "*/state/machines/*/console.log", "*/state/machines/*/vmm.log",
            "*/state/machines/*/exit.json", "*/machines/*/console.log", "*/machines/*/vmm.log",
            "*/machines/*/exit.json")


def save_failure_evidence(nodeid: str, since: float, *, out: str | None = None, root: str = "/tmp") -> list[Path]:
    """Copy the logs under ``root`` modified at or after ``since`` (a Unix time) to ``out``/evidence/<nodeid>;
    the copies made (none when ``out`` is unset)."""
    out = out if out is not None else os.environ.get(OUT_ENV)
    if not out:
        return []
    dest = Path(out) / "evidence" / re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:150]
    made: list[Path] = []
    for pattern in PATTERNS:
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            if len(made) >= MAX_FILES:
                return made
            try:
                st = os.stat(path)
                if st.st_mtime < since - 1:
                    continue
                with open(path, "rb") as f:
                    f.seek(max(0, st.st_size - TAIL_BYTES))
                    data = f.read(TAIL_BYTES)
                dest.mkdir(parents=True, exist_ok=True)
                target = dest / os.path.relpath(path, root).replace("/", "__")
                target.write_bytes(data)
                made.append(target)
            except OSError:
                continue
    return made
