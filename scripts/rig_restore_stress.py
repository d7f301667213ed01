"""Restore stress for the KVM rig (docs/kvm-rig.md, "The EVENTINJ flaw"): bake one 2-vCPU guest, restore it N times.

Run inside the rig, from the repository root, e.g.::

    scripts/kvm-rig --tb-size 32 --share /tmp/rs -- .venv/bin/python scripts/rig_restore_stress.py -n 100 --out /tmp/rs

Each restore (``--parallel`` at a time) runs a few short execs. A failed one leaves its VMM's stderr, its console
and, when the rig's tracefs is there, the L1 KVM trace (entries, exits, injections) and its threads' states in
``--out``. The last line counts the outcomes. A diagnostic, not a test: it never fails on its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from microvm import VM_CPUS, Microvm  # noqa: E402

from smold.images.artifacts import Artifacts, default_artifacts  # noqa: E402

TRACE = Path("/sys/kernel/tracing")
KVM_EVENTS = ("kvm_entry", "kvm_exit", "kvm_inj_virq", "kvm_inj_exception", "kvm_page_fault", "kvm_nested_vmexit",
              "kvm_apic_accept_irq", "kvm_set_irq", "kvm_msi_set_irq", "kvm_vcpu_wakeup", "kvm_apic_ipi",
              "kvm_userspace_exit")


def start_tracing() -> bool:
    if not (TRACE / "events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACE)], check=False)
    try:
        (TRACE / "buffer_size_kb").write_text("8192")
        for ev in KVM_EVENTS:
            f = TRACE / "events" / "kvm" / ev / "enable"
            if f.exists():
                f.write_text("1")
        (TRACE / "tracing_on").write_text("1")
        return True
    except OSError as e:
        print(f"no L1 KVM trace: {e}", flush=True)
        return False


class RestoredVm(Microvm):
    def __init__(self, snapshot: Path, state_dir: Path) -> None:
        super().__init__(Artifacts(Path(), Path(), Path()), state_dir=state_dir,
                         console_log=state_dir.parent / f"{state_dir.name}-console.log")
        self.argv = [sys.executable, "-m", "smold.vmm", "--restore", str(snapshot), "--state-dir", str(state_dir),
                     "--console-log", str(self.console_log), "--seccomp", "on", "--boot-timeout", "60", "-v",
                     "--new-identity", "--hostname", state_dir.name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=60, help="restores (default 60)")
    ap.add_argument("--parallel", type=int, default=2, help="restores at a time (default 2)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/restore-stress"), help="evidence of failures")
    ap.add_argument("--work", type=Path, default=Path("/tmp/restore-stress-work"))
    ap.add_argument("--load", default="for i in 1 2 3 4 5; do cat /proc/interrupts > /dev/null; done; echo ok",
                    help="shell command each of the 3 execs runs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    tracing = start_tracing()
    snap = args.work / "snap"
    t0 = time.monotonic()
    bake = Microvm(default_artifacts(build=True), cpus=VM_CPUS, memory_mib=512, state_dir=args.work / "parent",
                   console_log=args.work / "parent-console.log",
                   extra_args=["--seccomp", "on", "--snapshot-on-ready", str(snap), "--", "sh", "-c", "echo baked"])
    bake.start()
    print(f"bake exit {bake.wait(timeout=600)} in {time.monotonic() - t0:.1f} s", flush=True)

    def one(i: int) -> str:
        r = RestoredVm(snap, args.work / f"r{i}")
        t = time.monotonic()
        try:
            r.start(timeout=90)
            for _ in range(3):
                res = r.with_agent(lambda c: c.run(["sh", "-c", args.load], timeout=30), timeout=45)
                if res.exit_code != 0:
                    return f"exec-failed {res.exit_code}"
            return f"ok {time.monotonic() - t:.1f}s"
        except Exception as e:  # noqa: BLE001 -- every failure is counted and its evidence kept
            text = f"FAIL {time.monotonic() - t:.1f}s {str(e)[:300]!r}"
            (args.out / f"r{i}.stderr").write_bytes(r.stderr[-20000:])
            if r.console_log is not None and r.console_log.exists():
                (args.out / f"r{i}.console").write_bytes(r.console_log.read_bytes()[-200000:])
            if r.proc is not None and r.proc.poll() is None:
                threads = subprocess.run(["sh", "-c", f"for t in /proc/{r.proc.pid}/task/*; do echo $t "
                                          "$(cut -d' ' -f3,14,15 $t/stat) $(cat $t/wchan); done"],
                                         capture_output=True, text=True).stdout
                (args.out / f"r{i}.threads").write_text(threads)
            if tracing:
                (TRACE / "tracing_on").write_text("0")
                (args.out / f"r{i}.trace").write_bytes((TRACE / "trace").read_bytes()[-60_000_000:])
                (TRACE / "trace").write_text("")
                (TRACE / "tracing_on").write_text("1")
            return text
        finally:
            r.kill()

    counts: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as ex:
        for i, res in enumerate(ex.map(one, range(args.n))):
            counts[res.split()[0]] = counts.get(res.split()[0], 0) + 1
            print(f"{i}: {res}", flush=True)
    print("COUNTS", json.dumps(counts), f"total {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
