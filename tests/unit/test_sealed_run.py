"""A sealed Run through a real daemon (the guest agent on the host stands in for each VM): the outputs leave the
task's machine, which is destroyed, and the checks run in a second machine that receives them. Isolation itself
(a pristine guest) needs real VMs: tests/integration/test_daemon_vm.py."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import signal
import tarfile
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
ARTIFACT_CAP = 16 * 1024

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
                          destroy_grace_s=5.0, copy_cap_bytes=COPY_CAP, artifact_cap_bytes=ARTIFACT_CAP,
                          verifier_logs_path=str(d / "logs" / "verifier"))
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


ARTIFACTS_SMOLFILE = """
cpus = 1
memory = 256
setup = ["mkdir -p {d}/app"]
task = {task!r}
[verifier]
outputs = ["{d}/app"]
[[verifier.checks]]
name = "suite"
kind = "command"
run = "mkdir -p {d}/logs/verifier && echo judged > {d}/logs/verifier/out.txt && test $(cat {d}/app/answer) = 42"
"""


def members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        return {m.name: (t.extractfile(m).read() if m.isfile() else b"") for m in t}  # type: ignore[union-attr]


async def test_a_runs_outputs_and_verifier_logs_are_kept_with_its_result(env) -> None:
    """Artifacts (docs/verifier.md, "Artifacts"): the sealed outputs and the verifier's logs are kept beside the
    stored result, listed with their SHA-256, served by GetArtifact and checked on the way out; one over the
    artifact cap is listed, not kept; a file changed on disk is DATA_LOSS, not served."""
    d, stub = env
    text = ARTIFACTS_SMOLFILE.format(d=d, task=f"echo 42 > {d}/app/answer")
    resp = await stub.Run(pb.RunRequest(smolfile=pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(d)))))
    assert resp.outcome == pb.OUTCOME_PASS, resp
    arts = {a.name: a for a in resp.artifacts}
    assert sorted(arts) == ["outputs.tar", "verifier-logs.tar"] and all(a.kept for a in arts.values()), arts
    stored = (await stub.GetResult(pb.GetResultRequest(id=resp.result_id))).result
    assert list(stored.run.artifacts) == list(resp.artifacts)
    # identity: the Smolfile the Run ran is kept with it, and is the one its digest names
    from smold.api import convert  # noqa: PLC0415
    from smold.smolfile import digest  # noqa: PLC0415

    assert stored.run.smolfile == resp.smolfile and list(resp.smolfile.verifier_outputs) == [f"{d}/app"]
    assert digest(convert.smolfile_from_spec_proto(stored.run.smolfile)) == resp.result.smolfile_digest
    got = await stub.GetArtifact(pb.GetArtifactRequest(result_id=resp.result_id, name="outputs.tar"))
    assert got.sha256 == arts["outputs.tar"].sha256 == hashlib.sha256(got.content).hexdigest()
    assert members(got.content)[f"{str(d).lstrip('/')}/app/answer"] == b"42\n"
    logs = await stub.GetArtifact(pb.GetArtifactRequest(result_id=resp.result_id, name="verifier-logs.tar"))
    assert members(logs.content)[f"{str(d).lstrip('/')}/logs/verifier/out.txt"] == b"judged\n"
    assert len(logs.content) == arts["verifier-logs.tar"].size_bytes

    for name, code in (("nothing.tar", grpc.StatusCode.NOT_FOUND), ("../results.db", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetArtifact(pb.GetArtifactRequest(result_id=resp.result_id, name=name))
        assert e.value.code() == code, e.value
    kept = d / "state" / "results" / "artifacts" / resp.result_id / "outputs.tar"
    kept.write_bytes(kept.read_bytes()[:-1] + b"x")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GetArtifact(pb.GetArtifactRequest(result_id=resp.result_id, name="outputs.tar"))
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "does not match" in (e.value.details() or "")

    # smolctl results ID --artifact NAME -o FILE (a thread: the daemon serves on this event loop)
    from smolctl.__main__ import main as smolctl  # noqa: PLC0415

    argv = ["--socket", str(d / "smold.sock"), "results", resp.result_id, "--artifact", "verifier-logs.tar", "-o",
            str(d / "logs.tar")]
    assert await asyncio.to_thread(smolctl, argv) == 0 and (d / "logs.tar").read_bytes() == logs.content
    assert await asyncio.to_thread(smolctl, argv) == 2  # never overwritten
    from smolsdk import AsyncClient, NotFoundError  # noqa: PLC0415

    async with AsyncClient(d / "smold.sock") as client:
        assert await client.get_artifact(resp.result_id, "verifier-logs.tar") == logs.content
        stored_run = (await client.get_result(resp.result_id)).run
        assert stored_run is not None and [a.name for a in stored_run.artifacts if a.kept] == ["outputs.tar",
                                                                                               "verifier-logs.tar"]
        with pytest.raises(NotFoundError):
            await client.get_artifact(resp.result_id, "nothing.tar")

    big = f"head -c {ARTIFACT_CAP * 2} /dev/urandom > {d}/app/big; echo 42 > {d}/app/answer"
    text = ARTIFACTS_SMOLFILE.format(d=d, task=big)
    resp = await stub.Run(pb.RunRequest(smolfile=pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(d)))))
    assert resp.outcome == pb.OUTCOME_PASS, resp
    arts = {a.name: a for a in resp.artifacts}
    assert not arts["outputs.tar"].kept and arts["outputs.tar"].size_bytes > ARTIFACT_CAP
    assert "larger than the artifact cap" in arts["outputs.tar"].note and arts["verifier-logs.tar"].kept
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GetArtifact(pb.GetArtifactRequest(result_id=resp.result_id, name="outputs.tar"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "larger than the artifact cap" in (e.value.details() or "")
