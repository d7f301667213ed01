"""Load on smold (issue 7): 200 Exec calls across 4 machines while a quarter of the clients go away mid-call.

The machines are the real guest agent on the host (daemon_support.HostAgentLauncher), so the daemon's and
the agent's whole Exec paths run, in seconds. Counted afterwards: every call whose client stayed got its
complete result; the commands of the clients that left were killed; the daemon and every agent hold the
same number of file descriptors as before the load; no command process is left.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir, processes_mentioning, wait_until

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

MACHINES = 4
CALLS = 200
LEAVING = 50            # clients that disconnect after their command's first output
CONCURRENCY = 40        # calls in flight at once (below the daemon's default --max-concurrent-calls)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> list[int]:
    """The direct children of pid (the agents are the daemon's children, the commands the agents')."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("smld-", "--max-machines", str(MACHINES), check_exit=True) as d:
        yield d


async def exec_all(stub: pb_grpc.SmolStub, mid: str, argv: list[str],
                   timeout: int = 120) -> tuple[bytes, int | None, int]:
    """Run to the end: (stdout, exit code, number of exit events)."""
    out, code, exits = b"", None, 0
    async for msg in stub.Exec(pb.ExecRequest(machine_id=mid, argv=argv, timeout_seconds=timeout)):
        which = msg.WhichOneof("event")
        if which == "stdout":
            out += msg.stdout
        elif which == "exit":
            exits += 1
            code = msg.exit.exit_code
    return out, code, exits


async def exec_and_leave(sock: Path, mid: str, argv: list[str], timeout: int = 120) -> bytes:
    """A client on its own connection that reads the first output, then goes away (the channel closes)."""
    channel = grpc.aio.insecure_channel(f"unix:{sock}")
    try:
        call = pb_grpc.SmolStub(channel).Exec(pb.ExecRequest(machine_id=mid, argv=argv, timeout_seconds=timeout))
        async for msg in call:
            if msg.WhichOneof("event") == "stdout":
                return msg.stdout
        return b""
    finally:
        await channel.close(grace=None)


async def run_load(stub: pb_grpc.SmolStub, sock: Path, ids: list[str], tag: str, *, in_flight: int,
                   hold: int, timeout: int = 120, pause: Callable[[], str] = lambda: "") -> None:
    """CALLS Exec calls spread over the machines ``ids``, ``in_flight`` at once; LEAVING of them (a seeded
    choice) run ``sleep hold`` and their clients leave after the first output. Asserts that every other
    call got its whole output, one exit event and its exit code. ``tag`` is in every command's argv;
    ``pause()`` is shell put between a command's two lines of output."""
    leaving = set(random.Random(7).sample(range(CALLS), LEAVING))
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> tuple[int, object]:
        mid = ids[i % len(ids)]
        async with gate:
            if i in leaving:  # a long command: it is still running when its client goes away
                script = f"echo start {i}; sleep {hold}; echo never {i}"
                return i, await exec_and_leave(sock, mid, ["sh", "-c", script, tag], timeout=timeout)
            script = f'echo start {i}; {pause()}echo "$0" done {i}; exit {i % 7}'
            return i, await exec_all(stub, mid, ["sh", "-c", script, tag], timeout=timeout)

    results = dict(await asyncio.gather(*(one(i) for i in range(CALLS))))
    assert len(results) == CALLS
    for i, got in results.items():
        if i in leaving:
            assert got == f"start {i}\n".encode(), (i, got)
        else:  # nothing lost: the whole output, one exit event, the right code
            assert got == (f"start {i}\n{tag} done {i}\n".encode(), i % 7, 1), (i, got)


async def test_200_execs_across_4_machines_with_clients_leaving(daemon: DaemonProcess) -> None:
    tag = f"smload-{secrets.token_hex(4)}"   # in every command's argv: finds leftovers by command line
    rng = random.Random(7)
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = pb_grpc.SmolStub(channel)
        ids = []
        for _ in range(MACHINES):
            resp = await stub.CreateMachine(pb.CreateMachineRequest(smolfile=pb.Smolfile(
                spec=pb.SmolfileSpec(memory_mib=256, cpus=1))))
            ids.append(resp.machine.id)
        for mid in ids:   # warm every path once before counting
            assert (await exec_all(stub, mid, ["true"]))[1:] == (0, 1)
        agents = children(daemon.pid)
        assert len(agents) == MACHINES
        await asyncio.sleep(0.5)
        daemon_fds = fd_count(daemon.pid)
        agent_fds = {pid: fd_count(pid) for pid in agents}

        await run_load(stub, daemon.socket, ids, tag, in_flight=CONCURRENCY, hold=60,
                       pause=lambda: f"sleep 0.0{rng.randrange(10)}; ")

        # The commands whose clients left were killed (their whole process group), and nothing else is left.
        assert wait_until(lambda: not processes_mentioning(tag), timeout=30), processes_mentioning(tag)
        assert all(not children(pid) for pid in agents)
        # Every descriptor opened for the load is closed again: in the daemon and in each agent.
        assert wait_until(lambda: fd_count(daemon.pid) <= daemon_fds, timeout=15), (fd_count(daemon.pid), daemon_fds)
        for pid, before in agent_fds.items():
            assert wait_until(lambda: fd_count(pid) <= before, timeout=15), (pid, fd_count(pid), before)  # noqa: B023
        # And the machines still serve.
        for mid in ids:
            assert (await exec_all(stub, mid, ["echo", "after"])) == (b"after\n", 0, 1)
        for mid in ids:
            await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=mid))
    assert wait_until(lambda: not children(daemon.pid), timeout=15)
