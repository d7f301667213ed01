"""The durable result store: every Run and Verify result, with its evidence, in SQLite under STATE_DIR/results.

One database, ``STATE_DIR/results/results.db``, in WAL mode with ``synchronous=FULL``: a row committed before a
reply survives a kill -9 of the daemon and a power loss. SQLite is the standard library's (no hand-written file
format to get wrong, and a reader needs nothing but ``sqlite3``); every call runs on one worker thread, off the
event loop, which owns the only connection.

A Run's row is written ``running`` before its machine exists and ``done`` (with its outcome and the whole
RunResponse as evidence) before its reply. Rows still ``running`` when a daemon opens the store are from a
daemon that stopped during the Run: they become ``interrupted`` (docs/verifier.md, "Results").

A Run's artifacts (its sealed outputs, its verifier logs) are files under ``STATE_DIR/results/artifacts/<id>/``,
written and fsynced before the row that lists them (with their SHA-256) is committed.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from smold.api.machine import Artifact, ResultState, StoredResult
from smold.verifier import Outcome

from .errors import DaemonError, DaemonSetupError, InvalidRequestError, Status

log = logging.getLogger("smold.results")
T = TypeVar("T")

DB_FILE = "results.db"
ARTIFACTS_DIR = "artifacts"
ARTIFACT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{0,63}")
SCHEMA_VERSION = 1
RESULT_ID_RE = re.compile(r"r-[0-9a-f]{16}")
KINDS = ("run", "verify")
MAX_LIST = 10_000
DEFAULT_LIST = 100
MAX_LABELS = 32
MAX_LABEL_VALUE = 256
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}")
INTERRUPTED_DETAIL = "the daemon stopped during the run (crash, kill or shutdown); its machine was removed"

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    outcome TEXT NOT NULL DEFAULT '',
    outcome_detail TEXT NOT NULL DEFAULT '',
    labels TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    finished_at REAL,
    machine_id TEXT NOT NULL DEFAULT '',
    payload BLOB
);
CREATE INDEX IF NOT EXISTS results_state ON results(state);
CREATE TABLE IF NOT EXISTS labels (
    seq INTEGER NOT NULL REFERENCES results(seq) ON DELETE CASCADE,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (seq, key)
);
CREATE INDEX IF NOT EXISTS labels_kv ON labels(key, value);
"""
_COLUMNS = "id, kind, state, outcome, outcome_detail, labels, created_at, finished_at, machine_id, payload"


class ResultNotFoundError(DaemonError):
    """No stored result has that id."""

    status = Status.NOT_FOUND


class ResultStoreError(DaemonError):
    """The result store could not be read or written (disk full, I/O error, closed)."""

    status = Status.INTERNAL

    def __init__(self, message: str, status: Status = Status.INTERNAL) -> None:
        super().__init__(message)
        self.status = status


def validate_labels(labels: Mapping[str, str], what: str = "labels") -> dict[str, str]:
    """The labels, or InvalidRequestError naming the first bad one."""
    if len(labels) > MAX_LABELS:
        raise InvalidRequestError(f"{what}: {len(labels)} labels, at most {MAX_LABELS} are allowed")
    out = {}
    for key, value in labels.items():
        if not LABEL_KEY_RE.fullmatch(key):
            raise InvalidRequestError(
                f"{what}: key {key[:80]!r} is not valid (1-63 of letters, digits, '_.-/', starting with a letter "
                "or digit)")
        if len(value.encode()) > MAX_LABEL_VALUE:
            raise InvalidRequestError(f"{what}: the value of {key!r} is {len(value.encode())} bytes, at most "
                                      f"{MAX_LABEL_VALUE} are allowed")
        if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
            raise InvalidRequestError(f"{what}: the value of {key!r} contains control characters")
        out[key] = value
    return out


def check_result_id(rid: str) -> str:
    if not RESULT_ID_RE.fullmatch(rid):
        raise InvalidRequestError(f"id: {rid[:80]!r} is not a result id (r- and 16 hex digits, as Run, Verify and "
                                  "ListResults report them)")
    return rid


def new_result_id() -> str:
    return f"r-{secrets.token_hex(8)}"


