"""The daemon resolving OCI images: Smolfile ``image = "./layout"`` through the cache, exec defaults from the
image config, corrupt cached disks never booted (host-agent launcher: no KVM)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from daemon_support import fake_image_files, start_daemon_task
from oci_support import D, F, build_image, write_layout

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import DaemonConfig
from smold.daemon.errors import ImageNotFoundError
from smold.daemon.images import ImageStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(os.geteuid() != 0, reason="root disks keep ownership")]


@pytest.fixture
def workdir() -> AsyncIterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smo-", dir="/tmp"))  # short: AF_UNIX paths
    yield d  # type: ignore[misc]
    shutil.rmtree(d, ignore_errors=True)


def _layout(workdir: Path) -> Path:
    wd = workdir / "g" / "app"
    wd.mkdir(parents=True)
    built = build_image([[D("etc"), F("etc/hello", "hi")]],
                        config={"Env": ["GREETING=from-image", "SHADOWED=image"], "WorkingDir": str(wd)})
    return write_layout(built, workdir / "img")


def _store(workdir: Path) -> ImageStore:
    files = fake_image_files(workdir)
    return ImageStore({"default": lambda: files}, oci_root=workdir / "oci")


async def test_store_resolves_local_layout_with_exec_defaults(workdir: Path) -> None:
    _layout(workdir)
    store = _store(workdir)
    img = await store.resolve("./img", str(workdir))
    assert img.name == "./img" and img.kernel.name == "vmlinux" and img.rootfs.name == "rootfs.ext4"
    assert dict(img.env)["GREETING"] == "from-image" and img.working_dir == str(workdir / "g/app")
    assert img.digest == (await store.resolve(str(workdir / "img"))).digest
    # A cached disk altered after it was built is never used: it is rebuilt from the verified blobs.
    with open(img.rootfs, "r+b") as fh:
        fh.seek(2048)
        fh.write(b"tampered")
    again = await store.resolve("./img", str(workdir))
    with open(again.rootfs, "rb") as fh:
        fh.seek(2048)
        assert fh.read(8) != b"tampered"
    meta = json.loads((again.rootfs.parent / "image.json").read_text())
    assert meta["rootfs_digest"] == "sha256:" + hashlib.sha256(again.rootfs.read_bytes()).hexdigest()
    with pytest.raises(ImageNotFoundError, match="does not exist"):
        await store.resolve("./missing", str(workdir))
    with pytest.raises(ImageNotFoundError, match="unknown image 'nosuch'.*nosuch:latest"):
        await store.resolve("nosuch")


async def test_daemon_exec_uses_image_env_and_workdir(workdir: Path) -> None:
    _layout(workdir)
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=2,
                          max_memory_mib=4096)
    daemon, task = await start_daemon_task(replace(config), _store(workdir))
    try:
        async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
            stub = pb_grpc.SmolStub(channel)
            text = 'image = "./img"\nmemory = 256\ncpus = 1\n[env]\nSHADOWED = "smolfile"\n'
            sf = pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(workdir), filename="Smolfile"))
            m = (await stub.CreateMachine(pb.CreateMachineRequest(smolfile=sf))).machine
            assert m.image == "./img"
            out = b""
            async for msg in stub.Exec(pb.ExecRequest(machine_id=m.id, argv=[
                    "sh", "-c", 'echo "$GREETING $SHADOWED"; pwd'])):
                if msg.WhichOneof("event") == "stdout":
                    out += msg.stdout
            assert out.decode().split("\n")[:2] == ["from-image smolfile", str(workdir / "g/app")]
            await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)


def test_smolctl_image_pull_ls_rm_prune(workdir: Path) -> None:
    from daemon_support import DaemonProcess

    layout = _layout(workdir)
    other = write_layout(build_image([[F("other", "o")]]), workdir / "other")
    d = DaemonProcess(workdir).start()
    try:
        pulled = d.smolctl("image", "pull", "./img", cwd=workdir)
        assert pulled.returncode == 0, pulled.stderr
        assert f"oci:{layout}" in pulled.stdout.decode()
        again = json.loads(d.smolctl("image", "pull", str(other), "--json").stdout)
        assert again["names"] == [f"oci:{other}"] and again["manifest_digest"].startswith("sha256:")
        assert pulled.stderr == b""   # no progress ticker when stderr is not a terminal
        table = d.smolctl("image", "ls").stdout.decode().splitlines()
        assert table[0].split() == ["MANIFEST", "SIZE", "NAMES"] and len(table) == 3
        listed = json.loads(d.smolctl("image", "ls", "--json").stdout)
        assert sorted(n for i in listed for n in i["names"]) == sorted([f"oci:{layout}", f"oci:{other}"])
        # A machine using the image keeps it through rm + prune; the unnamed other image goes.
        sf = workdir / "sf"
        sf.mkdir()
        (sf / "Smolfile.toml").write_text(f'image = "{layout}"\nmemory = 256\ncpus = 1\n')
        created = d.smolctl("create", str(sf))
        assert created.returncode == 0, created.stderr
        mid = created.stdout.decode().strip()
        in_use = [i for i in listed if f"oci:{layout}" in i["names"]][0]["manifest_digest"]
        assert d.smolctl("image", "rm", str(layout)).stdout.decode() == f"removed oci:{layout}\n"
        assert json.loads(d.smolctl("image", "rm", f"oci:{other}", "--json").stdout) == [f"oci:{other}"]
        pruned = d.smolctl("image", "prune")
        assert pruned.returncode == 0 and "freed" in pruned.stdout.decode()
        left = json.loads(d.smolctl("image", "ls", "--json").stdout)
        assert [i["manifest_digest"] for i in left] == [in_use]  # unnamed, but a machine uses it
        assert "names" not in left[0]
        assert d.smolctl("rm", mid).returncode == 0
        last = json.loads(d.smolctl("image", "prune", "--json").stdout)
        assert in_use in last["removed"] and int(last["freed_bytes"]) > 0
        assert json.loads(d.smolctl("image", "ls", "--json").stdout) == []
        missing = d.smolctl("image", "rm", "nothing:here")
        assert missing.returncode != 0 and b"no cached image" in missing.stderr
        bad = d.smolctl("image", "pull", "127.0.0.1:1/nothing:v1")
        assert bad.returncode != 0 and b"127.0.0.1:1" in bad.stderr
    finally:
        d.terminate()


async def test_prune_keeps_images_named_by_checkpoints(workdir: Path) -> None:
    from daemon_support import HostAgentLauncher

    from smold.daemon import Controller

    _layout(workdir)
    store = _store(workdir)
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state")
    controller = Controller(config, HostAgentLauncher(), store)
    img = await store.resolve("./img", str(workdir))
    await controller.remove_image(str(workdir / "img"))  # no name left: only the checkpoint below keeps it
    cp = config.checkpoints_dir / "cp1"
    cp.mkdir(parents=True)
    (cp / "checkpoint.json").write_text(json.dumps({"image": "./img", "machine_id": "m-1"}))
    removed, _ = await controller.prune_images()
    assert img.rootfs.is_file() and removed == []
    shutil.rmtree(cp)
    removed, freed = await controller.prune_images()
    assert not img.rootfs.exists() and freed > 0 and removed
