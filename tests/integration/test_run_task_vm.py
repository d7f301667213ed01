"""Harbor-format tasks on real microVMs: smolctl run-task (one boot), and the real Harbor's trial in
smol.harbor_env.SmolEnvironment (one boot; Harbor runs in $SMOL_HARBOR_PYTHON, see tests/unit/test_harbor_cli.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from microvm import VM_CPUS
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
                                        f"[environment]\nmemory_mb = 512\ncpus = {VM_CPUS}\n")
        t0 = time.monotonic()
        res = daemon.smolctl("run-task", str(task), "--json")
        assert res.stdout.strip(), f"run-task printed nothing (exit {res.returncode}): {res.stderr.decode()[-3000:]}"
        out = json.loads(res.stdout)
        print(f"\nrun-task on a VM: {time.monotonic() - t0:.1f}s; steps: "
              + ", ".join(f"{s['name']} {s['duration_s']}s" for s in out["steps"]))
        assert res.returncode == 0 and out["reward"] == 1.0, res.stdout.decode() + res.stderr.decode()
    finally:
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


HARBOR_PYTHON = os.environ.get("SMOL_HARBOR_PYTHON", "")


@pytest.mark.skipif(not HARBOR_PYTHON and not os.environ.get("CI"), reason="SMOL_HARBOR_PYTHON is not set")
def test_harbor_trial_on_a_vm() -> None:
    assert HARBOR_PYTHON, "CI must set SMOL_HARBOR_PYTHON (.ci/harbor-python builds it)"
    d = Path(tempfile.mkdtemp(prefix="smht-", dir="/tmp"))
    daemon = Daemon(d).start()
    try:
        task = write_task(d, "vm-harbor", "echo $EXPECTED > answer.txt\n",
                          files={"seed.txt": "seed\n"},
                          dockerfile="FROM debian:bookworm\nWORKDIR /app\nENV EXPECTED=42\nCOPY seed.txt /app/\n")
        (task / "task.toml").write_text("[agent]\ntimeout_sec = 600.0\n[verifier]\ntimeout_sec = 600.0\n"
                                        f'[environment]\nmemory_mb = 512\ncpus = {VM_CPUS}\nnetwork_mode = "no-network"\n'
                                        "build_timeout_sec = 1500.0\n")
        t0 = time.monotonic()
        env = {**os.environ, "SMOL_SOCKET": str(daemon.socket), "HOME": str(d / "home"), "COLUMNS": "500",
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        r = subprocess.run([str(Path(HARBOR_PYTHON).parent / "harbor"), "trials", "start", "-p", str(task),
                            "-a", "oracle", "--env", "smol.harbor_env:SmolEnvironment", "--trials-dir",
                            str(d / "trials"), "--trial-name", "vm-harbor__1"],
                           capture_output=True, text=True, timeout=1700, env=env)
        print(f"\nHarbor trial on a VM: {time.monotonic() - t0:.1f}s")
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads((d / "trials" / "vm-harbor__1" / "result.json").read_text())
        assert result["verifier_result"]["rewards"]["reward"] == 1.0, result
        assert (d / "trials" / "vm-harbor__1" / "verifier" / "reward.txt").read_text().strip() == "1"
        assert json.loads(daemon.smolctl("ls", "--json").stdout) == []   # the trial destroyed its machine
    finally:
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
