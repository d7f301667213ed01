"""The asyncio smol client: the same calls as smolsdk.Client, awaited; machines destroyed even on cancellation."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from . import _common as c
from .errors import NotFoundError, from_rpc_error
from .types import (
    DaemonInfo,
    ExecCollector,
    ExecEvent,
    ExecResult,
    MachineInfo,
    RunResult,
    StoredResult,
    VerifyResult,
    exec_event_from_proto,
)

T = TypeVar("T")
PathLike = str | os.PathLike[str]


class AsyncClient:
    """An asyncio connection to smold (default socket: $SMOL_SOCKET, else /run/smold/smold.sock).

    The channel is opened lazily on first use, in the running event loop.
    """

    def __init__(self, socket: PathLike | None = None, *, timeout: float | None = None) -> None:
        self.socket = c.socket_path(socket)
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.SmolStub | None = None

    @property
    def _stub(self) -> pb_grpc.SmolStub:
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(c.target(self.socket), options=c.CHANNEL_OPTIONS)
            self._stub_ = pb_grpc.SmolStub(self._channel)
        return self._stub_

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # --- machines ---------------------------------------------------------------------------------------------
    async def create(self, smolfile: PathLike | None = None, *, toml: str | None = None,
                     base_dir: PathLike | None = None, name: str | None = None,
                     from_checkpoint: str | None = None) -> AsyncMachine:
        """Boot a machine; ``async with`` on the result destroys it. Cancelled or failed creates leave nothing."""
        name = name or c.new_name()
        req = pb.CreateMachineRequest(name=name)
        if from_checkpoint:
            req.from_checkpoint = from_checkpoint
        else:
            req.smolfile.CopyFrom(c.smolfile_message(smolfile, toml=toml, base_dir=base_dir))
        try:
            resp = await self._call(self._stub.CreateMachine(req, timeout=self.timeout))
        except BaseException:
            await self._destroy_shielded(name)
            raise
        return AsyncMachine(self, MachineInfo.from_proto(resp.machine))

    @contextlib.asynccontextmanager
    async def machine(self, smolfile: PathLike | None = None, **kwargs: Any) -> AsyncIterator[AsyncMachine]:
        """``async with client.machine(path) as m:``: destroyed when the block ends, however it ends."""
        m = await self.create(smolfile, **kwargs)
        try:
            yield m
        finally:
            await self._destroy_shielded(m.id)

    async def _destroy_shielded(self, machine_id: str) -> None:
        """Destroy, finishing even if the caller is cancelled meanwhile (the cancellation is re-raised)."""
        task = asyncio.ensure_future(self.destroy(machine_id))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 60)
            raise
        except NotFoundError:
            pass

    async def get(self, machine_id: str, console_tail_bytes: int = 0) -> MachineInfo:
        resp = await self._call(self._stub.GetMachine(
            pb.GetMachineRequest(machine_id=machine_id, console_tail_bytes=console_tail_bytes), timeout=self.timeout))
        return MachineInfo.from_proto(resp.machine)

    async def list(self) -> builtins.list[MachineInfo]:
        resp = await self._call(self._stub.ListMachines(pb.ListMachinesRequest(), timeout=self.timeout))
        return [MachineInfo.from_proto(m) for m in resp.machines]

    async def info(self) -> DaemonInfo:
        """The daemon's limits and what of them is in use."""
        return DaemonInfo.from_proto(await self._call(self._stub.GetDaemonInfo(pb.GetDaemonInfoRequest(),
                                                                              timeout=self.timeout)))

    async def attach(self, machine_id: str) -> AsyncMachine:
        return AsyncMachine(self, await self.get(machine_id))

    async def destroy(self, machine_id: str) -> None:
        """Destroy a machine; destroying one already gone is not an error."""
        try:
            await self._call(self._stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=machine_id),
                                                       timeout=self.timeout))
        except NotFoundError:
            pass

    async def set_network_policy(self, machine_id: str, *, allow: Sequence[str] = (),
                                 public: bool = False) -> MachineInfo:
        """As Client.set_network_policy."""
        resp = await self._call(self._stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(
            machine_id=machine_id, policy=pb.NetworkPolicy(allow=list(allow), public=public,
                                                           closed=not (allow or public))), timeout=self.timeout))
        return MachineInfo.from_proto(resp.machine)

    async def fork(self, machine_id: str, count: int = 1) -> builtins.list[AsyncMachine]:
        resp = await self._call(self._stub.Fork(pb.ForkRequest(machine_id=machine_id, count=count),
                                                timeout=self.timeout))
        return [AsyncMachine(self, MachineInfo.from_proto(m)) for m in resp.machines]

    async def snapshot(self, machine_id: str, name: str) -> pb.Checkpoint:
        resp = await self._call(self._stub.Snapshot(pb.SnapshotRequest(machine_id=machine_id, name=name),
                                                    timeout=self.timeout))
        return resp.checkpoint

    # --- commands ---------------------------------------------------------------------------------------------
    async def exec_stream(self, machine_id: str, argv: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
                          cwd: str | None = None, user: str | None = None, stdin: bytes | str | None = None,
                          timeout: float | None = None) -> AsyncGenerator[ExecEvent, None]:
        """Yield Stdout/Stderr chunks as they come, then one Exit. Leaving early (or cancelling) kills it."""
        req = c.exec_request(machine_id, argv, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout)
        call = self._stub.Exec(req)
        try:
            async for msg in call:
                event = exec_event_from_proto(msg)
                if event is not None:
                    yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def exec(self, machine_id: str, argv: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        """Run a command to completion and return all of its output (a string runs with ``sh -c``)."""
        out = ExecCollector()
        stream = self.exec_stream(machine_id, argv, **kwargs)
        async with contextlib.aclosing(stream):
            async for event in stream:
                out.add(event)
        return out.result()

    async def copy_in(self, machine_id: str, path: str, content: bytes | str, *, mode: int | None = None,
                      mkdirs: bool = True, tar: bool = False) -> int:
        req = c.copy_in_request(machine_id, path, content, mode=mode, mkdirs=mkdirs, tar=tar)
        return int((await self._call(self._stub.CopyIn(req, timeout=self.timeout))).size_bytes)

    async def copy_out(self, machine_id: str, path: str, *, max_size: int = 0, tar: bool = False) -> bytes:
        req = c.copy_out_request(machine_id, path, max_size=max_size, tar=tar)
        return bytes((await self._call(self._stub.CopyOut(req, timeout=self.timeout))).content)

    async def verify(self, machine_id: str, checks: Sequence[pb.Check] = ()) -> VerifyResult:
        resp = await self._call(self._stub.Verify(pb.VerifyRequest(machine_id=machine_id, checks=list(checks)),
                                                  timeout=self.timeout))
        return VerifyResult.from_proto(resp.result)

    async def run(self, smolfile: PathLike | None = None, *, toml: str | None = None,
                  base_dir: PathLike | None = None, name: str = "",
                  labels: Mapping[str, str] | None = None) -> RunResult:
        req = pb.RunRequest(smolfile=c.smolfile_message(smolfile, toml=toml, base_dir=base_dir), name=name,
                            labels=dict(labels or {}))
        return RunResult.from_proto(await self._call(self._stub.Run(req, timeout=self.timeout)))

    async def start_run(self, smolfile: PathLike | None = None, *, toml: str | None = None,
                        base_dir: PathLike | None = None, name: str = "",
                        labels: Mapping[str, str] | None = None) -> str:
        req = pb.RunRequest(smolfile=c.smolfile_message(smolfile, toml=toml, base_dir=base_dir), name=name,
                            labels=dict(labels or {}), detach=True)
        return str((await self._call(self._stub.Run(req, timeout=self.timeout))).result_id)

    async def get_result(self, result_id: str, *, wait: float | None = None) -> StoredResult:
        req = pb.GetResultRequest(id=result_id, wait_seconds=wait)
        return StoredResult.from_proto((await self._call(self._stub.GetResult(req, timeout=self.timeout))).result)

    async def get_artifact(self, result_id: str, name: str) -> bytes:
        req = pb.GetArtifactRequest(result_id=result_id, name=name)
        resp = await self._call(self._stub.GetArtifact(req, timeout=self.timeout))
        return c.checked_artifact(resp, result_id, name)

    async def prune_results(self, *, older_than: float, labels: Mapping[str, str] | None = None) -> tuple[int, int]:
        req = pb.PruneResultsRequest(older_than_seconds=older_than, labels=dict(labels or {}))
        resp = await self._call(self._stub.PruneResults(req, timeout=self.timeout))
        return resp.removed, resp.freed_bytes

    async def list_results(self, *, labels: Mapping[str, str] | None = None, kind: str = "",
                           limit: int = 0) -> builtins.list[StoredResult]:
        req = pb.ListResultsRequest(labels=dict(labels or {}), kind=kind, limit=limit)
        resp = await self._call(self._stub.ListResults(req, timeout=self.timeout))
        return [StoredResult.from_proto(r) for r in resp.results]


class AsyncMachine(c.MachineHandle[AsyncClient]):
    """A handle on one machine; ``async with`` destroys it at the end of the block, even when cancelled."""

    async def __aenter__(self) -> AsyncMachine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client._destroy_shielded(self.id)

    async def refresh(self) -> MachineInfo:
        self.info = await self.client.get(self.id)
        return self.info

    async def exec(self, argv: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        return await self.client.exec(self.id, argv, **kwargs)

    def exec_stream(self, argv: Sequence[str] | str, **kwargs: Any) -> AsyncIterator[ExecEvent]:
        return self.client.exec_stream(self.id, argv, **kwargs)

    async def copy_in(self, path: str, content: bytes | str, **kwargs: Any) -> int:
        return await self.client.copy_in(self.id, path, content, **kwargs)

    async def copy_out(self, path: str, **kwargs: Any) -> bytes:
        return await self.client.copy_out(self.id, path, **kwargs)

    async def verify(self, checks: Sequence[pb.Check] = ()) -> VerifyResult:
        return await self.client.verify(self.id, checks)

    async def fork(self, count: int = 1) -> builtins.list[AsyncMachine]:
        return await self.client.fork(self.id, count)

    async def snapshot(self, name: str) -> pb.Checkpoint:
        return await self.client.snapshot(self.id, name)

    async def destroy(self) -> None:
        await self.client.destroy(self.id)
