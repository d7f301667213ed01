"""An OCI image without python3, pushed to a real local registry, pulled by smold, booted as a microVM (one boot).

Checks the acceptance points that need a guest: the agent runs on the injected runtime (the image has
no python3), exec uses the image's binaries and its config's Env/WorkingDir, a file deleted by an upper
layer's whiteout is absent and an opaque directory hides the lower layer's contents, and Verify works.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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
