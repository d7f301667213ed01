#!/usr/bin/env python3
"""Benchmark: create-from-snapshot (restore) to agent-ready and to the first exec, with host memory per VM.

Usage: .venv/bin/python bench/create.py [--snapshot DIR] [--runs N] [--no-exec] [--concurrent] [--json]

Without --snapshot it first bakes one: boots the default guest (--cpus 1, 512 MiB) with
``--snapshot-on-ready``; that cold boot to agent-ready is the peer the restores are compared with
(same image, same run, same host). Each run then starts ``python -m smold.vmm --restore DIR`` (the VMM
process the daemon spawns) and records, from process start:
  * vCPUs running and agent answering (READY line; includes the guest clock correction);
  * the first exec of ``true`` through the agent (unless --no-exec: an exec costs seconds on PVM);
  * host RSS / PSS / anonymous memory of the VMM process after that exec.
With --concurrent all restored VMs stay up until the last run, so RSS shows what N VMs sharing one memory
file cost together. Results go to stdout; copy them to docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smold.agent import connect_vsock_uds  # noqa: E402
from smold.images.artifacts import default_artifacts  # noqa: E402
from smold.kvm import is_pvm  # noqa: E402


def host_info() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kvm = "PVM (nested, shadow paging; guest kernel emulated)" if is_pvm() else "hardware KVM"
    return f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}), kernel {platform.release()}, /dev/kvm = {kvm}"


def memory_of(pid: int) -> dict[str, float]:
    """MiB: VmRSS, RssAnon, RssFile (/proc/PID/status) and Pss (smaps_rollup)."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1]) / 1024
    return out


def wait_line(proc: subprocess.Popen[bytes], prefix: bytes, timeout: float) -> tuple[bytes, float]:
    """Read stdout lines until one starts with ``prefix``; returns it and when it came (monotonic)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line, time.monotonic()
    raise RuntimeError(f"no {prefix!r} line from pid {proc.pid} (exit {proc.poll()})")


def bake(work: Path, timeout: float, snap: Path | None = None) -> tuple[Path, dict[str, Any]]:
    art = default_artifacts(build=True)
    snap = snap or work / "snap"
    argv = [sys.executable, "-m", "smold.vmm", "--kernel", str(art.kernel), "--initramfs", str(art.initramfs),
            "--rootfs", str(art.rootfs), "--cpus", "1", "--memory", "512", "--state-dir", str(work / "bake"),
            "--snapshot-on-ready", str(snap)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready, _ = wait_line(proc, b"READY ", timeout)
    line, t_snap = wait_line(proc, b"SNAPSHOT ", 120)
    if proc.wait(60) != 0:
        raise RuntimeError(f"bake exited {proc.returncode}")
    info = {"boot_to_ready_s": json.loads(ready[6:])["boot_seconds"], "bake_total_s": t_snap - t0,
            "snapshot": json.loads(line[9:])}
    return snap, info


async def first_exec(vsock: str) -> float:
    client = await connect_vsock_uds(vsock, 1024, timeout=60)
    try:
        t0 = time.monotonic()
        r = await client.run(["true"], timeout=600)
        if r.exit_code != 0:
            raise RuntimeError(f"exec failed: {r}")
        return time.monotonic() - t0
    finally:
        await client.close()


def restore_once(snap: Path, work: Path, i: int, do_exec: bool) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    state = work / f"r{i}"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "smold.vmm", "--restore", str(snap), "--state-dir", str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    line, t_ready = wait_line(proc, b"READY ", 300)
    ready = json.loads(line[6:])
    rec: dict[str, Any] = {"ready_s": t_ready - t0, "vcpu_start_s": ready["vcpu_start_seconds"],
                           "timings": ready["timings"]}
    if do_exec:
        rec["first_exec_s"] = asyncio.run(first_exec(ready["vsock_path"]))
        rec["ready_to_exec_done_s"] = time.monotonic() - t0
    rec["memory_mib"] = memory_of(proc.pid)
    return rec, proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshot", type=Path, help="restore this snapshot (default: bake one first)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="bake into DIR and keep it (for bench/fork.py)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-exec", action="store_true", help="do not time a first exec")
    ap.add_argument("--concurrent", action="store_true", help="keep every restored VM up until the end")
    ap.add_argument("--boot-timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="smol-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {"host": host_info(), "runs": []}
    try:
        snap = args.snapshot
        if snap is None:
            snap, result["bake"] = bake(work, args.boot_timeout, args.keep)
        for i in range(args.runs):
            rec, proc = restore_once(snap, work, i, not args.no_exec)
            result["runs"].append(rec)
            if args.concurrent:
                procs.append(proc)
                rec["all_vms_rss_mib"] = round(sum(memory_of(p.pid)["VmRSS"] for p in procs), 1)
            else:
                stop(proc)
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)

    runs = result["runs"]
    med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "vcpu_start_s", "first_exec_s",
                                                               "ready_to_exec_done_s") if k in runs[0]}
    med["rss_mib"] = statistics.median(r["memory_mib"]["VmRSS"] for r in runs)
    med["anon_mib"] = statistics.median(r["memory_mib"]["RssAnon"] for r in runs)
    result["median"] = med
    if "bake" in result:
        result["ratio_boot_over_restore_ready"] = round(result["bake"]["boot_to_ready_s"] / med["ready_s"], 1)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(result["host"])
    if "bake" in result:
        b = result["bake"]
        print(f"peer: cold boot to agent-ready {b['boot_to_ready_s']:.1f} s; snapshot {b['snapshot']}")
    for i, r in enumerate(runs):
        m = r["memory_mib"]
        ex = f", first exec {r['first_exec_s']:.2f} s" if "first_exec_s" in r else ""
        print(f"run {i}: ready {r['ready_s']:.3f} s (vCPUs {r['vcpu_start_s']:.3f} s){ex}; RSS {m['VmRSS']:.0f} MiB "
              f"(anon {m['RssAnon']:.0f}, file {m['RssFile']:.0f}, PSS {m['Pss']:.0f})"
              + (f"; all VMs {r['all_vms_rss_mib']} MiB" if "all_vms_rss_mib" in r else ""))
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    if "ratio_boot_over_restore_ready" in result:
        print(f"cold boot / restore (to agent ready): {result['ratio_boot_over_restore_ready']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
