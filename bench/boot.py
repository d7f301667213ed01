#!/usr/bin/env python3
"""Benchmark: smol boot to agent-ready and exec latency, against QEMU microvm booting the same guest.

Usage: .venv/bin/python bench/boot.py [--runs N] [--execs N] [--no-qemu] [--json]

For each run it starts ``python -m smold.vmm`` (the VMM process the daemon spawns) and records:
  * first console byte, the initramfs' "smol-init: root ready" line, and agent-ready (READY line),
    all measured from process start;
  * exec round-trip latency of ``true`` through the agent (median and p90 over --execs calls).
The peer is Debian's qemu-system-x86_64 ``-M microvm`` booting the same vmlinux and initramfs (TCG,
and KVM where it works), measured to the same console line, the kernel's "Run /init as init process"
(QEMU has no vsock agent path here, so the shared milestone is the guest's own console line). Install the peer with
``apt-get install qemu-system-x86``. Results go to stdout; copy them to docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from create import host_info  # noqa: E402  (bench/ is on sys.path when run as a script)

from smold.agent import connect_vsock_uds  # noqa: E402
from smold.images.artifacts import Artifacts, default_artifacts  # noqa: E402

ROOT_READY = b"smol-init: root ready"
RUN_INIT = b"Run /init as init process"   # printed at loglevel 7: the kernel is done booting


def _watch(proc: subprocess.Popen[bytes], streams: dict[int, str], markers: dict[str, bytes], t0: float,
           timeout: float, bufs: dict[int, bytes] | None = None) -> dict[str, float]:
    """Read the child's pipes until every marker was seen (or timeout); returns marker -> seconds.

    ``bufs`` (fd -> bytes) receives the last 8 KiB read from each pipe."""
    seen: dict[str, float] = {}
    if bufs is None:
        bufs = {}
    bufs.update({fd: b"" for fd in streams})
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = t0 + timeout
    try:
        while len(seen) < len(markers) and time.monotonic() < deadline and sel.get_map():
            for key, _ in sel.select(timeout=0.5):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                now = time.monotonic() - t0
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                if "first_console" in markers and "first_console" not in seen and streams[key.fd] == "console":
                    seen["first_console"] = now
                bufs[key.fd] = (bufs[key.fd] + chunk)[-8192:]
                for name, pat in markers.items():
                    if name not in seen and pat and pat in bufs[key.fd]:
                        seen[name] = now
            if proc.poll() is not None and not sel.select(timeout=0):
                break
    finally:
        sel.close()
    return seen


def _drain(fd: int) -> None:
    try:
        os.set_blocking(fd, True)
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def run_smol(arts: Artifacts, cpus: int, memory: int, execs: int, timeout: float) -> dict[str, object]:
    argv = [sys.executable, "-m", "smold.vmm", "--kernel", str(arts.kernel), "--initramfs", str(arts.initramfs),
            "--rootfs", str(arts.rootfs), "--cpus", str(cpus), "--memory", str(memory), "--console",
            "--cmdline-extra", "loglevel=7"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout and proc.stderr
    bufs: dict[int, bytes] = {}
    seen = _watch(proc, {proc.stderr.fileno(): "console", proc.stdout.fileno(): "stdout"},
                  {"first_console": b"", "run_init": RUN_INIT, "root_ready": ROOT_READY,
                   "agent_ready": b"READY {"}, t0, timeout, bufs)
    # Keep draining the console so the guest never blocks on a full pipe.
    threading.Thread(target=_drain, args=(proc.stderr.fileno(),), daemon=True).start()
    result: dict[str, object] = {"peer": "smol", **{k: round(v, 3) for k, v in seen.items()}}
    try:
        if "agent_ready" not in seen:
            result["error"] = f"not ready within {timeout}s (exit {proc.poll()})"
            return result
        out = bufs[proc.stdout.fileno()]
        while b"\n" not in out[out.index(b"READY "):]:
            try:
                out += os.read(proc.stdout.fileno(), 65536)
            except BlockingIOError:
                time.sleep(0.01)
        ready = json.loads(out[out.index(b"READY ") + 6:].split(b"\n", 1)[0])
        result["cpu_template"] = ready["cpu_template"]
        result["agent_ready_in_process"] = ready["boot_seconds"]

        async def lat() -> list[float]:
            c = await connect_vsock_uds(ready["vsock_path"], ready["agent_port"])
            try:
                times = []
                for _ in range(execs):
                    s = time.monotonic()
                    r = await c.run(["true"])
                    assert r.exit_code == 0
                    times.append(time.monotonic() - s)
                await c.poweroff()
                return times
            finally:
                await c.close()
        times = asyncio.run(lat())
        result["exec_median_ms"] = round(statistics.median(times) * 1000, 2)
        result["exec_p90_ms"] = round(sorted(times)[int(len(times) * 0.9) - 1] * 1000, 2)
        proc.wait(60)
        result["exit_code"] = proc.returncode
        return result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_qemu(arts: Artifacts, cpus: int, memory: int, accel: str, timeout: float) -> dict[str, object]:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        return {"peer": f"qemu-microvm-{accel}", "error": "qemu-system-x86_64 not installed"}
    # The same guest arguments smol passes (minus its virtio-mmio list and the PVM compat switches).
    # With a PVH vmlinux QEMU does not add its virtio-mmio transports to the command line, so the
    # guest's root disk is not used here: the shared milestone is the kernel's "Run /init" line.
    cmdline = ("console=ttyS0 reboot=k panic=-1 tsc=reliable no_timer_check cryptomgr.notests "
               "rcupdate.rcu_expedited=1 loglevel=7 smol.hostname=smol")
    argv = [qemu, "-M", "microvm,x-option-roms=off,rtc=off", "-accel", accel, "-cpu",
            "max" if accel == "tcg" else "host", "-smp", str(cpus), "-m", str(memory), "-nodefaults",
            "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot", "-kernel", str(arts.kernel),
            "-initrd", str(arts.initramfs), "-append", cmdline,
            "-drive", f"id=root,file={arts.rootfs},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout and proc.stderr
    try:
        seen = _watch(proc, {proc.stdout.fileno(): "console", proc.stderr.fileno(): "stderr"},
                      {"first_console": b"", "run_init": RUN_INIT}, t0, timeout)
        result: dict[str, object] = {"peer": f"qemu-microvm-{accel}", **{k: round(v, 3) for k, v in seen.items()}}
        if "run_init" not in seen:
            err = proc.stderr.read() if proc.poll() is not None else b""
            result["error"] = f"no 'Run /init' line within {timeout}s {err[-300:].decode(errors='replace')}"
        return result
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--memory", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--no-qemu", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    arts = default_artifacts(build=False)
    rows: list[dict[str, object]] = []
    for _ in range(args.runs):
        rows.append(run_smol(arts, args.cpus, args.memory, args.execs, args.timeout))
        if not args.no_qemu:
            for accel in ("tcg", "kvm"):
                rows.append(run_qemu(arts, args.cpus, args.memory, accel, args.timeout))
    summary: dict[str, dict[str, float]] = {}
    for peer in sorted({str(r["peer"]) for r in rows}):
        runs = [r for r in rows if r["peer"] == peer and "error" not in r]
        summary[peer] = {k: round(statistics.median(float(r[k]) for r in runs), 3)  # type: ignore[arg-type]
                         for k in ("first_console", "run_init", "root_ready", "agent_ready", "exec_median_ms")
                         if runs and all(k in r for r in runs)}
    report = {"host": host_info(), "kernel": str(arts.kernel), "runs": rows, "median": summary}
    smol_ri = summary.get("smol", {}).get("run_init")
    for peer, med in summary.items():
        if peer != "smol" and smol_ri and med.get("run_init"):
            med["smol_run_init_ratio"] = round(smol_ri / med["run_init"], 2)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(report["host"])
        for r in rows:
            print("  ", json.dumps(r))
        print("median (seconds from process start; exec in ms):")
        for peer, med in summary.items():
            print(f"   {peer:22s} {json.dumps(med)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
