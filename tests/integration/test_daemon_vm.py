"""smold end to end with real microVMs: Run of both examples, supervision, kill -9, restart, destroy.

Makes four VMs in all, never more than two at once (the default vCPUs, 512 MiB each): on an emulated-KVM (PVM) host
one boot to agent-ready takes minutes and a whole host core, so the daemon boots at most the first and bakes it
as the base every later one restores (in the run's shared bake store, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from microvm import VM_CPUS, shared_bakes_args

from smold.images.artifacts import Artifacts, default_artifacts

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
VM_SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
[timeouts]
boot = 900
[[verifier.checks]]
kind = "file_matches"
path = "/root/hello.txt"
content = "hello\\n"
"""


class Daemon:
    """``python -m smold.daemon`` with the real VMM launcher on a temp socket and state dir."""

    def __init__(self, workdir: Path, *extra: str, max_machines: int = 2, max_memory_mib: int = 1024) -> None:
        self.workdir = workdir
        self.extra = [*extra, "--max-machines", str(max_machines), "--max-memory", str(max_memory_mib)]
        self.socket = workdir / "smold.sock"
        self.state = workdir / "state"
        self.log = workdir / "smold.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        argv = [sys.executable, "-m", "smold.daemon", "--socket", str(self.socket), "--state-dir", str(self.state),
                "--log-level", "debug", *shared_bakes_args(), *self.extra]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        deadline = time.monotonic() + 300  # re-adopting machines (a health check each) comes first
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "smold did not start"
            try:  # the socket file may be a stale one left by a killed daemon: wait until it answers
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                return self
            except OSError:
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(300)

    def smolctl(self, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self.smolctl_argv(*args), capture_output=True, timeout=timeout,
                              env={**os.environ, "SMOL_SOCKET": str(self.socket)})

    def smolctl_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "smolctl", "--socket", str(self.socket), *args]


