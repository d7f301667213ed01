"""The injected runtime: the guest agent runs from /.smol/runtime in an image that has no python3 (chroot, no KVM)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from oci_support import D, Entry, F, L, build_image, write_layout

from smold.agent import connect_unix
from smold.oci import runtime
from smold.oci.build import load_manifest, unpack_into
from smold.oci.source import import_layout_dir
from smold.oci.store import OciStore

REPO = Path(__file__).resolve().parents[2]
BUSYBOX = Path("/bin/busybox")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root"),
    pytest.mark.skipif(not BUSYBOX.is_file(), reason="busybox-static not installed"),
]


def test_init_uses_the_runtime_paths() -> None:
    init = (REPO / "guest-agent/init/init").read_text()
    assert f"RT=/{runtime.DEST}" in init and runtime.LOADER in init
    assert runtime.agent_command("/") == [f"/{runtime.DEST}/lib/{runtime.LOADER}", "--library-path",
                                          f"/{runtime.DEST}/lib", f"/{runtime.DEST}/bin/python3"]


@pytest.fixture
def no_python_root() -> Iterator[Path]:
    """An OCI image (busybox only, no python3) unpacked, with the runtime injected and the agent copied in as /init does."""
    work = Path(tempfile.mkdtemp(prefix="smolrt-", dir="/tmp"))  # short: AF_UNIX path limit
    try:
        layers = [[D("bin"), F("bin/busybox", BUSYBOX.read_bytes(), mode=0o755), L("bin/sh", "busybox"),
                   L("bin/ls", "busybox"), L("bin/cat", "busybox"), D("etc"), F("etc/passwd", "root:x:0:0::/root:/bin/sh\n"),
                   F("etc/motd", "lower")],
                  [F("etc/.wh.motd"), Entry("tmp", "dir", mode=0o1777)]]
        built = build_image(layers)
        store = OciStore(work / "store")
        digest = import_layout_dir(store, write_layout(built, work / "layout"))
        root = work / "root"
        root.mkdir()
        unpack_into(store, load_manifest(store, digest), root)
        runtime.inject_runtime(root)
        shutil.copytree(REPO / "guest-agent/smol_agent", root / "run/smol/smol_agent",
                        ignore=shutil.ignore_patterns("__pycache__"))
        assert not (root / "usr/bin/python3").exists()
        (root / "dev").mkdir()  # in the guest /init moves devtmpfs here
        os.mknod(root / "dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        yield root
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
async def chrooted_agent(no_python_root: Path) -> AsyncIterator[tuple[Path, object]]:
    root = no_python_root
    cmd = [shutil.which("chroot") or "/usr/sbin/chroot", str(root), *runtime.agent_command("/"), "-m", "smol_agent", "--listen", "unix:/agent.sock"]
    log = open(root.parent / "agent.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env={"PYTHONPATH": "/run/smol", "PATH": "/bin"}, stdout=log, stderr=log)
    import asyncio

    for _ in range(300):
        if (root / "agent.sock").exists() or proc.poll() is not None:
            break
        await asyncio.sleep(0.05)
    assert proc.poll() is None, (root.parent / "agent.log").read_text()
    client = await connect_unix(str(root / "agent.sock"))
    try:
        yield root, client
    finally:
        await client.close()
        proc.terminate()
        proc.wait(10)
        log.close()


async def test_agent_runs_without_image_python(chrooted_agent: tuple[Path, object]) -> None:
    root, client = chrooted_agent
    r = await client.run(["/bin/sh", "-c", "echo hi from $0; ls /usr/bin/python3 2>&1; cat /etc/motd"])  # type: ignore[attr-defined]
    assert r.stdout.startswith(b"hi from /bin/sh\n")
    assert b"No such file" in r.stdout  # the image has no python3: the agent runs on the injected one
    assert r.exit_code != 0  # /etc/motd was deleted by the upper layer's whiteout
    assert await client.write_file("/tmp/x", b"data") == 4  # type: ignore[attr-defined]
    assert (root / "tmp/x").read_bytes() == b"data"
    env = await client.run(["/bin/sh", "-c", "env"])  # type: ignore[attr-defined]
    assert b"LD_LIBRARY_PATH" not in env.stdout and b"PYTHONHOME" not in env.stdout
