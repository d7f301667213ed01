"""An OCI image without python3, pushed to a real local registry, pulled by smold, booted as a microVM (one boot).

Checks the acceptance points that need a guest: the agent runs on the injected runtime (the image has
no python3), exec uses the image's binaries and its config's Env/WorkingDir, a file deleted by an upper
layer's whiteout is absent and an opaque directory hides the lower layer's contents, and Verify works.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from microvm import VM_CPUS  # noqa: E402
from oci_support import D, F, L, build_image, write_layout  # noqa: E402
from test_daemon_vm import Daemon, vmm_processes  # noqa: E402
from test_oci_registry import LocalRegistry  # noqa: E402

from smold.images.artifacts import default_artifacts  # noqa: E402

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800),
              pytest.mark.skipif(shutil.which("docker-registry") is None or shutil.which("skopeo") is None,
                                 reason="apt-get install docker-registry skopeo"),
              pytest.mark.skipif(not Path("/bin/dash").is_file(), reason="dash")]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smoci-", dir="/tmp"))
    yield d
    for pid in vmm_processes(d):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def test_pulled_image_without_python_boots_execs_and_verifies(workdir: Path) -> None:
    default_artifacts(build=True)  # kernel + initramfs (the rootfs comes from the image)
    # The image's only program is the host's dash with its libc (dynamic, like most images): no python3.
    # Not static busybox: under PVM its execs segfault now and then (docs/pvm-emulator.md).
    libc = "lib/x86_64-linux-gnu/libc.so.6"
    loader = "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    lower = [D("bin"), F("bin/sh", Path("/bin/dash").read_bytes(), mode=0o755),
             D("lib"), D("lib/x86_64-linux-gnu"), F(libc, Path("/" + libc).read_bytes(), mode=0o755),
             F(loader, Path("/" + loader).read_bytes(), mode=0o755),
             D("lib64"), L("lib64/ld-linux-x86-64.so.2", "/" + loader),
             D("etc"), F("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), F("etc/group", "root:x:0:\n"),
             F("etc/removed", "lower layer file\n"), F("etc/kept", "kept\n"),
             D("opaque"), F("opaque/old", "hidden\n"), D("work")]
    upper = [F("etc/.wh.removed"), D("opaque"), F("opaque/.wh..wh..opq"), F("opaque/new", "visible\n")]
    built = build_image([lower, upper], config={"Env": ["PATH=/bin", "GREETING=from-image"],
                                                "WorkingDir": "/work"})
    layout = write_layout(built, workdir / "layout")
    registry = LocalRegistry(workdir / "registry")
    try:
        registry.push(layout, "smol/nopython:v1")
        ref = f"{registry.host}/smol/nopython:v1"
        sf_dir = workdir / "sf"
        sf_dir.mkdir()
        (sf_dir / "Smolfile.toml").write_text(f"""
