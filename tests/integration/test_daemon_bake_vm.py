"""smold pre-baked images end to end with a real microVM: one bake, then two creates restored from it.

Makes one VM (the default vCPUs, 512 MiB) to bake the Smolfile: it boots, or restores the base bake of the default image
at that size when a module before it sharing the run's bake store (tests/conftest.py) made one; its setup
command runs once, before the snapshot. Both machines created afterwards restore the bake instead of booting,
each with its own hostname and machine-id, and exec works in them at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from microvm import VM_CPUS
from test_daemon_fork_vm import artifacts, daemon, sh  # noqa: F401  (fixtures)

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.kvm, pytest.mark.linux, pytest.mark.timeout(1800)]

SMOLFILE = f"""
image = "default"
cpus = {VM_CPUS}
memory = "512M"
setup = ["echo baked-$BAKE_ENV > /root/baked"]
[env]
BAKE_ENV = "yes"
[timeouts]
boot = 900
"""
# Same boot state (image, size, env, setup); another verifier and timeouts: the same bake key.
SMOLFILE_WITH_VERIFIER = SMOLFILE.replace("boot = 900", "boot = 600\nsetup = 300") + """
[[verifier.checks]]
kind = "file_matches"
path = "/root/baked"
content = "baked-yes\\n"
"""


def smolctl(sock: Path, *args: str, timeout: float = 1500) -> str:
    r = subprocess.run([sys.executable, "-m", "smolctl", *args], capture_output=True, timeout=timeout,
                       env={**os.environ, "SMOL_SOCKET": str(sock)})
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout.decode()


def test_bake_then_two_creates_restore_it(daemon: tuple[pb_grpc.SmolStub, Path], tmp_path: Path) -> None:  # noqa: F811
    stub, state = daemon
    sock = state.parent / "smold.sock"
    (tmp_path / "Smolfile.toml").write_text(SMOLFILE)
    t0 = time.monotonic()
    key = smolctl(sock, "image", "bake", str(tmp_path)).strip()
    t_bake = time.monotonic() - t0
    assert stub.ListMachines(pb.ListMachinesRequest()).machines == []  # the baking machine is gone
    # Beside it, the base bake of the default image at this size (made by the first machine of that image and size
    # that booted, in this module or an earlier one sharing the store): the bake started from it.
    listed = {b["key"]: b for b in json.loads(smolctl(sock, "image", "bakes", "--json"))}
    assert key.startswith("sha256:") and key in listed and not listed[key].get("error")
    assert (Path(listed[key]["path"]) / "bake.json").is_file()

    request = pb.Smolfile(toml=pb.SmolfileToml(text=SMOLFILE_WITH_VERIFIER, base_dir=str(tmp_path)))
    timings, ids = [], []
    for name in ("one", "two"):
        t1 = time.monotonic()
        m = stub.CreateMachine(pb.CreateMachineRequest(name=name, smolfile=request), timeout=600).machine
        timings.append(time.monotonic() - t1)
        assert m.state == pb.MACHINE_STATE_RUNNING and m.restored_from == f"bake:{key}", m
        t2 = time.monotonic()
        # The setup ran once, at bake time; the machine has its own hostname and machine-id.
        out = sh(stub, name, "cat /root/baked; cat /proc/sys/kernel/hostname; cat /etc/machine-id")
        timings.append(time.monotonic() - t2)
        baked, host, machine_id = out.split()
        assert (baked, host) == ("baked-yes", name)
        ids.append(machine_id)
        assert stub.Verify(pb.VerifyRequest(machine_id=name), timeout=600).result.passed
    assert ids[0] != ids[1]
    listed = {b["key"]: b for b in json.loads(smolctl(sock, "image", "bakes", "--json"))}
    assert sorted(listed[key]["machine_ids"]) == sorted(m.id for m in stub.ListMachines(pb.ListMachinesRequest()).machines)

    # Deleting the bake does not disturb the machines restored from it.
    assert smolctl(sock, "image", "unbake", key.removeprefix("sha256:")[:12]).strip() == key.removeprefix("sha256:")[:12]
    assert key not in {b["key"] for b in json.loads(smolctl(sock, "image", "bakes", "--json"))}
    assert sh(stub, "one", "cat /root/baked") == "baked-yes"
    for name in ("one", "two"):
        stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=name), timeout=300)
    print(f"\nbake {t_bake:.0f}s; create from bake / first exec: one {timings[0]:.2f}s / {timings[1]:.1f}s, "
          f"two {timings[2]:.2f}s / {timings[3]:.1f}s")