def vmm_processes(path: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"smold.vmm" in cmdline and str(path).encode() in cmdline:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def sockets_under(path: Path) -> list[str]:
    with open("/proc/net/unix") as f:
        return [ln.split()[7] for ln in list(f)[1:] if len(ln.split()) >= 8 and ln.split()[7].startswith(str(path))]


@pytest.fixture(scope="module")
def artifacts() -> Artifacts:
    return default_artifacts(build=True)  # built by .ci/run beforehand; building here is the slow fallback


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smit-", dir="/tmp"))
    yield d
    for pid in vmm_processes(d):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(artifacts: Artifacts, workdir: Path) -> Iterator[Daemon]:
    d = Daemon(workdir).start()
    yield d
    code = d.terminate()
    assert code == 0, d.log.read_text()[-4000:]
    assert vmm_processes(workdir) == []


def test_run_passing_and_failing_examples(daemon: Daemon) -> None:
    """Both examples at once (two VMs): PASS with exit 0, FAIL with exit 1 and the failing checks' evidence."""
    t0 = time.monotonic()
    procs = {name: subprocess.Popen(daemon.smolctl_argv("run", "--json", str(REPO / "examples" / name)),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in ("hello-pass", "hello-fail")}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=1500)
        results[name] = (p.returncode, out, err)
    wall = time.monotonic() - t0
    code, out, err = results["hello-pass"]
    assert code == 0, (out.decode()[-3000:], err.decode(), daemon.log.read_text()[-3000:])
    passed = json.loads(out)
    assert passed["result"]["passed"] is True and [c["passed"] for c in passed["result"]["checks"]] == [True] * 3
    # tests/ is a [verifier.mounts] entry: not copied at create time, only when verification starts
    assert [s["name"] for s in passed["steps"]] == ["boot", "mount[0]", "setup[0]", "task"]
    assert "Ran 3 tests" in passed["result"]["checks"][0]["evidence"]["output_tail"]

    code, out, err = results["hello-fail"]
    assert code == 1, (out.decode()[-3000:], err.decode())
    failed = json.loads(out)
    suite, output, reward = failed["result"]["checks"]
    assert not suite["passed"] and suite["evidence"]["exit_code"] == 1
    assert "FAILED (failures=1)" in suite["evidence"]["output_tail"]
    assert not output["passed"] and "15: Fizz" in output["evidence"]["output_tail"]
    assert not reward["passed"] and "reward 0 < threshold 1" in reward["evidence"]["detail"]
    boots = {n: int(json.loads(r[1])["steps"][0]["evidence"]["duration_ms"]) / 1000 for n, r in results.items()}
    print(f"\nRun of both examples at once: {wall:.0f}s wall; boot to agent-ready: {boots}")
    assert daemon.smolctl("ls", "-q").stdout == b""  # Run destroyed both machines
    # both verdicts were stored with their evidence before the replies (docs/verifier.md, "Results")
    for doc, code, word in ((passed, 0, "PASS"), (failed, 1, "FAIL")):
        r = daemon.smolctl("results", doc["result_id"], "--json")
        stored = json.loads(r.stdout)
        assert r.returncode == code and stored["state"] == "RESULT_STATE_DONE" and stored["run"] == doc, r.stdout
        assert word in daemon.smolctl("results", doc["result_id"]).stdout.decode()
    listed = daemon.smolctl("results", "--kind", "run", "-q").stdout.decode().split()
    assert {passed["result_id"], failed["result_id"]} <= set(listed)
    assert vmm_processes(daemon.state) == [] and list((daemon.state / "machines").iterdir()) == []


PROBE_SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
# the "agent" looks for the tests, then plants its own at their path
task = "if [ -e /tests ]; then echo seen; else echo absent; fi > /root/seen; mkdir -p /tests; echo exit 0 > /tests/probe.sh; touch /tests/planted"
[verifier.mounts]
"tests" = "/tests"
[timeouts]
boot = 900
[[verifier.checks]]
name = "genuine tests, unseen by the task"
kind = "command"
run = "cat /root/seen; test ! -e /tests/planted && sh /tests/probe.sh"
"""


def test_verifier_mounts_arrive_only_for_the_verifier_and_replace_what_the_task_planted(
        daemon: Daemon, workdir: Path) -> None:
    task = workdir / "probe"
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "probe.sh").write_text("echo genuine; grep -qx absent /root/seen\n")
    (task / "Smolfile.toml").write_text(PROBE_SMOLFILE)
    r = subprocess.run(daemon.smolctl_argv("run", "--json", str(task)), capture_output=True, timeout=1500)
    assert r.returncode == 0, (r.stdout.decode()[-3000:], r.stderr.decode(), daemon.log.read_text()[-3000:])
    doc = json.loads(r.stdout)
    (check,) = doc["result"]["checks"]
    assert check["passed"] and "absent\ngenuine" in check["evidence"]["output_tail"], check
    assert [s["name"] for s in doc["steps"]] == ["boot", "task"]


def test_kill_9_restart_readopt_and_destroy(daemon: Daemon, workdir: Path) -> None:
    task = workdir / "vm"
    task.mkdir()
    (task / "Smolfile.toml").write_text(VM_SMOLFILE)
    creates = [subprocess.Popen(daemon.smolctl_argv("create", "--name", n, str(task)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE) for n in ("a", "b")]
    ids = []
    for p in creates:
        out, err = p.communicate(timeout=1500)
        assert p.returncode == 0, err.decode()
        ids.append(out.decode().strip())
    a, b = ids
    machines = {m["name"]: m for m in json.loads(daemon.smolctl("ls", "--json").stdout)}
    pid_a, pid_b = machines["a"]["vmm_pid"], machines["b"]["vmm_pid"]

    for name in ("a", "b"):   # a line on each guest's serial console (a restored machine's has no boot lines)
        r = daemon.smolctl("exec", name, "--", "sh", "-c",
                           f"echo hello > /root/hello.txt; echo console-of-{name} > /dev/console; nproc; hostname")
        assert (r.returncode, r.stdout.split()) == (0, [str(VM_CPUS).encode(), name.encode()]), r.stderr
    r = daemon.smolctl("verify", "b")
    assert r.returncode == 0 and r.stdout.startswith(b"PASS"), r.stdout

    os.kill(pid_a, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "failed" not in daemon.smolctl("ls").stdout.decode():
        assert time.monotonic() < deadline
        time.sleep(0.5)
    info = {m["name"]: m for m in json.loads(daemon.smolctl("ls", "--json").stdout)}
    assert info["a"]["state"] == "MACHINE_STATE_FAILED" and "killed by SIGKILL" in info["a"]["failure_reason"]
    logs = daemon.smolctl("logs", "a").stdout.decode()
    assert "console-of-a" in logs and "console-of-b" not in logs, logs[-2000:]
    assert info["b"]["state"] == "MACHINE_STATE_RUNNING"
    r = daemon.smolctl("exec", "b", "--", "cat", "/root/hello.txt")
    assert (r.returncode, r.stdout) == (0, b"hello\n")  # the other machine is untouched

    # Restart the daemon the hard way: b is re-adopted (same VM, same guest state), failed a is cleaned up.
    daemon.kill()
    assert alive(pid_b)
    daemon.start()
    assert daemon.smolctl("ls", "-q").stdout.split() == [b.encode()]
    assert not (daemon.state / "machines" / a).exists()
    r = daemon.smolctl("exec", "b", "--", "cat", "/root/hello.txt")
    assert (r.returncode, r.stdout) == (0, b"hello\n"), r.stderr

    # Destroy removes every process, socket and file of the machine.
    mdir = daemon.state / "machines" / b
    before = (vmm_processes(mdir), sockets_under(mdir), sorted(p.name for p in mdir.iterdir()))
    assert before[0] == [pid_b] and str(mdir / "vsock.sock") in before[1]
    assert {"ready.json", "console.log", "vsock.sock"} <= set(before[2])
    records = daemon.state / "records" / b     # machine.json: the daemon's, out of the VMM's reach
    assert (records / "machine.json").is_file() and "machine.json" not in before[2]
    t0 = time.monotonic()
    r = daemon.smolctl("rm", b)
    assert r.returncode == 0, r.stderr
    print(f"\ndestroy of a running VM: {time.monotonic() - t0:.2f}s")
    assert (vmm_processes(mdir), sockets_under(mdir), mdir.exists(), records.exists()) == ([], [], False, False)
    assert not alive(pid_b)
    assert daemon.smolctl("ls", "-q").stdout == b""

    # kill -9 of the daemon during a Run: the next daemon stores it interrupted and removes its VM (not re-adopted)
    (task / "Smolfile.toml").write_text(VM_SMOLFILE.replace('memory = "512M"\n', 'memory = "512M"\n'
                                                            'task = "touch /root/started; sleep 600"\n'))
    run = subprocess.Popen(daemon.smolctl_argv("run", "--label", "case=kill-9", str(task)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            ids = daemon.smolctl("ls", "-q").stdout.decode().split()
            if ids and daemon.smolctl("exec", ids[0], "--", "test", "-e", "/root/started").returncode == 0:
                break
            time.sleep(0.5)
        (rid,) = daemon.smolctl("results", "--label", "case=kill-9", "-q").stdout.decode().split()
        (run_pid,) = vmm_processes(daemon.state / "machines" / ids[0])
        daemon.kill()
        run.communicate(timeout=60)
        assert alive(run_pid)  # the VM outlives the daemon...
        daemon.start()
        r = daemon.smolctl("results", rid)
        assert r.returncode == 5 and f"{rid}  run  INTERRUPTED" in r.stdout.decode(), (r.stdout, r.stderr)
        assert daemon.smolctl("ls", "-q").stdout == b""  # ... and is removed by the next daemon, not re-adopted
        assert not alive(run_pid) and list((daemon.state / "machines").iterdir()) == []
    finally:
        run.kill()

    # a detached Run: its client leaves at once, with the id; the verdict is fetched later by that id
    (task / "Smolfile.toml").write_text(VM_SMOLFILE.replace('memory = "512M"\n', 'memory = "512M"\n'
                                                            'task = "echo hello > /root/hello.txt"\n'))
    r = daemon.smolctl("run", "--detach", "--label", "case=detached", str(task))
    assert r.returncode == 0, r.stderr
    rid = r.stdout.decode().strip()
    assert rid.startswith("r-"), r.stdout
    r = daemon.smolctl("results", rid, "--wait", "900")
    assert r.returncode == 0 and f"{rid}  run  PASS" in r.stdout.decode(), (r.stdout, r.stderr)
    assert daemon.smolctl("ls", "-q").stdout == b""


SEALED_SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
setup = ["mkdir -p /app"]
task = {{ run = "sh /task/solve.sh", timeout = 300 }}
[mounts]
"task" = "/task"
[verifier]
outputs = ["/app"]
[verifier.mounts]
"tests" = "/tests"
[timeouts]
boot = 900
[[verifier.checks]]
name = "suite"
kind = "command"
run = "python3 /tests/check.py"
[[verifier.checks]]
kind = "reward"
"""
# The tests: the answer must be 42, checked with the image's own python3; they write the reward.
CHECK_PY = """import pathlib, sys
ok = pathlib.Path("/app/answer").read_text().strip() == "42"
pathlib.Path("/logs/verifier").mkdir(parents=True, exist_ok=True)
pathlib.Path("/logs/verifier/reward.txt").write_text("1" if ok else "0")
print("genuine check:", "right" if ok else "wrong")
sys.exit(0 if ok else 1)
"""
# A hostile agent, root in its guest: a wrong answer, then every way it has to rig the verdict in place.
HOSTILE_SH = """echo 41 > /app/answer
printf '#!/bin/sh\\necho rigged; exit 0\\n' > /usr/bin/python3.rigged && chmod +x /usr/bin/python3.rigged
for t in /usr/bin/python3 /usr/local/bin/pytest; do cp /usr/bin/python3.rigged "$t"; done
echo /nonexistent/rig.so > /etc/ld.so.preload
mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && echo 'exit 0' > /tests/check.py
(sleep 30; while :; do echo 42 > /app/answer; sleep 0.2; done) > /dev/null 2>&1 &
echo hostile done
"""


# A hostile agent that cannot be judged by its own tar: `tar` replaced by a forger whose archive reaches for the
# verifier's files (an absolute name, "..", a name outside the outputs, a path through a symbolic link); it also
# leaves a storm of respawning processes behind and fills its disk.
FORGER_SH = """echo 41 > /app/answer
python3 - <<'PY'
import io, tarfile
def add(t, name, data):
    i = tarfile.TarInfo(name); i.size = len(data); t.addfile(i, io.BytesIO(data))
with tarfile.open("/tmp/evil.tar", "w", format=tarfile.GNU_FORMAT) as t:
    add(t, "app/answer", b"41\\n")
    add(t, "../logs/verifier/reward.txt", b"1")
    add(t, "/etc/ld.so.preload", b"/app/rig.so\\n")
    add(t, "tests/check.py", b"exit 0\\n")
    link = tarfile.TarInfo("app/l"); link.type = tarfile.SYMTYPE; link.linkname = "/logs/verifier"; t.addfile(link)
    add(t, "app/l/reward.txt", b"1")
PY
printf '#!/bin/sh\\ncat /tmp/evil.tar\\n' > /tmp/tar && chmod +x /tmp/tar
for t in /usr/local/bin/tar /usr/bin/tar; do cp /tmp/tar "$t"; done
for i in 1 2 3 4 5 6 7 8; do (while :; do sleep 5 & sleep 0.05; done) > /dev/null 2>&1 & done
fallocate -l "$(python3 -c 'import os; s = os.statvfs("/"); print(s.f_bavail * s.f_frsize)')" /fill
python3 -c 'import os; s = os.statvfs("/"); print("disk full" if s.f_bavail * s.f_frsize < 1 << 20 else "room left")'
echo forger done
"""
# A hostile agent that hooks the guest agent: it takes PID 1's vsock connections with pidfd_getfd(2) and writes
# forged EXIT frames (exit 0) and malformed ones (bad JSON, a 4 GiB length, bad magic) to the daemon.
HOOK_SH = """echo 41 > /app/answer
python3 - <<'PY'
import ctypes, json, os, struct, time
libc = ctypes.CDLL(None, use_errno=True)
def frame(kind, rid, payload=b"", magic=b"SMOL", length=None):
    return magic + struct.pack(">BBHII", 1, kind, 0, rid, len(payload) if length is None else length) + payload
exit0 = json.dumps({"exit_code": 0, "signal": None, "timed_out": False, "duration": 0.1}).encode()
frames = [b"".join(frame(0x15, rid, exit0) for rid in range(1, 33)), frame(0x15, 1, b"{not json"),
          frame(0x13, 1, length=0xFFFFFFFF), b"JUNK" * 4]
pidfd, taken = os.pidfd_open(1), []
for name in sorted(os.listdir("/proc/1/fd"), key=int):
    try:
        link = os.readlink(f"/proc/1/fd/{name}")
    except OSError:
        continue
    fd = libc.syscall(438, pidfd, int(name), 0) if link.startswith("socket:") else -1
    if fd >= 0:
        print("hooking", link, flush=True)
        taken.append(fd)
time.sleep(1)  # the agent sends what was printed before the forgeries follow it
for fd in taken:
    try:
        for f in frames:
            os.write(fd, f)
    except OSError as e:
        print("not connected:", e, flush=True)
PY
echo hook done
"""

# A hostile agent that goes for the guest agent itself: SIGKILL and SIGSEGV to PID 1 (the kernel protects init from
# both), /bin/sh replaced by a script that says "rigged", then the guest rebooted, which ends the VM: there is
# nothing left to judge, and the verdict says so (VERIFIER_ERROR), never PASS.
KILLER_SH = """echo 41 > /app/answer
kill -9 1; kill -SEGV 1; sleep 0.5; kill -0 1 && echo agent still alive
rm -f /bin/sh && printf '#!/bin/dash\\necho rigged\\n' > /bin/sh && chmod +x /bin/sh && echo sh replaced
sleep 0.5; sync; python3 -c 'import ctypes; ctypes.CDLL(None).reboot(0x01234567)'
echo still here
"""


def sealed_runs(daemon: Daemon, workdir: Path, solutions: dict[str, str]) -> dict[str, tuple[int, dict]]:
    """Sealed Runs of SEALED_SMOLFILE with these solve.sh scripts, all at once: {name: (exit code, reply)}."""
    procs = {}
    for name, solve in solutions.items():
        task = workdir / f"sealed-{name}"
        (task / "task").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "task" / "solve.sh").write_text(solve)
        (task / "tests" / "check.py").write_text(CHECK_PY)
        (task / "Smolfile.toml").write_text(SEALED_SMOLFILE)
        procs[name] = subprocess.Popen(daemon.smolctl_argv("run", "--json", str(task)), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
    verdicts = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=1500)
        verdicts[name] = (p.returncode, json.loads(out) if out else {"stderr": err.decode()})
    return verdicts


