"""A gRPC client in another language: Node's @grpc/grpc-js runs Create/Exec/Verify/Destroy against smold."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import REPO, DaemonProcess, daemon_in_tempdir

INTEROP = REPO / "tests" / "interop"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (the Node gRPC client needs it)"),
]


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """tests/interop/node_modules, installed from package-lock.json with `npm ci` if missing."""
    modules = INTEROP / "node_modules"
    if not (modules / "@grpc" / "grpc-js").is_dir() or not (modules / "@grpc" / "proto-loader").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "npm is needed to install tests/interop (npm ci)"
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=INTEROP, capture_output=True, timeout=240)
        assert r.returncode == 0, f"npm ci failed in {INTEROP}:\n{r.stdout.decode()}\n{r.stderr.decode()}"
    return modules


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("smi-", check_exit=True) as proc:
        yield proc


def test_node_client_create_exec_verify_destroy(node_modules: Path, daemon: DaemonProcess) -> None:
    guest = daemon.workdir / "g"
    guest.mkdir()
    r = subprocess.run(["node", str(INTEROP / "client.js"), str(daemon.socket), str(guest)], capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    report = json.loads(r.stdout)
    m = report["machine"]
    assert m["name"] == "from-node" and m["state"] == "MACHINE_STATE_RUNNING" and m["memory_mib"] == 256
    ex = report["exec"]
    assert ex["stdout"] == "hello from javascript\n" and ex["stderr_hex"] == "ff"  # bytes, not text
    assert ex["exit"]["exit_code"] == 5 and ex["last_event"] == "exit"
    assert (guest / "from-node.txt").read_text() == "written by node\n"  # stdin reached the command
    assert report["verify"]["passed"] is True and report["verify"]["checks"][0]["kind"] == "file_exists"
    assert report["after_destroy"]["code"] == "NOT_FOUND" and "was destroyed" in report["after_destroy"]["details"]
    assert report["bad_smolfile"] == {"code": "INVALID_ARGUMENT",
                                      "details": "node.toml: memory: must be at least 128 MiB (got 1 MiB)"}
    assert not list((daemon.state / "machines").iterdir())
