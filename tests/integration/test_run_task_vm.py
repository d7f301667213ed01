"""Harbor-format tasks on real microVMs: smolctl run-task (one boot), and the real Harbor's trial in
smolsdk.harbor_env.SmolEnvironment (one boot; Harbor runs in $SMOL_HARBOR_PYTHON, see tests/unit/test_harbor_cli.py)."""

from __future__ import annotations

import contextlib
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

# The task's tests: the answer, and the network as a public task must see it (one line of results on stdout).
# In the guest: GET addr:port, one word back (the reply's first line, spaces as "_", or the error's name).
GUEST_GET = r"""import socket
def get(addr, port):
    try:
        with socket.create_connection((addr, port), timeout=3) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(64).decode(errors="replace").strip().replace(" ", "_") or "empty"
    except OSError as e:
        return type(e).__name__
"""
NET_TEST = r"""#!/bin/bash
python3 - "$@" <<'PROBE'
""" + GUEST_GET + r"""answer = open("/app/answer.txt").read().strip()
seen = [get("@INTERNET@", 8080), get("169.254.169.254", 8080), get("@HOST_I@", @HOST_PORT@),
        get("10.214.20.1", @HOST_PORT@)]
print("probe:", answer, *seen)
ok = (answer == "42" and seen[0] == "HTTP/1.0_200_peer_@HOST_I@"
      and not any(x.startswith("HTTP") for x in seen[1:]))
open("/logs/verifier/reward.txt", "w").write("1" if ok else "0")
PROBE
"""
HOST_PORT = 9191
# The oracle of the phases task: it tries the test internet (offline: must fail), then answers.
AGENT_TRIES = r"""python3 - <<'PROBE'
import socket
try:
    with socket.create_connection(("@INTERNET@", 8080), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        got = s.recv(64).decode(errors="replace").strip().replace(" ", "_") or "empty"
except OSError as e:
    got = type(e).__name__
open("/app/agent-net.txt", "w").write(got)
PROBE
echo $EXPECTED > answer.txt
"""
# Its tests: the answer, the agent's attempt refused, the internet reached now, the metadata address not.
PHASE_TEST = r"""#!/bin/bash
python3 - <<'PROBE'
""" + GUEST_GET + r"""answer, agent = open("/app/answer.txt").read().strip(), open("/app/agent-net.txt").read().strip()
seen = [get("@INTERNET@", 8080), get("169.254.169.254", 8080)]
print("probe:", answer, agent, *seen)
ok = (answer == "42" and not agent.startswith("HTTP") and seen[0] == "HTTP/1.0_200_peer_@HOST_I@"
      and not seen[1].startswith("HTTP"))
open("/logs/verifier/reward.txt", "w").write("1" if ok else "0")
PROBE
"""


def test_run_task_on_a_vm() -> None:
    """A task with allow_internet = true (public) on a real VM: its tests reach the test "internet" (an echo
    server at 198.51.100.2, which sees the host's address: the daemon's masquerade), while the link-local
    metadata address 169.254.169.254 and the host's own HTTP server (on its address on that link and on the
    machine's uplink) stay unreachable."""
    from test_net_host import internet_hosts

    d = Path(tempfile.mkdtemp(prefix="smrt-", dir="/tmp"))
    hosts = contextlib.ExitStack()
    daemon = Daemon(d, "--net-pool", "10.214.20.0/28").start()   # its machine's uplink: host end 10.214.20.1
    try:
        net = hosts.enter_context(internet_hosts(d.name[-4:], "198.51.100.0/24", "169.254.169.252/30", HOST_PORT))
        assert net["addr_m"] == "169.254.169.254"
        test = (NET_TEST.replace("@INTERNET@", net["addr_i"]).replace("@HOST_I@", net["host_i"])
                .replace("@HOST_PORT@", str(HOST_PORT)))
        task = write_task(d, "vm-pass", "echo $EXPECTED > answer.txt\n", test=test,
                          dockerfile="FROM debian:bookworm\nWORKDIR /app\nENV EXPECTED=42\nCOPY seed.txt /app/\n",
                          files={"seed.txt": "seed\n"})
        (task / "task.toml").write_text("[agent]\ntimeout_sec = 300.0\n[verifier]\ntimeout_sec = 300.0\n"
                                        f"[environment]\nmemory_mb = 512\ncpus = {VM_CPUS}\nallow_internet = true\n")
        t0 = time.monotonic()
        res = daemon.smolctl("run-task", str(task), "--json")
        assert res.stdout.strip(), f"run-task printed nothing (exit {res.returncode}): {res.stderr.decode()[-3000:]}"
        out = json.loads(res.stdout)
        print(f"\nrun-task on a VM: {time.monotonic() - t0:.1f}s; steps: "
              + ", ".join(f"{s['name']} {s['duration_s']}s" for s in out["steps"]))
        probe = [line for s in out["steps"] for line in s.get("output_tail", "").splitlines() if "probe:" in line]
        assert res.returncode == 0 and out["reward"] == 1.0, (probe, res.stdout.decode() + res.stderr.decode())
    finally:
        hosts.close()
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


