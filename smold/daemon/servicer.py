"""The smol.v1.Smol gRPC servicer: proto -> dataclass -> controller -> proto, errors as gRPC status codes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from smold.api import convert
from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.smolfile import Limits, Smolfile, SmolfileError
from smold.smolfile.model import DEFAULT_MEMORY_MIB

from .controller import Controller
from .errors import DaemonError, InvalidRequestError
from .runs import Runs

log = logging.getLogger("smold.servicer")
T = TypeVar("T")


async def _abort(context: grpc.aio.ServicerContext[Any, Any], e: Exception) -> NoReturn:
    if isinstance(e, DaemonError):
        code = grpc.StatusCode[e.status.name]
    elif isinstance(e, SmolfileError | convert.ConversionError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        log.exception("internal error", exc_info=e)
        code, e = grpc.StatusCode.INTERNAL, Exception(f"internal error: {e!r}")
    await context.abort(code, str(e))
    raise AssertionError("unreachable")  # context.abort raises


class SmolServicer(pb_grpc.SmolServicer):
    """Thin: every method converts, calls the controller and converts back."""

    def __init__(self, controller: Controller, runs: Runs) -> None:
        self.controller = controller
        self.runs = runs

    @property
    def limits(self) -> Limits:
        c = self.controller.config
        return Limits(max_memory_mib=c.max_memory_mib, max_cpus=c.max_cpus)

    async def _call(self, context: grpc.aio.ServicerContext[Any, Any], fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except (DaemonError, SmolfileError, convert.ConversionError) as e:
            await _abort(context, e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e)

    def _smolfile(self, msg: pb.Smolfile) -> tuple[Smolfile, str]:
        sf = convert.smolfile_from_proto(msg, limits=self.limits)
        which = msg.WhichOneof("source")
        filename = (msg.toml.filename or "Smolfile.toml") if which == "toml" else convert.INLINE_SPEC
        return sf, filename

    async def CreateMachine(self, request: pb.CreateMachineRequest, context: Any) -> pb.CreateMachineResponse:
        async def go() -> pb.CreateMachineResponse:
            if request.from_checkpoint:
                if request.HasField("smolfile"):
                    raise InvalidRequestError("smolfile: must be unset with from_checkpoint (a restored machine "
                                              "keeps the Smolfile of the machine the checkpoint was taken of)")
                info = await self.controller.create_from_checkpoint(request.from_checkpoint, request.name)
            else:
                sf, filename = self._smolfile(request.smolfile)
                info = await self.controller.create(sf, request.name, filename)
            return pb.CreateMachineResponse(machine=convert.machine_to_proto(info))
        return await self._call(context, go)

    async def GetMachine(self, request: pb.GetMachineRequest, context: Any) -> pb.GetMachineResponse:
        async def go() -> pb.GetMachineResponse:
            await self.controller.refresh_network(request.machine_id)
            info = self.controller.get(request.machine_id, request.console_tail_bytes)
            return pb.GetMachineResponse(machine=convert.machine_to_proto(info))
        return await self._call(context, go)

    async def ListMachines(self, request: pb.ListMachinesRequest, context: Any) -> pb.ListMachinesResponse:
        async def go() -> pb.ListMachinesResponse:
            return pb.ListMachinesResponse(
                machines=[convert.machine_to_proto(m) for m in self.controller.list_machines()])
        return await self._call(context, go)

    async def Exec(self, request: pb.ExecRequest, context: Any) -> AsyncIterator[pb.ExecResponse]:
        events = self.controller.exec(
            request.machine_id, list(request.argv), env=dict(request.env), cwd=request.cwd, user=request.user,
            stdin=request.stdin, timeout=request.timeout_seconds if request.HasField("timeout_seconds") else None)
        # aclosing: when the client goes away this generator is cancelled, and closing the controller's
        # generator kills the command in the guest.
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    yield convert.exec_event_to_proto(event)
            except (DaemonError, SmolfileError, convert.ConversionError) as e:
                await _abort(context, e)

    async def CopyIn(self, request: pb.CopyInRequest, context: Any) -> pb.CopyInResponse:
        async def go() -> pb.CopyInResponse:
            size = await self.controller.copy_in(
                request.machine_id, request.path, request.content, tar=request.format == pb.COPY_FORMAT_TAR,
                mode=request.mode if request.HasField("mode") else None, mkdirs=request.mkdirs)
            return pb.CopyInResponse(size_bytes=size)
        return await self._call(context, go)

    async def CopyOut(self, request: pb.CopyOutRequest, context: Any) -> pb.CopyOutResponse:
        async def go() -> pb.CopyOutResponse:
            data = await self.controller.copy_out(request.machine_id, request.path,
                                                  tar=request.format == pb.COPY_FORMAT_TAR,
                                                  max_size=request.max_size_bytes)
            return pb.CopyOutResponse(content=data, size_bytes=len(data))
        return await self._call(context, go)

    async def Verify(self, request: pb.VerifyRequest, context: Any) -> pb.VerifyResponse:
        async def go() -> pb.VerifyResponse:
            checks = convert.checks_from_proto(request.checks) if len(request.checks) else None
            result, rid = await self.runs.verify(request.machine_id, checks)
            return pb.VerifyResponse(result=convert.verify_result_to_proto(result, result_id=rid))
        return await self._call(context, go)

    async def DestroyMachine(self, request: pb.DestroyMachineRequest, context: Any) -> pb.DestroyMachineResponse:
        async def go() -> pb.DestroyMachineResponse:
            await self.controller.destroy(request.machine_id)
            return pb.DestroyMachineResponse()
        return await self._call(context, go)

    async def SetNetworkPolicy(self, request: pb.SetNetworkPolicyRequest,
                               context: Any) -> pb.SetNetworkPolicyResponse:
        async def go() -> pb.SetNetworkPolicyResponse:
            policy = convert.network_policy_from_proto(request.policy)
            info = await self.controller.set_network_policy(request.machine_id, policy)
            return pb.SetNetworkPolicyResponse(machine=convert.machine_to_proto(info))
        return await self._call(context, go)

    async def Run(self, request: pb.RunRequest, context: Any) -> pb.RunResponse:
        async def go() -> pb.RunResponse:
            sf, filename = self._smolfile(request.smolfile)
            if request.detach:
                rid, _ = await self.runs.start(sf, request.name, filename, dict(request.labels))
                return pb.RunResponse(result_id=rid, state=pb.RESULT_STATE_RUNNING)
            result, rid = await self.runs.run(sf, request.name, filename, dict(request.labels))
            return convert.run_result_to_proto(result, result_id=rid)
        return await self._call(context, go)

    async def GetResult(self, request: pb.GetResultRequest, context: Any) -> pb.GetResultResponse:
        async def go() -> pb.GetResultResponse:
            wait = request.wait_seconds if request.HasField("wait_seconds") else None
            return pb.GetResultResponse(result=convert.stored_result_to_proto(await self.runs.get(request.id, wait)))
        return await self._call(context, go)

    async def GetArtifact(self, request: pb.GetArtifactRequest, context: Any) -> pb.GetArtifactResponse:
        async def go() -> pb.GetArtifactResponse:
            content, sha256 = await self.runs.artifact(request.result_id, request.name)
            return pb.GetArtifactResponse(content=content, sha256=sha256)
        return await self._call(context, go)

    async def PruneResults(self, request: pb.PruneResultsRequest, context: Any) -> pb.PruneResultsResponse:
        async def go() -> pb.PruneResultsResponse:
            removed, freed = await self.runs.prune(request.older_than_seconds, dict(request.labels))
            return pb.PruneResultsResponse(removed=removed, freed_bytes=freed)
        return await self._call(context, go)

    async def ListResults(self, request: pb.ListResultsRequest, context: Any) -> pb.ListResultsResponse:
        async def go() -> pb.ListResultsResponse:
            rows = await self.runs.list(dict(request.labels), request.kind, request.limit)
            return pb.ListResultsResponse(results=[convert.stored_result_to_proto(r) for r in rows])
        return await self._call(context, go)

    async def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        async def go() -> pb.ForkResponse:
            children = await self.controller.fork(request.machine_id, request.count)
            return pb.ForkResponse(machines=[convert.machine_to_proto(c) for c in children])
        return await self._call(context, go)

    async def Snapshot(self, request: pb.SnapshotRequest, context: Any) -> pb.SnapshotResponse:
        async def go() -> pb.SnapshotResponse:
            info = await self.controller.snapshot(request.machine_id, request.name)
            return pb.SnapshotResponse(checkpoint=convert.checkpoint_to_proto(info))
        return await self._call(context, go)

    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest, context: Any) -> pb.ListCheckpointsResponse:
        async def go() -> pb.ListCheckpointsResponse:
            infos = self.controller.list_checkpoints()  # small files; reads the machine table
            return pb.ListCheckpointsResponse(checkpoints=[convert.checkpoint_to_proto(c) for c in infos])
        return await self._call(context, go)

    async def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest,
                               context: Any) -> pb.DeleteCheckpointResponse:
        async def go() -> pb.DeleteCheckpointResponse:
            await self.controller.delete_checkpoint(request.name)
            return pb.DeleteCheckpointResponse()
        return await self._call(context, go)

    async def BakeImage(self, request: pb.BakeImageRequest, context: Any) -> pb.BakeImageResponse:
        async def go() -> pb.BakeImageResponse:
            if not request.HasField("smolfile"):
                raise InvalidRequestError("smolfile: required")
            sf, filename = self._smolfile(request.smolfile)
            info = await self.controller.bake(sf, filename, replace=request.replace)
            return pb.BakeImageResponse(bake=convert.bake_to_proto(info))
        return await self._call(context, go)

    async def GetDaemonInfo(self, request: pb.GetDaemonInfoRequest, context: Any) -> pb.GetDaemonInfoResponse:
        async def go() -> pb.GetDaemonInfoResponse:
            c, ctl = self.controller.config, self.controller
            return pb.GetDaemonInfoResponse(
                max_machines=c.max_machines, max_memory_mib=c.max_memory_mib, max_cpus=c.max_cpus,
                default_memory_mib=DEFAULT_MEMORY_MIB, live_machines=ctl.live_machines,
                memory_in_use_mib=ctl.memory_in_use_mib, public_network=c.public_network)
        return await self._call(context, go)

    async def ListBakes(self, request: pb.ListBakesRequest, context: Any) -> pb.ListBakesResponse:
        async def go() -> pb.ListBakesResponse:
            return pb.ListBakesResponse(bakes=[convert.bake_to_proto(b) for b in await self.controller.list_bakes()])
        return await self._call(context, go)

    async def DeleteBake(self, request: pb.DeleteBakeRequest, context: Any) -> pb.DeleteBakeResponse:
        async def go() -> pb.DeleteBakeResponse:
            await self.controller.delete_bake(request.key)
            return pb.DeleteBakeResponse()
        return await self._call(context, go)

    async def PullImage(self, request: pb.PullImageRequest, context: Any) -> pb.PullImageResponse:
        async def go() -> pb.PullImageResponse:
            if not request.ref:
                raise InvalidRequestError("ref: required")
            return pb.PullImageResponse(image=convert.image_to_proto(await self.controller.pull_image(request.ref)))
        return await self._call(context, go)

    async def ListImages(self, request: pb.ListImagesRequest, context: Any) -> pb.ListImagesResponse:
        async def go() -> pb.ListImagesResponse:
            return pb.ListImagesResponse(images=[convert.image_to_proto(e) for e in await self.controller.list_images()])
        return await self._call(context, go)

    async def RemoveImage(self, request: pb.RemoveImageRequest, context: Any) -> pb.RemoveImageResponse:
        async def go() -> pb.RemoveImageResponse:
            if not request.name:
                raise InvalidRequestError("name: required")
            return pb.RemoveImageResponse(removed=await self.controller.remove_image(request.name))
        return await self._call(context, go)

    async def PruneImages(self, request: pb.PruneImagesRequest, context: Any) -> pb.PruneImagesResponse:
        async def go() -> pb.PruneImagesResponse:
            removed, freed = await self.controller.prune_images()
            return pb.PruneImagesResponse(removed=removed, freed_bytes=freed)
        return await self._call(context, go)
