"""The smol SDK against a real smold (subprocess, host-agent launcher): sync and async clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir

import smolsdk

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("sdk-") as proc:
        yield proc


def test_sync_machine_lifecycle(daemon: DaemonProcess) -> None:
    guest = daemon.workdir / "g1"
    with smolsdk.Client(daemon.socket) as client:
        with client.machine(toml='[env]\nGREETING = "hi"\n') as m:
            assert m.info.state == "running"
            assert [x.id for x in client.list()] == [m.id]
            r = m.exec(["sh", "-c", 'echo "$GREETING $X"; echo err >&2; exit 3'], env={"X": "there"})
            assert (r.stdout, r.stderr, r.exit_code, r.ok) == (b"hi there\n", b"err\n", 3, False)
            assert m.exec("cat", stdin=b"\x00\xff") .stdout == b"\x00\xff"
            assert m.copy_in(f"{guest}/a/b.bin", b"\x01\x02") == 2
            assert m.copy_out(f"{guest}/a/b.bin") == b"\x01\x02"
            events = list(m.exec_stream(["sh", "-c", "printf one; printf two >&2"]))
            assert isinstance(events[-1], smolsdk.Exit) and events[-1].exit_code == 0
            assert b"".join(e.data for e in events if isinstance(e, smolsdk.Stdout)) == b"one"
            t = m.exec(["sleep", "5"], timeout=0.5)
            assert t.timed_out and not t.ok
            with pytest.raises(smolsdk.NotFoundError):
                m.copy_out(f"{guest}/missing")
            with pytest.raises(smolsdk.PermissionDeniedError):
                m.exec(["/etc/passwd"])
            mid = m.id
        assert client.list() == []
        client.destroy(mid)  # already gone: not an error
        with pytest.raises(smolsdk.NotFoundError):
            client.get(mid)


def test_sync_context_destroys_on_exception(daemon: DaemonProcess) -> None:
    with smolsdk.Client(daemon.socket) as client:
        with pytest.raises(RuntimeError), client.create() as m:
            raise RuntimeError("boom")
        assert all(x.id != m.id for x in client.list())
        with pytest.raises(smolsdk.InvalidArgumentError):
            client.create(toml="cpus = 'many'\n")
        assert client.list() == []


def test_sync_run_and_verify(daemon: DaemonProcess) -> None:
    guest = daemon.workdir / "g2"
    toml = f"""
task = "mkdir -p {guest} && echo 42 > {guest}/answer"
[[verifier.checks]]
kind = "file_matches"
path = "{guest}/answer"
content = "42\\n"
"""
    with smolsdk.Client(daemon.socket) as client:
        res = client.run(toml=toml)
        assert res.passed and [s.name for s in res.steps][-1] == "task"
        assert res.outcome == res.result.outcome == "pass" and res.result.outcome_detail == "all 1 checks passed"
        (guest / "answer").unlink()  # the host agent shares the host's filesystem
        with client.machine(toml=toml) as m:
            v = m.verify()  # the task only runs in Run
            assert not v.passed and v.outcome == "fail" and "1 of 1 checks failed" in v.outcome_detail
            assert not v.checks[0].error
            m.exec(["sh", "-c", f"mkdir -p {guest} && echo 42 > {guest}/answer"])
            v = m.verify()
            assert v.passed and v.checks[0].kind == "file_matches"


async def test_async_machine_and_cancellation(daemon: DaemonProcess) -> None:
    async with smolsdk.AsyncClient(daemon.socket) as client:
        async with client.machine() as m:
            r = await m.exec(["sh", "-c", "cat; echo done"], stdin="in\n")
            assert r.stdout == b"in\ndone\n" and r.exit_code == 0
            events = [e async for e in m.exec_stream("echo streamed")]
            assert events[0] == smolsdk.Stdout(b"streamed\n")
        assert await client.list() == []

        async def work() -> None:
            async with client.machine() as m2:
                await m2.exec(["sleep", "30"])

        task = asyncio.create_task(work())
        for _ in range(200):
            await asyncio.sleep(0.05)
            if await client.list():
                break
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.list() == []


async def test_async_errors(daemon: DaemonProcess) -> None:
    async with smolsdk.AsyncClient(daemon.socket) as client:
        with pytest.raises(smolsdk.NotFoundError):
            await client.exec("nope", ["true"])
        with pytest.raises(smolsdk.InvalidArgumentError) as ei:
            await client.create(toml="memory = 12\nbogus = 1\n")
        assert ei.value.code.name == "INVALID_ARGUMENT"
        assert await client.list() == []


def test_unreachable_daemon(tmp_path: Path) -> None:
    with smolsdk.Client(tmp_path / "nothing.sock", timeout=5) as client, pytest.raises(smolsdk.UnavailableError):
        client.list()