HARBOR_PYTHON = os.environ.get("SMOL_HARBOR_PYTHON", "")


@pytest.mark.skipif(not HARBOR_PYTHON and not os.environ.get("CI"), reason="SMOL_HARBOR_PYTHON is not set")
def test_harbor_trial_on_a_vm() -> None:
    """The real Harbor's trial of an offline task whose verifier phase is public, on a VM: the oracle's attempt
    to reach the test internet fails (smol's policy: the machine is created closed), the tests reach it
    (the policy switched in place for the verifier phase) and still not 169.254.169.254."""
    from test_net_host import internet_hosts

    assert HARBOR_PYTHON, "CI must set SMOL_HARBOR_PYTHON (.ci/harbor-python builds it)"
    d = Path(tempfile.mkdtemp(prefix="smht-", dir="/tmp"))
    hosts = contextlib.ExitStack()
    daemon = Daemon(d, "--net-pool", "10.214.21.0/28").start()
    try:
        net = hosts.enter_context(internet_hosts(d.name[-4:], "198.51.100.0/24", "169.254.169.252/30", HOST_PORT))
        fill = {"@INTERNET@": net["addr_i"], "@HOST_I@": net["host_i"]}
        solve, test = AGENT_TRIES, PHASE_TEST
        for k, v in fill.items():
            solve, test = solve.replace(k, v), test.replace(k, v)
        task = write_task(d, "vm-harbor", solve, test=test, files={"seed.txt": "seed\n"},
                          dockerfile="FROM debian:bookworm\nWORKDIR /app\nENV EXPECTED=42\nCOPY seed.txt /app/\n")
        (task / "task.toml").write_text('[agent]\ntimeout_sec = 600.0\n[verifier]\ntimeout_sec = 600.0\n'
                                        'network_mode = "public"\n'
                                        f'[environment]\nmemory_mb = 512\ncpus = {VM_CPUS}\nnetwork_mode = "no-network"\n'
                                        "build_timeout_sec = 1500.0\n")
        t0 = time.monotonic()
        env = {**os.environ, "SMOL_SOCKET": str(daemon.socket), "HOME": str(d / "home"), "COLUMNS": "500",
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        r = subprocess.run([str(Path(HARBOR_PYTHON).parent / "harbor"), "trials", "start", "-p", str(task),
                            "-a", "oracle", "--env", "smolsdk.harbor_env:SmolEnvironment", "--trials-dir",
                            str(d / "trials"), "--trial-name", "vm-harbor__1"],
                           capture_output=True, text=True, timeout=1700, env=env)
        print(f"\nHarbor trial on a VM: {time.monotonic() - t0:.1f}s")
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads((d / "trials" / "vm-harbor__1" / "result.json").read_text())
        assert result["verifier_result"] is not None, json.dumps(result.get("exception_info"), indent=1)
        assert result["verifier_result"]["rewards"]["reward"] == 1.0, \
            (result, [p.read_text(errors="replace")[-2000:] for p in (d / "trials").glob("vm-harbor__1/verifier/*")])
        verifier = d / "trials" / "vm-harbor__1" / "verifier"
        assert (verifier / "reward.txt").read_text().strip() == "1", \
            [p.read_text(errors="replace")[-2000:] for p in verifier.glob("*.txt")]
        assert json.loads(daemon.smolctl("ls", "--json").stdout) == []   # the trial destroyed its machine
    finally:
        hosts.close()
        daemon.terminate()
        for pid in vmm_processes(d):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
