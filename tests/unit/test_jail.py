"""The VMM jail (smold/jail/jailer.py) around a stand-in program: what the jailed process sees, who it runs
as, its limits and cgroup, and an OOM kill that is reported while a neighbouring jail keeps running.

No KVM: the jailer does not care what it execs. Needs root (namespaces, mounts, cgroups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smold.daemon.errors import LaunchError
from smold.daemon.images import Image
from smold.daemon.launcher import JailOptions, LaunchSpec, VmmLauncher
from smold.jail.cgroup import Cgroup, CgroupError, Limits
from smold.jail.jailer import JailError, JailSpec, minimal, python_paths

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the jail needs root")

UID = GID = 64123
MiB = 1 << 20

PROBE = r"""
import json, os, resource, socket, sys, time
import smold.agent, smold.vmm.machine   # what the VMM imports must be inside the jail (editable installs too)
secret = sys.argv[1]
info = {
    "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "groups": os.getgroups(), "pid": os.getpid(),
    "hostname": os.uname().nodename, "root": sorted(os.listdir("/")), "dev": sorted(os.listdir("/dev")),
    "secret_visible": os.path.exists(secret), "etc": sorted(os.listdir("/etc")),
    "nnp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0],
    "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "core": resource.getrlimit(resource.RLIMIT_CORE)[1],
    "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "state_writable": os.access(os.getcwd(), os.W_OK), "cwd": os.getcwd(),
    "links": sorted(name for _, name in socket.if_nameindex()),
}
try:
    open("/usr/smol-jail-test", "w")
    info["usr_writable"] = True
except OSError:
    info["usr_writable"] = False
with open("probe.json", "w") as f:
    json.dump(info, f)
time.sleep(float(sys.argv[2]))
"""

HOG = r"""
import sys, time
if sys.argv[1] == "hog":
    chunks = []
    for _ in range(64):
        chunks.append(bytearray(16 << 20))   # touched: zero-filled pages are charged to the cgroup
else:
    time.sleep(float(sys.argv[2]))
    open("done", "w").write("ok")
