"""Run one microVM in this process: boot (or restore a snapshot), wait for the guest agent, report readiness,
optionally snapshot it, end cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from smold.agent import AgentClient, AgentError, connect_vsock_uds, wait_ready
from smold.jail.seccomp import install_vmm_filter
from smold.snapshot.errors import SnapshotError
from smold.snapshot.state import VmSnapshot
from smold.vmm.control import ControlServer
from smold.vmm.machine import Machine, MachineConfig, MachineError, MachineExit, SnapshotResult

log = logging.getLogger(__name__)

AGENT_VSOCK_PORT = 1024       # the guest's /init starts the agent on this port
READY_FILE = "ready.json"
EXIT_FILE = "exit.json"
CONSOLE_FILE = "console.log"
SHUTDOWN_LIMIT_S = 60.0      # after the machine ended, for stopping its vCPUs and devices
CONTROL_FILE = "control.sock"


class RunnerError(Exception):
    """The VM could not be started or did not become ready."""


@dataclass(frozen=True)
class ReadyInfo:
    """Written to ``<state>/ready.json`` and printed as one ``READY {json}`` line once the agent answers."""

    pid: int
    vsock_path: str
    agent_port: int
    cpu_template: str
    cpus: int
    memory_mib: int
    boot_seconds: float       # from VMM process start to agent ready
    vcpu_start_seconds: float  # from VMM process start to the first vCPU running
    restored: bool = False     # restored from a snapshot rather than booted
    timings: dict[str, float] = field(default_factory=dict)   # restore steps, seconds

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


class AfterSnapshot:
    """What ``--snapshot-on-ready`` does once the snapshot is written."""

    EXIT = "exit"            # stop the VMM (the guest is not powered off: the snapshot is the product)
    CONTINUE = "continue"    # resume the guest and go on as without the option


@dataclass
class RunOutcome:
    """How a run ended: the machine's exit plus the runner's own verdict."""

    exit: MachineExit | None
    ready: ReadyInfo | None = None
    error: str = ""
    exec_code: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    snapshot: SnapshotResult | None = None

    @property
    def exit_code(self) -> int:
        """Process exit status: 0 for a clean end, 1 for a VM error, 2 for a boot timeout."""
        if self.error.startswith("boot timeout"):
            return 2
        if self.error or self.exit is None or not self.exit.clean:
            return 1
        return 0

    def to_json(self) -> str:
        return json.dumps({
            "kind": self.exit.kind if self.exit else "error",
            "detail": self.exit.detail if self.exit else "",
            "error": self.error,
            "exit_code": self.exit_code,
            "timings": self.timings,
        }, sort_keys=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def connect_attempt_timeout(attempt: int, restored: bool) -> float:
    """Seconds for the ``attempt``-th (1-based) connection to a booting guest's agent: 1, 2, 4, then 5 s each
    after a restore; 5 s each after a cold boot. Bounded for any count: a guest that refuses every connection
    at once is retried about twice a second until the boot timeout (an unbounded power of two here once
    overflowed a float after 1024 refusals and failed the runner)."""
    if not restored:
        return 5.0
    return min(5.0, 0.5 * 2 ** min(max(attempt, 1), 4))


class Runner:
    """Owns one Machine for the life of the process.

    ``state_dir`` holds ``vsock.sock`` and ``control.sock`` (removed at exit), ``ready.json`` (removed at
    exit), ``console.log`` and ``exit.json`` (kept for the supervisor). With ``remove_state_dir`` the whole
    directory is removed at exit (the CLI's private temporary directory).
    """

    def __init__(self, config: MachineConfig | None = None, *, boot_timeout: float = 600.0,
                 process_start: float | None = None,
                 on_ready: Callable[[ReadyInfo], None] | None = None,
                 remove_state_dir: bool = False, snapshot_dir: Path | None = None,
                 after_snapshot: str = AfterSnapshot.EXIT,
                 on_snapshot: Callable[[SnapshotResult], None] | None = None,
                 restore_state: VmSnapshot | None = None, new_identity: bool = False,
                 seccomp: str = "off") -> None:
        """``snapshot_dir``: once the agent is ready and ``body`` (the setup command) succeeded, write a
        snapshot there, then exit or continue (``after_snapshot``). ``seccomp``: on, log or off, the system
        call filter installed once the machine is built, before its vCPUs run (smold/jail/seccomp.py)."""
        if seccomp not in ("on", "log", "off"):
            raise RunnerError(f"seccomp must be 'on', 'log' or 'off', not {seccomp!r}")
        self.seccomp = seccomp
        if after_snapshot not in (AfterSnapshot.EXIT, AfterSnapshot.CONTINUE):
            raise RunnerError(f"after_snapshot must be 'exit' or 'continue', not {after_snapshot!r}")
        self.snapshot_dir = snapshot_dir
        self.restore_state = restore_state
        self.new_identity = new_identity
        self.after_snapshot = after_snapshot
        self.on_snapshot = on_snapshot
        self.remove_state_dir = remove_state_dir
        self.boot_timeout = boot_timeout
        self.process_start = process_start if process_start is not None else time.monotonic()
        self.on_ready = on_ready
        self._config = config
        self._own_dir: Path | None = None
        self.machine: Machine | None = None
        self.ready: ReadyInfo | None = None
        self._ready_event = asyncio.Event()

    @staticmethod
    def prepare(config: MachineConfig | None, remove_state_dir: bool) -> tuple[MachineConfig, Path | None]:
        """Default the console log into the state dir; returns (config, dir to remove at exit)."""
        if config is None:
            raise RunnerError("no machine configuration")
        if config.console_log is None:
            config = replace(config, console_log=Path(config.state_dir) / CONSOLE_FILE)
        return config, (Path(config.state_dir) if remove_state_dir else None)

    async def wait_ready(self) -> ReadyInfo:
        await self._ready_event.wait()
        assert self.ready is not None
        return self.ready

    async def connect(self, timeout: float = 10.0) -> AgentClient:
        """A new agent connection (the VM must be ready)."""
        assert self.machine is not None
        return await connect_vsock_uds(str(self.machine.vsock_path), AGENT_VSOCK_PORT, timeout=timeout)

    async def run(self, body: Callable[[Runner, AgentClient], Any] | None = None) -> RunOutcome:
        """Boot, wait for the agent, run ``body(runner, client)`` if given, then wait for the guest to end.

        ``body`` returning means: power the guest off. Without ``body`` the VM runs until the guest powers
        off or the process gets SIGTERM/SIGINT.
        """
        config, self._own_dir = self.prepare(self._config, self.remove_state_dir)
        outcome = RunOutcome(exit=None)
        state_dir = Path(config.state_dir)
        control: ControlServer | None = None
        try:
            try:
                self.machine = Machine(config, snapshot=self.restore_state)
                self.restore_state = None
            except MachineError as e:
                outcome.error = str(e)
                return outcome
            machine = self.machine
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, machine.stop, f"stopped by signal {sig.name}")
            started = asyncio.Event()
            run_task = asyncio.ensure_future(machine.run(on_started=started.set, before_vcpus=self._confine))
            await started.wait()
            control = ControlServer(machine, state_dir / CONTROL_FILE)
            await control.start()
            outcome.timings["vcpu_start"] = time.monotonic() - self.process_start
            supervisor = asyncio.ensure_future(self._supervise(machine, outcome, body))
            # The machine's end is known before run_task has stopped its vCPUs and devices: stop supervising
            # (connecting to a dead guest) at once.
            ended = asyncio.ensure_future(machine.wait_ended())
            done, _ = await asyncio.wait({run_task, supervisor, ended}, return_when=asyncio.FIRST_COMPLETED)
            if supervisor in done and supervisor.exception() is None and not outcome.error:
                # The body finished: wait for the guest to power off (bounded), else stop it.
                try:
                    await asyncio.wait_for(asyncio.shield(run_task), 30)
                except TimeoutError:
                    machine.stop("guest did not power off within 30 s of the request")
            elif supervisor in done:
                machine.stop(outcome.error or "runner failed")
            else:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await supervisor
            ended.cancel()
            try:
                outcome.exit = await asyncio.wait_for(asyncio.shield(run_task), SHUTDOWN_LIMIT_S)
            except TimeoutError:
                outcome.exit = machine.exit or MachineExit("error", "the machine did not stop")
                outcome.error = outcome.error or (f"the VMM could not stop its vCPUs and devices within "
                                                  f"{SHUTDOWN_LIMIT_S:g} s of the machine's end")
                log.error("%s", outcome.error)
            if supervisor.done() and not supervisor.cancelled() and supervisor.exception() is not None:
                outcome.error = outcome.error or f"runner failed: {supervisor.exception()!r}"
            if outcome.exit.kind in ("error", "crash") and not outcome.error:
                tail = machine.console_tail(2048).strip().splitlines()[-20:]
                outcome.error = outcome.exit.detail + ("\nconsole tail:\n" + "\n".join(tail) if tail else "")
            return outcome
        finally:
            if control is not None:
                await control.close()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if self.machine is not None:
                self.machine.close()
            with contextlib.suppress(FileNotFoundError):
                (state_dir / READY_FILE).unlink()
            if self._own_dir is not None:
                shutil.rmtree(self._own_dir, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    _write_atomic(state_dir / EXIT_FILE, outcome.to_json())

    def _confine(self) -> None:
        """Install the seccomp filter (every fd the VMM needs is open by now); SeccompError if it cannot."""
        count = install_vmm_filter(self.seccomp)
        if count:
            log.info("seccomp filter installed (%s, %d BPF instructions)", self.seccomp, count)

    async def _supervise(self, machine: Machine, outcome: RunOutcome,
                         body: Callable[[Runner, AgentClient], Any] | None) -> None:
        deadline = time.monotonic() + self.boot_timeout
        # A restored guest usually answers within a second, but an attempt that raced its vsock transport
        # reset (virtio 1.2 §5.10.6.7) is answered from the old CID and dropped: retry such an attempt
        # soon, with per-attempt timeouts growing to 5 s so a slow guest still gets through.
        attempts = [0]

        def connect() -> Awaitable[AgentClient]:
            attempts[0] += 1
            timeout = connect_attempt_timeout(attempts[0], machine.restored)
            return connect_vsock_uds(str(machine.vsock_path), AGENT_VSOCK_PORT, timeout=timeout)

        try:
            client = await wait_ready(
                connect,
                deadline, interval=0.05, max_interval=0.5)
        except AgentError as e:
            outcome.error = f"boot timeout: guest agent not ready after {self.boot_timeout:.0f}s ({e})"
            return
        now = time.monotonic()
        restore_timings: dict[str, float] = {}
        if machine.restored:
            restore_timings = {k: round(v, 4) for k, v in machine.timings.items()}
            restore_timings["agent"] = round(now - self.process_start, 4)
            try:
                await self._after_restore(machine, client)
            except (AgentError, OSError) as e:
                outcome.error = f"restored guest did not take its clock correction or identity: {e}"
                await client.close()
                return
            now = time.monotonic()
            restore_timings["clock_fix"] = round(now - self.process_start - restore_timings["agent"], 4)
        self.ready = ReadyInfo(
            pid=os.getpid(), vsock_path=str(machine.vsock_path), agent_port=AGENT_VSOCK_PORT,
            cpu_template=machine.template.value, cpus=machine.config.cpus,
            memory_mib=machine.config.memory_mib, boot_seconds=round(now - self.process_start, 3),
            vcpu_start_seconds=round(outcome.timings.get("vcpu_start", 0.0), 3), restored=machine.restored,
            timings=restore_timings)
        outcome.ready = self.ready
        outcome.timings["agent_ready"] = now - self.process_start
        _write_atomic(machine.state_dir / READY_FILE, self.ready.to_json())
        self._ready_event.set()
        if self.on_ready is not None:
            self.on_ready(self.ready)
        try:
            if body is not None:
                result = body(self, client)
                if asyncio.iscoroutine(result):
                    result = await result
                if isinstance(result, int):
                    outcome.exec_code = result
            if self.snapshot_dir is not None:
                await client.close()
                if not await self._snapshot(machine, outcome):
                    return
                if self.after_snapshot == AfterSnapshot.EXIT:
                    return
                if body is not None:
                    client = await self.connect()
            if body is None:
                await client.close()
                await asyncio.Event().wait()   # until the guest ends (run_task completes first)
                return
            with contextlib.suppress(AgentError, OSError):
                await client.poweroff()
        finally:
            await client.close()

    async def _snapshot(self, machine: Machine, outcome: RunOutcome) -> bool:
        """``--snapshot-on-ready``: write the snapshot; False (and outcome.error) if it was not written."""
        assert self.snapshot_dir is not None
        if outcome.exec_code not in (None, 0):
            outcome.error = (f"setup command exited with {outcome.exec_code}: no snapshot written")
            return False
        exiting = self.after_snapshot == AfterSnapshot.EXIT
        try:
            result = await machine.snapshot(self.snapshot_dir, resume=not exiting, digest=True, durable=True)
        except (SnapshotError, MachineError, OSError) as e:
            outcome.error = f"snapshot failed: {e}"
            return False
        outcome.snapshot = result
        if self.on_snapshot is not None:
            self.on_snapshot(result)
        if exiting:
            machine.stop(f"snapshot written to {result.directory}")
        return True

    async def _after_restore(self, machine: Machine, client: AgentClient) -> None:
        """Correct the guest's wall clock, which stood still while the snapshot was on disk.

        The restored kvmclock and TSC continue from their saved values, so CLOCK_MONOTONIC in the guest
        has no jump (timers and sleeps behave as if the VM had been paused); only CLOCK_REALTIME is
        stepped to the host's clock, by the agent's SET_TIME request (one clock_settime in the guest,
        no process spawned: an exec costs seconds of emulated kernel time on PVM). docs/snapshot.md.
        """
        spec = machine.restored_spec
        identity: dict[str, Any] = {}
        if spec is not None and machine.config.hostname != spec.hostname:
            identity["hostname"] = machine.config.hostname
        if self.new_identity:
            identity.update(hostname=machine.config.hostname, machine_id=uuid.uuid4().hex, entropy=os.urandom(64))
        jobs = [client.set_time()]
        if identity:
            jobs.append(client.set_identity(**identity))
        result, *_ = await asyncio.gather(*jobs)
        skew = (result.get("realtime_ns", 0) - time.time_ns()) / 1e9
        log.info("guest clock was %.3f s behind; stepped (residual %.4f s); identity %s",
                 (time.time_ns() - int(result.get("previous_ns", 0))) / 1e9, skew, sorted(identity))
