"""smolctl run-task on Harbor-format task directories written here, against smold with the host-agent launcher."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir

from smolctl import taskdir

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="the task launcher needs root and unshare(1)")]

TEST_SH = """#!/bin/bash
if [ "$(cat /app/answer.txt 2>/dev/null)" = "$EXPECTED" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("rtask-", "--net-pool", "10.214.13.0/24", launcher="sandbox_launcher:TaskLauncher") as proc:
        yield proc


def write_task(root: Path, name: str, solve: str, *, test: str = TEST_SH, toml: str = "",
               dockerfile: str | None = "FROM debian:bookworm\nWORKDIR /app\nENV EXPECTED=42\n",
               files: dict[str, str] | None = None) -> Path:
    t = root / name
    (t / "solution").mkdir(parents=True)
    (t / "tests").mkdir()
    (t / "environment").mkdir()
    (t / "instruction.md").write_text("Write the answer to /app/answer.txt.\n")
    (t / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 30.0\n'
                                 + toml)
    (t / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    (t / "tests" / "test.sh").write_text(test)
    if dockerfile is not None:
        (t / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        p = t / "environment" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return t


def run_task(daemon: DaemonProcess, task: Path, *extra: str) -> tuple[int, dict]:
    res = daemon.smolctl("run-task", str(task), "--json", *extra)
    assert res.returncode in (0, 1), res.stderr.decode()
    return res.returncode, json.loads(res.stdout)


def test_passing_oracle(daemon: DaemonProcess, tmp_path: Path) -> None:
    task = write_task(tmp_path, "pass", "echo $EXPECTED > answer.txt\n")
    code, out = run_task(daemon, task)
    assert (code, out["reward"], out["passed"], out["error"]) == (0, 1.0, True, "")
    assert [s["name"].split(":")[0] for s in out["steps"]] == ["environment", "agent", "verifier"]
    # Harbor's default network mode, public: the machine had its own namespace with public egress
    assert re.search(rf"machine {out['machine_id']}: network namespace \S+, uplink \S+ \(public egress\)",
                     daemon.log.read_text(errors="replace")), daemon.log_text()
    human = daemon.smolctl("run-task", str(task))
    assert human.returncode == 0 and b"PASS  pass  reward 1" in human.stdout


def test_failing_oracle(daemon: DaemonProcess, tmp_path: Path) -> None:
    task = write_task(tmp_path, "fail", "echo 41 > answer.txt\n")
    code, out = run_task(daemon, task)
    assert (code, out["reward"], out["passed"]) == (1, 0.0, False)


def test_network_is_off(daemon: DaemonProcess, tmp_path: Path) -> None:
    solve = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)\" "
             "&& echo $EXPECTED > answer.txt\n")
    code, out = run_task(daemon, write_task(tmp_path, "net", solve, toml='[environment]\nnetwork_mode = "no-network"\n'))
    assert (code, out["reward"]) == (1, 0.0)
    assert "Network is unreachable" in out["steps"][-2]["output_tail"]
    assert f"machine {out['machine_id']}: network namespace" not in daemon.log.read_text(errors="replace")


def test_reward_json_copy_env_and_run_steps(daemon: DaemonProcess, tmp_path: Path) -> None:
    dockerfile = ("FROM python:3.11-slim\nWORKDIR /app\nENV GREETING=hello \\\n    EXPECTED=hello-data\n"
                  "COPY data/ /app/data/\nCOPY seed.txt .\nRUN cat seed.txt >> data/in.txt\nCMD [\"bash\"]\n")
    test = ('#!/bin/bash\nif [ "$(cat /app/answer.txt)" = "$GREETING-$(head -1 /app/data/in.txt)" ] && '
            'grep -q seeded /app/data/in.txt; then r=1; else r=0; fi\n'
            'echo "{\\"reward\\": $r, \\"style\\": 0.5}" > /logs/verifier/reward.json\n')
    task = write_task(tmp_path, "json", 'echo "$GREETING-$(head -1 data/in.txt)" > answer.txt\n', test=test,
                      dockerfile=dockerfile, files={"data/in.txt": "data\n", "seed.txt": "seeded\n"})
    code, out = run_task(daemon, task)
    assert (code, out["reward"], out["rewards"]) == (0, 1.0, {"reward": 1.0, "style": 0.5}), json.dumps(out, indent=1)


def test_timeouts_and_missing_reward(daemon: DaemonProcess, tmp_path: Path) -> None:
    task = write_task(tmp_path, "slow", "sleep 30; echo $EXPECTED > answer.txt\n",
                      test="#!/bin/bash\ntrue\n")
    (task / "task.toml").write_text("[agent]\ntimeout_sec = 1.0\n[verifier]\ntimeout_sec = 5.0\n")
    code, out = run_task(daemon, task)
    assert code == 1 and out["reward"] is None
    assert out["steps"][-2]["detail"] == "timed out after 1s"
    assert "wrote neither" in out["error"]


@pytest.mark.parametrize("reward_json, expected", [
    ('{"accuracy": 1, "style": 1.0}', (0, 1.0, {"accuracy": 1.0, "style": 1.0}, "")),
    ('{"accuracy": 1, "style": 0.5}', (1, 0.5, {"accuracy": 1.0, "style": 0.5}, "")),  # every reward must be 1
    ("0.25", (1, 0.25, {"reward": 0.25}, "")),
    ('{"reward": NaN}', (1, None, {}, "not a finite number")),
    ('{"reward": "1"}', (1, None, {}, "not a finite number")),
    ("", (1, None, {}, "reward.json is empty")),
    ("{}", (1, 0.0, {}, "")),   # no rewards: Harbor's metrics count it as 0, not as an error
])
def test_harbor_reward_rules(daemon: DaemonProcess, tmp_path: Path, reward_json: str, expected: tuple) -> None:
    """reward.json first, with every named reward kept (Harbor 0.26's Verifier); a reward.txt beside it is
    ignored, and one the solution planted is removed before the tests run."""
    test = f"#!/bin/bash\nprintf '%s' '{reward_json}' > /logs/verifier/reward.json\necho 1 > /logs/verifier/reward.txt\n"
    task = write_task(tmp_path, "rules", "echo 1 > /logs/verifier/reward.txt\n", test=test)
    code, out = run_task(daemon, task)
    assert (code, out["reward"], out["rewards"]) == expected[:3], json.dumps(out, indent=1)
    assert expected[3] in out["error"]


def test_a_reward_the_solution_planted_is_removed_before_the_tests(daemon: DaemonProcess, tmp_path: Path) -> None:
    task = write_task(tmp_path, "planted", 'echo 1 > /logs/verifier/reward.txt; echo \'{"reward": 1}\' > '
                      "/logs/verifier/reward.json\n", test="#!/bin/bash\ntrue\n")
    code, out = run_task(daemon, task)
    assert code == 1 and out["reward"] is None and "wrote neither" in out["error"], out


def test_files_the_solution_planted_in_tests_never_reach_the_verdict(daemon: DaemonProcess, tmp_path: Path) -> None:
    """/tests is emptied before the task's tests are copied in (as Harbor does): a conftest.py, an extra test or a
    replaced test.sh the solution left there is gone."""
    solve = ("mkdir -p /tests && echo 'raise SystemExit(0)' > /tests/conftest.py && "
             "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; echo 42 > answer.txt\n")
    # the genuine tests pass only if they find nothing but themselves in /tests
    test = ('#!/bin/bash\nif [ -e /tests/conftest.py ] || [ "$(cat /app/answer.txt)" != 42 ]; then r=0; else r=1; fi; '
            "echo $r > /logs/verifier/reward.txt\n")
    code, out = run_task(daemon, write_task(tmp_path, "plants", solve, test=test))
    assert (code, out["reward"]) == (0, 1.0), out


def test_task_toml_env_workdir_user_and_cpus(daemon: DaemonProcess, tmp_path: Path, monkeypatch,
                                             request: pytest.FixtureRequest) -> None:
    """[environment.env] (with Harbor's ${VAR:-default} templates), [solution.env], [verifier.env], [environment]
    workdir over WORKDIR, [verifier] user, and a fractional cpus rounded up."""
    monkeypatch.setenv("SMOL_TEST_TOKEN", "from-host")
    wd = Path(f"/tmp/smol-rt-wd-{os.getpid()}-{tmp_path.name}")  # reachable by nobody (pytest's tmp_path is 0700)
    request.addfinalizer(lambda: shutil.rmtree(wd, ignore_errors=True))
    solve = 'echo "$BASE $TOKEN $DFLT $SOL ${VER:-none} $(pwd)" > answer.txt\n'
    test = ('#!/bin/bash\nread -r line < answer.txt\n'
            f'if [ "$line" = "base from-host d1 sol none {wd}" ] && [ "$VER" = ver ] && [ "$(id -u)" = 65534 ] '
            '&& [ -z "$SOL" ]; then echo 1; else echo "0 $line $VER $(id -u)"; fi > /logs/verifier/reward.txt\n')
    toml = ('[environment]\ncpus = 0.5\nworkdir = "' + str(wd) + '"\n'
            '[environment.env]\nBASE = "base"\nTOKEN = "${SMOL_TEST_TOKEN}"\nDFLT = "${SMOL_UNSET_X:-d1}"\n'
            '[solution.env]\nSOL = "sol"\n[verifier.env]\nVER = "ver"\n[verifier]\nuser = "nobody"\n')
    task = write_task(tmp_path, "fields", solve, test=test, toml="")
    (task / "task.toml").write_text(toml.replace("[verifier]\nuser", "[verifier]\ntimeout_sec = 30.0\nuser"))
    code, out = run_task(daemon, task)
    assert (code, out["reward"]) == (0, 1.0), json.dumps(out, indent=1)
    from smolctl import taskdir  # noqa: PLC0415

    assert taskdir.load(task).cpus == 1
    monkeypatch.delenv("SMOL_TEST_TOKEN")
    with pytest.raises(taskdir.TaskError, match="SMOL_TEST_TOKEN is not set"):
        taskdir.load(task)


def test_docker_image_is_booted_and_the_dockerfile_left_alone(tmp_path: Path) -> None:
    """[environment] docker_image: the task runs in that image (pulled by smold; a bare name means :latest), in its
    WorkingDir, and environment/Dockerfile is not used (Harbor's prebuilt image). The real pull and boot:
    tests/integration/test_oci_vm.py."""
    from smolctl import taskdir  # noqa: PLC0415

    for given, image in (("registry.local:5000/team/env:v2", "registry.local:5000/team/env:v2"),
                         ("ubuntu", "ubuntu:latest"), ("alpine@sha256:" + "a" * 64, "alpine@sha256:" + "a" * 64)):
        task = write_task(tmp_path, f"img-{len(given)}", "true\n", dockerfile="FROM x\nUSER nobody\n",
                          toml=f'[environment]\ndocker_image = "{given}"\n')
        t = taskdir.load(task)
        assert (t.image, t.workdir, t.steps) == (image, "", [])
    bad = write_task(tmp_path, "bad-img", "true\n", toml="[environment]\ndocker_image = 3\n")
    with pytest.raises(taskdir.TaskError, match="docker_image must be an image reference"):
        taskdir.load(bad)


def test_network_policies_follow_harbors_task_spec(tmp_path: Path) -> None:
    def load(toml: str) -> tuple[str, list[str]]:
        task = write_task(tmp_path, f"n{len(list(tmp_path.iterdir()))}", "true\n")
        (task / "task.toml").write_text(toml)
        t = taskdir.load(task)
        return t.network_mode, t.allowed_hosts

    assert load("") == ("public", [])                                         # Harbor's default
    assert load("[environment]\nallow_internet = true\n") == ("public", [])    # deprecated, still honoured
    assert load("[environment]\nallow_internet = false\n") == ("no-network", [])
    assert load('[environment]\nnetwork_mode = "no-network"\n') == ("no-network", [])
    assert load('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["example.org", "10.0.0.0/8"]\n'
                '[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["example.org", "10.0.0.0/8"]\n') == (
        "allowlist", ["example.org", "10.0.0.0/8"])
    for toml, why in (
            ('[environment]\nnetwork_mode = "internet"\n', "network_mode must be one of public, no-network, allowlist"),
            ('[environment]\nnetwork_mode = "public"\nallowed_hosts = ["a.org"]\n', "allowed_hosts is only valid"),
            ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = "a.org"\n', "must be an array of strings"),
            ('[environment]\nnetwork_mode = "no-network"\nallow_internet = true\n', "contradicts"),
            ("[environment]\nallow_internet = 1\n", "allow_internet must be true or false"),
            ('[agent]\nnetwork_mode = "offline"\n', "[agent] network_mode must be one of"),
            ('[verifier]\nallowed_hosts = ["a.org"]\n', "[verifier] network_mode must be one of")):
        with pytest.raises(taskdir.TaskError, match=re.escape(why)):
            load(toml)
    # Harbor's phase overrides: kept where they differ from the environment's
    task = write_task(tmp_path, "phases", "true\n")
    (task / "task.toml").write_text('[environment]\nnetwork_mode = "no-network"\n[agent]\nnetwork_mode = "no-network"\n'
                                    '[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n')
    t = taskdir.load(task)
    assert (t.agent_network, t.verifier_network) == (None, ("allowlist", ["pypi.org"]))


def test_phase_network_policies_are_applied_around_the_agent_and_the_tests(daemon: DaemonProcess,
                                                                           tmp_path: Path) -> None:
    task = write_task(tmp_path, "phases", "echo $EXPECTED > answer.txt\n")
    with (task / "task.toml").open("a") as f:   # after write_task's [agent] table
        f.write('network_mode = "no-network"\n')
    code, out = run_task(daemon, task)
    assert (code, out["reward"]) == (0, 1.0), out
    steps = [(s["name"], s["detail"]) for s in out["steps"] if s["name"].startswith("network:")]
    assert steps == [("network: agent", "no network"), ("network: environment", "public")]
    log = daemon.log.read_text(errors="replace")
    assert re.search(rf"machine {out['machine_id']}: network policy 2: nothing allowed", log)
    assert re.search(rf"machine {out['machine_id']}: network policy 3: public", log)


def test_refusals(daemon: DaemonProcess, tmp_path: Path) -> None:
    user = write_task(tmp_path, "user", "true\n", dockerfile="FROM debian\nUSER nobody\n")
    res = daemon.smolctl("run-task", str(user))
    assert res.returncode == 2 and b"Dockerfile:2: USER is not supported" in res.stderr
    with pytest.raises(taskdir.TaskError, match="COPY source"):
        taskdir.load(write_task(tmp_path, "copy", "true\n", dockerfile="COPY ../../etc/passwd /x\n"))
    with pytest.raises(taskdir.TaskError, match="solve.sh is missing"):
        (tmp_path / "nosol" / "tests").mkdir(parents=True)
        (tmp_path / "nosol" / "tests" / "test.sh").write_text("")
        taskdir.load(tmp_path / "nosol")


def write_steps_task(root: Path, name: str, steps: dict[str, tuple[str, str]], toml: str,
                     workdirs: dict[str, dict[str, str]] | None = None) -> Path:
    """A multi-step task: steps/<name>/{instruction.md, solution/solve.sh, tests/test.sh[, workdir/...]}."""
    t = root / name
    (t / "environment").mkdir(parents=True)
    (t / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (t / "instruction.md").write_text("Do the steps.\n")
    (t / "task.toml").write_text(toml)
    for step, (solve, test) in steps.items():
        d = t / "steps" / step
        (d / "solution").mkdir(parents=True)
        (d / "tests").mkdir()
        (d / "instruction.md").write_text(f"Step {step}.\n")
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
        (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test)
        for rel, text in (workdirs or {}).get(step, {}).items():
            (d / "workdir" / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / "workdir" / rel).write_text(text)
    return t


STEPS_TOML = ('version = "1.0"\n[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n'
              '[environment]\nnetwork_mode = "no-network"\n')


def test_a_multi_step_task_runs_each_step_and_averages_the_rewards(daemon: DaemonProcess, tmp_path: Path) -> None:
    steps = {
        # step one: named rewards, and a stale /tests file the next step must not see
        "one": ("echo 1 > one.txt\n",
                'touch /tests/left-by-one; echo "{\\"reward\\": $(cat /app/one.txt), \\"style\\": 0.5}" '
                "> /logs/verifier/reward.json\n"),
        # step two: its workdir (seed.txt, setup.sh) is staged first; its tests see only their own files
        "two": ("cp seeded.txt two.txt\n",
                'if [ -e /tests/left-by-one ] || [ "$(cat /app/two.txt)" != seed ]; then r=0; else r=1; fi; '
                "echo $r > /logs/verifier/reward.txt\n"),
    }
    toml = STEPS_TOML + '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n[steps.agent]\ntimeout_sec = 20.0\n'
    task = write_steps_task(tmp_path, "multi", steps, toml,
                            workdirs={"two": {"seed.txt": "seed\n", "setup.sh": "cp seed.txt seeded.txt\n"}})
    t = taskdir.load(task)
    assert [s.name for s in t.task_steps] == ["one", "two"] and t.task_steps[1].agent_timeout == 20.0
    code, out = run_task(daemon, task)
    assert [(s["name"], s["reward"], s["error"]) for s in out["step_results"]] == [("one", 1.0, ""), ("two", 1.0, "")]
    # mean per key over the steps; a key a step lacks counts 0
    assert (code, out["reward"], out["rewards"]) == (0, 1.0, {"reward": 1.0, "style": 0.25}), out
    names = [s["name"] for s in out["steps"]]
    assert "step two: setup.sh" in names and "step one: agent: oracle solution/solve.sh" in names


def test_a_step_below_its_min_reward_ends_the_task(daemon: DaemonProcess, tmp_path: Path) -> None:
    steps = {"one": ("true\n", "echo 0.5 > /logs/verifier/reward.txt\n"),
             "two": ("touch /app/two-ran\n", "echo 1 > /logs/verifier/reward.txt\n")}
    toml = ('multi_step_reward_strategy = "final"\n' + STEPS_TOML +    # a top-level key: before the tables
            '[[steps]]\nname = "one"\nmin_reward = 0.75\n[[steps]]\nname = "two"\n')
    code, out = run_task(daemon, write_steps_task(tmp_path, "gated", steps, toml))
    assert [s["name"] for s in out["step_results"]] == ["one"]        # step two never ran
    assert (code, out["reward"]) == (1, 0.5), out                     # "final": the last step that ran
    assert any(s["name"] == "step one: min_reward" and "reward=0.5 < 0.75" in s["detail"] for s in out["steps"])


def test_a_step_that_fails_without_a_reward_ends_the_task(daemon: DaemonProcess, tmp_path: Path) -> None:
    steps = {"one": ("true\n", "echo 1 > /logs/verifier/reward.txt\n"),
             "two": ("true\n", "echo 1 > /logs/verifier/reward.txt\n"),
             "three": ("true\n", "echo 1 > /logs/verifier/reward.txt\n")}
    toml = STEPS_TOML + '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n[[steps]]\nname = "three"\n'
    task = write_steps_task(tmp_path, "broken", steps, toml, workdirs={"two": {"setup.sh": "exit 3\n"}})
    code, out = run_task(daemon, task)
    assert [(s["name"], s["reward"]) for s in out["step_results"]] == [("one", 1.0), ("two", None)]
    assert (code, out["reward"]) == (0, 1.0), out   # the mean over the steps with rewards, as Harbor's


def test_the_final_strategy_takes_the_last_steps_rewards(daemon: DaemonProcess, tmp_path: Path) -> None:
    steps = {"one": ("true\n", "echo 0 > /logs/verifier/reward.txt\n"),
             "two": ("true\n", "echo 1 > /logs/verifier/reward.txt\n")}
    toml = 'multi_step_reward_strategy = "final"\n' + STEPS_TOML + '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n'
    code, out = run_task(daemon, write_steps_task(tmp_path, "final", steps, toml))
    assert (code, out["reward"], [s["reward"] for s in out["step_results"]]) == (0, 1.0, [0.0, 1.0]), out


def test_a_step_with_an_empty_reward_object_counts_zero(daemon: DaemonProcess, tmp_path: Path) -> None:
    steps = {"one": ("true\n", "echo 1 > /logs/verifier/reward.txt\n"),
             "two": ("true\n", "echo '{}' > /logs/verifier/reward.json\n")}
    toml = STEPS_TOML + '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n'
    code, out = run_task(daemon, write_steps_task(tmp_path, "empty", steps, toml))
    assert [(s["reward"], s["rewards"], s["error"]) for s in out["step_results"]] == [
        (1.0, {"reward": 1.0}, ""), (0.0, {}, "")], out
    assert (code, out["reward"], out["rewards"]) == (1, 0.5, {"reward": 0.5}), out   # Harbor: the missing key is 0


def test_multi_step_task_errors() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ok = {"a": ("true\n", "true\n")}
        for toml, why in (
                ("steps = []\n" + STEPS_TOML, "steps must be a non-empty array of tables"),
                (STEPS_TOML + '[[steps]]\nname = "../x"\n', "name must be a portable directory name"),
                (STEPS_TOML + '[[steps]]\nname = "a"\n[[steps]]\nname = "A"\n', "step name 'A' is used twice"),
                (STEPS_TOML + '[[steps]]\nname = "b"\n', "steps/b/solution/solve.sh is missing"),
                (STEPS_TOML + '[[steps]]\nname = "a"\nmin_reward = "high"\n', "min_reward must be a number"),
                ('multi_step_reward_strategy = "max"\n' + STEPS_TOML + '[[steps]]\nname = "a"\n',
                 "multi_step_reward_strategy must be one of mean, final"),
                (STEPS_TOML + '[[steps]]\nname = "a"\n[steps.agent]\nnetwork_mode = "public"\n',
                 "a step's own network policy is not supported")):
            task = write_steps_task(root, f"t{len(list(root.iterdir()))}", ok, toml)
            with pytest.raises(taskdir.TaskError, match=re.escape(why)):
                taskdir.load(task)
