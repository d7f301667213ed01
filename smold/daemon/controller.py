"""The machine table: create, exec, copy, verify, destroy and run machines; supervise their VM processes.

One VM process per machine (started by a Launcher). Phases: CREATING (VM booting, mounts copied, setup
running) -> RUNNING -> destroyed (removed from the table); any phase -> FAILED when the VM process dies,
boot times out or a mount/setup step fails. A failed machine keeps its state directory (console log)
until it is destroyed. Nothing that happens to one machine takes the daemon or other machines down.

Snapshots (docs/daemon.md, "Checkpoints and fork"): Snapshot asks a running machine's VMM (control socket)
to write a named checkpoint into ``STATE_DIR/checkpoints/<name>/``; CreateMachine can restore one instead of
booting. Fork writes a private base into ``STATE_DIR/forks/`` and restores N machines from it; the base is
removed when the last machine restored from it is destroyed.

Pre-baked images (docs/daemon.md, "Pre-baked images"): BakeImage creates a machine as CreateMachine would
(boot, mounts, setup), snapshots it into ``STATE_DIR/bakes/<key>/`` (smold/daemon/bakes.py) and destroys it;
CreateMachine and Run restore the bake whose key matches the Smolfile and image instead of booting. A bake
that fails its checks is not used: the machine boots as if there were none, and the boot step says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from smold.agent import AgentClient, AgentConnectError, AgentError, ExecEvent
from smold.api.machine import (
    Artifact,
    BakeInfo,
    CheckpointInfo,
    MachineInfo,
    MachineState,
    NetworkReport,
    RunResult,
    StepResult,
)
from smold.authrecord import KEY_FILE, RecordAuthError, RecordKey, read_unverified
from smold.net import AddressPool, ForwardError, NetError, NetworkManager, NftError, VmNetwork
from smold.net.manager import NET_FILE
from smold.smolfile import (
    Check,
    NetworkPolicy,
    RewardCheck,
    Smolfile,
    SmolfileError,
    check_mount_sources,
    digest,
    parse_mapping,
    to_mapping,
)
from smold.verifier import CheckResult, Evidence, Outcome, VerifyResult, tail_text, verify
from smold.verifier.outputs import OutputsError, Repacked, repack

from . import guestops
from .bakes import (
    TEMP_PREFIX,
    BakeBusyError,
    BakeCorruptError,
    BakeExistsError,
    BakeMeta,
    BakeNotFoundError,
    BakeStore,
    bake_key,
    base_smolfile,
    mounts_digest,
)
from .config import DEFAULT_CONSOLE_TAIL, MAX_CONSOLE_TAIL, DaemonConfig
from .errors import (
    CheckpointExistsError,
    CheckpointFailedError,
    CheckpointNoSpaceError,
    CheckpointNotFoundError,
    CreateFailedError,
    DaemonError,
    DestroyIncompleteError,
    GuestUnavailableError,
    InvalidRequestError,
    LaunchError,
    LimitExceededError,
    MachineNotFoundError,
    NameTakenError,
    RefusedByPolicyError,
    ShuttingDownError,
    Status,
    WrongPhaseError,
)
from .images import ImageStore
from .launcher import CONSOLE_FILE, EXIT_FILE, LOG_FILE, READY_FILE, Launcher, LaunchSpec, read_ready
from .process import (
    AdoptedProcess,
    ExitStatus,
    ProcessGoneError,
    VmProcess,
    group_members,
    is_same_process,
    kill_group,
)
from .record import RECORD_FILE, MachineRecord, RecordError, record_dir

log = logging.getLogger("smold.controller")
OUTPUTS_ARTIFACT = "outputs.tar"  # a sealed Run's re-packed outputs, kept with its result
VERIFIER_LOGS_ARTIFACT = "verifier-logs.tar"  # DaemonConfig.verifier_logs_path after the checks
VERIFIER_LOGS_TIMEOUT_S = 60.0

ID_RE = re.compile(r"m-[0-9a-f]{12}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
TOMBSTONES = 1024          # destroyed ids remembered, to answer "was destroyed" rather than "no such machine"
ADOPT_HEALTH_TIMEOUT_S = 10.0
SLOW_AGENT_CONNECT_S = 5.0  # a connect + HELLO slower than this is logged (a busy or emulated guest)
LIVE = (MachineState.CREATING, MachineState.RUNNING)
CHECKPOINT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
CHECKPOINT_META = "checkpoint.json"   # beside the VMM's snapshot.state and memory.raw
MAX_FORK = 16
SNAPSHOT_TIMEOUT_S = 300.0


@dataclass
class Machine:
    """One machine in the table (mutable; the controller owns it)."""

    id: str
    name: str
    smolfile: Smolfile
    image: str
    image_digest: str
    smolfile_digest: str
    state_dir: Path
    created_at: datetime
    launcher: str
    phase: MachineState = MachineState.CREATING
    proc: VmProcess | None = None
    ready: dict[str, Any] | None = None
    failure_reason: str = ""
    failed_at: float = 0.0
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    exit_status: ExitStatus | None = None
    watcher: asyncio.Task[None] | None = None
    create_task: asyncio.Task[Any] | None = None
    destroy_task: asyncio.Task[None] | None = None
    destroy_requested: bool = False  # a Destroy arrived while creating: the create ends with an error
    checkpoint: Path | None = None   # the snapshot directory it was restored from (None: booted)
    boot_note: str = ""              # said in the boot step: the bake restored, or why one was refused
    snapshot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one snapshot of its VM at a time
    net: VmNetwork | None = None      # its namespace, tap, nft rules and DNS resolver (None: networking off)
    net_report: NetworkReport | None = None  # the last one read (kept after the network is gone)
    # Exec defaults from an OCI image's config (Env, WorkingDir, User); the Smolfile and requests win.
    image_env: tuple[tuple[str, str], ...] = ()
    image_cwd: str = ""
    image_user: str = ""
    run_result: str = ""             # the result id of the Run this machine serves: never re-adopted

    @property
    def environ(self) -> dict[str, str]:
        """The environment every command gets: the image's Env, overridden by the Smolfile's env."""
        return {**dict(self.image_env), **self.smolfile.environ}

    def cwd_for(self, cwd: str | None) -> str | None:
        return cwd or self.image_cwd or None

    def user_for(self, user: str | None) -> str | None:
        return user or self.image_user or None

    @property
    def cpus(self) -> int:
        return self.smolfile.cpus

    @property
    def memory_mib(self) -> int:
        return self.smolfile.memory_mib

    def record(self) -> MachineRecord:
        proc = self.proc
        return MachineRecord(
            id=self.id, name=self.name, phase=self.phase.value, created_at=self.created_at.isoformat(),
            cpus=self.cpus, memory_mib=self.memory_mib, image=self.image, image_digest=self.image_digest,
            smolfile=to_mapping(self.smolfile), smolfile_digest=self.smolfile_digest,
            base_dir=self.smolfile.base_dir, launcher=self.launcher, pid=proc.pid if proc else 0,
            argv=list(proc.argv) if proc else [], started=proc.started if proc else None,
            failure_reason=self.failure_reason, checkpoint=str(self.checkpoint or ""), run_result=self.run_result)

    @property
    def record_dir(self) -> Path:
        """The daemon's records of it (machine.json, net.json): out of its VMM's reach."""
        return record_dir(self.state_dir)

    def save(self, key: RecordKey) -> None:
        if not self.state_dir.is_dir():   # destroyed meanwhile: no record to leave behind
            return
        with contextlib.suppress(OSError):
            self.record_dir.mkdir(mode=0o700, exist_ok=True)
            self.record().save(self.record_dir, key)


EXIT_FIELD_CHARS = 500   # of each exit.json field in a failure reason (the VMM wrote them)


class StepFailedError(Exception):
    """Creating a machine stopped at a failed mount or setup step (internal: Create and Run report it)."""

    def __init__(self, step: StepResult) -> None:
        super().__init__(f"{step.name} failed: {step.evidence.detail}")
        self.step = step
        self.machine: Machine | None = None


class Controller:
    """Owns every machine of this daemon. All methods run on the daemon's event loop."""

    def __init__(self, config: DaemonConfig, launcher: Launcher, images: ImageStore | None = None,
                 network: NetworkManager | None = None) -> None:
        self.config = config
        self.network = network or NetworkManager(AddressPool(config.net_pool))
        self.launcher = launcher
        self.images = images or ImageStore()
        self._machines: dict[str, Machine] = {}
        self._destroyed: OrderedDict[str, None] = OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._pinned: set[Path] = set()       # fork bases being written or restored (not yet referenced)
        self._checkpointing: set[str] = set()  # checkpoint names being written
        self.bakes = BakeStore(config.bakes_dir)
        self._baking: set[str] = set()        # bake keys being baked
        self._restoring: Counter[Path] = Counter()  # snapshot directories a create is about to restore
        # authenticates machine.json and net.json, which sit where a jailed VMM can write (start() loads the
        # daemon's persistent key; a controller that is never started keeps this one)
        self.record_key = RecordKey.generate()

    # --- start-up: re-adopt or clean up what an earlier daemon left ---------------------------------------
    async def start(self) -> None:
        self.config.machines_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config.records_dir.mkdir(exist_ok=True, mode=0o700)
        self.record_key = RecordKey.load_or_create(self.config.state_dir / KEY_FILE)
        self.network.record_key = self.record_key
        self.config.bakes_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.bakes.key = RecordKey.load_or_create(self.config.bakes_key_file)
        for d in sorted(self.config.machines_dir.iterdir()):
            if d.is_dir() and not d.is_symlink():
                try:
                    await self._adopt_or_clean(d)
                except Exception:   # one machine's leftovers, whatever is wrong with them, never stop the daemon
                    log.exception("machine directory %s: adopting or cleaning it up failed; left as it is", d)
            else:
                with contextlib.suppress(OSError):
                    d.unlink()
        for r in sorted(self.config.records_dir.iterdir()):   # records of machines whose directory is gone
            if not (self.config.machines_dir / r.name).is_dir():
                await asyncio.to_thread(_remove_path, r)
        await asyncio.to_thread(self._clean_checkpoint_dirs)

    async def _clean_host_side(self, machine_dir: Path) -> None:
        """Remove what a machine that is not re-adopted has outside its state directory: what its jail left,
        its namespace and uplink (only this daemon's own: another daemon on the host may run machines of its
        own)."""
        if not ID_RE.fullmatch(machine_dir.name):
            return
        await asyncio.to_thread(self.launcher.cleanup, machine_dir.name)
        try:
            await self.network.teardown_machine(machine_dir.name)
        except (NetError, OSError) as e:
            log.warning("machine %s: removing its network failed: %s", machine_dir.name, e)

    def _clean_checkpoint_dirs(self) -> None:
        """Remove half-written checkpoints and fork bases no (re-adopted) machine was restored from."""
        self.config.checkpoints_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config.forks_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.bakes.clean()
        used = {m.checkpoint for m in self._machines.values()}
        for d in self.config.checkpoints_dir.iterdir():
            if d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)
        for d in self.config.forks_dir.iterdir():
            if d not in used:
                log.info("removing unused fork base %s", d)
                shutil.rmtree(d, ignore_errors=True)

    async def _remove_leftovers(self, d: Path, pid: int | None = None) -> None:
        """A machine that is not re-adopted: its VM process (if still ours) killed, its jail's leftovers and
        network removed, its state directory deleted."""
        if pid is not None:
            await self._kill_stray(pid)
        await self._clean_host_side(d)
        await asyncio.to_thread(shutil.rmtree, d, True)
        await asyncio.to_thread(_remove_path, record_dir(d))

    @staticmethod
    def _unverified_vmm_pid(d: Path) -> int | None:
        """The VM process a record this daemon cannot authenticate names (an older daemon's, or forged), to be
        killed only if it is alive with exactly that argv and start time and its argv names this machine's own
        directory: a forged record cannot get another process killed."""
        try:
            path = record_dir(d) / RECORD_FILE
            data = read_unverified(path if path.exists() else d / RECORD_FILE)   # an older daemon's: in d
            pid, argv, started = data.get("pid"), data.get("argv"), data.get("started")
        except RecordAuthError:
            return None
        if not (isinstance(pid, int) and pid > 1 and isinstance(argv, list) and all(isinstance(a, str) for a in argv)
                and (started is None or isinstance(started, int))):
            return None
        if not any(a == str(d) or f"{d}/" in a for a in argv):
            return None
        return pid if is_same_process(pid, argv, started) else None

    def _load_record(self, d: Path) -> MachineRecord:
        """The machine's record from the records directory; one that an older daemon kept in the machine's own
        directory is taken from there (it must verify all the same) and moved with its net.json."""
        rd = record_dir(d)
        if not (rd / RECORD_FILE).exists() and (d / RECORD_FILE).exists():
            rec = MachineRecord.load(d, self.record_key)
            rd.mkdir(mode=0o700, exist_ok=True)
            rec.save(rd, self.record_key)
            (d / RECORD_FILE).unlink()
            if (d / NET_FILE).exists():
                self.record_key.write(rd / NET_FILE, self.record_key.read(d / NET_FILE, f"{NET_FILE} {d.name}"),
                                      f"{NET_FILE} {d.name}")
                (d / NET_FILE).unlink()
            return rec
        return MachineRecord.load(rd, self.record_key)

    async def _adopt_or_clean(self, d: Path) -> None:
        try:
            rec = self._load_record(d)
        except (RecordError, RecordAuthError) as e:
            log.warning("removing %s: %s", d, e)
            await self._remove_leftovers(d, self._unverified_vmm_pid(d))
            return
        why = ""
        proc: AdoptedProcess | None = None
        if rec.id != d.name:
            why = f"record id {rec.id!r} does not match its directory"
        elif rec.run_result:
            why = f"it served Run {rec.run_result}, which the daemon's stop interrupted (stored as interrupted)"
        elif rec.phase != MachineState.RUNNING.value:
            why = f"it was {rec.phase} when the daemon stopped"
        elif rec.launcher != self.launcher.kind:
            why = f"it was started by the {rec.launcher!r} launcher, this daemon uses {self.launcher.kind!r}"
        else:
            try:
                proc = AdoptedProcess(rec.pid, rec.argv, rec.started)
            except ProcessGoneError as e:
                why = f"its VM process is gone ({e})"
        ready = read_ready(d / READY_FILE)
        if proc is not None and ready is None:
            why = "its VM process has no ready.json"
        smolfile: Smolfile | None = None
        if proc is not None and not why:
            try:
                smolfile = parse_mapping(rec.smolfile, base_dir=rec.base_dir)
            except SmolfileError as e:
                why = f"its recorded Smolfile no longer validates: {e}"
        if proc is not None and not why:
            assert ready is not None
            try:
                client = await self._connect_agent(d, ready, ADOPT_HEALTH_TIMEOUT_S)
                try:
                    await asyncio.wait_for(client.health(), ADOPT_HEALTH_TIMEOUT_S)
                finally:
                    await client.close()
            except (AgentError, LaunchError, OSError, TimeoutError) as e:
                why = f"its guest agent does not answer ({e})"
        if why or proc is None or smolfile is None:
            log.info("cleaning up machine %s: %s", d.name, why)
            ours = bool(rec.pid) and is_same_process(rec.pid, rec.argv, rec.started)
            await self._remove_leftovers(d, rec.pid if ours else None)
            return
        net: VmNetwork | None = None
        if smolfile.network.enabled:
            try:
                net = await self.network.adopt(rec.id, smolfile.network, record_dir(d))
            except (NetError, OSError) as e:
                log.info("cleaning up machine %s: its network cannot be re-adopted (%s)", d.name, e)
                await self._remove_leftovers(d, proc.pid)
                return
            if net.policy.public and not self.config.public_network:
                # the operator turned public egress off (--no-public-network): a machine that has it, by its
                # Smolfile or a SetNetworkPolicy, is not kept with it and not silently narrowed: it goes
                log.warning("cleaning up machine %s: it has public egress, which this daemon refuses "
                            "(--no-public-network)", d.name)
                await self._remove_leftovers(d, proc.pid)
                return
        m = Machine(
            id=rec.id, name=rec.name, smolfile=smolfile, image=rec.image, image_digest=rec.image_digest,
            smolfile_digest=rec.smolfile_digest, state_dir=d, created_at=datetime.fromisoformat(rec.created_at),
            launcher=rec.launcher, phase=MachineState.RUNNING, proc=proc, ready=ready,
            checkpoint=Path(rec.checkpoint) if rec.checkpoint else None, net=net)
        self._machines[m.id] = m
        m.watcher = asyncio.create_task(self._watch(m))
        log.info("re-adopted machine %s (VM process %d)", m.id, proc.pid)

    @staticmethod
    async def _kill_stray(pid: int) -> None:
        kill_group(pid, signal.SIGKILL)
        for _ in range(100):
            if not group_members(pid):
                return
            await asyncio.sleep(0.05)

    # --- queries --------------------------------------------------------------------------------------------
    def _lookup(self, ref: str) -> Machine:
        if not ref:
            raise InvalidRequestError("machine_id: a machine id or name is required")
        m = self._machines.get(ref)
        if m is not None:
            return m
        for m in self._machines.values():
            if m.name and m.name == ref:
                return m
        if ref in self._destroyed:
            raise MachineNotFoundError(f"machine {ref} was destroyed")
        raise MachineNotFoundError(f"no machine {ref!r}")

    def machine_id(self, ref: str) -> str:
        """The id of the machine ``ref`` names (an id or a name); MachineNotFoundError otherwise."""
        return self._lookup(ref).id

    def _running(self, ref: str) -> Machine:
        try:
            m = self._lookup(ref)
        except MachineNotFoundError:
            if ref in self._destroyed:
                raise WrongPhaseError(f"machine {ref} was destroyed") from None
            raise
        if m.phase is not MachineState.RUNNING:
            reason = f": {m.failure_reason}" if m.phase is MachineState.FAILED and m.failure_reason else ""
            raise WrongPhaseError(f"machine {m.id} is {m.phase.value}, not running{reason}")
        return m

    def info(self, m: Machine, console_bytes: int | None = None) -> MachineInfo:
        if console_bytes is None:
            console_bytes = DEFAULT_CONSOLE_TAIL if m.phase is MachineState.FAILED else 0
        proc = m.proc
        return MachineInfo(
            id=m.id, name=m.name, state=m.phase, cpus=m.cpus, memory_mib=m.memory_mib, image=m.image,
            created_at=m.created_at, image_digest=m.image_digest, smolfile_digest=m.smolfile_digest,
            failure_reason=m.failure_reason,
            console_tail=self.console_tail(m, console_bytes) if console_bytes else "",
            vmm_pid=proc.pid if proc is not None and m.exit_status is None else 0,
            restored_from=self._restored_from(m.checkpoint),
            network=m.net_report or (NetworkReport() if m.smolfile.network.enabled else None),
            forwarded_ports=m.net.forwarded_ports if m.net is not None else ())

    def _restored_from(self, directory: Path | None) -> str:
        if directory is None:
            return ""
        if directory.parent == self.config.bakes_dir:
            return f"bake:sha256:{directory.name}"
        if directory.parent == self.config.checkpoints_dir:
            return f"checkpoint:{directory.name}"
        if directory.parent == self.config.forks_dir:
            return f"fork:{directory.name.rsplit('-', 1)[0]}"
        return str(directory)

    def _restored_machines(self, directory: Path) -> tuple[str, ...]:
        return tuple(m.id for m in sorted(self._machines.values(), key=lambda m: (m.created_at, m.id))
                     if m.checkpoint == directory)

    async def refresh_network(self, ref: str) -> None:
        """Read a machine's network report (nft counters, denied destinations and names) into m.net_report."""
        with contextlib.suppress(MachineNotFoundError):
            m = self._lookup(ref)
            await self._read_network(m)

    async def _read_network(self, m: Machine) -> NetworkReport | None:
        if m.net is not None:
            try:
                m.net_report = await self.network.report(m.net)
            except (NetError, OSError) as e:
                log.warning("machine %s: cannot read its network report: %s", m.id, e)
        return m.net_report

    def get(self, ref: str, console_bytes: int = 0) -> MachineInfo:
        n = DEFAULT_CONSOLE_TAIL if console_bytes <= 0 else min(console_bytes, MAX_CONSOLE_TAIL)
        return self.info(self._lookup(ref), n)

    def list_machines(self) -> list[MachineInfo]:
        return [self.info(m) for m in sorted(self._machines.values(), key=lambda m: (m.created_at, m.id))]

    @staticmethod
    def console_tail(m: Machine, limit: int) -> str:
        """The end of the serial console log (or, for a VM process without one, of its own output)."""
        for name in (CONSOLE_FILE, LOG_FILE):
            try:
                return Controller.file_tail(m.state_dir / name, limit, missing_ok=False)
            except OSError:
                continue
        return ""

    @staticmethod
    def file_tail(path: Path, limit: int, *, missing_ok: bool = True) -> str:
        """The last ``limit`` bytes of a file the VM process writes (hostile: bounded, decoded with replacement)."""
        try:
            # Never follow a link or block on a FIFO the VM process may have put in its place.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{path} is not a regular file")
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - limit))
                return tail_text(f.read(limit), limit)
        except OSError:
            if missing_ok:
                return ""
            raise

    @property
    def memory_in_use_mib(self) -> int:
        return sum(m.memory_mib for m in self._machines.values() if m.phase in LIVE)

    @property
    def live_machines(self) -> int:
        return sum(1 for m in self._machines.values() if m.phase in LIVE)

    # --- create ---------------------------------------------------------------------------------------------
    async def create(self, smolfile: Smolfile, name: str = "", filename: str = "Smolfile.toml") -> MachineInfo:
        """Boot a machine, copy its mounts in, run its setup. CreateFailedError leaves it FAILED."""
        steps: list[StepResult] = []
        try:
            m = await self._create(smolfile, name, filename, steps)
        except StepFailedError as e:
            mid = e.machine.id if e.machine else "?"
            raise CreateFailedError(f"machine {mid}: {e}; it is kept as failed (see its console log) until "
                                    "destroyed", Status.ABORTED) from None
        return self.info(m)

    def _admit(self, smolfile: Smolfile, name: str) -> None:
        if name:
            if not NAME_RE.fullmatch(name) or ID_RE.fullmatch(name):
                raise InvalidRequestError(f"name: {name!r} is not a valid machine name (letters, digits, '_.-', "
                                          "at most 63, not of the form m-<12 hex digits>)")
            if any(m.name == name for m in self._machines.values()):
                raise NameTakenError(f"a machine named {name!r} already exists")
        if self._closing:
            raise ShuttingDownError("the daemon is shutting down")
        if smolfile.network.public and not self.config.public_network:
            raise RefusedByPolicyError('network = "public": this daemon gives no machine public egress '
                                       "(smold --no-public-network); list the destinations in network.allow instead")
        live = [m for m in self._machines.values() if m.phase in LIVE]
        if len(live) >= self.config.max_machines:
            raise LimitExceededError(f"machine limit reached: {len(live)} of {self.config.max_machines} "
                                     "machines are running or being created")
        used = self.memory_in_use_mib
        if used + smolfile.memory_mib > self.config.max_memory_mib:
            raise LimitExceededError(
                f"memory limit reached: {smolfile.memory_mib} MiB requested, {used} of "
                f"{self.config.max_memory_mib} MiB in use")

    async def _create(self, smolfile: Smolfile, name: str, filename: str, steps: list[StepResult], *,
                      restore: Path | None = None, image_digest: str = "", use_bake: bool = True,
                      run_result: str = "") -> Machine:
        """Boot (or, with ``restore``, restore that snapshot directory: no mounts, no setup) one machine.
        Without ``restore`` a verified bake matching the Smolfile and image is restored if there is one
        (unless ``use_bake`` is false); failing that, its base bake (the same machine before mounts, env and
        setup), which are then provisioned as after a boot. A cold boot is itself baked as that base
        (``auto_bake``) before its mounts and setup, so the next machine of that image and size restores."""
        provision = restore is None
        if restore is None:
            await asyncio.to_thread(check_mount_sources, smolfile, filename=filename)
            await asyncio.to_thread(check_mount_roots, smolfile, self.config.mount_roots, filename)
        self._admit(smolfile, name)  # fail fast before resolving the image (which may hash files)
        image = await self.images.resolve(smolfile.image, smolfile.base_dir)
        note = ""
        if restore is None and use_bake:
            restore, note = await self._find_bake(smolfile, image)
            provision = restore is None
        base = base_smolfile(smolfile)
        if restore is None and base != smolfile:
            restore, base_note = await self._find_bake(base, image, base=True)
            note = "; ".join(n for n in (note, base_note) if n)
        self._admit(smolfile, name)  # again: no await between this check and the insert below
        mid = f"m-{secrets.token_hex(6)}"
        m = Machine(
            id=mid, name=name, smolfile=smolfile, image=image.name, image_digest=image_digest or image.digest,
            smolfile_digest=digest(smolfile), state_dir=self.config.machines_dir / mid,
            created_at=datetime.now(UTC), launcher=self.launcher.kind, checkpoint=restore, boot_note=note,
            image_env=image.env, image_cwd=image.working_dir, image_user=image.user, run_result=run_result)
        self._machines[mid] = m
        m.create_task = asyncio.current_task()
        try:
            await self._boot(m, image, steps)
            if restore is None and self.config.auto_bake:
                await self._auto_bake(m, base, image)
            if provision:  # a bake of this Smolfile (or a fork, a checkpoint) already holds its mounts and setup
                await self._provision(m, steps)
        except asyncio.CancelledError:
            if m.destroy_requested:  # DestroyMachine cancelled us: report that rather than a cancellation
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise CreateFailedError(f"machine {mid} was destroyed while being created", Status.ABORTED) from None
            self._destroy_task(m)  # the client went away: nobody will use this machine
            raise
        except StepFailedError as e:
            e.machine = m
            await self._fail(m, f"machine {mid}: {e}")
            raise
        except CreateFailedError as e:
            e.machine_id = mid
            await self._fail(m, str(e))
            raise
        except Exception as e:
            log.exception("creating machine %s failed", mid)
            await self._fail(m, f"internal error while creating: {e!r}")
            raise CreateFailedError(f"machine {mid}: internal error while creating: {e!r}", Status.INTERNAL) from e
        finally:
            m.create_task = None
        m.phase = MachineState.RUNNING
        m.save(self.record_key)
        log.info("machine %s running (%d cpus, %d MiB)", mid, m.cpus, m.memory_mib)
        return m

    async def _boot(self, m: Machine, image: Any, steps: list[StepResult]) -> None:
        start = time.monotonic()
        await asyncio.to_thread(m.state_dir.mkdir, 0o700)
        m.save(self.record_key)
        try:   # the VM process's uid and gid: a jailed VMM's own, its tap handed to them
            vmm_ids = self.launcher.assign_vmm_ids(m.state_dir)
        except LaunchError as e:
            raise CreateFailedError(str(e), Status.RESOURCE_EXHAUSTED) from None
        boot_timeout = m.smolfile.timeouts.boot
        if m.smolfile.network.enabled:  # its own namespace, uplink, tap, rules and resolver, before the VMM
            try:
                fork_child = m.checkpoint is not None and m.checkpoint.parent == self.config.forks_dir
                m.net = await self.network.setup(m.id, m.smolfile.network, state_dir=m.record_dir,
                                                 auto_ports=fork_child, tap_owner=vmm_ids)
            except ForwardError as e:
                raise CreateFailedError(f"{e} (choose another host port in network.forward, or none for a free "
                                        "one)", Status.FAILED_PRECONDITION) from None
            except NetError as e:
                raise CreateFailedError(f"machine {m.id}: cannot set up its network: {e}", Status.INTERNAL) from None
        spec = LaunchSpec(machine_id=m.id, state_dir=m.state_dir, image=image, cpus=m.cpus,
                          memory_mib=m.memory_mib, hostname=_hostname(m), boot_timeout=boot_timeout,
                          restore_from=m.checkpoint,
                          net_args=tuple(m.net.vmm_args()) if m.net else (),
                          netns_prefix=tuple(m.net.launch_prefix()) if m.net else ())
        try:
            proc = await self.launcher.spawn(spec)
        except LaunchError as e:
            raise CreateFailedError(f"machine {m.id}: {e}", Status.INTERNAL) from None
        m.proc = proc
        m.save(self.record_key)
        m.watcher = asyncio.create_task(self._watch(m))
        ready_task = asyncio.ensure_future(self.launcher.wait_ready(spec, proc))
        exited_task = asyncio.ensure_future(m.exited.wait())
        try:
            done, _ = await asyncio.wait({ready_task, exited_task}, timeout=boot_timeout + self.config.boot_grace_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready_task.cancel()
            exited_task.cancel()
        seconds = time.monotonic() - start
        if ready_task in done and not ready_task.cancelled() and ready_task.exception() is None:
            m.ready = ready_task.result()
            note = f"{m.boot_note}; " if m.boot_note else ""
            steps.append(StepResult("boot", True, Evidence(
                duration_ms=round(seconds * 1000), detail=f"{note}guest agent ready after {seconds:.1f}s")))
            return
        if ready_task in done and ready_task.exception() is not None:
            exc = ready_task.exception()
            timed_out = isinstance(exc, LaunchError) and exc.timed_out
            raise CreateFailedError(f"machine {m.id}: boot failed: {exc}",
                                    Status.DEADLINE_EXCEEDED if timed_out else Status.INTERNAL)
        if exited_task in done:
            reason = self._exit_reason(m)
            status = Status.DEADLINE_EXCEEDED if "boot timeout" in reason else Status.INTERNAL
            raise CreateFailedError(f"machine {m.id}: boot failed: {reason}", status)
        raise CreateFailedError(f"machine {m.id}: boot timed out: the guest agent did not answer within "
                                f"{boot_timeout:g}s", Status.DEADLINE_EXCEEDED)

    async def _provision(self, m: Machine, steps: list[StepResult]) -> None:
        """Copy the mounts in, then run the setup commands within the setup timeout."""
        sf = m.smolfile
        if not sf.mounts and not sf.setup:
            return
        async with self._agent(m) as client:
            for i, mount in enumerate(sf.mounts):
                step = await self._copy_mount(m, client, i, sf.host_path(mount), mount.guest)
                steps.append(step)
                if not step.ok:
                    raise StepFailedError(step)
            deadline = time.monotonic() + sf.timeouts.setup
            for i, cmd in enumerate(sf.setup):
                left = deadline - time.monotonic()
                budget = min(cmd.timeout, left) if cmd.timeout is not None else left
                step = await guestops.run_step(client, f"setup[{i}]", cmd.argv, env=m.environ,
                                               cwd=m.cwd_for(cmd.cwd), user=m.user_for(cmd.user), timeout=budget)
                steps.append(step)
                if not step.ok:
                    raise StepFailedError(step)

    async def _copy_mount(self, m: Machine, client: AgentClient, index: int, src: Path, dest: str, *,
                          replace: bool = False, name: str = "") -> StepResult:
        """Copy one mount in; with ``replace``, whatever is at ``dest`` (file, tree or symlink) is removed first."""
        name = name or f"mount[{index}]"
        start = time.monotonic()

        def step(ok: bool, detail: str) -> StepResult:
            return StepResult(name, ok, Evidence(duration_ms=round((time.monotonic() - start) * 1000), detail=detail))

        cap = self.config.copy_cap_bytes
        try:
            if replace:
                try:
                    res = await client.run(["rm", "-rf", "--", dest], timeout=60)
                except AgentError as e:
                    raise guestops.guest_error(e, m.id) from None
                if res.exit_code != 0:
                    detail = (res.stderr or res.stdout).decode(errors="replace").strip()[-500:]
                    return step(False, f"removing what was at {dest} before copying {src} failed: "
                                       f"{detail or res.exit_code}")
            if src.is_dir():
                archive = await asyncio.to_thread(guestops.pack_tree, src, cap)
                await guestops.unpack_in_guest(client, m.id, archive, dest)
                return step(True, f"copied directory {src} to {dest} ({len(archive)} bytes of tar)")
            data = await asyncio.to_thread(_read_capped, src, cap)
            mode = await asyncio.to_thread(guestops.host_file_mode, src)
            try:
                await client.write_file(dest, data, mode=mode & 0o777, mkdirs=True)
            except AgentError as e:
                raise guestops.guest_error(e, m.id) from None
            return step(True, f"copied file {src} to {dest} ({len(data)} bytes)")
        except (DaemonError, OSError) as e:
            return step(False, f"copying {src} to {dest}: {e}")

    # --- supervision -----------------------------------------------------------------------------------------
    async def _watch(self, m: Machine) -> None:
        """Wait for the VM process to end; unless the machine is being destroyed, that makes it FAILED."""
        assert m.proc is not None
        try:
            m.exit_status = await m.proc.wait()
        except Exception as e:  # never let supervision die silently
            log.exception("watching machine %s failed", m.id)
            m.exit_status = ExitStatus(None)
            m.failure_reason = m.failure_reason or f"lost track of the VM process: {e!r}"
        m.exited.set()
        if m.phase in (MachineState.STOPPING, MachineState.FAILED) or self._closing:
            return
        reason = self._exit_reason(m)
        log.warning("machine %s failed: %s", m.id, reason)
        self._mark_failed(m, reason)

    def _exit_reason(self, m: Machine) -> str:
        """Why the VM process ended: its exit status and what it wrote to exit.json."""
        st = m.exit_status.describe() if m.exit_status else "ended"
        text = f"VM process {m.proc.pid if m.proc else '?'} {st}"
        try:
            info: dict[str, Any] | None = read_unverified(m.state_dir / EXIT_FILE)   # the VMM's words: hostile
        except RecordAuthError:
            info = None
        if info is not None:
            bits = [str(info.get(k))[:EXIT_FIELD_CHARS] for k in ("kind", "detail") if info.get(k)]
            if info.get("error"):
                bits.append((str(info["error"]).splitlines() or [""])[0][:EXIT_FIELD_CHARS])
            if bits:
                text += ": " + ": ".join(bits)
        return text

    def _mark_failed(self, m: Machine, reason: str) -> None:
        m.phase = MachineState.FAILED
        m.failure_reason = reason
        m.failed_at = time.monotonic()
        if m.proc is not None and m.exit_status is not None:
            m.proc.kill_group(signal.SIGKILL)  # whatever the VM process left behind
        for name in ("vsock.sock", "agent.sock", READY_FILE):
            with contextlib.suppress(OSError):
                (m.state_dir / name).unlink()
        m.save(self.record_key)
        tail = self.console_tail(m, 2048).rstrip()
        if tail:
            log.warning("machine %s console tail:\n%s", m.id, tail)
        vmm_tail = self.file_tail(m.state_dir / LOG_FILE, 3072).rstrip()
        if vmm_tail:   # what the VMM logged (a restored guest's console starts empty)
            log.warning("machine %s %s tail:\n%s", m.id, LOG_FILE, vmm_tail)
        self._evict_failed()

    async def _fail(self, m: Machine, reason: str) -> None:
        """Creation failed: stop the VM process (if it still runs) and keep the machine as FAILED."""
        if m.phase in (MachineState.STOPPING, MachineState.FAILED):
            return
        m.phase = MachineState.FAILED  # before stopping it, so the watcher does not report the exit
        await self._stop_process(m)
        self._mark_failed(m, reason)

    def _evict_failed(self) -> None:
        failed = sorted((m for m in self._machines.values() if m.phase is MachineState.FAILED),
                        key=lambda m: m.failed_at)
        for m in failed[: max(0, len(failed) - self.config.keep_failed)]:
            self._destroy_task(m)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_task_error)
        return task

    # --- guest operations -------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _agent(self, m: Machine) -> AsyncIterator[AgentClient]:
        """A fresh connection to the machine's guest agent for one request (closed afterwards)."""
        if m.ready is None:
            raise GuestUnavailableError(f"machine {m.id}: the guest agent is not ready")
        try:
            client = await self._connect_agent(m.state_dir, m.ready, self.config.agent_connect_timeout_s, m.exited)
        except (AgentError, OSError, TimeoutError) as e:
            raise await self._unavailable(m, f"cannot reach the guest agent: {e}") from None
        try:
            yield client
        finally:
            await client.close()

    async def _connect_agent(self, state_dir: Path, ready: dict[str, Any], timeout: float,
                             exited: asyncio.Event | None = None) -> AgentClient:
        """Connect within ``timeout``. A refused connect is retried: a busy guest kernel answers a vsock
        REQUEST late or resets it while its agent's accept queue is full; an agent that is gone fails at the
        deadline, or at once if the VM process exited."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout
        delay = 0.05
        refusals = 0
        while True:
            left = deadline - loop.time()
            try:
                client = await asyncio.wait_for(self.launcher.connect(state_dir, ready, left), left + 1)
            except AgentConnectError as e:
                if (exited is not None and exited.is_set()) or loop.time() + delay >= deadline:
                    raise
                refusals += 1
                log.debug("machine %s: agent connect refused (%s), retrying", state_dir.name, e)
            else:
                if refusals or loop.time() - start > SLOW_AGENT_CONNECT_S:
                    log.info("machine %s: guest agent answered after %.1f s (%d refused connects)",
                             state_dir.name, loop.time() - start, refusals)
                return client
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _unavailable(self, m: Machine, what: str) -> DaemonError:
        """The error for a guest that stopped answering; names the failure if the VM process just died."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(m.exited.wait(), 1.0)
        if m.exited.is_set():
            return GuestUnavailableError(f"machine {m.id} failed: {m.failure_reason or self._exit_reason(m)}")
        return GuestUnavailableError(f"machine {m.id}: {what}")

    async def _guest_error(self, m: Machine, e: AgentError) -> DaemonError:
        from smold.agent import AgentRequestError
        if isinstance(e, AgentRequestError):
            return guestops.guest_error(e, m.id)
        return await self._unavailable(m, f"lost the guest agent: {e}")

    async def exec(
        self,
        ref: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "",
        user: str = "",
        stdin: bytes = b"",
        timeout: float | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Stream one command's output events, then its exit. Closing the iterator kills the command."""
        if not argv:
            raise InvalidRequestError("argv: at least the program to run is required")
        for what, values in (("argv", argv), ("env", [*(env or {}), *(env or {}).values()]), ("cwd", [cwd]),
                             ("user", [user])):
            if any("\0" in v for v in values):
                raise InvalidRequestError(f"{what}: must not contain NUL bytes")
        if cwd:
            guestops.validate_guest_path(cwd, what="cwd", allow_root=True)
        if timeout is not None and not 0 < timeout <= 86400:
            raise InvalidRequestError(f"timeout_seconds: must be more than 0 and at most 86400 (got {timeout})")
        m = self._running(ref)
        merged = {**m.environ, **(env or {})}
        async with self._agent(m) as client:
            if guestops.argv_size(argv) > guestops.ARGV_SPILL_BYTES:
                argv = await guestops.spill_argv(client, m.id, argv)
            stream = client.exec(list(argv), env=merged or None, cwd=m.cwd_for(cwd), user=m.user_for(user),
                                 stdin=stdin or None, timeout=timeout)
            try:
                try:
                    await stream.start()
                except AgentError as e:
                    raise await self._guest_error(m, e) from None
                while True:
                    try:
                        event = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    except AgentError as e:
                        raise await self._guest_error(m, e) from None
                    yield event
            finally:
                await stream.aclose()  # SIGKILLs the process group if the command still runs

    async def copy_in(self, ref: str, path: str, content: bytes, *, tar: bool = False, mode: int | None = None,
                      mkdirs: bool = False) -> int:
        """Write one file (or unpack a tar archive into a directory) in the guest; returns the bytes taken."""
        guestops.validate_guest_path(path, allow_root=tar)
        cap = self.config.copy_cap_bytes
        if len(content) > cap:
            raise LimitExceededError(f"content is {len(content)} bytes, more than the copy cap of {cap} bytes")
        if mode is not None and not 0 <= mode <= 0o7777:
            raise InvalidRequestError(f"mode: must be permission bits, at most 0o7777 (got {oct(mode)})")
        if tar:
            await asyncio.to_thread(guestops.check_tar, content)
        m = self._running(ref)
        async with self._agent(m) as client:
            if tar:
                await guestops.unpack_in_guest(client, m.id, content, path)
                return len(content)
            try:
                return await client.write_file(path, content, mode=0o644 if mode is None else mode, mkdirs=mkdirs)
            except AgentError as e:
                raise await self._guest_error(m, e) from None

    async def copy_out(self, ref: str, path: str, *, tar: bool = False, max_size: int = 0) -> bytes:
        """Read one file (or a directory as a tar archive) from the guest, up to min(max_size, copy cap)."""
        guestops.validate_guest_path(path, allow_root=tar)
        cap = self.config.copy_cap_bytes if max_size <= 0 else min(max_size, self.config.copy_cap_bytes)
        m = self._running(ref)
        async with self._agent(m) as client:
            if tar:
                return await guestops.pack_in_guest(client, m.id, path, cap)
            try:
                return await client.read_file(path, cap)
            except AgentError as e:
                err = await self._guest_error(m, e)
                if err.status is Status.RESOURCE_EXHAUSTED:
                    raise LimitExceededError(f"{path} in machine {m.id} is larger than {cap} bytes") from None
                raise err from None

    async def verify(self, ref: str, checks: Sequence[Check] | None = None) -> VerifyResult:
        """Run the given checks, or the machine's Smolfile verifier, against its current state."""
        m = self._running(ref)
        return await self._verify(m, checks)

    async def _verify(self, m: Machine, checks: Sequence[Check] | None = None, *, keep: bool = False) -> VerifyResult:
        """The checks (the Smolfile's unless given), with the verifier mounts copied in first and, unless ``keep``
        (a Run's machine is destroyed next anyway), removed again after."""
        sf = m.smolfile
        async with self._agent(m) as client:
            if not sf.verifier_mounts:
                return await self._run_checks(m, client, checks)
            # [verifier.mounts]: in only now, so the task never saw them; whatever the task left at their paths
            # is removed first. A copy that fails leaves the verdict undecided (verifier_error), with why.
            start = time.monotonic()

            def undecided(name: str, evidence: Evidence) -> VerifyResult:
                return _undecided(m, name, "mount", evidence, start)

            # the sources are checked again now, not only at create: a client could have swapped one for a symlink
            # out of the task directory (or out of --mount-root) since, and a restored machine was never checked
            only = replace_fields(sf, mounts=())
            try:
                await asyncio.to_thread(check_mount_sources, only)
                await asyncio.to_thread(check_mount_roots, only, self.config.mount_roots, "Smolfile.toml")
            except SmolfileError as e:
                return undecided("verifier.mounts", Evidence(detail=str(e)))
            try:
                for i, mount in enumerate(sf.verifier_mounts):
                    step = await self._copy_mount(m, client, i, sf.host_path(mount), mount.guest, replace=True,
                                                  name=f"verifier.mounts[{i}]")
                    if not step.ok:
                        return undecided(step.name, step.evidence)
                return await self._run_checks(m, client, checks)
            finally:
                # out again, so that a task that goes on after a Verify (or a snapshot of it) does not see them
                if not keep:
                    with contextlib.suppress(DaemonError, AgentError, OSError):
                        await client.run(["rm", "-rf", "--", *(vm.guest for vm in sf.verifier_mounts)], timeout=60)

    async def _run_checks(self, m: Machine, client: AgentClient, checks: Sequence[Check] | None) -> VerifyResult:
        sf = m.smolfile
        checks = sf.checks if checks is None else checks
        # A reward is what this verification's checks wrote, never a file the task planted: the reward files the
        # reward checks read are removed first. If that fails the verdict is undecided, never a planted pass.
        rewards = sorted({p for c in checks if isinstance(c, RewardCheck) for p in c.candidate_paths})
        if rewards:
            start = time.monotonic()
            detail = ""
            try:
                res = await client.run(["rm", "-f", "--", *rewards], timeout=60)
                if res.exit_code != 0:
                    detail = (res.stderr or res.stdout).decode(errors="replace").strip()[-500:] or str(res.exit_code)
            except (AgentError, OSError) as e:
                detail = str(e)
            if detail:
                return _undecided(m, "clear reward files", "reward",
                                  Evidence(duration_ms=_ms_since(start), detail=f"removing stale reward files "
                                           f"{', '.join(rewards)} failed: {detail}"), start)
        return await verify(client, checks, env=m.environ or None, timeout=sf.timeouts.verify,
                            image_digest=m.image_digest, smolfile_digest=m.smolfile_digest)

    # --- OCI images ---------------------------------------------------------------------------------------------
    async def pull_image(self, ref: str) -> Any:
        return await self.images.pull(ref)

    async def list_images(self) -> list[Any]:
        return await self.images.list_images()

    async def remove_image(self, name: str) -> list[str]:
        return await self.images.remove_image(name)

    async def prune_images(self) -> tuple[list[str], int]:
        """Garbage-collect the image cache; images of existing machines and of checkpoints are kept."""
        return await self.images.prune_images({m.image for m in self._machines.values()}
                                              | await asyncio.to_thread(self._checkpoint_images))

    def _checkpoint_images(self) -> set[str]:
        names = set()
        if self.config.checkpoints_dir.is_dir():
            for d in self.config.checkpoints_dir.iterdir():
                if (d / CHECKPOINT_META).is_file():
                    with contextlib.suppress(Exception):
                        names.add(str(_read_meta(d).get("image", "")))
        return names

    # --- network policy ---------------------------------------------------------------------------------------
    async def set_network_policy(self, ref: str, policy: NetworkPolicy) -> MachineInfo:
        """Give a running machine another network policy (NetworkManager.update: atomic, counters kept,
        connections the new policy does not allow cut). It must have a NIC: a machine created with networking
        off has none to open."""
        m = self._running(ref)
        if m.net is None:
            raise WrongPhaseError(f"machine {m.id} was created with networking off and has no NIC; create it with "
                                  'network = "closed" (or any policy) to change its policy later')
        if policy.public and not self.config.public_network:
            raise RefusedByPolicyError('network = "public": this daemon gives no machine public egress '
                                       "(smold --no-public-network); list the destinations in network.allow instead")
        try:
            await self.network.update(m.net, policy, m.record_dir)
        except NftError as e:   # the host's nft failed: the old policy is still in force
            raise DaemonError(f"machine {m.id}: the new network policy could not be applied (the old one stays): "
                              f"{e}") from None
        except NetError as e:
            raise InvalidRequestError(f"policy: {e}") from None
        await self._read_network(m)
        return self.info(m)

    # --- destroy ----------------------------------------------------------------------------------------------
    async def destroy(self, ref: str) -> None:
        """Stop the machine and remove its process, sockets and files; idempotent for destroyed ids."""
        try:
            m = self._lookup(ref)
        except MachineNotFoundError:
            if ref in self._destroyed:
                return
            raise
        await asyncio.shield(self._destroy_task(m))

    def _destroy_task(self, m: Machine) -> asyncio.Task[None]:
        """The machine's one destroy task (started if none runs; a failed one is retried)."""
        if m.destroy_task is None or m.destroy_task.done():
            m.destroy_task = self._spawn(self._destroy(m))
        return m.destroy_task

    async def _destroy(self, m: Machine) -> None:
        m.phase = MachineState.STOPPING
        if m.create_task is not None and not m.create_task.done():
            m.destroy_requested = True
            m.create_task.cancel()
        await self._stop_process(m)
        if m.proc is None or m.exited.is_set():
            await asyncio.to_thread(self.launcher.cleanup, m.id)
        if m.net is not None or m.smolfile.network.enabled:
            await self._read_network(m)
            try:
                await self.network.teardown_machine(m.id)
            except (NetError, OSError) as e:
                log.error("machine %s: tearing down its network failed: %s", m.id, e)
            m.net = None
        await asyncio.to_thread(shutil.rmtree, m.state_dir, True)
        await asyncio.to_thread(_remove_path, m.record_dir)
        leftovers = await asyncio.to_thread(self._leftovers, m)
        if leftovers:
            m.phase = MachineState.FAILED
            m.failure_reason = "destroy incomplete: " + "; ".join(leftovers)
            m.failed_at = time.monotonic()
            log.error("machine %s: %s", m.id, m.failure_reason)
            raise DestroyIncompleteError(f"machine {m.id}: {m.failure_reason}")
        if m.watcher is not None and not m.watcher.done():
            m.watcher.cancel()
        self._machines.pop(m.id, None)
        await self._release_fork_base(m.checkpoint)
        self._destroyed[m.id] = None
        while len(self._destroyed) > TOMBSTONES:
            self._destroyed.popitem(last=False)
        log.info("machine %s destroyed", m.id)

    async def _stop_process(self, m: Machine) -> None:
        """SIGTERM the VM process, SIGKILL its group after the grace period, wait for it to end."""
        proc = m.proc
        if proc is None or m.watcher is None:
            return
        if not m.exited.is_set():
            proc.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(m.exited.wait()), self.config.destroy_grace_s)
            except TimeoutError:
                log.warning("machine %s: VM process %d ignored SIGTERM for %gs, killing it", m.id, proc.pid,
                            self.config.destroy_grace_s)
                proc.kill_group(signal.SIGKILL)
                proc.signal(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(m.exited.wait()), 10)
        proc.kill_group(signal.SIGKILL)
        for _ in range(40):  # group members may take a moment to die after SIGKILL
            if not group_members(proc.pid):
                break
            await asyncio.sleep(0.05)

    def _leftovers(self, m: Machine) -> list[str]:
        """What of the machine still exists on the host (should be nothing after destroy)."""
        out = []
        if m.proc is not None:
            if not m.exited.is_set():
                out.append(f"VM process {m.proc.pid} still runs")
            members = group_members(m.proc.pid)
            if members:
                out.append(f"processes {members} of its group still run")
        if m.state_dir.exists():
            out.append(f"{m.state_dir} still exists")
        if m.record_dir.exists():
            out.append(f"{m.record_dir} still exists")
        if m.smolfile.network.enabled:
            out.extend(self.network.leftovers(m.id))
        out.extend(self.launcher.leftovers(m.id))
        return out

    # --- checkpoints and fork ---------------------------------------------------------------------------------
    async def snapshot(self, ref: str, name: str) -> CheckpointInfo:
        """Write a running machine's full state as checkpoint ``name``; the machine keeps running."""
        if not CHECKPOINT_NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"name: {name!r} is not a valid checkpoint name (lower-case letters, digits, "
                                      "'._-', starting with a letter or digit, at most 63)")
        m = self._running(ref)
        final = self.config.checkpoints_dir / name
        if name in self._checkpointing or final.exists():
            raise CheckpointExistsError(f"a checkpoint named {name!r} already exists")
        self._checkpointing.add(name)
        try:
            tmp = self.config.checkpoints_dir / f".tmp-{secrets.token_hex(6)}"
            await self._write_checkpoint(m, tmp, name)
            try:
                await asyncio.to_thread(os.rename, tmp, final)
            except OSError as e:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
                raise CheckpointFailedError(f"checkpoint {name!r}: cannot move it into place: {e}") from None
        finally:
            self._checkpointing.discard(name)
        log.info("machine %s: checkpoint %s written", m.id, name)
        return self._checkpoint_info(final)  # small files; reads the machine table

    async def _write_checkpoint(self, m: Machine, directory: Path, name: str, *, memory_digest: bool = False) -> None:
        """Have the machine's VMM snapshot itself into ``directory`` (``memory_digest``: with the memory file's
        sha256 in the state), then describe it in checkpoint.json."""
        await asyncio.to_thread(directory.parent.mkdir, 0o700, True, True)
        meta = {"name": name, "machine_id": m.id, "created_at": datetime.now(UTC).isoformat(), "image": m.image,
                "image_digest": m.image_digest, "smolfile": to_mapping(m.smolfile),
                "smolfile_digest": m.smolfile_digest, "base_dir": m.smolfile.base_dir}
        try:
            async with m.snapshot_lock:
                await self.launcher.snapshot(m.state_dir, directory.absolute(), SNAPSHOT_TIMEOUT_S,
                                           digest=memory_digest)
            await asyncio.to_thread(_write_new_file, directory / CHECKPOINT_META, json.dumps(meta, indent=1) + "\n")
        except (LaunchError, OSError) as e:
            await asyncio.to_thread(shutil.rmtree, directory, True)
            if m.exited.is_set():
                raise WrongPhaseError(f"machine {m.id} failed: {m.failure_reason or self._exit_reason(m)}") from None
            if (e.no_space if isinstance(e, LaunchError) else e.errno in (errno.ENOSPC, errno.EDQUOT)):
                raise CheckpointNoSpaceError(f"machine {m.id}: snapshot failed, the host disk is full: {e}") from None
            raise CheckpointFailedError(f"machine {m.id}: snapshot failed: {e}") from None

    def _checkpoint_info(self, directory: Path) -> CheckpointInfo:
        meta = _read_meta(directory)
        size = sum(p.lstat().st_blocks * 512 for p in directory.iterdir() if p.is_file())
        try:
            created = datetime.fromisoformat(str(meta.get("created_at")))
        except ValueError:
            created = datetime.fromtimestamp(directory.stat().st_mtime, UTC)
        if created.tzinfo is None:
            created = created.replace(tzinfo=UTC)
        return CheckpointInfo(name=directory.name, path=str(directory), size_bytes=size, created_at=created,
                              machine_id=str(meta.get("machine_id", "")),
                              machine_ids=self._restored_machines(directory))

    def _load_checkpoint(self, name: str) -> tuple[Path, Smolfile, str]:
        """The checkpoint's directory, the Smolfile and image digest of the machine it was taken of."""
        if not CHECKPOINT_NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"from_checkpoint: {name!r} is not a valid checkpoint name")
        directory = self.config.checkpoints_dir / name
        if not (directory / CHECKPOINT_META).is_file():
            raise CheckpointNotFoundError(f"no checkpoint {name!r}")
        meta = _read_meta(directory)
        try:
            smolfile = parse_mapping(meta["smolfile"], base_dir=meta.get("base_dir"))
        except (KeyError, TypeError, SmolfileError) as e:
            raise CheckpointNotFoundError(f"checkpoint {name!r} is unreadable: {e}") from None
        return directory, smolfile, str(meta.get("image_digest", ""))

    async def create_from_checkpoint(self, checkpoint: str, name: str = "") -> MachineInfo:
        """Start a machine by restoring a named checkpoint (new hostname and identity) instead of booting."""
        directory, smolfile, image_digest = await asyncio.to_thread(self._load_checkpoint, checkpoint)
        self._restoring[directory] += 1   # DeleteCheckpoint waits until the VMM has it mapped
        try:
            m = await self._create(smolfile, name, f"checkpoint {checkpoint}", [], restore=directory,
                                   image_digest=image_digest)
        finally:
            self._unpin(directory)
        return self.info(m)

    def _unpin(self, directory: Path) -> None:
        self._restoring[directory] -= 1
        if self._restoring[directory] <= 0:
            del self._restoring[directory]

    def _restore_busy(self, directory: Path) -> str:
        """Why ``directory`` cannot be deleted now ("" if it can): a create is restoring from it."""
        if self._restoring.get(directory):
            return "a machine is being created from it"
        creating = [m.id for m in self._machines.values()
                    if m.checkpoint == directory and m.phase is MachineState.CREATING]
        return f"machine {creating[0]} is being restored from it" if creating else ""

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every complete named checkpoint, sorted by name."""
        out = []
        d = self.config.checkpoints_dir
        for c in sorted(d.iterdir()) if d.is_dir() else []:
            if c.name.startswith(".") or not c.is_dir() or c.is_symlink():
                continue
            try:
                out.append(self._checkpoint_info(c))
            except (CheckpointNotFoundError, OSError) as e:  # unreadable meta: listed so it can be removed
                log.warning("checkpoint %s: %s", c.name, e)
                out.append(CheckpointInfo(name=c.name, path=str(c), size_bytes=0,
                                          created_at=datetime.fromtimestamp(0, UTC),
                                          machine_ids=self._restored_machines(c)))
        return out

    async def delete_checkpoint(self, name: str) -> None:
        """Remove a named checkpoint. Machines restored from it keep running (they map its memory file,
        whose inode outlives the directory); refused while a machine is being restored from it."""
        if not CHECKPOINT_NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"name: {name!r} is not a valid checkpoint name")
        directory = self.config.checkpoints_dir / name
        if not directory.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint {name!r}")
        busy = self._restore_busy(directory)
        if busy:
            raise WrongPhaseError(f"checkpoint {name!r} is in use: {busy}; try again once it is running")
        aside = self.config.checkpoints_dir / f".tmp-del-{secrets.token_hex(6)}"
        try:
            await asyncio.to_thread(os.rename, directory, aside)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {name!r}") from None
        await asyncio.to_thread(shutil.rmtree, aside, True)
        log.info("checkpoint %s deleted", name)

    # --- pre-baked images -------------------------------------------------------------------------------------
    async def _bake_key(self, smolfile: Smolfile, image: Any) -> tuple[str, str]:
        mounts = await asyncio.to_thread(mounts_digest, smolfile)
        return bake_key(smolfile, image.digest, mounts), mounts

    async def _find_bake(self, smolfile: Smolfile, image: Any, *, base: bool = False) -> tuple[Path | None, str]:
        """The bake to restore for this Smolfile and image, if one exists and passes its checks; and what
        to say in the boot step about it (``base``: the Smolfile is a base_smolfile)."""
        key, _ = await self._bake_key(smolfile, image)
        directory = self.bakes.path(key)
        if key in self._baking or not await asyncio.to_thread(directory.is_dir):
            return None, ""
        what = "base bake" if base else "bake"
        try:
            await asyncio.to_thread(self.bakes.verify, key, smolfile=smolfile, image=image)
        except BakeNotFoundError:  # deleted meanwhile
            return None, ""
        except BakeCorruptError as e:
            log.warning("not using %s: %s", key, e)
            return None, f"{what} {key[:19]} refused ({e}); booted instead"
        return directory, f"restored {what} {key[:19]}" + (" (then mounts and setup)" if base else "")

    async def _auto_bake(self, m: Machine, base: Smolfile, image: Any) -> None:
        """Snapshot a machine that has just booted (before its mounts and setup) as the base bake of its image,
        size and network, unless there is one: later machines restore it instead of booting. Best effort: a
        failure is logged and the machine goes on. Another daemon sharing the bake store may bake the same
        key at the same time; the first one in place is kept (``_finish_bake(replace=False)``)."""
        start = time.monotonic()
        key, mounts = await self._bake_key(base, image)
        final = self.bakes.path(key)
        if key in self._baking:
            return
        refused = False
        if await asyncio.to_thread(final.is_dir):
            try:  # remembered from the lookup that refused it: no second hash of its memory
                await asyncio.to_thread(self.bakes.verify, key, smolfile=base, image=image)
                return
            except BakeNotFoundError:
                pass
            except BakeCorruptError:  # replaced below, unless machines of this daemon were restored from it
                if self._restore_busy(final) or self._restored_machines(final):
                    return
                refused = True
        self._baking.add(key)
        try:
            # A refused base is replaced; one that another daemon put in place meanwhile is kept.
            if await self._store_bake(m, key, base, image, mounts, start, replace=refused):
                log.info("machine %s baked as base %s in %.1fs", m.id, key_short(key), time.monotonic() - start)
        except DaemonError as e:
            if m.exited.is_set():
                raise CreateFailedError(f"machine {m.id}: {e}", Status.INTERNAL) from None
            log.warning("machine %s: not baked as base %s: %s", m.id, key_short(key), e)
        except OSError as e:
            log.warning("machine %s: not baked as base %s: %s", m.id, key_short(key), e)
        finally:
            self._baking.discard(key)

    async def _store_bake(self, m: Machine, key: str, smolfile: Smolfile, image: Any, mounts: str, start: float, *,
                          replace: bool) -> bool:
        """Snapshot the machine (memory digest recorded) under a temp name, describe it and move it into place as
        bake ``key`` (``_finish_bake``); False when ``replace`` is off and the key is baked already. Nothing is
        left under the temp name either way; DaemonError from the snapshot, OSError from the move."""
        tmp = self.bakes.temp_path()
        kept = False
        try:
            await self._write_checkpoint(m, tmp, "", memory_digest=True)
            meta = BakeMeta.for_smolfile(key, smolfile, image, mounts, time.monotonic() - start)
            kept = await asyncio.to_thread(_finish_bake, tmp, self.bakes.path(key), meta, self.bakes.key,
                                           replace=replace)
        finally:
            if not kept:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
        if kept:
            self.bakes.forget(key)
        return kept

    async def bake(self, smolfile: Smolfile, filename: str = "Smolfile.toml", *, replace: bool = False) -> BakeInfo:
        """Create a machine from the Smolfile (boot, mounts, setup; never from a bake), snapshot it into the
        bake store under its key, destroy it. ALREADY_EXISTS when that key is baked (unless ``replace``)."""
        start = time.monotonic()
        await asyncio.to_thread(check_mount_sources, smolfile, filename=filename)
        self._admit(smolfile, "")
        image = await self.images.resolve(smolfile.image, smolfile.base_dir)
        key, mounts = await self._bake_key(smolfile, image)
        final = self.bakes.path(key)
        if key in self._baking:
            raise BakeExistsError(f"bake {key} is being baked")
        if not replace and await asyncio.to_thread(final.is_dir):
            raise BakeExistsError(f"bake {key} already exists (replace it, or delete it first)")
        self._baking.add(key)
        try:
            try:
                m = await self._create(smolfile, "", filename, [], use_bake=False)
            except StepFailedError as e:
                if e.machine is not None:
                    await self._destroy_quietly(e.machine)
                raise CreateFailedError(f"baking {key}: {e}", Status.ABORTED) from None
            except CreateFailedError as e:
                gone = self._machines.get(e.machine_id)
                if gone is not None:
                    await self._destroy_quietly(gone)
                raise
            try:
                await self._store_bake(m, key, smolfile, image, mounts, start, replace=True)
            except OSError as e:
                raise CheckpointFailedError(f"bake {key}: cannot move it into place: {e}") from None
            finally:
                await self._destroy_quietly(m)
        finally:
            self._baking.discard(key)
        log.info("baked %s in %.1fs (%s, %d MiB)", key, time.monotonic() - start, image.name, smolfile.memory_mib)
        return self._bake_info(key)

    def _bake_info(self, key: str) -> BakeInfo:
        directory = self.bakes.path(key)
        machines = self._restored_machines(directory)
        try:
            meta = BakeMeta.load(directory, self.bakes.key)
        except BakeCorruptError as e:
            return BakeInfo(key=key, path=str(directory), image="", image_digest="", cpus=0, memory_mib=0,
                            size_bytes=self.bakes.size_bytes(key), created_at=datetime.fromtimestamp(0, UTC),
                            error=str(e), machine_ids=machines)
        error = ""
        try:  # the cheap checks; the memory file's hash is only reported once a create computed it
            self.bakes.verify(key, hash_memory=False)
        except BakeCorruptError as e:
            error = str(e)
        except OSError as e:
            error = f"bake {key_short(key)}: {e}"
        return BakeInfo(key=key, path=str(directory), image=meta.image, image_digest=meta.image_digest,
                        cpus=meta.cpus, memory_mib=meta.memory_mib, size_bytes=self.bakes.size_bytes(key),
                        created_at=meta.created, bake_seconds=float(meta.bake_seconds),
                        smolfile_digest=str(meta.smolfile_digest), error=error, machine_ids=machines)

    async def list_bakes(self) -> list[BakeInfo]:
        """Every bake in the store, sorted by key; ``error`` set for one that fails its checks."""
        keys = await asyncio.to_thread(self.bakes.keys)
        return [self._bake_info(k) for k in keys]  # a state file read each: milliseconds

    async def delete_bake(self, ref: str) -> str:
        """Remove a bake (by key or unique prefix); machines restored from it keep running. Returns its key."""
        key = await asyncio.to_thread(self.bakes.resolve, ref)
        if key in self._baking:
            raise BakeBusyError(f"bake {key} is being baked")
        busy = self._restore_busy(self.bakes.path(key))
        if busy:
            raise BakeBusyError(f"bake {key} is in use: {busy}; try again once it is running")
        await asyncio.to_thread(self.bakes.remove, key)
        log.info("bake %s deleted", key)
        return key

    async def fork(self, ref: str, count: int) -> list[MachineInfo]:
        """``count`` copy-on-write children of a running machine, each restored from one private snapshot of
        it with its own identity; the parent keeps running. All children are created, or none."""
        if not 1 <= count <= MAX_FORK:
            raise InvalidRequestError(f"count: must be 1 to {MAX_FORK} (got {count})")
        parent = self._running(ref)
        if self._closing:
            raise ShuttingDownError("the daemon is shutting down")
        live = sum(1 for m in self._machines.values() if m.phase in LIVE)
        if live + count > self.config.max_machines:
            raise LimitExceededError(f"machine limit reached: {count} children requested, {live} of "
                                     f"{self.config.max_machines} machines are running or being created")
        want = count * parent.memory_mib
        if self.memory_in_use_mib + want > self.config.max_memory_mib:
            raise LimitExceededError(f"memory limit reached: {want} MiB requested, {self.memory_in_use_mib} of "
                                     f"{self.config.max_memory_mib} MiB in use")
        base = self.config.forks_dir / f"{parent.id}-{secrets.token_hex(4)}"
        self._pinned.add(base)
        try:
            await self._write_checkpoint(parent, base, "")
            # the children get the network policy in force (SetNetworkPolicy may have changed the created one)
            sf = parent.smolfile if parent.net is None else replace_fields(parent.smolfile, network=parent.net.policy)
            results = await asyncio.gather(
                *(self._create(sf, "", f"fork of {parent.id}", [], restore=base,
                               image_digest=parent.image_digest) for _ in range(count)),
                return_exceptions=True)
            children = [r for r in results if isinstance(r, Machine)]
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                doomed = children + [self._machines[e.machine_id] for e in errors
                                     if isinstance(e, CreateFailedError) and e.machine_id in self._machines]
                await asyncio.gather(*(self._destroy_quietly(c) for c in doomed))
                raise errors[0]
        finally:
            self._pinned.discard(base)
            await self._release_fork_base(base)
        log.info("machine %s forked into %s", parent.id, ", ".join(c.id for c in children))
        return [self.info(c) for c in children]

    async def _release_fork_base(self, base: Path | None) -> None:
        """Remove a private fork base once no machine in the table was restored from it."""
        if base is None or base.parent != self.config.forks_dir or base in self._pinned:
            return
        if any(m.checkpoint == base for m in self._machines.values()):
            return
        await asyncio.to_thread(shutil.rmtree, base, True)
        log.info("fork base %s removed (its last machine was destroyed)", base.name)

    # --- run ----------------------------------------------------------------------------------------------------
    async def run(self, smolfile: Smolfile, name: str = "", filename: str = "Smolfile.toml", *,
                  run_result: str = "") -> RunResult:
        """Create, copy mounts, set up, run the task, verify, destroy (always); only the result comes back.
        ``run_result``: the stored result this Run ends in (its machine is then never re-adopted)."""
        return replace_fields(await self._run(smolfile, name, filename, run_result=run_result), smolfile=smolfile)

    async def _run(self, smolfile: Smolfile, name: str, filename: str, *, run_result: str) -> RunResult:
        start = time.monotonic()
        steps: list[StepResult] = []
        sdigest = digest(smolfile)
        m: Machine | None = None
        try:
            try:
                m = await self._create(smolfile, name, filename, steps, run_result=run_result)
            except CreateFailedError as e:  # could not boot: an error, not a result; nothing is kept
                gone = self._machines.get(e.machine_id)
                if gone is not None:
                    await self._destroy_quietly(gone)
                raise
            except StepFailedError as e:
                failed = e.machine
                if failed is not None:
                    await self._destroy_quietly(failed)
                empty = VerifyResult(False, (), failed.image_digest if failed else "", sdigest, 0)
                return RunResult(empty, tuple(steps), failed.id if failed else "", error=str(e),
                                 duration_ms=_ms_since(start), image_digest=empty.image_digest)
            sf = smolfile
            if sf.task is not None:
                cmd = sf.task
                budget = min(cmd.timeout, sf.timeouts.task) if cmd.timeout is not None else sf.timeouts.task
                try:
                    async with self._agent(m) as client:
                        steps.append(await guestops.run_step(client, "task", cmd.argv, env=m.environ,
                                                             cwd=m.cwd_for(cmd.cwd), user=m.user_for(cmd.user),
                                                             timeout=budget))
                except GuestUnavailableError as e:
                    steps.append(StepResult("task", False, Evidence(detail=str(e))))
            if sf.sealed:
                network = await self._read_network(m)
                return await self._sealed_run(m, filename, steps, start, network, run_result)
            try:
                result = await self._verify(m, keep=True)
            except GuestUnavailableError as e:
                result = VerifyResult(False, (), m.image_digest, sdigest, 0)
                return RunResult(result, tuple(steps), m.id, error=f"verify: {e}", duration_ms=_ms_since(start),
                                 network=await self._read_network(m), error_outcome=Outcome.VERIFIER_ERROR,
                                 image_digest=m.image_digest)
            logs = await self._verifier_logs(m)
            return RunResult(result, tuple(steps), m.id, duration_ms=_ms_since(start),
                             network=await self._read_network(m), image_digest=m.image_digest,
                             artifacts=(logs,) if logs is not None else ())
        finally:
            if m is not None and m.id in self._machines:
                await self._destroy_quietly(m)

    async def _sealed_run(self, m: Machine, filename: str, steps: list[StepResult], start: float,
                          network: NetworkReport | None, run_result: str) -> RunResult:
        """Sealed verification (docs/verifier.md, "Sealed verification"): only the declared outputs leave the task's
        machine, which is then destroyed with every process the task started; the checks run in a pristine machine
        of the same Smolfile (its bake: a restore) that receives them, with its own tools and agent."""
        sf = m.smolfile
        t0 = time.monotonic()
        packed: Repacked | None = None
        why = ""
        killed = ""
        try:  # everything from the task's guest is hostile: its archive is re-packed on the host
            async with self._agent(m) as client:  # first nothing of the task's may run (its own connection: a
                killed = await guestops.kill_task_processes(client, m.id)  # hook on it dies with the task)
            async with self._agent(m) as client:
                raw = await guestops.pack_outputs(client, m.id, sf.verifier_outputs, self.config.copy_cap_bytes)
            packed = await asyncio.to_thread(repack, raw, sf.verifier_outputs, cap=self.config.copy_cap_bytes)
        except (OutputsError, DaemonError) as e:
            why = str(e)
        await self._destroy_quietly(m)
        if packed is None:
            why = "; ".join(x for x in (killed, why) if x)
            steps.append(StepResult("outputs", False, Evidence(duration_ms=_ms_since(t0), detail=why)))
            result = _undecided(m, "outputs", "outputs", Evidence(detail=f"the task's outputs could not be taken: "
                                                                  f"{why}"), t0)
            return RunResult(result, tuple(steps), m.id, duration_ms=_ms_since(start), network=network, sealed=True,
                             image_digest=m.image_digest)
        missing = [o for o in sf.verifier_outputs if o not in packed.present]
        detail = packed.describe() + (f"; not present: {', '.join(missing)}" if missing else "") + f"; {killed}"
        artifacts: tuple[Artifact, ...] = (Artifact(OUTPUTS_ARTIFACT, len(packed.archive), content=packed.archive),)
        steps.append(StepResult("outputs", True, Evidence(duration_ms=_ms_since(t0), detail=detail)))
        vsteps: list[StepResult] = []
        v: Machine | None = None
        try:
            try:
                v = await self._create(sf.verifier_smolfile(), "", filename, vsteps, run_result=run_result)
            except (DaemonError, StepFailedError) as e:  # a limit reached meanwhile too: the task did run
                failed = (self._machines.get(e.machine_id) if isinstance(e, CreateFailedError)
                          else e.machine if isinstance(e, StepFailedError) else None)
                if failed is not None:
                    await self._destroy_quietly(failed)
                steps.extend(replace_fields(s, name=f"verifier.{s.name}") for s in vsteps)
                result = VerifyResult(False, (), m.image_digest, m.smolfile_digest, 0)
                return RunResult(result, tuple(steps), m.id, error=f"the verifier machine: {e}",
                                 duration_ms=_ms_since(start), network=network, sealed=True, image_digest=m.image_digest,
                                 artifacts=artifacts,
                                 verifier_machine_id=failed.id if failed is not None else "")
            steps.extend(replace_fields(s, name=f"verifier.{s.name}") for s in vsteps)
            try:
                async with self._agent(v) as client:
                    await guestops.place_outputs(client, v.id, sf.verifier_outputs, packed.archive)
                result = await self._verify(v, keep=True)
            except DaemonError as e:
                result = _undecided(m, "outputs", "outputs", Evidence(detail=f"placing the task's outputs in the "
                                                                      f"verifier machine failed: {e}"), t0)
            else:
                logs = await self._verifier_logs(v)
                artifacts += (logs,) if logs is not None else ()
            return RunResult(result, tuple(steps), m.id, duration_ms=_ms_since(start), network=network, sealed=True,
                             verifier_machine_id=v.id, image_digest=m.image_digest, artifacts=artifacts)
        finally:
            if v is not None:
                await self._destroy_quietly(v)

    async def _verifier_logs(self, m: Machine) -> Artifact | None:
        """The verifier's log directory of the machine the checks ran in, re-packed as hostile data (in an unsealed
        Run the agent had that guest): evidence kept with the result, never part of the verdict. None when the
        directory does not exist or artifacts are off; an Artifact with a note when it could not be taken."""
        cap = min(self.config.artifact_cap_bytes, self.config.copy_cap_bytes)
        path = self.config.verifier_logs_path
        if cap == 0:
            return None
        try:
            async with self._agent(m) as client:
                raw = await guestops.pack_outputs(client, m.id, (path,), cap, what=path, timeout=VERIFIER_LOGS_TIMEOUT_S)
            packed = await asyncio.to_thread(repack, raw, (path,), cap=cap)
        except (OutputsError, DaemonError) as e:
            log.warning("%s: the verifier logs were not kept: %s", m.id, e)
            return Artifact(VERIFIER_LOGS_ARTIFACT, 0, note=f"not kept: {e}")
        if path not in packed.present:
            return None
        return Artifact(VERIFIER_LOGS_ARTIFACT, len(packed.archive), note=packed.describe(), content=packed.archive)

    async def _destroy_quietly(self, m: Machine) -> None:
        """Destroy, even if the caller is being cancelled; a failure is logged (the machine stays FAILED)."""
        try:
            await asyncio.shield(self._destroy_task(m))
        except DaemonError as e:
            log.error("%s", e)

    # --- shutdown -----------------------------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        """The daemon is shutting down: no new machines."""
        return self._closing

    def stop_admitting(self) -> None:
        """Refuse new machines from now on (the daemon is shutting down)."""
        self._closing = True

    async def shutdown(self, leave: bool) -> None:
        """Destroy every machine, or (leave) keep running ones for the next daemon to re-adopt."""
        self._closing = True
        # Destroys already under way (e.g. of Runs cancelled by the server's stop) finish first.
        busy = [m.destroy_task for m in self._machines.values() if m.destroy_task and not m.destroy_task.done()]
        await asyncio.gather(*busy, return_exceptions=True)
        victims = [m for m in self._machines.values() if not leave or m.phase is not MachineState.RUNNING]
        results = await asyncio.gather(*(self._destroy_quietly(m) for m in victims), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("destroy during shutdown failed: %r", r)
        for m in list(self._machines.values()):
            if m.watcher is not None:
                m.watcher.cancel()
            m.save(self.record_key)
            if leave and m.phase is MachineState.RUNNING:
                log.info("leaving machine %s running (VM process %s)", m.id, m.proc.pid if m.proc else "?")
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def key_short(key: str) -> str:
    return key.removeprefix("sha256:")[:12]


def _finish_bake(tmp: Path, final: Path, meta: BakeMeta, key: RecordKey, *, replace: bool = True) -> bool:
    """Describe a written bake (bake.json, authenticated with the store's key), make it durable and move it into
    place, replacing an older one of the same key; without ``replace`` an existing one is kept and False returned
    (the caller removes ``tmp``)."""
    meta.write(tmp, key)
    for p in tmp.iterdir():
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    old = None
    if final.exists():
        if not replace:
            return False
        old = final.with_name(f"{TEMP_PREFIX}{os.getpid()}-old-{secrets.token_hex(6)}")
        os.rename(final, old)
    try:
        os.rename(tmp, final)  # a directory onto a non-empty one fails: another daemon's bake came first
    except OSError as e:
        if replace or e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return True


def _hostname(m: Machine) -> str:
    base = m.name or m.id
    return re.sub(r"[^a-z0-9-]", "-", base.lower()).strip("-")[:63] or m.id


def _remove_path(path: Path) -> None:
    """Remove a directory tree, or whatever else is at ``path``; nothing if nothing is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _write_new_file(path: Path, text: str) -> None:
    """``text`` as a new file at ``path`` (a fresh inode put in place with rename): never through a file that
    was there, which a VMM could hold open."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _read_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / CHECKPOINT_META).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointNotFoundError(f"checkpoint {directory.name!r} is unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointNotFoundError(f"checkpoint {directory.name!r} is unreadable: not a JSON object")
    return meta


def _read_capped(path: Path, cap: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise LimitExceededError(f"{path}: larger than the copy cap of {cap} bytes")
    return data


def _undecided(m: Machine, name: str, kind: str, evidence: Evidence, start: float) -> VerifyResult:
    """A verdict the verifier could not reach (verifier_error): one undecided check saying why."""
    check = CheckResult(name, kind, False, evidence, error=True)
    return VerifyResult(False, (check,), m.image_digest, m.smolfile_digest, _ms_since(start))


def _ms_since(start: float) -> int:
    return max(0, round((time.monotonic() - start) * 1000))


def _log_task_error(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), DaemonError):
        log.error("background task failed: %r", task.exception())


def check_mount_roots(smolfile: Smolfile, roots: tuple[Path, ...], filename: str) -> None:
    """With ``--mount-root``: every mount source (symlinks resolved) lies inside one of ``roots``, so a
    client cannot have the daemon read host files outside them by naming another base_dir."""
    if not roots or not smolfile.all_mounts:
        return
    allowed = [r.resolve() for r in roots]
    for prefix, mount in smolfile.all_mounts:
        real = smolfile.host_path(mount).resolve()
        if not any(real == r or r in real.parents for r in allowed):
            raise SmolfileError.at(filename, [*prefix, mount.host],
                                   f"host path {real} is outside the daemon's mount roots "
                                   f"({', '.join(map(str, allowed))})")
