"""A sealed Run through a real daemon (the guest agent on the host stands in for each VM): the outputs leave the
task's machine, which is destroyed, and the checks run in a second machine that receives them. Isolation itself
(a pristine guest) needs real VMs: tests/integration/test_daemon_vm.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from daemon_support import fake_image_files, processes_mentioning, start_daemon_task

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import DaemonConfig
from smold.daemon.images import ImageStore

pytestmark = pytest.mark.timeout(120)
COPY_CAP = 64 * 1024

SMOLFILE = """
cpus = 1
memory = 256
setup = ["mkdir -p {d}/app"]
task = {task!r}
[verifier]
outputs = ["{d}/app", "{d}/absent"]
[[verifier.checks]]
name = "answer"
kind = "file_matches"
path = "{d}/app/answer"
regex = "^42$"
"""


@pytest.fixture
async def env(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Path, pb_grpc.SmolStub]]:
    d = Path(tempfile.mkdtemp(prefix="sms-", dir="/tmp"))
    config = DaemonConfig(socket_path=d / "smold.sock", state_dir=d / "state", max_machines=4, max_memory_mib=2048,
                          destroy_grace_s=5.0, copy_cap_bytes=COPY_CAP)
    files = fake_image_files(d)
    (d / "checker").mkdir()
    checker = (*files[:2], fake_image_files(d / "checker")[2])  # another rootfs: another image digest
    (d / "checker" / "rootfs.ext4").write_bytes(b"the verifier's own image")
    images = ImageStore({"default": lambda: files, "checker": lambda: checker})
    daemon, task = await start_daemon_task(config, images)
    try:
        async with grpc.aio.insecure_channel(f"unix:{d / 'smold.sock'}") as channel:
            yield d, pb_grpc.SmolStub(channel)
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)
        leftover = processes_mentioning(str(d / "state"))
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
        assert leftover == []


def smolfile(d: Path, task: str) -> pb.Smolfile:
    return pb.Smolfile(toml=pb.SmolfileToml(text=SMOLFILE.format(d=d, task=task), base_dir=str(d)))


async def test_a_sealed_run_judges_in_a_second_machine_that_gets_only_the_outputs(env) -> None:
    d, stub = env
    task = (f"echo 42 > {d}/app/answer; mkfifo {d}/app/fifo; ln -s /etc {d}/app/etc; "
            f"ln {d}/app/answer {d}/app/hard; echo planted > {d}/elsewhere")
    resp = await stub.Run(pb.RunRequest(smolfile=smolfile(d, task)))
    assert resp.outcome == pb.OUTCOME_PASS, resp
    assert resp.sealed and resp.verifier_machine_id and resp.verifier_machine_id != resp.machine_id
    names = [s.name for s in resp.steps]
    assert names[:3] == ["boot", "setup[0]", "task"] and names[3] == "outputs" and "verifier.boot" in names, names
    assert "verifier.setup[0]" in names  # the verifier machine is set up as the task's was, then gets the outputs
    outputs = resp.steps[3].evidence.detail
    # the hostile members are left out and said so; a declared output that does not exist is named
    assert "2 files, 6 bytes" in outputs and "1 devices, fifos" in outputs, outputs
    assert f"not present: {d}/absent" in outputs
    assert os.readlink(d / "app" / "etc") == "/etc" and not (d / "app" / "fifo").exists()
    assert (await stub.ListMachines(pb.ListMachinesRequest())).machines == []
    stored = (await stub.GetResult(pb.GetResultRequest(id=resp.result_id))).result
    assert stored.run.sealed and stored.run.verifier_machine_id == resp.verifier_machine_id

    failed = await stub.Run(pb.RunRequest(smolfile=smolfile(d, f"echo 41 > {d}/app/answer")))
    assert failed.outcome == pb.OUTCOME_FAIL and failed.sealed and "41" in failed.result.checks[0].evidence.output_tail


async def test_outputs_over_the_cap_leave_the_verdict_undecided(env) -> None:
    d, stub = env
    big = f"head -c {COPY_CAP * 2} /dev/urandom > {d}/app/big; echo 42 > {d}/app/answer"
    resp = await stub.Run(pb.RunRequest(smolfile=smolfile(d, big)))
    assert resp.outcome == pb.OUTCOME_VERIFIER_ERROR and resp.sealed and not resp.verifier_machine_id, resp
    (check,) = resp.result.checks
    assert check.error and check.name == "outputs" and f"larger than the cap of {COPY_CAP} bytes" in \
        check.evidence.detail
    assert [s.name for s in resp.steps][-1] == "outputs" and not resp.steps[-1].ok
    assert (await stub.ListMachines(pb.ListMachinesRequest())).machines == []


async def test_a_verifier_image_judges_in_a_machine_of_that_image_without_the_tasks_setup(env) -> None:
    """[verifier] image (Harbor's separate verifier environment): the checks' machine boots that image, is not set
    up as the task's was, and receives only the outputs; the reply names both images."""
    d, stub = env
    text = SMOLFILE.format(d=d, task=f"echo 42 > {d}/app/answer").replace("[verifier]\n",
                                                                           '[verifier]\nimage = "checker"\n')
    resp = await stub.Run(pb.RunRequest(smolfile=pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(d)))))
    assert resp.outcome == pb.OUTCOME_PASS and resp.sealed, resp
    names = [s.name for s in resp.steps]
    assert names[:4] == ["boot", "setup[0]", "task", "outputs"] and "verifier.boot" in names, names
    assert "verifier.setup[0]" not in names  # the task's setup belongs to the task's image
    assert resp.image_digest and resp.result.image_digest and resp.image_digest != resp.result.image_digest
    plain = await stub.Run(pb.RunRequest(smolfile=smolfile(d, f"echo 42 > {d}/app/answer")))
    assert plain.image_digest == resp.image_digest == plain.result.image_digest  # one image: the same digest
    stored = (await stub.GetResult(pb.GetResultRequest(id=resp.result_id))).result
    assert stored.run.image_digest == resp.image_digest and stored.run.result.image_digest == resp.result.image_digest
    assert (await stub.ListMachines(pb.ListMachinesRequest())).machines == []
