"""The real Harbor (0.26, Python >= 3.12) runs trials in smolsdk.harbor_env.SmolEnvironment: ``harbor trials
start -a oracle --env smolsdk.harbor_env:SmolEnvironment`` on task directories these tests write.

Harbor runs in its own interpreter, ``$SMOL_HARBOR_PYTHON`` (``.ci/harbor-python`` builds it; CI always sets
it, elsewhere the tests are skipped without it). The daemon's machines are the task launcher's sandboxes
(tests/unit/sandbox_launcher.py: the real guest agent on the host, no network), so no KVM is needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir
from test_run_task import write_task

import smolsdk

ROOT = Path(__file__).resolve().parents[2]
HARBOR_PYTHON = os.environ.get("SMOL_HARBOR_PYTHON", "")
NO_NETWORK = '[environment]\nnetwork_mode = "no-network"\n'

if not HARBOR_PYTHON and os.environ.get("CI"):
    raise RuntimeError("CI must set SMOL_HARBOR_PYTHON (.ci/harbor-python builds it)")
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not HARBOR_PYTHON, reason="SMOL_HARBOR_PYTHON is not set (.ci/harbor-python)"),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="the task launcher needs root and unshare(1)")]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("hcli-", "--net-pool", "10.214.11.0/24", launcher="sandbox_launcher:TaskLauncher") as proc:
        yield proc


def harbor_env(daemon: DaemonProcess, home: Path) -> dict[str, str]:
    return {**os.environ, "SMOL_SOCKET": str(daemon.socket), "PYTHONPATH": str(ROOT), "HOME": str(home),
            "COLUMNS": "500", "NO_COLOR": "1"}


def trial(daemon: DaemonProcess, task: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str],
                                                                              dict | None]:
    """One Harbor trial with the oracle agent; its process and result.json (None if Harbor wrote none)."""
    name = f"{task.name}__{uuid.uuid4().hex[:6]}"
    bindir = Path(HARBOR_PYTHON).parent
    r = subprocess.run([str(bindir / "harbor"), "trials", "start", "-p", str(task), "-a", "oracle",
                        "--env", "smolsdk.harbor_env:SmolEnvironment", "--trials-dir", str(out), "--trial-name", name,
                        *extra], capture_output=True, text=True, timeout=240, env=harbor_env(daemon, out / "home"))
    result = out / name / "result.json"
    return r, json.loads(result.read_text()) if result.exists() else None


def reward(result: dict | None) -> float | None:
    assert result is not None
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    return rewards.get("reward")


def machines(daemon: DaemonProcess) -> list:
    with smolsdk.Client(daemon.socket) as c:
        return c.list()


def test_passing_and_failing_oracles_give_their_rewards(daemon: DaemonProcess, tmp_path: Path) -> None:
    good = write_task(tmp_path, "good", "echo $EXPECTED > answer.txt\n", toml=NO_NETWORK)
    bad = write_task(tmp_path, "bad", "echo 41 > answer.txt\n", toml=NO_NETWORK)
    r, result = trial(daemon, good, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 1.0 and result is not None and result.get("exception_info") is None, result
    # Harbor downloaded the logs out of the machine: the oracle's output and the verifier's reward.
    trial_dir = tmp_path / "t" / result["trial_name"]
    assert (trial_dir / "verifier" / "reward.txt").read_text().strip() == "1"
    assert (trial_dir / "agent" / "oracle.txt").exists()
    r, result = trial(daemon, bad, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 0.0
    assert machines(daemon) == []    # every trial's machine is destroyed


def test_a_task_without_network_that_tries_to_use_it_fails(daemon: DaemonProcess, tmp_path: Path) -> None:
    solve = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)\" "
             "&& echo $EXPECTED > answer.txt\n")
    task = write_task(tmp_path, "net", solve, toml=NO_NETWORK)
    r, result = trial(daemon, task, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 0.0
    assert result is not None
    oracle = (tmp_path / "t" / result["trial_name"] / "agent" / "oracle.txt").read_text()
    assert "Network is unreachable" in oracle, oracle
    assert machines(daemon) == []


def test_public_network_runs_public_unless_the_run_refuses_it_or_turns_it_off(daemon: DaemonProcess,
                                                                             tmp_path: Path) -> None:
    task = write_task(tmp_path, "public", "echo $EXPECTED > answer.txt\n")   # Harbor's default: public
    r, result = trial(daemon, task, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 1.0
    r, _ = trial(daemon, task, tmp_path / "t2", "--environment-kwarg", "public_network=refuse")
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0 and "network_mode='public' is refused by this run" in said, said
    assert machines(daemon) == []    # refused before any machine was created
    r, result = trial(daemon, task, tmp_path / "t3", "--environment-kwarg", "public_network=off")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 1.0


def test_phase_policies_change_the_machines_policy_in_place(daemon: DaemonProcess, tmp_path: Path) -> None:
    """An offline environment whose verifier phase is public: the machine is created closed (a NIC, nothing
    allowed), opened for the tests and closed again (dynamic_network_policy, smold's SetNetworkPolicy)."""
    task = write_task(tmp_path, "phases", "echo $EXPECTED > answer.txt\n")
    (task / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n'
                                    'network_mode = "public"\n[environment]\nnetwork_mode = "no-network"\n')
    r, result = trial(daemon, task, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert reward(result) == 1.0
    changes: dict[str, list[tuple[str, str]]] = {}
    for mid, number, what in re.findall(r"machine (m-[0-9a-f]+): network policy (\d+): (.*)",
                                        daemon.log.read_text(errors="replace")):
        changes.setdefault(mid, []).append((number, what.strip()))
    assert [("2", "public"), ("3", "nothing allowed")] in changes.values(), changes
    assert machines(daemon) == []


CHECK_POLICIES = r"""
import json, sys
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from smolsdk.harbor_env import SmolEnvironment
env_dir = Path(sys.argv[1])
def make(**policy):
    return SmolEnvironment(env_dir, "t", "t__1", None, EnvironmentConfig(cpus=2, memory_mb=768),
                           network_policy=NetworkPolicy(**policy))
out = {"allow": make(network_mode=NetworkMode.ALLOWLIST,
                     allowed_hosts=["example.org", "192.0.2.7", "10.0.0.0/8"]).smolfile_toml(),
       "off": make(network_mode=NetworkMode.NO_NETWORK).smolfile_toml(),
       "public": make(network_mode=NetworkMode.PUBLIC).smolfile_toml(),
       "public, off": SmolEnvironment(env_dir, "t", "t__1", None, EnvironmentConfig(cpus=2, memory_mb=768),
                                      network_policy=NetworkPolicy(network_mode=NetworkMode.PUBLIC),
                                      public_network="off").smolfile_toml(),
       "phases": SmolEnvironment(env_dir, "t", "t__1", None, EnvironmentConfig(cpus=2, memory_mb=768),
                                 network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
                                 phase_network_policies=[NetworkPolicy(network_mode=NetworkMode.PUBLIC)]
                                 ).smolfile_toml()}
for hosts in (["*.example.org"], ["2001:db8::1"]):
    try:
        make(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=hosts)
        out[hosts[0]] = "accepted"
    except ValueError as e:
        out[hosts[0]] = str(e)
print(json.dumps(out))
"""


def test_network_policies_become_the_smolfile_or_are_refused_by_harbor(daemon: DaemonProcess,
                                                                        tmp_path: Path) -> None:
    task = write_task(tmp_path, "pol", "true\n")
    r = subprocess.run([HARBOR_PYTHON, "-c", CHECK_POLICIES, str(task / "environment")], capture_output=True,
                       text=True, timeout=120, env=harbor_env(daemon, tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["allow"] == ('cpus = 2\nmemory = "768M"\nnetwork = { allow = ["example.org", "192.0.2.7", '
                            '"10.0.0.0/8"] }\n[timeouts]\nboot = 900\n')
    assert out["off"] == 'cpus = 2\nmemory = "768M"\n[timeouts]\nboot = 900\n'     # no NIC at all
    assert out["public"] == 'cpus = 2\nmemory = "768M"\nnetwork = "public"\n[timeouts]\nboot = 900\n'
    assert out["public, off"] == out["off"]
    assert out["phases"] == 'cpus = 2\nmemory = "768M"\nnetwork = "closed"\n[timeouts]\nboot = 900\n'
    assert "wildcard hostnames is not supported" in out["*.example.org"]
    assert "IPv6 addresses is not supported" in out["2001:db8::1"]


CHECK_OPTIONS = r"""
import json
from smolsdk.harbor_env import SmolEnvironment
out = {}
for name, kwargs in (("ok", {"socket": "/run/x.sock", "public_network": "off"}), ("bad", {"public_network": "maybe"}),
                     ("typo", {"sokcet": "/run/x.sock"})):
    try:
        SmolEnvironment.preflight(kwargs)
        out[name] = "accepted"
    except ValueError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_environment_kwargs_are_typed_and_checked_before_any_trial(daemon: DaemonProcess, tmp_path: Path) -> None:
    r = subprocess.run([HARBOR_PYTHON, "-c", CHECK_OPTIONS], capture_output=True, text=True, timeout=120,
                       env=harbor_env(daemon, tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] == "accepted"
    assert "public_network" in out["bad"] and "'on', 'refuse' or 'off'" in out["bad"], out["bad"]
    assert "Unknown option 'sokcet'" in out["typo"], out["typo"]
    task = write_task(tmp_path, "typo", "echo $EXPECTED > answer.txt\n")
    r2, _ = trial(daemon, task, tmp_path / "t", "--environment-kwarg", "sokcet=/run/x.sock")
    assert r2.returncode != 0 and "Unknown option 'sokcet'" in " ".join((r2.stdout + r2.stderr).split())
    assert machines(daemon) == []


def test_a_multi_step_task_through_harbors_own_trial(daemon: DaemonProcess, tmp_path: Path) -> None:
    """Harbor 0.26 orchestrates the steps itself (MultiStepTrial) through the smol environment; run-task's own
    multi-step runner gives the same rewards (tests/unit/test_run_task.py)."""
    from test_run_task import STEPS_TOML, write_steps_task
    steps = {"one": ("echo 1 > one.txt\n",
                     'echo "{\\"reward\\": $(cat /app/one.txt), \\"style\\": 0.5}" > /logs/verifier/reward.json\n'),
             "two": ("cp seeded.txt two.txt\n",
                     '[ "$(cat /app/two.txt)" = seed ] && echo 1 > /logs/verifier/reward.txt || '
                     "echo 0 > /logs/verifier/reward.txt\n")}
    toml = STEPS_TOML + '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n'
    task = write_steps_task(tmp_path, "multi", steps, toml,
                            workdirs={"two": {"seed.txt": "seed\n", "setup.sh": "cp seed.txt seeded.txt\n"}})
    r, result = trial(daemon, task, tmp_path / "t")
    assert r.returncode == 0, r.stdout + r.stderr
    assert result is not None
    rewards = (result.get("verifier_result") or {}).get("rewards")
    assert rewards == {"reward": 1.0, "style": 0.25}, (rewards, result.get("exception_info"))
    assert machines(daemon) == []


def test_two_concurrent_trials_of_a_dataset_each_get_their_own_machine_and_reward(daemon: DaemonProcess,
                                                                                 tmp_path: Path) -> None:
    """`harbor run -n 2` over a dataset of two tasks: both trials run at once, each in a machine of its own
    (two machines seen at the same time), and each gets its own reward (issue #17: 2 concurrent trials)."""
    import time
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    write_task(dataset, "good", "sleep 6; echo $EXPECTED > answer.txt\n", toml=NO_NETWORK)
    write_task(dataset, "bad", "sleep 6; echo 41 > answer.txt\n", toml=NO_NETWORK)
    jobs = tmp_path / "jobs"
    bindir = Path(HARBOR_PYTHON).parent
    proc = subprocess.Popen([str(bindir / "harbor"), "run", "-p", str(dataset), "-a", "oracle", "-n", "2",
                             "--env", "smolsdk.harbor_env:SmolEnvironment", "-o", str(jobs), "--job-name", "pair"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=harbor_env(daemon, tmp_path / "home"))
    most = 0
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        most = max(most, sum(1 for m in machines(daemon) if m.state == "running"))
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    results = {json.loads(p.read_text())["task_name"]: json.loads(p.read_text())
               for p in (jobs / "pair").glob("*/result.json")}
    assert {name: reward(r) for name, r in results.items()} == {"good": 1.0, "bad": 0.0}, out[-3000:]
    assert most == 2, most          # the two trials overlapped, each in its own machine
    assert machines(daemon) == []
