"""The durable result store: the SQLite store itself, then Run/Verify/GetResult/ListResults through a real daemon
(the guest agent on the host stands in for each VM), a client that leaves mid-Run, SIGTERM and kill -9 mid-Run."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sqlite3
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from daemon_support import (
    DaemonProcess,
    fake_images,
    pid_alive,
    processes_mentioning,
    start_daemon_task,
    wait_until,
)

from smold.api.machine import Artifact, ResultState
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import DaemonConfig
from smold.daemon.errors import DaemonSetupError, InvalidRequestError
from smold.daemon.results import DB_FILE, ResultNotFoundError, ResultStore
from smold.verifier import Outcome

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smr-", dir="/tmp"))  # short: AF_UNIX paths are limited
    yield d
    for pid in processes_mentioning(str(d / "state")):  # never leave agents behind, whatever failed
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


# --- the store ------------------------------------------------------------------------------------------------
async def test_prune_removes_finished_results_with_their_artifacts_never_running_ones(workdir: Path) -> None:
    store = ResultStore(workdir / "results")
    await store.open()
    old = await store.begin("run", {"campaign": "a"})
    other = await store.begin("run", {"campaign": "b"})
    running = await store.begin("run", {"campaign": "a"})
    for rid in (old, other):
        (kept,) = await store.keep_artifacts(rid, (Artifact("outputs.tar", 5, content=b"12345"),), cap=100)
        assert kept.kept and kept.sha256 and (workdir / "results" / "artifacts" / rid / "outputs.tar").is_file()
        await store.finish(rid, state=ResultState.DONE, outcome=Outcome.PASS, outcome_detail="", payload=b"x")
    ver = await store.add("verify", outcome=Outcome.FAIL, outcome_detail="", payload=b"v")
    time.sleep(0.01)
    assert await store.prune(older_than=3600) == (0, 0)  # nothing ended an hour ago
    assert await store.prune(older_than=0, labels={"campaign": "a"}) == (1, 5)  # not the running one
    with pytest.raises(ResultNotFoundError):
        await store.get(old)
    assert not (workdir / "results" / "artifacts" / old).exists()
    assert (await store.get(running)).state is ResultState.RUNNING
    assert await store.prune(older_than=0, keep={other}) == (1, 0)  # the Verify; `other` is kept
    with pytest.raises(ResultNotFoundError):
        await store.get(ver)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError):
            await store.prune(older_than=bad)
    # a prune stopped between its commit and its removals: the next open removes directories without a row
    orphan = workdir / "results" / "artifacts" / "r-0123456789abcdef"
    orphan.mkdir()
    (orphan / "outputs.tar").write_bytes(b"x")
    await store.close()
    again = ResultStore(workdir / "results")
    await again.open()
    assert not orphan.exists() and (workdir / "results" / "artifacts" / other / "outputs.tar").is_file()
    await again.close()



async def test_store_rows_survive_reopening_and_running_ones_become_interrupted(workdir: Path) -> None:
    store = ResultStore(workdir / "results")
    assert await store.open() == 0
    done = await store.begin("run", {"agent": "a", "task": "t1"})
    left = await store.begin("run", {"agent": "a", "task": "t2"})
    assert (await store.get(left)).state is ResultState.RUNNING and (await store.get(left)).outcome is None
    await store.finish(done, state=ResultState.DONE, outcome=Outcome.FAIL, outcome_detail="1 of 2 checks failed",
                       payload=b"\x01evidence", machine_id="m-1")
    ver = await store.add("verify", outcome=Outcome.PASS, outcome_detail="", payload=b"v", machine_id="m-2")
    await store.close()  # as a kill -9 would leave it: `left` still running

    again = ResultStore(workdir / "results")
    assert await again.open() == 1
    try:
        r = await again.get(left)
        assert (r.state, r.outcome) == (ResultState.INTERRUPTED, Outcome.INTERRUPTED)
        assert "daemon stopped" in r.outcome_detail and r.finished_at is not None and r.payload == b""
        r = await again.get(done)
        assert (r.state, r.outcome, r.outcome_detail, r.payload, r.machine_id) == (
            ResultState.DONE, Outcome.FAIL, "1 of 2 checks failed", b"\x01evidence", "m-1")
        assert r.labels == (("agent", "a"), ("task", "t1")) and r.finished_at is not None
        assert r.created_at <= r.finished_at <= time.time()
        # newest first, without payloads; filters by every label given and by kind
        assert [x.id for x in await again.list()] == [ver, left, done]
        assert all(x.payload == b"" for x in await again.list())
        assert [x.id for x in await again.list(labels={"agent": "a"})] == [left, done]
        assert [x.id for x in await again.list(labels={"agent": "a", "task": "t1"})] == [done]
        assert await again.list(labels={"agent": "b"}) == []
        assert [x.id for x in await again.list(kind="verify")] == [ver]
        assert [x.id for x in await again.list(limit=1)] == [ver]
        with pytest.raises(ResultNotFoundError, match="not in this daemon's result store"):
            await again.get("r-0123456789abcdef")
        for bad in ("", "r-1", "../x", "r-0123456789ABCDEF"):
            with pytest.raises(InvalidRequestError, match="is not a result id"):
                await again.get(bad)
        with pytest.raises(InvalidRequestError, match="kind"):
            await again.list(kind="build")
        with pytest.raises(InvalidRequestError, match="limit"):
            await again.list(limit=10_001)
        with pytest.raises(InvalidRequestError, match="key"):
            await again.list(labels={"-bad": "x"})
    finally:
        await again.close()
    assert os.stat(workdir / "results").st_mode & 0o777 == 0o700


async def test_store_refuses_a_database_of_another_schema_or_a_corrupt_file(workdir: Path) -> None:
    root = workdir / "results"
    store = ResultStore(root)
    await store.open()
    await store.close()
    with sqlite3.connect(root / DB_FILE) as db:
        db.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(DaemonSetupError, match="schema version 99"):
        await ResultStore(root).open()
    shutil.rmtree(root)
    root.mkdir()
    (root / DB_FILE).write_bytes(b"not a database" * 100)
    with pytest.raises(DaemonSetupError, match="moved aside"):
        await ResultStore(root).open()


# --- through the daemon ---------------------------------------------------------------------------------------
SMOLFILE = """
cpus = 1
memory = 256
task = {{ run = {task!r} }}
[[verifier.checks]]
name = "answer"
kind = "file_matches"
path = "{answer}"
regex = "^42$"
"""


class Env:
    def __init__(self, d: Path, stub: pb_grpc.SmolStub) -> None:
        self.dir, self.stub = d, stub

    def smolfile(self, task: str) -> pb.Smolfile:
        text = SMOLFILE.format(task=task, answer=self.dir / "answer")
        return pb.Smolfile(toml=pb.SmolfileToml(text=text, base_dir=str(self.dir)))


@pytest.fixture
async def env(workdir: Path) -> AsyncIterator[Env]:
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=4,
                          max_memory_mib=2048, destroy_grace_s=5.0)
    daemon, task = await start_daemon_task(config, fake_images(workdir))
    try:
        async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
            yield Env(workdir, pb_grpc.SmolStub(channel))
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)
    assert processes_mentioning(str(workdir / "state")) == []


async def test_run_and_verify_results_are_stored_and_listed_by_label(env: Env) -> None:
    answer = env.dir / "answer"
    resp = await env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"echo 42 > {answer}"),
                                            labels={"agent": "a1", "task": "t"}))
    assert resp.outcome == pb.OUTCOME_PASS and resp.result_id.startswith("r-")
    stored = (await env.stub.GetResult(pb.GetResultRequest(id=resp.result_id))).result
    assert (stored.kind, stored.state, stored.outcome) == ("run", pb.RESULT_STATE_DONE, pb.OUTCOME_PASS)
    assert stored.run == resp and dict(stored.labels) == {"agent": "a1", "task": "t"}
    assert stored.machine_id == resp.machine_id and stored.finished_at.ToSeconds() >= stored.created_at.ToSeconds()

    failed = await env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"echo 41 > {answer}"), labels={"agent": "a2"}))
    assert failed.outcome == pb.OUTCOME_FAIL
    stored = (await env.stub.GetResult(pb.GetResultRequest(id=failed.result_id))).result
    assert stored.outcome == pb.OUTCOME_FAIL and "answer" in stored.outcome_detail
    assert "41" in stored.run.result.checks[0].evidence.output_tail  # the evidence is kept, not just the verdict

    # Verify on a machine the client holds is stored too
    m = (await env.stub.CreateMachine(pb.CreateMachineRequest(smolfile=env.smolfile("true"), name="held"))).machine
    ver = (await env.stub.Verify(pb.VerifyRequest(machine_id="held"))).result
    assert ver.result_id.startswith("r-") and ver.outcome == pb.OUTCOME_FAIL
    stored = (await env.stub.GetResult(pb.GetResultRequest(id=ver.result_id))).result
    assert (stored.kind, stored.machine_id, stored.verify) == ("verify", m.id, ver)
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))

    listed = (await env.stub.ListResults(pb.ListResultsRequest())).results
    assert [r.id for r in listed] == [ver.result_id, failed.result_id, resp.result_id]
    assert all(not r.HasField("run") and not r.HasField("verify") for r in listed)  # GetResult has the evidence
    a1 = (await env.stub.ListResults(pb.ListResultsRequest(labels={"agent": "a1"}))).results
    assert [r.id for r in a1] == [resp.result_id]
    runs = (await env.stub.ListResults(pb.ListResultsRequest(kind="run", limit=1))).results
    assert [r.id for r in runs] == [failed.result_id]

    # bad requests name what is wrong; a refused Run leaves no row
    for call, fragment in [
        (env.stub.GetResult(pb.GetResultRequest(id="nope")), "is not a result id"),
        (env.stub.GetResult(pb.GetResultRequest(id="r-0000000000000000")), "not in this daemon's result store"),
        (env.stub.GetResult(pb.GetResultRequest(id=resp.result_id, wait_seconds=-1)), "wait_seconds"),
        (env.stub.ListResults(pb.ListResultsRequest(kind="nope")), "kind"),
        (env.stub.Run(pb.RunRequest(smolfile=env.smolfile("true"), labels={"bad key": "x"})), "labels: key"),
        (env.stub.Run(pb.RunRequest(smolfile=env.smolfile("true"), name="held2", labels={"k": "\x01"})),
         "control characters"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        code = info.value.code()
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), info.value.details()
        assert fragment in (info.value.details() or ""), info.value.details()
    big = pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=4096, cpus=1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env.stub.Run(pb.RunRequest(smolfile=big))
    assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    assert len((await env.stub.ListResults(pb.ListResultsRequest())).results) == 3


async def test_a_run_whose_client_leaves_still_ends_and_stores_its_result(env: Env) -> None:
    answer, started = env.dir / "answer", env.dir / "started"
    call = env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"touch {started}; sleep 2; echo 42 > {answer}"),
                                      labels={"who": "leaver"}))
    assert await asyncio.to_thread(wait_until, started.exists, 30)
    (row,) = (await env.stub.ListResults(pb.ListResultsRequest(labels={"who": "leaver"}))).results
    assert row.state == pb.RESULT_STATE_RUNNING and row.outcome == pb.OUTCOME_UNSPECIFIED
    call.cancel()  # the client goes away mid-task
    with pytest.raises(asyncio.CancelledError):
        await call
    got = (await env.stub.GetResult(pb.GetResultRequest(id=row.id, wait_seconds=60))).result
    assert (got.state, got.outcome) == (pb.RESULT_STATE_DONE, pb.OUTCOME_PASS), got
    assert got.run.result_id == row.id and got.run.steps[-1].name == "task"
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []


async def test_a_detached_run_replies_at_once_and_its_verdict_is_fetched_later(env: Env) -> None:
    answer, go = env.dir / "answer", env.dir / "go"
    resp = await env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"while [ ! -e {go} ]; do sleep 0.05; done; "
                                                                  f"echo 42 > {answer}"),
                                            labels={"mode": "detached"}, detach=True))
    assert resp.state == pb.RESULT_STATE_RUNNING and resp.result_id.startswith("r-") and not resp.steps
    got = (await env.stub.GetResult(pb.GetResultRequest(id=resp.result_id, wait_seconds=0.2))).result
    assert got.state == pb.RESULT_STATE_RUNNING and not got.HasField("run")  # the wait ran out first
    go.touch()
    got = (await env.stub.GetResult(pb.GetResultRequest(id=resp.result_id, wait_seconds=60))).result
    assert (got.state, got.outcome) == (pb.RESULT_STATE_DONE, pb.OUTCOME_PASS)
    assert got.run.state == pb.RESULT_STATE_DONE and got.run.result_id == resp.result_id

    # a detached Run refused by a limit is stored as infra_error: its client holds nothing but the id
    big = pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=2048, cpus=1))
    first = await env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"sleep 0.5; echo 42 > {answer}"), name="x",
                                             detach=True))
    second = await env.stub.Run(pb.RunRequest(smolfile=big, detach=True))
    got = (await env.stub.GetResult(pb.GetResultRequest(id=second.result_id, wait_seconds=60))).result
    assert got.outcome == pb.OUTCOME_INFRA_ERROR and "memory" in got.outcome_detail, got
    got = (await env.stub.GetResult(pb.GetResultRequest(id=first.result_id, wait_seconds=60))).result
    assert got.outcome == pb.OUTCOME_PASS


async def test_sigterm_mid_run_stores_it_interrupted_and_removes_its_machine(workdir: Path) -> None:
    config = DaemonConfig(socket_path=workdir / "smold.sock", state_dir=workdir / "state", max_machines=4,
                          max_memory_mib=2048, destroy_grace_s=5.0)
    daemon, task = await start_daemon_task(config, fake_images(workdir))
    started = workdir / "started"
    async with grpc.aio.insecure_channel(f"unix:{workdir / 'smold.sock'}") as channel:
        env = Env(workdir, pb_grpc.SmolStub(channel))
        call = env.stub.Run(pb.RunRequest(smolfile=env.smolfile(f"touch {started}; sleep 60")))
        assert await asyncio.to_thread(wait_until, started.exists, 30)
        (row,) = (await env.stub.ListResults(pb.ListResultsRequest())).results
        daemon.stop()
        await asyncio.wait_for(task, 60)
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    assert list((workdir / "state" / "machines").iterdir()) == []
    store = ResultStore(workdir / "state" / "results")
    assert await store.open() == 0  # it was written interrupted by the stopping daemon itself
    try:
        got = await store.get(row.id)
        assert (got.state, got.outcome) == (ResultState.INTERRUPTED, Outcome.INTERRUPTED)
    finally:
        await store.close()


def test_kill_9_mid_run_is_interrupted_after_restart_and_its_machine_is_removed(workdir: Path) -> None:
    started = workdir / "started"
    (workdir / "task").mkdir()
    d1 = DaemonProcess(workdir).start()
    channel = grpc.insecure_channel(f"unix:{d1.socket}")
    try:
        stub = pb_grpc.SmolStub(channel)
        smolfile = Env(workdir, stub).smolfile(f"touch {started}; sleep 300")
        future = stub.Run.future(pb.RunRequest(smolfile=smolfile, labels={"case": "kill-9"}))
        assert wait_until(started.exists, 30)
        (row,) = stub.ListResults(pb.ListResultsRequest()).results
        (mdir,) = (d1.state / "machines").iterdir()
        agent_pids = processes_mentioning(str(mdir))
        assert agent_pids
        d1.kill()  # kill -9: no shutdown code runs
        with pytest.raises(grpc.RpcError):
            future.result(timeout=30)
    finally:
        channel.close()
        d1.kill()
    d2 = DaemonProcess(workdir).start()
    try:
        with grpc.insecure_channel(f"unix:{d2.socket}") as ch:
            stub = pb_grpc.SmolStub(ch)
            got = stub.GetResult(pb.GetResultRequest(id=row.id)).result
            assert (got.state, got.outcome) == (pb.RESULT_STATE_INTERRUPTED, pb.OUTCOME_INTERRUPTED)
            assert dict(got.labels) == {"case": "kill-9"} and "daemon stopped" in got.outcome_detail
            assert stub.ListMachines(pb.ListMachinesRequest()).machines == []  # not re-adopted
        assert not mdir.exists()
        assert wait_until(lambda: not any(pid_alive(p) for p in agent_pids), 10)
        assert f"served Run {row.id}" in d2.log_text()
    finally:
        assert d2.terminate() == 0, d2.log_text()



def test_smolctl_and_the_sdk_read_stored_results(workdir: Path) -> None:
    from smolsdk import Client  # noqa: PLC0415

    answer = workdir / "answer"
    task = workdir / "task"
    task.mkdir()
    (task / "Smolfile.toml").write_text(SMOLFILE.format(task=f"echo 42 > {answer}", answer=answer))
    d = DaemonProcess(workdir).start()
    try:
        r = d.smolctl("run", str(task), "--label", "agent=a1", "--label", "task=hello")
        assert r.returncode == 0, r.stderr
        rid = r.stdout.decode().split("result ", 1)[1].split(")", 1)[0]
        shown = d.smolctl("results", rid)
        assert shown.returncode == 0 and f"{rid}  run  PASS  (agent=a1, task=hello)" in shown.stdout.decode()
        assert "checks:" in shown.stdout.decode() and "steps:" in shown.stdout.decode()
        table = d.smolctl("results", "--label", "agent=a1").stdout.decode()
        assert rid in table and "PASS" in table and "agent=a1,task=hello" in table, table
        assert d.smolctl("results", "--label", "agent=other", "-q").stdout == b""
        bad = d.smolctl("results", "--label", "novalue")
        assert bad.returncode == 2 and b"expected KEY=VALUE" in bad.stderr
        missing = d.smolctl("results", "r-0000000000000000")
        assert missing.returncode == 2 and b"not in this daemon's result store" in missing.stderr

        with Client(d.socket) as client:
            run = client.run(task, labels={"agent": "sdk"})
            assert run.outcome == "pass" and run.result_id.startswith("r-")
            got = client.get_result(run.result_id, wait=1)
            assert (got.kind, got.state, got.outcome, got.passed) == ("run", "done", "pass", True)
            assert got.run is not None and got.run.result_id == run.result_id and got.labels == {"agent": "sdk"}
            assert got.finished_at is not None and got.finished_at >= got.created_at
            assert [x.id for x in client.list_results(labels={"agent": "sdk"})] == [run.result_id]
            assert [x.id for x in client.list_results(kind="run")] == [run.result_id, rid]
            assert all(x.run is None for x in client.list_results())
            rid2 = client.start_run(task, labels={"agent": "detached"})
            assert client.get_result(rid2, wait=60).outcome == "pass"
        detached = d.smolctl("run", "--detach", str(task))
        assert detached.returncode == 0 and detached.stdout.decode().strip().startswith("r-"), detached.stderr
        waited = d.smolctl("results", detached.stdout.decode().strip(), "--wait", "60")
        assert waited.returncode == 0 and b"PASS" in waited.stdout, waited.stdout

        # pruning: by age and label, through smolctl and the SDK
        assert d.smolctl("results", "--prune").returncode == 2  # --older-than is required
        kept = d.smolctl("results", "--prune", "--older-than", "1d")
        assert kept.returncode == 0 and b"removed 0 results" in kept.stdout, kept
        gone = d.smolctl("results", "--prune", "--older-than", "0", "--label", "agent=a1")
        assert gone.returncode == 0 and b"removed 1 results" in gone.stdout, gone
        assert d.smolctl("results", rid).returncode == 2  # gone
        with Client(d.socket) as client:
            assert client.prune_results(older_than=0, labels={"agent": "sdk"})[0] == 1
            assert client.list_results(labels={"agent": "detached"})  # the others stay
            assert client.prune_results(older_than=0)[0] == 2 and client.list_results() == []
    finally:
        assert d.terminate() == 0, d.log_text()
