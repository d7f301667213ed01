"""smolctl run-task on a real microVM: a Harbor-format task whose oracle passes (one boot)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_daemon_vm import Daemon, vmm_processes

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_run_task import write_task  # noqa: E402


def test_run_task_on_a_vm() -> None:
    d = Path(tempfile.mkdtemp(prefix="smrt-", dir="/tmp"))
    daemon = Daemon(d).start()
    try:
        task = write_task(d, "vm-pass", "echo $EXPECTED > answer.txt\n",
                          dockerfile="FROM debian:bookworm\nWORKDIR /app\nENV EXPECTED=42\nCOPY seed.txt /app/\n",
                          files={"seed.txt": "seed\n"})
        (task / "task.toml").write_text("[agent]\ntimeout_sec = 300.0\n[verifier]\ntimeout_sec = 300.0\n"
                                        "[environment]\nmemory_mb = 512\ncpus = 1\n")
        t0 = time.monotonic()
        res = daemon.smolctl("run-task", str(task), "--json")
        out = json.loads(res.stdout)
        print(f"\nrun-task on a VM: {time.monotonic() - t0:.1f}s; steps: "
              + ", ".join(f"{s['name']} {s['duration_s']}s" for s in out["steps"]))
        assert res.returncode == 0 and out["reward"] == 1.0, res.stdout.decode() + res.stderr.decode()
    finally:
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
