"""Client-facing limits of smold (docs/security.md): mount sources confined to --mount-root, at most
--max-concurrent-calls calls in progress, and what a bad client can and cannot make the daemon do."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from test_daemon import Env, create, expect_error, run_exec, smolfile_of, start_daemon, toml

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import DaemonConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def limited() -> AsyncIterator[Env]:
    workdir = Path(tempfile.mkdtemp(prefix="smdl-", dir="/tmp"))   # short: AF_UNIX paths are limited
    allowed = workdir / "tasks"
    allowed.mkdir()
    daemon, task = await start_daemon(workdir, mount_roots=(allowed,), max_concurrent_calls=3)
    guest = workdir / "g"
    guest.mkdir()
    async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
        yield Env(daemon, pb_grpc.SmolStub(channel), workdir, guest)
    daemon.stop()
    await asyncio.wait_for(task, 30)
    shutil.rmtree(workdir, ignore_errors=True)


async def test_mount_outside_the_mount_roots_is_refused(limited: Env) -> None:
    outside = limited.dir / "elsewhere"
    outside.mkdir()
    (outside / "secret").write_text("host file")
    text = f'memory = 256\ncpus = 1\n[mounts]\n"secret" = "{limited.guest}/s"\n'
    await expect_error(limited.stub.CreateMachine(pb.CreateMachineRequest(smolfile=toml(text, outside))),
                       grpc.StatusCode.INVALID_ARGUMENT, "outside the daemon's mount roots")
    # base_dir "/" with a relative path into the host: the same refusal.
    text = f'memory = 256\ncpus = 1\n[mounts]\n"{str(outside / "secret").lstrip("/")}" = "{limited.guest}/s"\n'
    await expect_error(limited.stub.CreateMachine(pb.CreateMachineRequest(smolfile=toml(text, Path("/")))),
                       grpc.StatusCode.INVALID_ARGUMENT, "outside the daemon's mount roots")
    # A symlink inside the root pointing out of it is judged by where it leads.
    task = limited.dir / "tasks" / "t1"
    task.mkdir()
    (task / "link").symlink_to(outside / "secret")
    (task / "ok.txt").write_text("fine")
    (task / "Smolfile.toml").write_text(f'memory = 256\ncpus = 1\n[mounts]\n"link" = "{limited.guest}/s"\n')
    await expect_error(limited.stub.CreateMachine(pb.CreateMachineRequest(smolfile=smolfile_of(task))),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert not (limited.guest / "s").exists()
    (task / "Smolfile.toml").write_text(f'memory = 256\ncpus = 1\n[mounts]\n"ok.txt" = "{limited.guest}/ok"\n')
    m = await create(limited, smolfile_of(task))
    assert (limited.guest / "ok").read_text() == "fine"
    await limited.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))


async def test_calls_beyond_the_concurrency_limit_are_refused_and_served_later(limited: Env) -> None:
    m = await create(limited)
    slow = [asyncio.ensure_future(run_exec(limited, m.id, ["sleep", "2"])) for _ in range(3)]
    await asyncio.sleep(0.8)    # the three calls are in progress
    await expect_error(limited.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id)),
                       grpc.StatusCode.RESOURCE_EXHAUSTED)
    for out in await asyncio.gather(*slow):
        assert out[2].exit_code == 0
    got = await limited.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id))
    assert got.machine.id == m.id
    await limited.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))


async def test_unix_socket_is_born_with_its_mode(limited: Env) -> None:
    st = os.stat(limited.daemon.config.socket_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660


def test_limit_settings_are_validated(tmp_path: Path) -> None:
    base = DaemonConfig(socket_path=tmp_path / "s.sock", state_dir=tmp_path)
    for bad, msg in (({"max_concurrent_calls": 0}, "max-concurrent-calls"),
                     ({"mount_roots": (Path("rel"),)}, "mount-root"),
                     ({"jail": True, "jail_uid": 0}, "jail-uid"),
                     ({"vmm_seccomp": "maybe"}, "vmm-seccomp")):
        from dataclasses import replace
        with pytest.raises(ValueError, match=msg):
            replace(base, **bad).validate()  # type: ignore[arg-type]