def test_a_sealed_run_keeps_a_hostile_agent_from_rigging_the_verdict(daemon: Daemon, workdir: Path) -> None:
    """Red team (issue #18): sealed verification on real VMs. The agent replaces python3 and pytest, writes
    /etc/ld.so.preload, plants the reward and the tests, and leaves a process that would fix its answer later: the
    verdict is FAIL, decided in a pristine machine; the legitimate solution beside it passes. Then an agent whose
    `tar` forges the outputs archive, and one that writes forged and malformed frames into the guest agent's
    connections: FAIL (or VERIFIER_ERROR), never PASS, and the daemon carries on."""
    verdicts = sealed_runs(daemon, workdir, {"hostile": HOSTILE_SH, "legit": "echo 42 > /app/answer\n"})
    code, doc = verdicts["hostile"]
    assert code == 1 and doc["outcome"] == "OUTCOME_FAIL" and doc["sealed"], doc
    suite, reward = doc["result"]["checks"]
    assert "genuine check: wrong" in suite["evidence"]["output_tail"], suite
    assert "rigged" not in suite["evidence"]["output_tail"] and not reward["passed"], reward
    steps = {s["name"]: s for s in doc["steps"]}
    assert "hostile done" in steps["task"]["evidence"]["output_tail"], steps["task"]
    assert "1 files" in steps["outputs"]["evidence"]["detail"] and "verifier.boot" in steps
    assert "processes the task left were killed" in steps["outputs"]["evidence"]["detail"]  # the rewriter too
    code, doc = verdicts["legit"]
    assert code == 0 and doc["outcome"] == "OUTCOME_PASS" and doc["sealed"], doc
    assert doc["verifier_machine_id"] != doc["machine_id"]
    assert "genuine check: right" in doc["result"]["checks"][0]["evidence"]["output_tail"]
    arts = {a["name"]: a for a in doc.get("artifacts", [])}  # kept with the result: the outputs, the verifier's logs
    assert arts["outputs.tar"].get("kept") and arts["verifier-logs.tar"].get("kept"), arts
    logs = workdir / "legit-verifier-logs.tar"
    r = daemon.smolctl("results", doc["result_id"], "--artifact", "verifier-logs.tar", "-o", str(logs))
    assert r.returncode == 0, r.stderr
    with tarfile.open(logs) as t:
        assert t.extractfile("logs/verifier/reward.txt").read().strip() == b"1"  # type: ignore[union-attr]

    verdicts = sealed_runs(daemon, workdir, {"forger": FORGER_SH, "hook": HOOK_SH})
    code, doc = verdicts["forger"]
    assert code == 1 and doc["outcome"] == "OUTCOME_FAIL" and doc["sealed"], doc
    steps = {s["name"]: s for s in doc["steps"]}
    assert "forger done" in steps["task"]["evidence"]["output_tail"], steps["task"]
    outputs = steps["outputs"]["evidence"]["detail"]
    assert "names outside the outputs" in outputs and "entries below a symbolic link" in outputs, outputs
    assert "disk full" in steps["task"]["evidence"]["output_tail"], steps["task"]
    killed = re.search(r"(\d+) processes the task left were killed", outputs)  # KILL_ALL before the outputs
    assert killed and int(killed.group(1)) >= 8, outputs
    assert "genuine check: wrong" in doc["result"]["checks"][0]["evidence"]["output_tail"], doc
    code, doc = verdicts["hook"]
    assert doc.get("outcome") in ("OUTCOME_FAIL", "OUTCOME_VERIFIER_ERROR") and doc["sealed"], doc
    steps = {s["name"]: s for s in doc["steps"]}
    assert "hooking socket:" in steps["task"]["evidence"]["output_tail"], doc  # it did reach a connection
    if doc["outcome"] == "OUTCOME_FAIL":
        assert "genuine check: wrong" in doc["result"]["checks"][0]["evidence"]["output_tail"], doc
    assert daemon.smolctl("ls", "-q").returncode == 0  # the daemon is unharmed

    code, doc = sealed_runs(daemon, workdir, {"killer": KILLER_SH})["killer"]
    assert code == 3 and doc["outcome"] == "OUTCOME_VERIFIER_ERROR" and doc["sealed"], doc
    steps = {s["name"]: s for s in doc["steps"]}
    assert "agent still alive" in steps["task"]["evidence"]["output_tail"], steps["task"]
    assert "sh replaced" in steps["task"]["evidence"]["output_tail"] and not steps["task"].get("ok"), steps["task"]
    assert "still here" not in steps["task"]["evidence"]["output_tail"], steps["task"]
    assert not steps["outputs"].get("ok"), steps["outputs"]  # the guest is gone: nothing to judge
    assert "the task's outputs could not be taken" in doc["result"]["checks"][0]["evidence"]["detail"], doc
    assert daemon.smolctl("ls", "-q").stdout == b"" and vmm_processes(daemon.state) == []