"""


def jail_argv(name: str, state: Path, base: Path, memory: int | None, *cmd: str) -> list[str]:
    argv = [sys.executable, "-m", "smold.jail", "--name", name, "--uid", str(UID), "--gid", str(GID),
            "--state-dir", str(state), "--jail-base", str(base), "--cgroup-parent", "smol-test"]
    if memory:
        argv += ["--memory-bytes", str(memory), "--cpus", "0.5"]
    return [*argv, "--", *cmd]


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)


def child_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise AssertionError("the jailer started no child")


def wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"jailed process ended ({proc.returncode}): {proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    time.sleep(0.1)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return tmp_path / "jails"


def test_jailed_process_sees_only_its_jail(tmp_path: Path, base: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    secret = tmp_path / "host-secret"
    secret.write_text("not for the VMM")
    proc = start(jail_argv("probe", state, base, 128 * MiB, sys.executable, "-c", PROBE, str(secret), "3"))
    try:
        wait_file(state / "probe.json", proc)
        vmm = child_of(proc.pid)
        info = json.loads((state / "probe.json").read_text())
        # The host's view of the jailed process: its root is the jail, its cgroup is limited.
        assert sorted(os.listdir(f"/proc/{vmm}/root")) == info["root"] != sorted(os.listdir("/"))
        assert not os.path.exists(f"/proc/{vmm}/root{secret}")
        assert os.stat(f"/proc/{vmm}").st_uid == UID
        assert os.readlink(f"/proc/{vmm}/ns/net") != os.readlink("/proc/self/ns/net")   # its own, empty netns
        cg = Cgroup("probe", "smol-test")
        assert cg.memory_limit() == 128 * MiB
        assert vmm in cg.procs() and proc.pid not in cg.procs()   # the jailer stays outside
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    assert (info["uid"], info["gid"], info["euid"], info["groups"]) == (UID, GID, UID, [])
    assert info["pid"] == 1 and info["procs"] == [1]       # its own PID namespace: nothing else visible
    assert info["hostname"] == "smol-vmm"
    assert info["links"] == ["lo"]                          # no host interface: networking is off
    assert not info["secret_visible"] and not info["usr_writable"] and info["state_writable"]
    # The system directories, plus the top of each path the interpreter and smold need (where the checkout
    # and its venv live: /work here, elsewhere on a CI machine), and nothing more.
    code_tops = {p.parts[1] for p in minimal(python_paths()) if len(p.parts) > 1}
    assert set(info["root"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "sys",
                                 "tmp", "usr"} | code_tops
    assert set(info["dev"]) <= {"kvm", "net", "null", "urandom"}
    assert set(info["etc"]) <= {"ld.so.cache", "localtime"}   # no passwd, no shadow, no host config
    assert (info["nnp"], info["nofile"], info["core"]) == ("1", 4096, 0)
    assert info["cwd"] == str(state)
    assert not Cgroup("probe", "smol-test").dirs["" if Cgroup("probe", "smol-test").v2 else "memory"].exists()
    assert not (base / "probe").exists()


def test_oom_kill_is_reported_and_the_neighbour_keeps_running(tmp_path: Path, base: Path) -> None:
    hog_state, calm_state = tmp_path / "hog", tmp_path / "calm"
    hog_state.mkdir()
    calm_state.mkdir()
    calm = start(jail_argv("calm", calm_state, base, 128 * MiB, sys.executable, "-c", HOG, "calm", "4"))
    hog = start(jail_argv("hog", hog_state, base, 96 * MiB, sys.executable, "-c", HOG, "hog", "0"))
    assert hog.wait(60) == 137, hog.stderr.read() if hog.stderr else ""
    info = json.loads((hog_state / "exit.json").read_text())
    assert info["detail"] == "out of memory" and "cgroup memory limit of 96 MiB" in info["error"]
    assert calm.poll() is None                      # the other jail is still running
    assert calm.wait(60) == 0
    assert (calm_state / "done").read_text() == "ok"
    assert not (calm_state / "exit.json").exists()


def test_jail_refuses_root_and_relative_paths(tmp_path: Path) -> None:
    with pytest.raises(JailError, match="must not be 0"):
        JailSpec("x", 0, 1, tmp_path, tmp_path).validate()
    with pytest.raises(JailError, match="absolute"):
        JailSpec("x", 5, 5, Path("rel"), tmp_path).validate()
    with pytest.raises(JailError, match="bad jail name"):
        JailSpec("../x", 5, 5, tmp_path, tmp_path).validate()
    with pytest.raises(CgroupError):
        Cgroup("a/b")
    assert minimal([Path("/usr/lib"), Path("/usr"), Path("/opt/x"), Path("/usr")]) == [Path("/usr"), Path("/opt/x")]


def test_launcher_wraps_the_vmm_in_the_jail(tmp_path: Path) -> None:
    spec = LaunchSpec("m-7", tmp_path, Image("default", Path("/k"), Path("/i"), Path("/r")), 2, 512, "web", 60,
                      restore_from=Path("/snap"))
    launcher = VmmLauncher("/py", jail=JailOptions(uid=7000, gid=7001, memory_overhead_mib=100))
    argv = launcher.command(spec)
    sep = argv.index("--")
    assert argv[:4] == ["/py", "-P", "-m", "smold.jail"] and argv[sep + 1:] == launcher.vmm_command(spec)
    from smold.jail.__main__ import parser
    args = parser().parse_args(argv[4:])
    assert (args.name, args.uid, args.gid, args.memory_bytes, args.cpus) == ("m-7", 7000, 7001, 612 * MiB, 2.0)
    assert set(args.ro) == {Path("/k"), Path("/i"), Path("/r"), Path("/snap")} and args.state_dir == tmp_path
    assert VmmLauncher("/py").command(spec)[:4] == ["/py", "-P", "-m", "smold.vmm"]


async def test_jailed_snapshot_is_written_in_the_state_dir_and_moved_into_place(tmp_path: Path) -> None:
    """A jailed VMM sees only its state dir: the launcher asks for the snapshot there, then moves it."""
    import asyncio

    state, target = tmp_path / "state", tmp_path / "checkpoints" / ".tmp-1"
    state.mkdir()
    target.parent.mkdir()
    asked: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = json.loads(await reader.readline())
        asked.append(req["dir"])
        Path(req["dir"]).mkdir()
        (Path(req["dir"]) / "snapshot.state").write_text("s")
        os.chown(req["dir"], *vmm)
        os.chown(Path(req["dir"]) / "snapshot.state", *vmm)
        writer.write(json.dumps({"ok": True, "snapshot": {"directory": req["dir"]}}).encode() + b"\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, str(state / "control.sock"))
    launcher = VmmLauncher("/py", jail=JailOptions())
    vmm = launcher.assign_vmm_ids(state)
    os.chown(state / "control.sock", *vmm)   # made by the jailed VMM's uid
    try:
        info = await launcher.snapshot(state, target)
    finally:
        server.close()
    assert asked == [str(state / "snapshot.out")]
    assert (target / "snapshot.state").read_text() == "s" and not (state / "snapshot.out").exists()
    assert info["directory"] == str(target)
    assert {(p.stat().st_uid, p.stat().st_gid) for p in (target, target / "snapshot.state")} == {(0, 0)}  # out of reach


def test_a_running_cgroups_memory_limit_can_be_lowered_and_raised() -> None:
    cg = Cgroup(f"setlim-{os.getpid()}", "smol-test")
    cg.create(Limits(memory_bytes=256 * MiB, cpus=1))
    try:
        cg.set_memory_limit(128 * MiB)     # below the memory+swap limit (v1): memory first
        assert cg.memory_limit() == 128 * MiB
        cg.set_memory_limit(512 * MiB)     # above it: memory+swap first, or the kernel refuses
        assert cg.memory_limit() == 512 * MiB
        if not cg.v2 and (cg.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
            assert int((cg.dirs["memory"] / "memory.memsw.limit_in_bytes").read_text()) == 512 * MiB
        assert cg.memory_usage() == 0      # no process in it
        with pytest.raises(CgroupError, match="bad memory limit"):
            cg.set_memory_limit(0)
    finally:
        cg.remove()
    assert not cg.dirs["" if cg.v2 else "memory"].exists()


def test_launcher_cleanup_removes_what_a_killed_jailer_left(tmp_path: Path) -> None:
    """A jailer killed by SIGKILL leaves its (empty) cgroup and jail mount point; the daemon's destroy calls
    VmmLauncher.cleanup, and leftovers() reports what could not go."""
    launcher = VmmLauncher(jail=JailOptions(base=tmp_path / "jails", cgroup_parent="smol-test"))
    mid = f"m-{os.getpid():012x}"
    cg = Cgroup(mid, "smol-test")
    cg.create(Limits(memory_bytes=64 * MiB, cpus=1))
    (tmp_path / "jails" / mid).mkdir(parents=True)
    try:
        assert sorted(launcher.leftovers(mid)) == sorted(
            [f"{d} still exists" for d in cg.dirs.values()] + [f"{tmp_path / 'jails' / mid} still exists"])
        (tmp_path / "jails" / mid / "busy").mkdir()        # not empty: cannot go, and is reported
        launcher.cleanup(mid)
        assert launcher.leftovers(mid) == [f"{tmp_path / 'jails' / mid} still exists"]
        assert not any(d.exists() for d in cg.dirs.values())
        (tmp_path / "jails" / mid / "busy").rmdir()
        launcher.cleanup(mid)
        assert launcher.leftovers(mid) == []
        launcher.cleanup(mid)                               # nothing left to remove: no error
    finally:
        cg.remove(0)
    assert VmmLauncher().leftovers(mid) == []             # without a jail there is nothing to clean


def test_cgroup_procs_leave_out_kernel_threads() -> None:
    # KVM attaches each VM's worker kthread to the VMM's cgroup on v2 hosts (the KVM rig showed it): not a process
    # of the machine's, so procs() must not count it.
    from smold.jail.cgroup import _kernel_thread
    assert _kernel_thread(2)               # kthreadd
    assert not _kernel_thread(os.getpid())
    assert not _kernel_thread(1 << 30)     # no such process


def test_a_module_planted_in_the_state_dir_is_never_imported(tmp_path: Path) -> None:
    """Issue #19 (8): VM processes start in their state dir, which the VMM can write; with ``python -m`` that
    directory came first on sys.path, so a planted ``smold`` package ran as root in the jailer. The launcher's
    command lines use -P: the planted package is not imported (without -P, as before, it is)."""
    import subprocess
    import sys

    from smold.daemon.launcher import SAFE_PATH

    state = tmp_path / "state"
    (state / "smold" / "jail").mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    (state / "smold" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (state / "smold" / "jail" / "__init__.py").write_text("")
    (state / "smold" / "jail" / "__main__.py").write_text("")
    spec = LaunchSpec("m-8", state, Image("default", Path("/k"), Path("/i"), Path("/r")), 1, 256, "h", 60)
    argv = VmmLauncher(sys.executable, jail=JailOptions(uid=7000, gid=7001)).command(spec)
    prefix = argv[:argv.index("smold.jail") + 1]
    assert prefix == [sys.executable, *SAFE_PATH, "-m", "smold.jail"]
    r = subprocess.run([*prefix, "--help"], cwd=state, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage" in r.stdout and not marker.exists(), r.stderr
    subprocess.run([sys.executable, "-m", "smold.jail", "--help"], cwd=state, capture_output=True, timeout=60)
    assert marker.exists()   # what the test guards against: the old command line imports the planted package


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo", "subdir", "meta", "outlink", "roots"])
async def test_a_jailed_snapshot_holding_anything_but_plain_files_is_refused(tmp_path: Path, plant: str) -> None:
    """A jailed VMM writes its snapshot in its own state dir and the daemon (root) moves it into place: a link
    planted there would later be followed by root (a restore outside the jail, a copy of the checkpoint)."""
    import asyncio

    state, target = tmp_path / "state", tmp_path / "checkpoints" / ".tmp-1"
    state.mkdir()
    target.parent.mkdir()
    secret = tmp_path / "shadow"
    secret.write_text("root:secret\n")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        d = Path(json.loads(await reader.readline())["dir"])
        if plant == "outlink":            # snapshot.out itself a link to a directory of the host's
            d.symlink_to(tmp_path)
        else:
            d.mkdir()
            (d / "snapshot.state").write_text("s")
            os.chown(d, *vmm)
            os.chown(d / "snapshot.state", *vmm)
        if plant == "symlink":
            (d / "memory.raw").symlink_to(secret)
        elif plant == "hardlink":
            os.link(secret, d / "memory.raw")
        elif plant == "fifo":
            os.mkfifo(d / "memory.raw")
        elif plant == "subdir":
            (d / "memory.raw").mkdir()
        elif plant == "meta":             # a name the daemon writes itself, to be kept open and rewritten
            (d / "checkpoint.json").write_text("{}")
        elif plant == "roots":            # a file the VMM did not write
            (d / "memory.raw").write_text("m")
        writer.write(json.dumps({"ok": True, "snapshot": {"directory": str(d)}}).encode() + b"\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, str(state / "control.sock"))
    launcher = VmmLauncher("/py", jail=JailOptions())
    vmm = launcher.assign_vmm_ids(state)
    os.chown(state / "control.sock", *vmm)
    mode = secret.stat().st_mode
    try:
        with pytest.raises(LaunchError, match="snapshot is refused: (memory.raw is not a plain file|memory.raw is "
                           "not the VM process's own|checkpoint.json is not a file a snapshot holds|snapshot.out "
                           "is not a directory)"):
            await launcher.snapshot(state, target)
    finally:
        server.close()
    assert not target.exists() and secret.read_text() == "root:secret\n" and secret.stat().st_mode == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "shadow", "state"]   # nothing staged left