class ResultStore:
    """open() once per daemon, close() at its end; the async methods run on the store's one thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._db: sqlite3.Connection | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smold-results")

    @property
    def path(self) -> Path:
        return self.root / DB_FILE

    # --- open, recover, close (the daemon's start and stop) ----------------------------------------------------
    async def open(self) -> int:
        """Open (creating) the database and mark rows left ``running`` interrupted; returns how many were.
        DaemonSetupError when the store cannot be used."""
        try:
            return await self._run(self._open)
        except (sqlite3.Error, OSError) as e:
            await self.close()
            raise DaemonSetupError(f"cannot open the result store {self.path}: {e} (check the state directory's "
                                   "permissions and free space; a corrupt database can be moved aside, losing the "
                                   "results stored in it)") from None

    def _open(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
        try:
            db.execute("PRAGMA journal_mode=WAL").fetchone()
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(SCHEMA)  # idempotent (IF NOT EXISTS)
            with _txn(db):
                row = db.execute("SELECT version FROM schema_version").fetchone()
                if row is None:
                    db.execute("INSERT INTO schema_version(version) VALUES (?)", (SCHEMA_VERSION,))
                elif row[0] != SCHEMA_VERSION:
                    raise sqlite3.DatabaseError(f"schema version {row[0]}; this daemon reads version {SCHEMA_VERSION}")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            with _txn(db):
                cur = db.execute(
                    "UPDATE results SET state=?, outcome=?, outcome_detail=?, finished_at=? WHERE state=?",
                    (ResultState.INTERRUPTED.value, Outcome.INTERRUPTED.value, INTERRUPTED_DETAIL, time.time(),
                     ResultState.RUNNING.value))
        except BaseException:
            db.close()
            raise
        self._db = db
        self._sweep_artifacts(db)
        if cur.rowcount:
            log.warning("%d result(s) were still running when the last daemon stopped: now interrupted",
                        cur.rowcount)
        return int(cur.rowcount)

    def _sweep_artifacts(self, db: sqlite3.Connection) -> None:
        """Remove artifact directories whose row is gone (a prune that stopped between its commit and its
        removals): a directory is only ever created for a row that exists."""
        root = self.root / ARTIFACTS_DIR
        if not root.is_dir():
            return
        for d in root.iterdir():
            if RESULT_ID_RE.fullmatch(d.name) and db.execute("SELECT 1 FROM results WHERE id=?",
                                                             (d.name,)).fetchone() is None:
                shutil.rmtree(d, ignore_errors=True)
                log.info("removed the artifacts of result %s, which is no longer in the store", d.name)

    async def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                await self._run(self._close)
        self._pool.shutdown(wait=True)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # --- plumbing -----------------------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._run(fn, *args)
        except sqlite3.Error as e:
            raise ResultStoreError(f"result store {self.path}: {e}") from None
        except OSError as e:
            raise ResultStoreError(f"result store {self.path}: {e}", Status.RESOURCE_EXHAUSTED
                                   if e.errno in (28, 122) else Status.INTERNAL) from None
        except RuntimeError as e:  # the worker pool is shut down: the daemon is stopping
            raise ResultStoreError(f"the result store is closed ({e})", Status.UNAVAILABLE) from None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ResultStoreError("the result store is closed (the daemon is stopping)", Status.UNAVAILABLE)
        return self._db

    # --- writes -------------------------------------------------------------------------------------------------
    async def begin(self, kind: str, labels: Mapping[str, str] | None = None) -> str:
        """Insert a ``running`` row (committed when this returns); its id."""
        rid = new_result_id()
        await self._guarded(self._insert, rid, kind, ResultState.RUNNING, None, "", dict(labels or {}), "", b"")
        return rid

    async def add(self, kind: str, *, outcome: Outcome, outcome_detail: str, payload: bytes, machine_id: str = "",
                  labels: Mapping[str, str] | None = None, result_id: str = "") -> str:
        """Insert a finished row in one step (Verify); its id (``result_id``, or a new one)."""
        rid = result_id or new_result_id()
        await self._guarded(self._insert, rid, kind, ResultState.DONE, outcome, outcome_detail, dict(labels or {}),
                            machine_id, payload)
        return rid

    def _insert(self, rid: str, kind: str, state: ResultState, outcome: Outcome | None, detail: str,
                labels: dict[str, str], machine_id: str, payload: bytes) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}")
        db = self._conn()
        now = time.time()
        with _txn(db):
            cur = db.execute(
                f"INSERT INTO results({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (rid, kind, state.value, outcome.value if outcome else "", detail, json.dumps(labels, sort_keys=True),
                 now, None if state is ResultState.RUNNING else now, machine_id, payload))
            db.executemany("INSERT INTO labels(seq, key, value) VALUES (?,?,?)",
                           [(cur.lastrowid, k, v) for k, v in labels.items()])

    async def finish(self, rid: str, *, state: ResultState, outcome: Outcome, outcome_detail: str,
                     payload: bytes = b"", machine_id: str = "") -> None:
        """Write a running row's end (committed when this returns)."""
        await self._guarded(self._finish, rid, state, outcome, outcome_detail, payload, machine_id)

    def _finish(self, rid: str, state: ResultState, outcome: Outcome, detail: str, payload: bytes,
                machine_id: str) -> None:
        db = self._conn()
        with _txn(db):
            cur = db.execute("UPDATE results SET state=?, outcome=?, outcome_detail=?, finished_at=?, machine_id=?, "
                             "payload=? WHERE id=?",
                             (state.value, outcome.value, detail, time.time(), machine_id, payload, rid))
        if cur.rowcount != 1:
            raise ResultNotFoundError(f"result {rid}: not in the store")

    async def discard(self, rid: str) -> None:
        """Remove a row: a Run refused before it started (bad request, limits) is an error, not a result."""
        await self._guarded(self._discard, rid)

    def _discard(self, rid: str) -> None:
        db = self._conn()
        with _txn(db):
            db.execute("DELETE FROM results WHERE id=?", (rid,))

    # --- artifacts ----------------------------------------------------------------------------------------------
    async def keep_artifacts(self, rid: str, artifacts: tuple[Artifact, ...], cap: int) -> tuple[Artifact, ...]:
        """Write each artifact of at most ``cap`` bytes to disk (fsynced); the artifacts as the result lists them,
        without their content: kept with their SHA-256, or not kept with a note saying why. Never raises: an
        artifact is evidence, and failing to keep one must not lose the result."""
        out = []
        for a in artifacts:
            if not ARTIFACT_NAME_RE.fullmatch(a.name):
                raise ValueError(f"artifact name {a.name!r}")
            if a.size_bytes > cap or len(a.content) > cap:
                out.append(Artifact(a.name, a.size_bytes, note=a.note or f"not kept: larger than the artifact cap "
                                                                         f"of {cap} bytes (--max-artifact-bytes)"))
                continue
            if not a.content and a.note:  # nothing to keep: the controller said why
                out.append(Artifact(a.name, a.size_bytes, note=a.note))
                continue
            try:
                digest = await asyncio.to_thread(self._write_artifact, rid, a.name, a.content)
            except OSError as e:
                log.error("result %s: keeping artifact %s failed: %s", rid, a.name, e)
                out.append(Artifact(a.name, len(a.content), note=f"not kept: writing it failed: {e}"))
                continue
            out.append(Artifact(a.name, len(a.content), sha256=digest, kept=True, note=a.note))
        return tuple(out)

    def artifact_path(self, rid: str, name: str) -> Path:
        check_result_id(rid)
        if not ARTIFACT_NAME_RE.fullmatch(name):
            raise InvalidRequestError(f"name: {name[:80]!r} is not an artifact name (as the result lists them, "
                                      "e.g. outputs.tar)")
        return self.root / ARTIFACTS_DIR / rid / name

    def _write_artifact(self, rid: str, name: str, content: bytes) -> str:
        path = self.artifact_path(rid, name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return hashlib.sha256(content).hexdigest()

    async def read_artifact(self, rid: str, name: str, sha256: str, cap: int) -> bytes:
        """A kept artifact's content, checked against the SHA-256 its result lists."""
        path = self.artifact_path(rid, name)

        def read() -> bytes:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                return f.read(cap + 1)
        try:
            data = await asyncio.to_thread(read)
        except FileNotFoundError:
            raise ResultNotFoundError(f"result {rid}: its artifact {name} is gone from {path.parent}") from None
        except OSError as e:
            raise ResultStoreError(f"result {rid}: reading its artifact {name}: {e}") from None
        if len(data) > cap or hashlib.sha256(data).hexdigest() != sha256:
            raise ResultStoreError(f"result {rid}: its artifact {name} in {path.parent} does not match the SHA-256 "
                                   "its result lists (changed on disk since it was kept)", Status.DATA_LOSS)
        return data

    # --- pruning ------------------------------------------------------------------------------------------------
    async def prune(self, *, older_than: float, labels: Mapping[str, str] | None = None,
                    keep: Collection[str] = ()) -> tuple[int, int]:
        """Remove finished results (done or interrupted) that ended more than ``older_than`` seconds ago and carry
        every label given, with their artifacts; never a running one nor one in ``keep``. (removed, freed
        artifact bytes)."""
        if not math.isfinite(older_than) or older_than < 0:
            raise InvalidRequestError(f"older_than_seconds: {older_than} must be a finite number of seconds >= 0")
        wanted = validate_labels(dict(labels or {}))
        ids = await self._guarded(self._prune_rows, time.time() - older_than, wanted, frozenset(keep))
        freed = 0
        for rid in ids:  # after the commit: a crash in between leaves directories the next open() removes
            freed += await asyncio.to_thread(_remove_tree, self.root / ARTIFACTS_DIR / rid)
        if ids:
            log.info("pruned %d result(s), freeing %d bytes of artifacts", len(ids), freed)
        return len(ids), freed

    def _prune_rows(self, before: float, labels: dict[str, str], keep: frozenset[str]) -> builtins.list[str]:
        db = self._conn()
        where = ["state != ?", "finished_at IS NOT NULL", "finished_at < ?"]
        args: builtins.list[Any] = [ResultState.RUNNING.value, before]
        for k, v in labels.items():
            where.append("seq IN (SELECT seq FROM labels WHERE key=? AND value=?)")
            args += [k, v]
        with _txn(db):
            rows = db.execute(f"SELECT seq, id FROM results WHERE {' AND '.join(where)}", args).fetchall()
            rows = [(seq, rid) for seq, rid in rows if rid not in keep]
            db.executemany("DELETE FROM labels WHERE seq=?", [(seq,) for seq, _ in rows])
            db.executemany("DELETE FROM results WHERE seq=?", [(seq,) for seq, _ in rows])
        return [rid for _, rid in rows]

    # --- reads --------------------------------------------------------------------------------------------------
    async def get(self, rid: str) -> StoredResult:
        check_result_id(rid)
        rec = await self._guarded(self._get, rid)
        if rec is None:
            raise ResultNotFoundError(f"result {rid}: not in this daemon's result store (ListResults lists what it "
                                      "holds)")
        return rec

    def _get(self, rid: str) -> StoredResult | None:
        row = self._conn().execute(f"SELECT {_COLUMNS} FROM results WHERE id=?", (rid,)).fetchone()
        return _record(row) if row is not None else None

    async def list(self, *, labels: Mapping[str, str] | None = None, kind: str = "",
                   limit: int = 0) -> builtins.list[StoredResult]:
        """Newest first; only rows carrying every label given; limit 0: DEFAULT_LIST, at most MAX_LIST. Without
        payloads (10000 evidence bodies would not fit one reply; get() has them)."""
        if kind and kind not in KINDS:
            raise InvalidRequestError(f"kind: {kind[:40]!r} is not one of '', 'run', 'verify'")
        if limit < 0 or limit > MAX_LIST:
            raise InvalidRequestError(f"limit: {limit} is out of range (0..{MAX_LIST}; 0 means {DEFAULT_LIST})")
        wanted = validate_labels(dict(labels or {}))
        return await self._guarded(self._list, wanted, kind, limit or DEFAULT_LIST)

    def _list(self, labels: dict[str, str], kind: str, limit: int) -> builtins.list[StoredResult]:
        where: builtins.list[str] = []
        args: builtins.list[Any] = []
        if kind:
            where.append("kind=?")
            args.append(kind)
        for k, v in labels.items():
            where.append("seq IN (SELECT seq FROM labels WHERE key=? AND value=?)")
            args += [k, v]
        sql = f"SELECT {_COLUMNS.replace('payload', 'NULL')} FROM results"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        return [_record(r) for r in self._conn().execute(sql, (*args, limit))]


def _remove_tree(path: Path) -> int:
    """Remove a directory of plain files; the bytes it held."""
    size = 0
    if path.is_dir():
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                size += f.lstat().st_size
        shutil.rmtree(path, ignore_errors=True)
    return size


@contextlib.contextmanager
def _txn(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _record(row: tuple[Any, ...]) -> StoredResult:
    rid, kind, state, outcome, detail, labels, created, finished, machine_id, payload = row
    return StoredResult(
        id=rid, kind=kind, state=ResultState(state), outcome=Outcome(outcome) if outcome else None,
        outcome_detail=detail, labels=tuple(sorted(json.loads(labels).items())), created_at=created,
        finished_at=finished, machine_id=machine_id, payload=bytes(payload or b""))
