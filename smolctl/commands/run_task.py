"""smolctl run-task DIR: run a Harbor/Terminal-Bench task with its oracle solution and print the reward."""

from __future__ import annotations

import argparse
import io
import json
import math
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from .. import taskdir
from ..client import fail, terminal_safe, write_err

NAME = "run-task"
HELP = ("run a Harbor/Terminal-Bench task directory with its oracle solution (solution/solve.sh) and print "
        "the verifier's reward (exit 0 if the reward is at least 1, 1 if less)")
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
BOOT_TIMEOUT = 900
# Empties /tests and /logs/verifier (mount points under some launchers, so their contents, dot files included)
# with only what a task image must have anyway (sh, rm, mkdir, chmod: a docker_image may lack find).
EMPTY_VERIFIER_DIRS = ("mkdir -p /tests /logs/verifier && "
                       "rm -rf /tests/* /tests/.[!.]* /tests/..?* /logs/verifier/* /logs/verifier/.[!.]* "
                       "/logs/verifier/..?* && chmod 0777 /logs/verifier")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", help="the task directory (instruction.md, task.toml, environment/, solution/, tests/)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--keep", action="store_true", help="leave the machine running afterwards (prints its id)")


def _tar(paths: list[tuple[Path, str]]) -> bytes:
    """A tar archive holding each host path (file or directory contents) under its archive name."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for src, arcname in paths:
            tar.add(src, arcname=arcname, recursive=True)
    return buf.getvalue()


class _Runner:
    def __init__(self, stub: pb_grpc.SmolStub, machine_id: str) -> None:
        self.stub, self.machine_id = stub, machine_id
        self.steps: list[dict[str, Any]] = []

    def exec(self, name: str, argv: list[str], *, cwd: str, env: dict[str, str], timeout: float,
             user: str = "", quiet: bool = False) -> bool:
        """Run one command as a step; ``quiet``: housekeeping, recorded as a step only if it fails."""
        start = time.monotonic()
        req = pb.ExecRequest(machine_id=self.machine_id, argv=argv, cwd=cwd, env=env, user=user,
                             timeout_seconds=max(timeout, 0.001))
        out = bytearray()
        code: int | None = None
        sig: int | None = None
        timed_out = False
        try:
            for msg in self.stub.Exec(req):
                which = msg.WhichOneof("event")
                if which in ("stdout", "stderr"):
                    out += getattr(msg, which)
                elif which == "exit":
                    code = msg.exit.exit_code if msg.exit.HasField("exit_code") else None
                    sig = msg.exit.signal if msg.exit.HasField("signal") else None
                    timed_out = msg.exit.timed_out
        except grpc.RpcError as e:
            out += f"\n{e.details() if isinstance(e, grpc.Call) else e}\n".encode()
        ok = code == 0 and not timed_out
        detail = (f"timed out after {timeout:g}s" if timed_out else f"exit {code}" if code is not None
                  else f"signal {sig}" if sig is not None else "did not run")
        if not (quiet and ok):
            self.steps.append({"name": name, "ok": ok, "detail": detail,
                               "duration_s": round(time.monotonic() - start, 3),
                               "output_tail": out[-4096:].decode("utf-8", "replace")})
        return ok

    def set_network(self, phase: str, msg: pb.NetworkPolicy | None) -> bool:
        """Give the machine a phase's network policy (None: nothing to change), as a step."""
        if msg is None:
            return True
        start = time.monotonic()
        what = "public" if msg.public else ", ".join(msg.allow) if len(msg.allow) else "no network"
        try:
            self.stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(machine_id=self.machine_id, policy=msg))
            ok, detail = True, what
        except grpc.RpcError as e:
            ok, detail = False, f"{what}: {e.details() if isinstance(e, grpc.Call) else e}"
        self.steps.append({"name": f"network: {phase}", "ok": ok, "detail": detail,
                           "duration_s": round(time.monotonic() - start, 3), "output_tail": ""})
        return ok

    def output(self, argv: list[str], cwd: str) -> str:
        """A housekeeping command's stdout ("" if it fails)."""
        out = bytearray()
        code: int | None = None
        try:
            for msg in self.stub.Exec(pb.ExecRequest(machine_id=self.machine_id, argv=argv, cwd=cwd,
                                                     timeout_seconds=60)):
                if msg.WhichOneof("event") == "stdout":
                    out += msg.stdout
                elif msg.WhichOneof("event") == "exit":
                    code = msg.exit.exit_code if msg.exit.HasField("exit_code") else None
        except grpc.RpcError:
            return ""
        return out.decode("utf-8", "replace").strip() if code == 0 else ""

    def copy_tar(self, archive: bytes, dest: str) -> None:
        self.stub.CopyIn(pb.CopyInRequest(machine_id=self.machine_id, path=dest, content=archive,
                                          format=pb.COPY_FORMAT_TAR, mkdirs=True))


