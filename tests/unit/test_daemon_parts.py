"""smold's small parts: guest path rules, sd_notify, image options, records, exit status, smolctl helpers."""

from __future__ import annotations

import shutil
import signal
import socket
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from smolctl.client import rpc_error_message
from smolctl.commands.cp import remote
from smold.api import convert
from smold.api.machine import MachineInfo, MachineState, RunResult, StepResult
from smold.api.v1 import smol_pb2 as pb
from smold.authrecord import RecordKey
from smold.daemon.config import DaemonConfig
from smold.daemon.errors import InvalidRequestError
from smold.daemon.guestops import check_tar, pack_tree, validate_guest_path
from smold.daemon.images import ImageStore, parse_image_option
from smold.daemon.launcher import LaunchSpec, VmmLauncher, load_launcher
from smold.daemon.notify import sd_notify
from smold.daemon.process import ExitStatus, is_same_process, read_cmdline, start_time
from smold.daemon.record import MachineRecord, RecordError
from smold.verifier import CheckResult, Evidence, VerifyResult


@pytest.mark.parametrize("path", ["/a", "/a/b.txt", "/work/dir with space/x"])
def test_valid_guest_paths(path: str) -> None:
    assert validate_guest_path(path) == path


@pytest.mark.parametrize(("path", "reason"), [
    ("", "required"), ("rel", "absolute"), ("/a\0b", "NUL"), ("/a/../b", "normalized"), ("/a/./b", "normalized"),
    ("//a", "normalized"), ("/a//b", "normalized"), ("/a/", "normalized"), ("/", "must not be '/'"),
    ("/" + "x" * 5000, "longer than 4096"),
])
def test_invalid_guest_paths(path: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError, match=reason):
        validate_guest_path(path, what="path")


def test_root_is_allowed_where_asked() -> None:
    assert validate_guest_path("/", allow_root=True) == "/"


def test_pack_tree_caps_size_and_round_trips(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 5000)
    (tmp_path / "d" / "link").symlink_to("/etc/passwd")  # kept as a link, never followed on the host
    archive = pack_tree(tmp_path / "d", 1 << 20)
    assert check_tar(archive) == 3  # ".", "f", "link"
    with pytest.raises(Exception, match="copy cap of 4096 bytes"):
        pack_tree(tmp_path / "d", 4096)
    with pytest.raises(InvalidRequestError, match="not a readable tar"):
        check_tar(b"\x01" * 1024)


