"""Runs and Verify calls behind the API: every result is stored before its reply, and a Run outlives its client.

The rules (docs/verifier.md, "Results"):
- a Run's row is written ``running`` before its machine is created and ``done`` before the reply;
- a client that goes away (disconnect, deadline, Ctrl-C) only stops waiting: the Run goes on, destroys its
  machine and stores its result, which GetResult returns by the id the client may already hold (from
  ListResults with the Run's labels otherwise);
- a Run refused before anything ran (a bad Smolfile, limits, a name in use) leaves no row: it is an error;
  a Run whose machine failed to boot ends ``infra_error`` with the error's text;
- a daemon that stops (SIGTERM) cancels its Runs: their machines are destroyed and their rows end
  ``interrupted``; a daemon killed outright leaves them ``running``, and the next one marks them
  ``interrupted`` and removes their machines instead of re-adopting them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

from smold.api import convert
from smold.api.machine import ResultState, RunResult, StoredResult
from smold.api.v1 import smol_pb2 as pb
from smold.smolfile import Check, Smolfile
from smold.verifier import Outcome, VerifyResult

from .controller import Controller
from .errors import DaemonError, InvalidRequestError, ShuttingDownError, Status
from .results import (
    INTERRUPTED_DETAIL,
    ResultNotFoundError,
    ResultStore,
    ResultStoreError,
    check_result_id,
    new_result_id,
    validate_labels,
)

log = logging.getLogger("smold.runs")
MAX_WAIT_S = 3600.0
# Errors that refuse a Run before it starts: no result is stored for them.
REFUSALS = frozenset({Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.ALREADY_EXISTS, Status.RESOURCE_EXHAUSTED,
                      Status.FAILED_PRECONDITION, Status.UNAVAILABLE})


class Runs:
    """Owns the Runs in flight; the controller does the work, the store keeps the results."""

    def __init__(self, controller: Controller, store: ResultStore) -> None:
        self.controller = controller
        self.store = store
        self._tasks: dict[str, asyncio.Task[RunResult]] = {}

    async def run(self, smolfile: Smolfile, name: str = "", filename: str = "Smolfile.toml",
                  labels: Mapping[str, str] | None = None) -> tuple[RunResult, str]:
        """The Run's result and its id. Cancelling this call (the client left) does not cancel the Run."""
        rid, task = await self.start(smolfile, name, filename, labels, detached=False)
        try:
            return await asyncio.shield(task), rid
        except asyncio.CancelledError:
            if not task.done():
                log.info("run %s: its client went away; it goes on and stores its result", rid)
            raise

    async def start(self, smolfile: Smolfile, name: str = "", filename: str = "Smolfile.toml",
                    labels: Mapping[str, str] | None = None, *,
                    detached: bool = True) -> tuple[str, asyncio.Task[RunResult]]:
        """Start a Run (its row written ``running`` first); its id and the task that ends it. A detached Run's
        client only gets the id, so a refusal (a limit, a name in use) is stored as its ``infra_error`` result
        rather than dropped."""
        if self.controller.closing:
            raise ShuttingDownError("the daemon is shutting down: no new Runs")
        wanted = validate_labels(dict(labels or {}))
        rid = await self.store.begin("run", wanted)
        task = asyncio.create_task(self._run(rid, smolfile, name, filename, detached), name=f"run {rid}")
        self._tasks[rid] = task
        task.add_done_callback(lambda t: self._done(rid, t))
        return rid, task

    def _done(self, rid: str, task: asyncio.Task[RunResult]) -> None:
        self._tasks.pop(rid, None)
        if not task.cancelled() and task.exception() is not None:  # retrieved here: the client may be gone
            log.debug("run %s ended with an error: %s", rid, task.exception())

    async def _run(self, rid: str, smolfile: Smolfile, name: str, filename: str, detached: bool) -> RunResult:
        try:
            result = await self.controller.run(smolfile, name, filename, run_result=rid)
        except asyncio.CancelledError:
            await self._end(rid, ResultState.INTERRUPTED, Outcome.INTERRUPTED, INTERRUPTED_DETAIL)
            raise
        except DaemonError as e:
            if e.status in REFUSALS and not detached:
                with contextlib.suppress(ResultStoreError):
                    await self.store.discard(rid)
            else:
                await self._end(rid, ResultState.DONE, Outcome.INFRA_ERROR, str(e))
            raise
        except Exception as e:
            await self._end(rid, ResultState.DONE, Outcome.INFRA_ERROR, f"internal error: {e!r}")
            raise
        if result.artifacts:  # on disk before the row that lists them
            cap = min(self.controller.config.artifact_cap_bytes, self.controller.config.copy_cap_bytes)
            result = dataclasses.replace(result, artifacts=await self.store.keep_artifacts(rid, result.artifacts, cap))
        payload = convert.run_result_to_proto(result, result_id=rid).SerializeToString()
        await self.store.finish(rid, state=ResultState.DONE, outcome=result.outcome,
                                outcome_detail=result.outcome_detail, payload=payload, machine_id=result.machine_id)
        log.info("run %s: %s (%s)", rid, result.outcome.value, result.outcome_detail or "every check passed")
        return result

    async def _end(self, rid: str, state: ResultState, outcome: Outcome, detail: str) -> None:
        """Store how a Run ended without a result; a store that fails here is logged (the next daemon start
        marks the row interrupted)."""
        try:
            await self.store.finish(rid, state=state, outcome=outcome, outcome_detail=detail)
        except ResultStoreError as e:
            log.error("run %s: storing its end (%s) failed: %s", rid, outcome.value, e)

    async def verify(self, ref: str, checks: Sequence[Check] | None) -> tuple[VerifyResult, str]:
        """Verify a machine and store the result; the result and its id."""
        machine_id = self.controller.machine_id(ref)
        result = await self.controller.verify(ref, checks)
        rid = new_result_id()
        await self.store.add("verify", result_id=rid, outcome=result.outcome, outcome_detail=result.outcome_detail,
                             payload=convert.verify_result_to_proto(result, result_id=rid).SerializeToString(),
                             machine_id=machine_id)
        return result, rid

    async def get(self, rid: str, wait_seconds: float | None = None) -> StoredResult:
        """A stored result; with ``wait_seconds``, first wait up to that long for a running Run to end."""
        check_result_id(rid)
        if wait_seconds is not None:
            if not math.isfinite(wait_seconds) or not 0 <= wait_seconds <= MAX_WAIT_S:
                raise InvalidRequestError(f"wait_seconds: {wait_seconds} is out of range (0..{MAX_WAIT_S:g})")
            task = self._tasks.get(rid)
            if task is not None:
                await asyncio.wait({task}, timeout=wait_seconds)
        return await self.store.get(rid)

    async def artifact(self, rid: str, name: str) -> tuple[bytes, str]:
        """A kept artifact of a stored Run: its content and SHA-256 (NOT_FOUND unless its result lists it kept)."""
        self.store.artifact_path(rid, name)  # a malformed id or name is INVALID_ARGUMENT
        stored = await self.store.get(rid)
        if stored.kind != "run" or not stored.payload:
            raise ResultNotFoundError(f"result {rid}: a {stored.state.value} {stored.kind} result without a Run's "
                                      "reply has no artifacts")
        listed = {a.name: a for a in pb.RunResponse.FromString(stored.payload).artifacts}
        a = listed.get(name)
        if a is None or not a.kept:
            have = ", ".join(n for n, x in sorted(listed.items()) if x.kept) or "none"
            why = f" ({a.note})" if a is not None and a.note else ""
            raise ResultNotFoundError(f"result {rid}: no artifact {name!r} was kept{why}; kept: {have}")
        cap = self.controller.config.copy_cap_bytes
        return await self.store.read_artifact(rid, name, a.sha256, cap), a.sha256

    async def prune(self, older_than: float, labels: Mapping[str, str] | None = None) -> tuple[int, int]:
        """Remove finished results older than ``older_than`` seconds (with every label given) and their artifacts;
        (removed, freed bytes). A Run in flight is never removed."""
        return await self.store.prune(older_than=older_than, labels=labels, keep=set(self._tasks))

    async def list(self, labels: Mapping[str, str] | None = None, kind: str = "", limit: int = 0) -> list[StoredResult]:
        return await self.store.list(labels=labels, kind=kind, limit=limit)

    async def shutdown(self) -> None:
        """Cancel the Runs in flight: their machines are destroyed and their rows end interrupted."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