def _copy_step(r: _Runner, task: taskdir.Task, step: taskdir.Step) -> None:
    context = task.path / "environment"
    *sources, dest = step.args
    for src in sources:
        host = context / src
        if host.is_dir():
            r.copy_tar(_tar([(host, ".")]), dest.rstrip("/") or "/")
        elif dest.endswith("/") or len(sources) > 1:
            r.copy_tar(_tar([(host, host.name)]), dest.rstrip("/") or "/")
        else:
            parent, _, base = dest.rpartition("/")
            r.copy_tar(_tar([(host, base)]), parent or "/")


def _reward(stub: pb_grpc.SmolStub, machine_id: str) -> tuple[float | None, dict[str, float], str]:
    """Harbor's reward rules (harbor.verifier.Verifier): reward.json if it exists (a number, or named numbers,
    all kept; an empty object is a reward of 0, as Harbor's metrics count it), else reward.txt (one number); an
    empty file, non-numeric or non-finite is an error. Returns the reward
    (the one named "reward", else the only one, else the lowest: a pass needs every reward at least 1), all
    rewards, and an error."""
    def read(path: str) -> bytes | None:
        try:
            return bytes(stub.CopyOut(pb.CopyOutRequest(machine_id=machine_id, path=path)).content)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    raw = read(REWARD_JSON)
    if raw is not None:
        if not raw:
            return None, {}, f"{REWARD_JSON} is empty"
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return None, {}, f"{REWARD_JSON}: not JSON: {e}"
        rewards = doc if isinstance(doc, dict) else {"reward": doc}
        for key, value in rewards.items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                return None, {}, f"{REWARD_JSON}: reward {key!r} is {value!r}, not a finite number"
        if not rewards:   # Harbor keeps an empty object as no rewards, which its metrics count as 0
            return 0.0, {}, ""
        values = {str(k): float(v) for k, v in rewards.items()}
        if "reward" in values:
            return values["reward"], values, ""
        return min(values.values()), values, ""
    txt = read(REWARD_TXT)
    if txt is None:
        return None, {}, f"the verifier wrote neither {REWARD_JSON} nor {REWARD_TXT}"
    if not txt:
        return None, {}, f"{REWARD_TXT} is empty"
    try:
        value = float(txt.decode().strip())
    except (UnicodeDecodeError, ValueError):
        return None, {}, f"{REWARD_TXT}: not a number: {txt[:100]!r}"
    if not math.isfinite(value):
        return None, {}, f"{REWARD_TXT}: not a finite number: {value!r}"
    return value, {"reward": value}, ""


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    try:
        task = taskdir.load(Path(args.task))
    except taskdir.TaskError as e:
        fail(str(e))
    sf = pb.SmolfileSpec(image=task.image, env=task.env, timeouts=pb.Timeouts(boot_seconds=BOOT_TIMEOUT),
                         base_dir=str(task.path.resolve()))
    if task.cpus is not None:
        sf.cpus = task.cpus
    if task.memory_mib is not None:
        sf.memory_mib = task.memory_mib
    # Harbor's default is public: the internet, never the host (docs/networking.md). A phase whose policy
    # differs gets it while it runs (SetNetworkPolicy); an offline environment with such a phase starts closed.
    baseline = _policy(task.network_mode, task.allowed_hosts)
    phases = [_policy(*p) for p in (task.agent_network, task.verifier_network) if p is not None]
    if not baseline.closed:
        sf.network.CopyFrom(baseline)
    elif any(not p.closed for p in phases):
        sf.network.closed = True
    name = f"task-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    result: dict[str, Any] = {"task": task.name, "reward": None, "rewards": {}, "passed": False, "error": "",
                              "machine_id": ""}
    try:
        machine = stub.CreateMachine(pb.CreateMachineRequest(name=name, smolfile=pb.Smolfile(spec=sf))).machine
    except BaseException:
        _destroy(stub, name)
        raise
    result["machine_id"] = machine.id
    r = _Runner(stub, machine.id)
    try:
        if task.task_steps:
            result["reward"], result["rewards"], result["error"], result["step_results"] = _run_steps(r, task)
        else:
            result["error"] = _run_task(r, task)
            if not result["error"]:
                result["reward"], result["rewards"], result["error"] = _reward(stub, machine.id)
    finally:
        if not args.keep:
            _destroy(stub, machine.id)
    result["passed"] = result["reward"] is not None and result["reward"] >= 1.0
    result["steps"] = r.steps
    result["duration_s"] = round(time.monotonic() - started, 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for s in r.steps:
            print(terminal_safe(f"{'ok  ' if s['ok'] else 'FAIL'}  {s['name']}  {s['duration_s']:.2f}s  {s['detail']}"))
            if not s["ok"] and s["output_tail"].strip():
                for line in s["output_tail"].rstrip().splitlines()[-20:]:
                    print(terminal_safe(f"      | {line}"))
        for st in result.get("step_results", []):
            shown = "-" if st["reward"] is None else f"{st['reward']:g}"
            print(terminal_safe(f"step  {st['name']}  reward {shown}" + (f"  ({st['error']})" if st["error"] else "")))
        if result["error"]:
            print(terminal_safe(f"error: {result['error']}"))
        reward = "-" if result["reward"] is None else f"{result['reward']:g}"
        print(f"{'PASS' if result['passed'] else 'FAIL'}  {task.name}  reward {reward}  "
              f"({result['duration_s']:.1f}s{', machine ' + machine.id + ' kept' if args.keep else ''})")
    if result["reward"] is None and result["error"]:
        write_err(f"smolctl: run-task: {result['error']}\n")
    return 0 if result["passed"] else 1


def _build(r: _Runner, task: taskdir.Task) -> str:
    """The environment: the Dockerfile's steps, /logs and the working directory; the reason it failed, or ""."""
    deadline = time.monotonic() + task.build_timeout
    for step in task.steps:
        label = f"environment: Dockerfile line {step.line}"
        if step.kind == "copy":
            try:
                _copy_step(r, task, step)
            except grpc.RpcError as e:
                return f"{label}: COPY failed: {e.details() if isinstance(e, grpc.Call) else e}"
            r.steps.append({"name": f"{label} COPY", "ok": True, "detail": "copied", "duration_s": 0.0,
                            "output_tail": ""})
        elif not r.exec(f"{label} RUN", list(step.args), cwd=step.workdir, env=dict(step.env),
                        timeout=deadline - time.monotonic()):
            return f"{label}: the build step failed (smol builds Dockerfiles on its default image)"
    # /logs/* writable by every user, as Harbor's mounted log directories are (the agent or the tests may not be root)
    if not r.exec("setup: /logs and the working directory",
                  ["sh", "-c", 'mkdir -p -- /logs/verifier /logs/agent ${1:+"$1"} && '
                   "chmod 0777 /logs/verifier /logs/agent", "sh", task.workdir], cwd="/", env={}, timeout=60,
                  quiet=True):
        return f"creating /logs/verifier, /logs/agent and {task.workdir or 'the working directory'} failed"
    return ""


def _agent_and_tests(r: _Runner, task: taskdir.Task, src: Path, *, agent_timeout: float, verifier_timeout: float,
                     agent_user: str, verifier_user: str, label: str = "") -> str:
    """The oracle (src/solution/solve.sh as /solution) and the tests (src/tests as /tests), each under its phase's
    network policy; the reason it stopped early, or "" (the tests then wrote the reward, or failed to)."""
    r.copy_tar(_tar([(src / "solution", ".")]), "/solution")
    # Harbor's phase policies: the agent's (or the verifier's) while it runs, the environment's around them
    baseline = _policy(task.network_mode, task.allowed_hosts)
    agent_policy = _policy(*task.agent_network) if task.agent_network else None
    if not r.set_network(f"{label}agent", agent_policy):
        return "the agent phase's network policy could not be applied"
    r.exec(f"{label}agent: oracle solution/solve.sh", ["bash", "/solution/solve.sh"],
           cwd=task.workdir, env={**task.env, **task.solution_env}, timeout=agent_timeout, user=agent_user)
    if not r.set_network(f"{label}environment", baseline if agent_policy else None):
        return "the environment's network policy could not be restored after the agent"
    # /tests and /logs/verifier are emptied first, as Harbor does before every verifier: a reward file, a
    # conftest.py or a test the solution planted (or an earlier step left) never reaches the verdict.
    if not r.exec(f"{label}verifier: empty /tests and /logs/verifier",
                  ["sh", "-c", EMPTY_VERIFIER_DIRS], cwd="/", env={}, timeout=60, quiet=True):
        return "emptying /tests and /logs/verifier before the tests failed"
    r.copy_tar(_tar([(src / "tests", ".")]), "/tests")
    verifier_policy = _policy(*task.verifier_network) if task.verifier_network else None
    if not r.set_network(f"{label}verifier", verifier_policy):
        return "the verifier phase's network policy could not be applied"
    r.exec(f"{label}verifier: tests/test.sh", ["bash", "/tests/test.sh"], cwd=task.workdir,
           env={**task.env, **task.verifier_env}, timeout=verifier_timeout, user=verifier_user)
    if not r.set_network(f"{label}environment", baseline if verifier_policy else None):
        return "the environment's network policy could not be restored after the tests"
    return ""


def _run_task(r: _Runner, task: taskdir.Task) -> str:
    """Build the environment, run the oracle, run the tests; the reason it stopped early, or ""."""
    return _build(r, task) or _agent_and_tests(
        r, task, task.path, agent_timeout=task.agent_timeout, verifier_timeout=task.verifier_timeout,
        agent_user=task.agent_user, verifier_user=task.verifier_user)


def _run_steps(r: _Runner, task: taskdir.Task) -> tuple[float | None, dict[str, float], str, list[dict[str, Any]]]:
    """A multi-step task (Harbor's MultiStepTrial): for each step, its workdir/ staged into the working directory
    and its setup.sh run, its oracle and its tests (/tests and /logs/verifier emptied first); a step that
    failed without rewards, or whose rewards miss its min_reward, ends the run. The task's rewards: per key, the mean over
    the steps that have rewards (a key a step lacks counts 0), or the last step's ("final")."""
    results: list[dict[str, Any]] = []
    error = _build(r, task)
    if error:
        return None, {}, error, results
    pwd = task.workdir or r.output(["pwd"], "") or "/"   # "": the image's WorkingDir (docker_image)
    for st in task.task_steps:
        label = f"step {st.name}: "
        record: dict[str, Any] = {"name": st.name, "reward": None, "rewards": {}, "error": ""}
        results.append(record)
        src = task.path / "steps" / st.name
        if (src / "workdir").is_dir():
            r.copy_tar(_tar([(src / "workdir", ".")]), pwd)
            if (src / "workdir" / "setup.sh").is_file() and not r.exec(
                    f"{label}setup.sh", ["bash", "setup.sh"], cwd=pwd, env=dict(task.env), timeout=st.agent_timeout,
                    user=st.agent_user):
                record["error"] = f"steps/{st.name}/workdir/setup.sh failed"
        if not record["error"]:
            record["error"] = _agent_and_tests(
                r, task, src, agent_timeout=st.agent_timeout, verifier_timeout=st.verifier_timeout,
                agent_user=st.agent_user, verifier_user=st.verifier_user, label=label)
        if not record["error"]:
            record["reward"], record["rewards"], record["error"] = _reward(r.stub, r.machine_id)
        if record["error"] and not record["rewards"]:   # as Harbor: a step that failed ends the task
            r.steps.append({"name": f"{label}failed", "ok": False, "detail": f"{record['error']}: stop",
                            "duration_s": 0.0, "output_tail": ""})
            break
        if st.min_reward is not None:
            missed = [f"{k}={record['rewards'].get(k, '-inf')} < {v:g}" for k, v in st.min_reward.items()
                      if record["rewards"].get(k, -math.inf) < v]
            if missed:
                r.steps.append({"name": f"{label}min_reward", "ok": False, "detail": ", ".join(missed) + ": stop",
                                "duration_s": 0.0, "output_tail": ""})
                break
    scored = [rec["rewards"] for rec in results if rec["reward"] is not None]   # {} scored: no rewards, 0
    if not scored:
        errors = "; ".join(f"step {rec['name']}: {rec['error']}" for rec in results if rec["error"])
        return None, {}, errors or "no step wrote a reward", results
    if task.reward_strategy == "final":
        if results[-1]["reward"] is None:
            return None, {}, f"step {results[-1]['name']}: {results[-1]['error']}", results
        rewards = results[-1]["rewards"]
    else:
        keys = {k for rw in scored for k in rw}
        rewards = {k: sum(rw.get(k, 0.0) for rw in scored) / len(scored) for k in sorted(keys)}
    reward = rewards["reward"] if "reward" in rewards else min(rewards.values(), default=0.0)
    return reward, rewards, "", results


def _policy(mode: str, hosts: list[str]) -> pb.NetworkPolicy:
    """Harbor's (network_mode, allowed_hosts) as smol's policy; no network at all is ``closed``."""
    if mode == "public":
        return pb.NetworkPolicy(public=True)
    if mode == "allowlist" and hosts:
        return pb.NetworkPolicy(allow=hosts)
    return pb.NetworkPolicy(closed=True)


def _destroy(stub: pb_grpc.SmolStub, machine_id: str) -> None:
    try:
        stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=machine_id))
    except grpc.RpcError as e:
        if not (isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.NOT_FOUND):
            write_err(f"smolctl: run-task: destroying {machine_id}: {e.details() if isinstance(e, grpc.Call) else e}\n")
