"""The synchronous smol client: machines you create, exec in, copy to and from, verify and destroy."""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

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


class Client:
    """A connection to smold on its Unix socket (default: $SMOL_SOCKET, else /run/smold/smold.sock)."""

    def __init__(self, socket: PathLike | None = None, *, timeout: float | None = None) -> None:
        self.socket = c.socket_path(socket)
        self.timeout = timeout  # per-call deadline for unary calls; None: none
        self._channel = grpc.insecure_channel(c.target(self.socket), options=c.CHANNEL_OPTIONS)
        self._stub = pb_grpc.SmolStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., T], request: Any) -> T:
        try:
            return fn(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # --- machines ---------------------------------------------------------------------------------------------
    def create(self, smolfile: PathLike | None = None, *, toml: str | None = None, base_dir: PathLike | None = None,
               name: str | None = None, from_checkpoint: str | None = None) -> Machine:
        """Boot a machine (from a Smolfile path or TOML text, or a checkpoint); use it as a context manager.

        The machine always gets a name (a unique one unless given), so if the call is interrupted before the
        reply arrives the machine is destroyed by name rather than leaked.
        """
        name = name or c.new_name()
        req = pb.CreateMachineRequest(name=name)
        if from_checkpoint:
            req.from_checkpoint = from_checkpoint
        else:
            req.smolfile.CopyFrom(c.smolfile_message(smolfile, toml=toml, base_dir=base_dir))
        try:
            resp = self._call(self._stub.CreateMachine, req)
        except BaseException:
            self._destroy_quietly(name)
            raise
        return Machine(self, MachineInfo.from_proto(resp.machine))

    @contextlib.contextmanager
    def machine(self, smolfile: PathLike | None = None, **kwargs: Any) -> Iterator[Machine]:
        """``with client.machine(path) as m:``: a machine destroyed when the block ends, however it ends."""
        m = self.create(smolfile, **kwargs)
        try:
            yield m
        finally:
            m.destroy()

    def get(self, machine_id: str, console_tail_bytes: int = 0) -> MachineInfo:
        resp = self._call(self._stub.GetMachine, pb.GetMachineRequest(machine_id=machine_id,
                                                                      console_tail_bytes=console_tail_bytes))
        return MachineInfo.from_proto(resp.machine)

    def list(self) -> builtins.list[MachineInfo]:
        return [MachineInfo.from_proto(m) for m in self._call(self._stub.ListMachines, pb.ListMachinesRequest()).machines]

    def info(self) -> DaemonInfo:
        """The daemon's limits and what of them is in use."""
        return DaemonInfo.from_proto(self._call(self._stub.GetDaemonInfo, pb.GetDaemonInfoRequest()))

    def attach(self, machine_id: str) -> Machine:
        """A handle on an existing machine."""
        return Machine(self, self.get(machine_id))

    def destroy(self, machine_id: str) -> None:
        """Destroy a machine; destroying one already gone is not an error."""
        try:
            self._call(self._stub.DestroyMachine, pb.DestroyMachineRequest(machine_id=machine_id))
        except NotFoundError:
            pass

    def _destroy_quietly(self, machine_id: str) -> None:
        with contextlib.suppress(Exception):
            self.destroy(machine_id)

    def set_network_policy(self, machine_id: str, *, allow: Sequence[str] = (), public: bool = False) -> MachineInfo:
        """Change a running machine's network policy: the allow entries (Smolfile syntax) and/or public egress;
        neither closes it (its NIC stays, nothing passes). The machine must have been created with a network
        policy (``network = "closed"`` for one that starts with nothing allowed)."""
        resp = self._call(self._stub.SetNetworkPolicy, pb.SetNetworkPolicyRequest(
            machine_id=machine_id, policy=pb.NetworkPolicy(allow=list(allow), public=public, closed=not (allow or public))))
        return MachineInfo.from_proto(resp.machine)

    def fork(self, machine_id: str, count: int = 1) -> builtins.list[Machine]:
        resp = self._call(self._stub.Fork, pb.ForkRequest(machine_id=machine_id, count=count))
        return [Machine(self, MachineInfo.from_proto(m)) for m in resp.machines]

    def snapshot(self, machine_id: str, name: str) -> pb.Checkpoint:
        return self._call(self._stub.Snapshot, pb.SnapshotRequest(machine_id=machine_id, name=name)).checkpoint

    # --- commands ---------------------------------------------------------------------------------------------
    def exec_stream(self, machine_id: str, argv: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None, stdin: bytes | str | None = None,
                    timeout: float | None = None) -> Iterator[ExecEvent]:
        """Yield Stdout/Stderr chunks as they come, then one Exit. Leaving early kills the command."""
        req = c.exec_request(machine_id, argv, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout)
        call = self._stub.Exec(req)
        try:
            for msg in call:
                event = exec_event_from_proto(msg)
                if event is not None:
                    yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the stream is done; else smold kills the command

    def exec(self, machine_id: str, argv: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        """Run a command to completion and return all of its output (a string runs with ``sh -c``)."""
        out = ExecCollector()
        for event in self.exec_stream(machine_id, argv, **kwargs):
            out.add(event)
        return out.result()

    def copy_in(self, machine_id: str, path: str, content: bytes | str, *, mode: int | None = None,
                mkdirs: bool = True, tar: bool = False) -> int:
        """Write a guest file (or unpack a tar archive into a guest directory); returns the bytes taken."""
        req = c.copy_in_request(machine_id, path, content, mode=mode, mkdirs=mkdirs, tar=tar)
        return int(self._call(self._stub.CopyIn, req).size_bytes)

    def copy_out(self, machine_id: str, path: str, *, max_size: int = 0, tar: bool = False) -> bytes:
        """Read a guest file (or a guest directory as a tar archive), up to max_size (0: the server's cap)."""
        return bytes(self._call(self._stub.CopyOut, c.copy_out_request(machine_id, path, max_size=max_size,
                                                                       tar=tar)).content)

    def verify(self, machine_id: str, checks: Sequence[pb.Check] = ()) -> VerifyResult:
        """Run the machine's verifier (or the checks given)."""
        resp = self._call(self._stub.Verify, pb.VerifyRequest(machine_id=machine_id, checks=list(checks)))
        return VerifyResult.from_proto(resp.result)

    def run(self, smolfile: PathLike | None = None, *, toml: str | None = None, base_dir: PathLike | None = None,
            name: str = "", labels: Mapping[str, str] | None = None) -> RunResult:
        """One shot: create, set up, run the task, verify, destroy. The result is stored (``result_id``) with
        ``labels``; if this client goes away first, the Run still ends and get_result() has it."""
        req = pb.RunRequest(smolfile=c.smolfile_message(smolfile, toml=toml, base_dir=base_dir), name=name,
                            labels=dict(labels or {}))
        return RunResult.from_proto(self._call(self._stub.Run, req))

    def start_run(self, smolfile: PathLike | None = None, *, toml: str | None = None,
                  base_dir: PathLike | None = None, name: str = "", labels: Mapping[str, str] | None = None) -> str:
        """A detached Run: its result id at once; ``get_result(id, wait=...)`` has the verdict when it ends."""
        req = pb.RunRequest(smolfile=c.smolfile_message(smolfile, toml=toml, base_dir=base_dir), name=name,
                            labels=dict(labels or {}), detach=True)
        return str(self._call(self._stub.Run, req).result_id)

    def get_result(self, result_id: str, *, wait: float | None = None) -> StoredResult:
        """A stored Run or Verify result; ``wait``: first wait up to that many seconds for a running Run."""
        req = pb.GetResultRequest(id=result_id, wait_seconds=wait)
        return StoredResult.from_proto(self._call(self._stub.GetResult, req).result)

    def get_artifact(self, result_id: str, name: str) -> bytes:
        """An artifact kept with a stored Run (RunResult.artifacts names them), checked against its SHA-256."""
        resp = self._call(self._stub.GetArtifact, pb.GetArtifactRequest(result_id=result_id, name=name))
        return c.checked_artifact(resp, result_id, name)

    def prune_results(self, *, older_than: float, labels: Mapping[str, str] | None = None) -> tuple[int, int]:
        """Remove finished results that ended more than ``older_than`` seconds ago (0: all) and carry every label
        given, with their artifacts; (removed, freed bytes). A Run still running is never removed."""
        req = pb.PruneResultsRequest(older_than_seconds=older_than, labels=dict(labels or {}))
        resp = self._call(self._stub.PruneResults, req)
        return resp.removed, resp.freed_bytes

    def list_results(self, *, labels: Mapping[str, str] | None = None, kind: str = "",
                     limit: int = 0) -> builtins.list[StoredResult]:
        """Stored results, newest first, without their evidence (get_result has it); only those carrying every
        label given; ``kind``: "run" or "verify"; ``limit`` 0: 100."""
        req = pb.ListResultsRequest(labels=dict(labels or {}), kind=kind, limit=limit)
        return [StoredResult.from_proto(r) for r in self._call(self._stub.ListResults, req).results]


class Machine(c.MachineHandle[Client]):
    """A handle on one machine; ``with`` destroys it at the end of the block."""

    def __enter__(self) -> Machine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def refresh(self) -> MachineInfo:
        self.info = self.client.get(self.id)
        return self.info

    def exec(self, argv: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        return self.client.exec(self.id, argv, **kwargs)

    def exec_stream(self, argv: Sequence[str] | str, **kwargs: Any) -> Iterator[ExecEvent]:
        return self.client.exec_stream(self.id, argv, **kwargs)

    def copy_in(self, path: str, content: bytes | str, **kwargs: Any) -> int:
        return self.client.copy_in(self.id, path, content, **kwargs)

    def copy_out(self, path: str, **kwargs: Any) -> bytes:
        return self.client.copy_out(self.id, path, **kwargs)

    def verify(self, checks: Sequence[pb.Check] = ()) -> VerifyResult:
        return self.client.verify(self.id, checks)

    def fork(self, count: int = 1) -> builtins.list[Machine]:
        return self.client.fork(self.id, count)

    def snapshot(self, name: str) -> pb.Checkpoint:
        return self.client.snapshot(self.id, name)

    def destroy(self) -> None:
        self.client.destroy(self.id)