def test_sd_notify_sends_datagrams_and_is_silent_without_a_manager(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        assert sd_notify("READY=1", "STATUS=x", env={"NOTIFY_SOCKET": str(path)})
        assert s.recv(100) == b"READY=1\nSTATUS=x"
    assert not sd_notify("READY=1", env={})
    assert not sd_notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not sd_notify("READY=1", env={"NOTIFY_SOCKET": "relative"})


def test_abstract_notify_socket() -> None:
    name = f"smold-test-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert sd_notify("READY=1", env={"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"READY=1"


def test_image_option_and_store(tmp_path: Path) -> None:
    name, paths = parse_image_option(f"py312={tmp_path}/k:{tmp_path}/i:{tmp_path}/r")
    assert name == "py312" and paths == (tmp_path / "k", tmp_path / "i", tmp_path / "r")
    for bad in ("x", "x=a:b", "=a:b:c", "x=a::c"):
        with pytest.raises(ValueError, match="NAME=KERNEL:INITRAMFS:ROOTFS"):
            parse_image_option(bad)
    for p in paths:
        p.write_bytes(p.name.encode())
    store = ImageStore.with_files({"py312": paths})
    assert store.names == ["default", "py312"]


async def test_image_digest_depends_on_content(tmp_path: Path) -> None:
    files = tuple(tmp_path / n for n in ("k", "i", "r"))
    for f in files:
        f.write_bytes(b"1")
    store = ImageStore({"x": lambda: files})  # type: ignore[dict-item]
    first = await store.resolve("x")
    assert first.digest.startswith("sha256:") and first.digest == (await store.resolve("x")).digest
    files[2].write_bytes(b"22")
    assert (await store.resolve("x")).digest != first.digest
    from smold.daemon.errors import ImageNotFoundError
    with pytest.raises(ImageNotFoundError, match="unknown image 'y' \\(this daemon has: x\\)"):
        await store.resolve("y")
    files[0].unlink()
    with pytest.raises(ImageNotFoundError, match="cannot read its kernel"):
        await store.resolve("x")


def test_vmm_command_line_is_the_vmm_cli(tmp_path: Path) -> None:
    from smold.daemon.images import Image
    spec = LaunchSpec("m-1", tmp_path, Image("default", Path("/k"), Path("/i"), Path("/r")), 2, 768, "web", 120)
    argv = VmmLauncher("/py").command(spec)
    assert argv[:4] == ["/py", "-P", "-m", "smold.vmm"]
    opts = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert opts == {"--kernel": "/k", "--initramfs": "/i", "--rootfs": "/r", "--cpus": "2", "--memory": "768",
                    "--state-dir": str(tmp_path), "--console-log": str(tmp_path / "console.log"),
                    "--boot-timeout": "120", "--hostname": "web", "--seccomp": "on"}
    from smold.vmm.__main__ import _parser
    parsed = _parser().parse_args(argv[4:])  # the VMM accepts exactly this command line
    assert (parsed.cpus, parsed.memory, parsed.state_dir, parsed.seccomp) == (2, 768, tmp_path, "on")
    assert VmmLauncher("/py", seccomp="log").command(spec)[-2:] == ["--seccomp", "log"]


def test_load_launcher() -> None:
    assert isinstance(load_launcher("vmm"), VmmLauncher)
    for bad, msg in (("nope", "module:attribute"), ("os:path", "did not give a Launcher"),
                     ("no_such_module_x:y", "No module named")):
        with pytest.raises(ValueError, match=msg):
            load_launcher(bad)


def test_record_round_trip_and_rejects(tmp_path: Path) -> None:
    key = RecordKey.generate()
    d = tmp_path / "m-1"
    d.mkdir()
    rec = MachineRecord(id="m-1", name="n", phase="running", created_at=datetime.now(UTC).isoformat(), cpus=1,
                        memory_mib=128, image="default", image_digest="sha256:i", smolfile={"cpus": 1},
                        smolfile_digest="sha256:s", base_dir=None, launcher="vmm", pid=5, argv=["a", "b"], started=7)
    rec.save(d, key)
    assert MachineRecord.load(d, key) == rec
    with pytest.raises(RecordError, match="does not verify"):
        MachineRecord.load(d, RecordKey.generate())              # another daemon's key
    other = tmp_path / "m-2"
    other.mkdir()
    shutil.copy(d / "machine.json", other / "machine.json")
    with pytest.raises(RecordError, match="does not verify"):
        MachineRecord.load(other, key)                            # moved to another machine's directory
    (d / "machine.json").write_text('{"version": 99}')
    with pytest.raises(RecordError, match="no MAC"):
        MachineRecord.load(d, key)
    (d / "machine.json").write_text("{")
    with pytest.raises(RecordError):
        MachineRecord.load(d, key)


def test_an_older_daemons_record_in_the_machine_dir_moves_to_the_records_dir(tmp_path: Path) -> None:
    """Records used to sit in the machine's own (VMM-writable) directory: a daemon that finds one there takes it,
    only if it verifies, into STATE_DIR/records/<id>/ (0700) with its net.json, and reads only there after."""
    from smold.daemon.controller import Controller
    from smold.daemon.record import record_dir

    config = DaemonConfig(socket_path=tmp_path / "s", state_dir=tmp_path / "state")
    ctl = Controller(config, VmmLauncher())
    d = config.machines_dir / "m-0123456789ab"
    d.mkdir(parents=True)
    config.records_dir.mkdir()
    rec = MachineRecord(id=d.name, name="n", phase="running", created_at=datetime.now(UTC).isoformat(), cpus=1,
                        memory_mib=128, image="default", image_digest="sha256:i", smolfile={"cpus": 1},
                        smolfile_digest="sha256:s", base_dir=None, launcher="vmm", pid=5, argv=["a"], started=7)
    rec.save(d, ctl.record_key)
    ctl.record_key.write(d / "net.json", {"policy": {"allow": []}}, f"net.json {d.name}")
    assert ctl._load_record(d) == rec
    rd = record_dir(d)
    assert rd == config.records_dir / d.name and (rd.stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in rd.iterdir()) == ["machine.json", "net.json"]
    assert not (d / "machine.json").exists() and not (d / "net.json").exists()
    (d / "machine.json").write_text('{"forged": true}')                 # planted later: never read
    assert ctl._load_record(d) == rec
    other = config.machines_dir / "m-ba9876543210"                      # an old record that does not verify
    other.mkdir()
    (other / "machine.json").write_text('{"version": 1}')
    with pytest.raises(RecordError, match="no MAC"):
        ctl._load_record(other)
    assert not record_dir(other).exists()


def test_exit_status_and_proc_helpers() -> None:
    assert ExitStatus(0).describe() == "exited with status 0"
    assert ExitStatus(-signal.SIGKILL).describe() == "killed by SIGKILL"
    assert ExitStatus(None).describe().startswith("exited (status unknown")
    import os
    me = os.getpid()
    argv = read_cmdline(me)
    assert argv and is_same_process(me, argv, start_time(me))
    assert not is_same_process(me, [*argv, "x"], None) and not is_same_process(me, argv, -1)
    assert read_cmdline(2**22 + 12345) is None


def test_config_validation(tmp_path: Path) -> None:
    DaemonConfig(socket_path=tmp_path / "s", state_dir=tmp_path).validate()
    for kw, msg in (({"max_machines": 0}, "--max-machines"), ({"max_memory_mib": 64}, "--max-memory"),
                    ({"on_shutdown": "explode"}, "--on-shutdown"), ({"socket_mode": 0o10000}, "--socket-mode"),
                    ({"socket_path": Path("rel")}, "absolute"), ({"socket_path": tmp_path / ("x" * 120)}, "longer"),
                    ({"bakes_path": Path("rel")}, "--bakes-dir")):
        with pytest.raises(ValueError, match=msg):
            DaemonConfig(**{"socket_path": tmp_path / "s", "state_dir": tmp_path, **kw}).validate()  # type: ignore[arg-type]


def test_bake_store_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smold.daemon.__main__ import config_from_args, parser
    plain = config_from_args(parser().parse_args(["--state-dir", str(tmp_path)]))
    assert plain.auto_bake and plain.bakes_dir == tmp_path / "bakes"
    monkeypatch.chdir(tmp_path)
    shared = config_from_args(parser().parse_args(["--state-dir", str(tmp_path), "--bakes-dir", "shared",
                                                   "--no-auto-bake"]))
    assert not shared.auto_bake and shared.bakes_dir == tmp_path / "shared"
    shared.validate()
    assert plain.public_network
    assert not config_from_args(parser().parse_args(["--state-dir", str(tmp_path), "--no-public-network"])).public_network


def test_run_result_and_machine_conversions() -> None:
    ev = Evidence(exit_code=0, output_tail="ok", duration_ms=5, detail="exit 0")
    result = VerifyResult(True, (CheckResult("c", "command", True, ev),), "sha256:i", "sha256:s", 9)
    run = RunResult(result, (StepResult("boot", True, Evidence(duration_ms=3)), StepResult("task", False, ev)),
                    "m-1", error="", duration_ms=42)
    msg = pb.RunResponse.FromString(convert.run_result_to_proto(run).SerializeToString())
    assert convert.run_result_from_proto(msg) == run
    info = MachineInfo("m-1", "n", MachineState.RUNNING, 1, 256, "default", datetime(2025, 1, 1, tzinfo=UTC),
                       vmm_pid=1234)
    assert convert.machine_from_proto(convert.machine_to_proto(info)) == info


@pytest.mark.parametrize(("spec", "expected"), [
    ("m-0123456789ab:/tmp/x", ("m-0123456789ab", "/tmp/x")), ("web:/", ("web", "/")),
    ("a.b_c-d:/x:y", ("a.b_c-d", "/x:y")), ("./web:/x", None), ("web:rel", None), ("/abs/path", None),
    ("file.txt", None), (":/x", None),
])
def test_cp_remote_syntax(spec: str, expected: tuple[str, str] | None) -> None:
    assert remote(spec) == expected


def test_rpc_error_messages_are_one_line() -> None:
    class Err(grpc.RpcError, grpc.Call):  # type: ignore[misc]
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

        def initial_metadata(self): ...  # type: ignore[no-untyped-def]
        def trailing_metadata(self): ...  # type: ignore[no-untyped-def]
        def is_active(self): ...  # type: ignore[no-untyped-def]
        def time_remaining(self): ...  # type: ignore[no-untyped-def]
        def cancel(self): ...  # type: ignore[no-untyped-def]
        def add_callback(self, cb): ...  # type: ignore[no-untyped-def]

    assert rpc_error_message(Err(grpc.StatusCode.NOT_FOUND, "no machine 'x'\nmore"), "/s") == "no machine 'x'"
    msg = rpc_error_message(Err(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: "
                                                              "UNKNOWN: unix:/s: No such file or directory"), "/s")
    assert msg.startswith("cannot reach smold at /s: failed to connect") and "SMOL_SOCKET" in msg
    assert rpc_error_message(Err(grpc.StatusCode.INTERNAL, ""), "/s") == "INTERNAL"


def test_an_unauthenticated_record_gets_only_its_own_machines_process_killed(tmp_path: Path) -> None:
    """A record without this daemon's MAC (forged, or an older daemon's) names the VM process to kill only if
    that process is alive with exactly that argv and start time and its argv names the machine's directory."""
    import json
    import subprocess
    import sys

    from smold.daemon.controller import Controller
    from smold.daemon.process import start_time

    d = tmp_path / "m-1"
    d.mkdir()
    mine = [sys.executable, "-c", "import time; time.sleep(60)", f"{d}/vsock.sock"]
    other = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(argv) for argv in (mine, other)]
    try:
        for p, argv, expect in ((procs[0], mine, True), (procs[1], other, False)):
            (d / "machine.json").write_text(json.dumps({"pid": p.pid, "argv": argv, "started": start_time(p.pid)}))
            assert (Controller._unverified_vmm_pid(d) == p.pid) is expect
        (d / "machine.json").write_text(json.dumps({"pid": procs[0].pid, "argv": mine, "started": 1}))
        assert Controller._unverified_vmm_pid(d) is None             # not the process that was started then
    finally:
        for p in procs:
            p.kill()
            p.wait()
