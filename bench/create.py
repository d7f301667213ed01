#!/usr/bin/env python3
"""Benchmark: create-from-bake through smold, and create-from-snapshot of the bare VMM, to agent-ready and to
the first exec, with host memory per VM.

Usage: .venv/bin/python bench/create.py [--runs N] [--no-exec] [--concurrent] [--json]        (through smold)
       .venv/bin/python bench/create.py --vmm [--snapshot DIR] [--runs N] [--no-exec] [--concurrent] [--json]

Default (through the daemon): start ``python -m smold.daemon`` (real VMM launcher) on a temp socket and state
dir, BakeImage a Smolfile (default image, cpus 1, 512 MiB; its cold boot + snapshot is the peer), then N times
CreateMachine from the same Smolfile (restored from the bake: new hostname, machine-id, entropy, clock set)
and record: CreateMachine's round trip (the machine is RUNNING: agent answered), the first Exec of ``true``
(to its exit event), create to exec done, and the VMM process's host memory.

With --vmm, the VMM alone:

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
from smold.api.v1 import smol_pb2 as pb  # noqa: E402
from smold.api.v1 import smol_pb2_grpc as pb_grpc  # noqa: E402
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


BENCH_SMOLFILE = """
image = "default"
cpus = 1
memory = "512M"
[timeouts]
boot = 900
"""


def via_daemon(args: argparse.Namespace) -> int:
    import grpc

    work = Path(tempfile.mkdtemp(prefix="smol-bench-", dir="/tmp"))
    sock, log = work / "smold.sock", work / "smold.log"
    default_artifacts(build=True)
    with open(log, "ab") as f:
        daemon = subprocess.Popen([sys.executable, "-m", "smold.daemon", "--socket", str(sock), "--state-dir",
                                   str(work / "state"), "--max-machines", str(max(4, args.runs + 1)),
                                   "--max-memory", str(512 * max(4, args.runs + 1))],
                                  stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
    result: dict[str, Any] = {"host": host_info(), "mode": "smold CreateMachine from a bake", "runs": []}
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smold did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            stub = pb_grpc.SmolStub(channel)
            spec = pb.Smolfile(toml=pb.SmolfileToml(text=BENCH_SMOLFILE))
            t0 = time.monotonic()
            bake = stub.BakeImage(pb.BakeImageRequest(smolfile=spec), timeout=args.boot_timeout + 300).bake
            result["bake"] = {"total_s": time.monotonic() - t0, "bake_seconds": bake.bake_seconds,
                              "disk_mib": bake.size_bytes / (1 << 20), "key": bake.key}
            live: list[str] = []
            for _ in range(args.runs):
                t1 = time.monotonic()
                m = stub.CreateMachine(pb.CreateMachineRequest(smolfile=spec), timeout=600).machine
                t_ready = time.monotonic()
                if m.restored_from != f"bake:{bake.key}":
                    raise RuntimeError(f"machine {m.id} was not restored from the bake: {m.restored_from!r}")
                rec: dict[str, Any] = {"create_s": t_ready - t1}
                if not args.no_exec:
                    code = None
                    for msg in stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["true"], timeout_seconds=600),
                                         timeout=900):
                        if msg.WhichOneof("event") == "exit":
                            code = msg.exit.exit_code
                    if code != 0:
                        raise RuntimeError(f"exec in {m.id} exited {code}")
                    rec["first_exec_s"] = time.monotonic() - t_ready
                    rec["create_to_exec_done_s"] = time.monotonic() - t1
                rec["memory_mib"] = memory_of(m.vmm_pid)
                result["runs"].append(rec)
                if args.concurrent:
                    live.append(m.id)
                    rec["all_vms_rss_mib"] = round(sum(memory_of(stub.GetMachine(pb.GetMachineRequest(
                        machine_id=i)).machine.vmm_pid)["VmRSS"] for i in live), 1)
                else:
                    stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id), timeout=300)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(300)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(work, ignore_errors=True)

    runs = result["runs"]
    med = {k: statistics.median(r[k] for r in runs) for k in ("create_s", "first_exec_s", "create_to_exec_done_s")
           if k in runs[0]}
    med["rss_mib"] = statistics.median(r["memory_mib"]["VmRSS"] for r in runs)
    med["pss_mib"] = statistics.median(r["memory_mib"]["Pss"] for r in runs)
    med["anon_mib"] = statistics.median(r["memory_mib"]["RssAnon"] for r in runs)
    result["median"] = med
    result["ratio_bake_over_create"] = round(result["bake"]["total_s"] / med["create_s"], 1)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(result["host"])
    b = result["bake"]
    print(f"peer: BakeImage (cold boot to agent-ready + snapshot with memory digest) {b['total_s']:.1f} s; "
          f"bake on disk {b['disk_mib']:.0f} MiB")
    for i, r in enumerate(runs):
        m = r["memory_mib"]
        ex = (f", first exec {r['first_exec_s']:.2f} s, create to exec done {r['create_to_exec_done_s']:.2f} s"
              if "first_exec_s" in r else "")
        print(f"run {i}: CreateMachine from bake {r['create_s']:.3f} s{ex}; VMM RSS {m['VmRSS']:.0f} MiB "
              f"(anon {m['RssAnon']:.0f}, file {m['RssFile']:.0f}, PSS {m['Pss']:.0f})"
              + (f"; all VMs {r['all_vms_rss_mib']} MiB" if "all_vms_rss_mib" in r else ""))
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"bake / create from bake: {result['ratio_bake_over_create']}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vmm", action="store_true", help="measure the bare VMM's --restore instead of smold")
    ap.add_argument("--snapshot", type=Path, help="restore this snapshot (default: bake one first)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="bake into DIR and keep it (for bench/fork.py)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-exec", action="store_true", help="do not time a first exec")
    ap.add_argument("--concurrent", action="store_true", help="keep every restored VM up until the end")
    ap.add_argument("--boot-timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.vmm:
        if args.snapshot is not None or args.keep is not None:
            ap.error("--snapshot and --keep go with --vmm")
        return via_daemon(args)

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
