#!/usr/bin/env python3
"""Benchmark: fork a running VM into N copy-on-write children; time to all children ready, memory per child.

Usage: .venv/bin/python bench/fork.py [--snapshot DIR] [--counts 1,4,16] [--exec] [--json]

The parent is a VM restored from --snapshot (default: bake one first: boot the default guest with
--cpus 1 and --snapshot-on-ready; that cold boot is the peer in the same run). For each N the parent is
forked with ``smold.vmm.fork.fork_vm``: snapshot through its control socket (the parent resumes), then N
``--restore --new-identity`` VMM processes. Recorded: parent pause/snapshot time, time until every child's
agent answered with its clock and identity set, host RSS / PSS / anonymous MiB per child, and with --exec
the first exec of ``true`` in child 0 (an exec costs seconds on PVM hosts). Copy results to
docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from create import bake, first_exec, host_info, memory_of, stop, wait_line  # noqa: E402

from smold.vmm.fork import fork_vm  # noqa: E402


def start_parent(snap: Path, work: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-m", "smold.vmm", "--restore", str(snap), "--state-dir",
                             str(work / "parent")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    line, _ = wait_line(proc, b"READY ", 300)
    return proc, json.loads(line[6:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshot", type=Path, help="parent = a VM restored from this snapshot (default: bake)")
    ap.add_argument("--counts", default="1,4,16", help="comma-separated N")
    ap.add_argument("--exec", action="store_true", help="time a first exec in child 0")
    ap.add_argument("--boot-timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(n) for n in args.counts.split(",") if n]

    work = Path(tempfile.mkdtemp(prefix="smol-fork-bench-"))
    result: dict[str, Any] = {"host": host_info(), "forks": []}
    parent = None
    try:
        snap = args.snapshot
        if snap is None:
            snap, result["bake"] = bake(work, args.boot_timeout)
        parent, ready = start_parent(snap, work)
        result["parent_ready_s"] = ready["boot_seconds"]
        for n in counts:
            t0 = time.monotonic()
            fr = asyncio.run(fork_vm(work / "parent" / "control.sock", work / f"fork{n}", n, timeout=900))
            rec: dict[str, Any] = {"n": n, "wall_s": time.monotonic() - t0, "timings": fr.timings,
                                   "parent_paused_s": fr.snapshot["timings"]["total"],
                                   "memory_written_mib": fr.snapshot["memory_written"] / (1 << 20)}
            mems = [memory_of(c.pid) for c in fr.children]
            rec["child_rss_mib"] = statistics.median(m["VmRSS"] for m in mems)
            rec["child_pss_mib"] = statistics.median(m["Pss"] for m in mems)
            rec["child_anon_mib"] = statistics.median(m["RssAnon"] for m in mems)
            rec["children_rss_total_mib"] = round(sum(m["VmRSS"] for m in mems), 1)
            rec["children_pss_total_mib"] = round(sum(m["Pss"] for m in mems), 1)
            if args.exec:
                rec["child0_first_exec_s"] = asyncio.run(first_exec(fr.children[0].vsock_path))
            for c in fr.children:
                c.kill()
            result["forks"].append(rec)
    finally:
        if parent is not None:
            stop(parent)
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(result["host"])
    if "bake" in result:
        print(f"peer: cold boot to agent-ready {result['bake']['boot_to_ready_s']:.1f} s")
    print(f"parent restored to ready in {result['parent_ready_s']} s")
    for r in result["forks"]:
        t = r["timings"]
        ex = f"; child 0 first exec {r['child0_first_exec_s']:.2f} s" if "child0_first_exec_s" in r else ""
        print(f"N={r['n']}: all children ready {t['total']:.2f} s (parent paused {r['parent_paused_s']:.2f} s, "
              f"snapshot {t['snapshot']:.2f} s, children {t['ready']:.2f} s); per child RSS {r['child_rss_mib']:.0f} "
              f"MiB, PSS {r['child_pss_mib']:.0f}, anon {r['child_anon_mib']:.0f}; all children PSS "
              f"{r['children_pss_total_mib']} MiB{ex}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