image = "{ref}"
cpus = {VM_CPUS}
memory = "512M"
[timeouts]
boot = 900
[[verifier.checks]]
kind = "file_matches"
path = "/etc/kept"
content = "kept\\n"
[[verifier.checks]]
kind = "command"
run = "test ! -e /etc/removed"
""")
        daemon = Daemon(workdir).start()
        try:
            created = daemon.smolctl("create", str(sf_dir))
            assert created.returncode == 0, (created.stderr.decode(), daemon.log.read_text()[-4000:])
            mid = created.stdout.decode().strip()
            r = daemon.smolctl("exec", mid, "--", "sh", "-c",
                               'echo "$GREETING"; pwd; echo /etc/*; echo /opaque/*; test -e /usr/bin/python3 || echo no-python')
            assert r.returncode == 0, r.stderr
            lines = r.stdout.decode().split()
            assert lines[:2] == ["from-image", "/work"]
            assert "/etc/kept" in lines and "/etc/removed" not in lines
            assert "/opaque/new" in lines and "/opaque/old" not in lines
            assert lines[-1] == "no-python"
            v = daemon.smolctl("verify", "--json", mid)
            assert v.returncode == 0, v.stdout.decode() + v.stderr.decode()
            assert json.loads(v.stdout)["passed"] is True
            assert daemon.smolctl("rm", mid).returncode == 0
        finally:
            code = daemon.terminate()
            assert code == 0, daemon.log.read_text()[-4000:]
            assert vmm_processes(workdir) == []
    finally:
        registry.close()


def host_programs(*names: str) -> list:
    """Layer entries holding these host programs and every library ldd names, at the paths the host has them
    (``/bin/sh`` is the host's dash): enough of a userland for a Harbor task without the default image."""
    files: dict[str, bytes] = {"bin/sh": Path("/bin/dash").read_bytes()}
    for name in names:
        prog = shutil.which(name)
        assert prog, name
        files[f"bin/{name}"] = Path(prog).read_bytes()
        out = subprocess.run(["ldd", prog], capture_output=True, text=True, check=True).stdout
        for lib in re.findall(r"(/\S+) \(0x", out):
            files[lib.lstrip("/")] = Path(lib).read_bytes()
    dirs = sorted({str(a) for p in files for a in Path(p).parents if str(a) != "."} | {"tmp", "work"})
    return ([D(d, mode=0o1777 if d == "tmp" else 0o755) for d in dirs]
            + [F(p, data, mode=0o755) for p, data in sorted(files.items())])


def test_run_task_with_a_docker_image_from_the_local_registry(workdir: Path) -> None:
    """Issue #16: a Harbor task whose [environment] docker_image is in a registry: smold pulls it, boots it, and
    run-task runs the oracle and the tests in it (the image's Env and WorkingDir; no Dockerfile used). Then (issue
    #18) a sealed Run whose checks run in a machine of that image ([verifier] image)."""
    built = build_image([host_programs("bash", "tar", "mkdir", "chmod", "rm", "cat")],
                        config={"Env": ["PATH=/bin", "GREETING=from-image"], "WorkingDir": "/work"})
    layout = write_layout(built, workdir / "harbor-layout")
    registry = LocalRegistry(workdir / "registry2")
    daemon = None
    try:
        registry.push(layout, "smol/harbor-base:v1")
        task = workdir / "prebuilt"
        for sub in ("solution", "tests", "environment"):
            (task / sub).mkdir(parents=True)
        (task / "instruction.md").write_text("Write 42 to answer.txt.\n")
        (task / "task.toml").write_text(f'[environment]\ndocker_image = "{registry.host}/smol/harbor-base:v1"\n'
                                        f"cpus = {VM_CPUS}\nmemory_mb = 512\n[agent]\ntimeout_sec = 300.0\n")
        (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nRUN exit 1\n")  # not used
        (task / "solution" / "solve.sh").write_text("echo 42 > answer.txt\n")
        (task / "tests" / "test.sh").write_text(
            'if [ "$(cat /work/answer.txt)" = 42 ] && [ "$GREETING" = from-image ] && [ ! -e /usr/bin/python3 ]; '
            "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
        daemon = Daemon(workdir).start()
        res = daemon.smolctl("run-task", str(task), "--json")
        assert res.stdout.strip(), (res.stderr.decode()[-3000:], daemon.log.read_text()[-3000:])
        out = json.loads(res.stdout)
        assert res.returncode == 0 and out["reward"] == 1.0, json.dumps(out, indent=1)
        assert not any("Dockerfile" in s["name"] for s in out["steps"])
        # Issue #18, [verifier] image: a sealed Run whose task runs on smol's default image and whose checks run in
        # a machine of this image (no python3, the image's Env), given only the declared outputs.
        sealed = workdir / "sealed-verifier-image"
        sealed.mkdir()
        (sealed / "Smolfile.toml").write_text(f"""
cpus = {VM_CPUS}
memory = "512M"
setup = ["mkdir -p /app"]
task = "echo 42 > /app/answer; test -x /usr/bin/python3 && echo task-had-python"
[timeouts]
boot = 900
[verifier]
image = "{registry.host}/smol/harbor-base:v1"
outputs = ["/app"]
[[verifier.checks]]
name = "judged-elsewhere"
kind = "command"
run = 'test "$(cat /app/answer)" = 42 && test ! -e /usr/bin/python3 && test "$GREETING" = from-image && echo judged'
""")
        res = daemon.smolctl("run", "--json", str(sealed))
        doc = json.loads(res.stdout) if res.stdout.strip() else res.stderr.decode()[-3000:]
        assert res.returncode == 0 and doc["outcome"] == "OUTCOME_PASS" and doc["sealed"], doc
        steps = {s["name"]: s for s in doc["steps"]}
        assert "task-had-python" in steps["task"]["evidence"]["output_tail"] and "verifier.setup[0]" not in steps
        assert "judged" in doc["result"]["checks"][0]["evidence"]["output_tail"]
        assert doc["image_digest"] != doc["result"]["image_digest"], doc
    finally:
        if daemon is not None:
            code = daemon.terminate()
            assert code == 0, daemon.log.read_text()[-4000:]
        registry.close()
    assert vmm_processes(workdir) == []


INSPECT_CHECKS = ("test_read_and_write_file_text", "test_read_file_not_found", "test_read_file_is_directory",
                  "test_write_text_file_without_permissions", "test_exec_output", "test_exec_stderr_utf",
                  "test_exec_returncode", "test_exec_env_vars", "test_exec_input_binary", "test_cwd_relative",
                  "test_exec_as_nonexistent_user")


def test_inspect_sandbox_from_a_compose_file_whose_image_is_in_the_local_registry(workdir: Path) -> None:
    """Issue #17: an Inspect eval written for Docker (a compose.yaml naming a registry image) runs on smol: the
    provider takes the compose file, smold pulls the image and boots it, and a cross-section of Inspect's
    sandbox self-check passes in that machine, with the service's working_dir and environment applied."""
    import asyncio

    from inspect_ai.util._sandbox import self_check

    from smolsdk.inspect_sandbox import SmolSandboxEnvironment

    built = build_image([host_programs("bash", "cat", "rm", "stat", "mkdir", "ls", "chmod", "sleep", "printf",
                                       "touch", "whoami")],
                        config={"Env": ["PATH=/bin", "GREETING=from-image"], "WorkingDir": "/"})
    registry = LocalRegistry(workdir / "registry3")
    daemon = None
    try:
        registry.push(write_layout(built, workdir / "inspect-layout"), "smol/inspect-base:v1")
        compose = workdir / "inspect-task" / "compose.yaml"
        compose.parent.mkdir()
        compose.write_text(f"""
services:
  default:
    image: {registry.host}/smol/inspect-base:v1
    command: tail -f /dev/null
    init: true
    working_dir: /work
    network_mode: none
    environment: [GREETING=from-compose]
    cpus: {VM_CPUS}
    mem_limit: 512m
""")
        daemon = Daemon(workdir).start()
        os.environ["SMOL_SOCKET"] = str(daemon.socket)

        async def run() -> list[str]:
            await SmolSandboxEnvironment.task_init("t", str(compose))
            envs = await SmolSandboxEnvironment.sample_init("t", str(compose), {})
            env = envs["default"]
            failed = []
            try:
                r = await env.exec(["sh", "-c", 'echo "$GREETING $(pwd)"'])
                assert r.stdout.split() == ["from-compose", "/work"], r
                for name in INSPECT_CHECKS:
                    try:
                        await getattr(self_check, name)(env)
                    except Exception as e:   # every check runs; the failures are listed together
                        failed.append(f"{name}: {type(e).__name__}: {e}")
            finally:
                await SmolSandboxEnvironment.sample_cleanup("t", str(compose), envs, False)
            return failed

        failed = asyncio.run(run())
        assert failed == [], "\n".join(failed)
    finally:
        os.environ.pop("SMOL_SOCKET", None)
        if daemon is not None:
            code = daemon.terminate()
            assert code == 0, daemon.log.read_text()[-4000:]
        registry.close()
    assert vmm_processes(workdir) == []
