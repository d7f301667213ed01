"""Run one microVM in this process: boot, wait for the guest agent, report readiness, end cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from smold.agent import AgentClient, AgentError, connect_vsock_uds, wait_ready
from smold.vmm.machine import Machine, MachineConfig, MachineError, MachineExit

AGENT_VSOCK_PORT = 1024       # the guest's /init starts the agent on this port
READY_FILE = "ready.json"
EXIT_FILE = "exit.json"
CONSOLE_FILE = "console.log"


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

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


@dataclass
class RunOutcome:
    """How a run ended: the machine's exit plus the runner's own verdict."""

    exit: MachineExit | None
    ready: ReadyInfo | None = None
    error: str = ""
    exec_code: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

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


class Runner:
    """Owns one Machine for the life of the process.

    ``state_dir`` holds ``vsock.sock`` (removed at exit), ``ready.json`` (removed at exit),
    ``console.log`` and ``exit.json`` (kept for the supervisor). With ``remove_state_dir`` the whole
    directory is removed at exit (the CLI's private temporary directory).
    """

    def __init__(self, config: MachineConfig | None = None, *, boot_timeout: float = 600.0,
                 process_start: float | None = None,
                 on_ready: Callable[[ReadyInfo], None] | None = None,
                 remove_state_dir: bool = False) -> None:
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
        try:
            try:
                self.machine = Machine(config)
            except MachineError as e:
                outcome.error = str(e)
                return outcome
            machine = self.machine
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, machine.stop, f"stopped by signal {sig.name}")
            started = asyncio.Event()
            run_task = asyncio.ensure_future(machine.run(on_started=started.set))
            await started.wait()
            outcome.timings["vcpu_start"] = time.monotonic() - self.process_start
            supervisor = asyncio.ensure_future(self._supervise(machine, outcome, body))
            done, _ = await asyncio.wait({run_task, supervisor}, return_when=asyncio.FIRST_COMPLETED)
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
            outcome.exit = await run_task
            if supervisor.done() and not supervisor.cancelled() and supervisor.exception() is not None:
                outcome.error = outcome.error or f"runner failed: {supervisor.exception()!r}"
            if outcome.exit.kind in ("error", "crash") and not outcome.error:
                tail = machine.console_tail(2048).strip().splitlines()[-20:]
                outcome.error = outcome.exit.detail + ("\nconsole tail:\n" + "\n".join(tail) if tail else "")
            return outcome
        finally:
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

    async def _supervise(self, machine: Machine, outcome: RunOutcome,
                         body: Callable[[Runner, AgentClient], Any] | None) -> None:
        deadline = time.monotonic() + self.boot_timeout
        try:
            client = await wait_ready(
                lambda: connect_vsock_uds(str(machine.vsock_path), AGENT_VSOCK_PORT, timeout=5.0),
                deadline, interval=0.05, max_interval=0.5)
        except AgentError as e:
            outcome.error = f"boot timeout: guest agent not ready after {self.boot_timeout:.0f}s ({e})"
            return
        now = time.monotonic()
        self.ready = ReadyInfo(
            pid=os.getpid(), vsock_path=str(machine.vsock_path), agent_port=AGENT_VSOCK_PORT,
            cpu_template=machine.template.value, cpus=machine.config.cpus,
            memory_mib=machine.config.memory_mib, boot_seconds=round(now - self.process_start, 3),
            vcpu_start_seconds=round(outcome.timings.get("vcpu_start", 0.0), 3))
        outcome.ready = self.ready
        outcome.timings["agent_ready"] = now - self.process_start
        _write_atomic(machine.state_dir / READY_FILE, self.ready.to_json())
        self._ready_event.set()
        if self.on_ready is not None:
            self.on_ready(self.ready)
        try:
            if body is None:
                await client.close()
                await asyncio.Event().wait()   # until the guest ends (run_task completes first)
                return
            result = body(self, client)
            if asyncio.iscoroutine(result):
                result = await result
            if isinstance(result, int):
                outcome.exec_code = result
            with contextlib.suppress(AgentError, OSError):
                await client.poweroff()
        finally:
            await client.close()
