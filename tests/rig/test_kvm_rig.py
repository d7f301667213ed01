"""The KVM rig (scripts/kvm_rig.py) for real: it boots QEMU TCG with kvm_amd, runs a command, and cleans up.

Each test boots the rig once (about 15-25 s on a 2-core host): the command's output, exit status, directory,
environment and files come back; a broken rig (kvm_amd refusing to load), a hung rig (its heartbeat stopped)
and a run past its time limit all fail with the rig's own status, and nothing is left behind (no QEMU process,
no job directory), also when the rig is interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from daemon_support import processes_mentioning  # noqa: E402
from vm_tier_support import TESTS, VM_TIER, write_suite  # noqa: E402

RIG = [sys.executable, str(REPO / "scripts" / "kvm_rig.py")]

pytestmark = [pytest.mark.timeout(600)]


def qemu_processes(tmp_path: Path) -> list[int]:
    """Live QEMU processes of this test's rig (their command line names the job directory under tmp_path/tmp)."""
    return processes_mentioning(str(tmp_path / "tmp"))


def rig(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "SMOL_RIG_PROBE": "probe value"}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run([*RIG, "--memory", "2048", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path)


def assert_clean(tmp_path: Path) -> None:
    assert qemu_processes(tmp_path) == []
    assert list((tmp_path / "tmp").iterdir()) == [], "the rig's job directory was removed"


def test_output_status_cwd_env_files_and_real_kvm(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "input.txt").write_text("from the host\n")
    script = ("echo cwd=$(pwd); echo env=$SMOL_RIG_PROBE/$EXTRA; cat input.txt; echo cpus=$(nproc); "
              "echo cgroup=$(stat -fc %T /sys/fs/cgroup); ls -l /dev/kvm; "
              "python3 -c 'import fcntl,os; fd=os.open(\"/dev/kvm\", os.O_RDWR); print(\"api\", fcntl.ioctl(fd, 0xAE00))'; "
              "mkdir -p out; echo result > out/r.txt; echo live > shared/live.txt; echo to-stderr >&2; exit 7")
    r = rig(tmp_path, "--cwd", str(work), "--cpus", "2", "--env", "EXTRA=x y", "--bring-back", "out/r.txt",
            "--share", "shared", "--", "sh", "-c", script)
    assert r.returncode == 7, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert f"cwd={work}" in lines
    assert "env=probe value/x y" in lines
    assert "from the host" in lines and "to-stderr" in lines
    assert "cpus=2" in lines
    assert "cgroup=cgroup2fs" in lines                    # a unified cgroup v2 hierarchy
    assert "api 12" in lines                              # KVM_GET_API_VERSION on a real /dev/kvm
    assert any(ln.startswith("crw-rw-rw-") for ln in lines)
    assert "Nested Paging enabled" in r.stdout            # kvm_amd with NPT (the rig's banner line)
    assert "kvm-rig: QEMU 10." in r.stdout                # the QEMU scripts/setup ci installs, named in the banner
    assert re.search(r"kvm_amd nested=\S+ npt=\S+ vgif=[01] vls=\S+ avic=\S+,", r.stdout)   # the module's parameters
    assert (work / "out" / "r.txt").read_text() == "result\n"
    assert (work / "shared" / "live.txt").read_text() == "live\n"     # --share: written through to this host
    assert_clean(tmp_path)


def test_kvm_amd_refusing_to_load_fails_the_run(tmp_path: Path) -> None:
    r = rig(tmp_path, "--break-kvm", "--", "true")
    assert r.returncode == 125, r.stdout + r.stderr
    assert "loading kvm_amd failed" in r.stderr
    assert_clean(tmp_path)


def test_missing_command_status_is_the_shells(tmp_path: Path) -> None:
    r = rig(tmp_path, "--", "no-such-command-here")
    assert r.returncode == 127, r.stdout + r.stderr
    assert_clean(tmp_path)


def test_a_hung_rig_is_noticed_by_the_watchdog(tmp_path: Path) -> None:
    # The command stops stage two's heartbeat, as a hung rig kernel would, and then waits forever.
    t0 = time.monotonic()
    r = rig(tmp_path, "--hang-timeout", "20", "--", "sh", "-c", "kill -STOP $(cat /run/rig-heartbeat.pid); sleep 600")
    assert r.returncode == 125, r.stdout + r.stderr
    assert "stopped answering" in r.stderr and "rig console" in r.stderr
    assert time.monotonic() - t0 < 200
    assert_clean(tmp_path)


def test_timeout_powers_the_rig_off(tmp_path: Path) -> None:
    r = rig(tmp_path, "--timeout", "60", "--", "sh", "-c", "echo started; sleep 600")
    assert r.returncode == 124, r.stdout + r.stderr
    assert "started" in r.stdout and "timed out" in r.stderr
    assert_clean(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_powers_the_rig_off(tmp_path: Path, sig: int) -> None:
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([*RIG, "--memory", "2048", "--", "sh", "-c", "echo running; sleep 600"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == "running" or not line:
            break
    assert line.strip() == "running", "the command started"
    assert qemu_processes(tmp_path), "QEMU is running"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "interrupted" in err
    assert_clean(tmp_path)


def test_vm_tier_lists_what_finished_when_the_rig_panics_and_runs_only_the_rest_in_a_fresh_rig(tmp_path: Path) -> None:
    """CI's VM tier runner (scripts/vm_tier.py) with the real rig: a test panics the rig's kernel (sysrq c) the
    first time; the tests that finished before keep their outcomes, and a second rig runs only the others."""
    suite = write_suite(tmp_path / "suite")
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "SMOL_TIER_MARK": str(out / "mark"), "SMOL_TIER_FAIL": "0"}
    r = subprocess.run([*VM_TIER, "--out", str(out), "--rig-arg=--memory=2048", "--", sys.executable, "-m",
                        "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                       cwd=suite, env=env, capture_output=True, text=True, timeout=900)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "Kernel panic" in (out / "rig-console-1.log").read_text(errors="replace")   # the rig really died
    assert "the KVM rig failed (status 125, above) in try 1, after 2 finished tests" in text
    assert "passed  test_tier.py::test_first" in text and "not finished (2):" in text
    second = [json.loads(line) for line in (out / "vm-tier-try-2.jsonl").read_text().splitlines()]
    assert [d["nodeid"] for d in second if d.get("when") == "setup"] == TESTS[2:]
    assert "4 passed" in text.split("summary of every try")[1]
    assert_clean(tmp_path)
