"""smold as a process: restart and re-adoption, SIGTERM (destroy or leave), sd_notify, socket mode, exclusivity."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import DaemonProcess, files_under, pid_alive, processes_mentioning, wait_until

pytestmark = pytest.mark.timeout(120)

SMOLFILE = "memory = 256\ncpus = 1\n"


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smp-", dir="/tmp"))
    (d / "task").mkdir()
    (d / "task" / "Smolfile.toml").write_text(SMOLFILE)
    yield d
    for pid in processes_mentioning(str(d / "state")):  # never leave agents behind, whatever failed
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout.decode()


def machine_pid(d: DaemonProcess, mid: str) -> int:
    return int(json.loads((d.state / "records" / mid / "machine.json").read_text())["pid"])


def test_restart_readopts_running_machines_and_cleans_up_the_rest(workdir: Path) -> None:
    d1 = DaemonProcess(workdir).start()
    try:
        keep = ok(d1.smolctl("create", str(workdir / "task"), "--name", "keep")).strip()
        lost = ok(d1.smolctl("create", str(workdir / "task"), "--name", "lost")).strip()
        keep_pid, lost_pid = machine_pid(d1, keep), machine_pid(d1, lost)
        ok(d1.smolctl("exec", "keep", "--", "sh", "-c", f"echo before > {workdir}/note"))
    finally:
        d1.proc.kill()  # type: ignore[union-attr]  # a crash: no shutdown code runs
        d1.proc.wait()  # type: ignore[union-attr]
    assert pid_alive(keep_pid) and pid_alive(lost_pid)  # VM processes outlive the daemon
    os.kill(lost_pid, signal.SIGKILL)  # ... and one dies while no daemon watches
    assert wait_until(lambda: not pid_alive(lost_pid))

    d2 = DaemonProcess(workdir).start()
    try:
        table = ok(d2.smolctl("ls"))
        assert keep in table and "running" in table and lost not in table, table
        assert not (d2.state / "machines" / lost).exists()
        r = d2.smolctl("exec", "keep", "--", "cat", f"{workdir}/note")
        assert (r.returncode, r.stdout) == (0, b"before\n"), r.stderr
        info = json.loads(ok(d2.smolctl("ls", "--json")))
        assert [(m["id"], m["vmm_pid"]) for m in info] == [(keep, keep_pid)]
        # The re-adopted machine is supervised too: a kill -9 now marks it failed.
        os.kill(keep_pid, signal.SIGKILL)
        assert wait_until(lambda: "failed" in ok(d2.smolctl("ls")), timeout=10)
        assert "exited (status unknown" in ok(d2.smolctl("ls"))
        ok(d2.smolctl("rm", keep))
        assert files_under(d2.state / "machines") == []
        assert "re-adopted machine" in d2.log_text() and f"cleaning up machine {lost}" in d2.log_text()
    finally:
        assert d2.terminate() == 0


def test_a_machine_record_the_vm_process_could_have_forged_is_not_adopted(workdir: Path) -> None:
    """#19 finding 6: machine.json sat in the state dir a jailed VMM owns. Before, a restarted daemon adopted
    whatever record it found there (a forged Smolfile: other allowed names, other mounts). Now the daemon keeps
    it in its own records directory, where the VMM cannot write (one planted in the machine's directory is
    never read), and a record without this daemon's MAC is not adopted: the machine is cleaned up."""
    d1 = DaemonProcess(workdir).start()
    try:
        mid = ok(d1.smolctl("create", str(workdir / "task"), "--name", "forged")).strip()
        pid = machine_pid(d1, mid)
    finally:
        d1.kill()
    record = d1.state / "records" / mid / "machine.json"
    assert not (d1.state / "machines" / mid / "machine.json").exists()
    data = json.loads(record.read_text())
    data["smolfile"]["env"] = {"FORGED": "1"}
    record.write_text(json.dumps(data))
    d2 = DaemonProcess(workdir).start()
    try:
        assert mid not in ok(d2.smolctl("ls"))
        assert wait_until(lambda: not pid_alive(pid))
        assert not (d2.state / "machines" / mid).exists() and not (d2.state / "records" / mid).exists()
        assert f"removing {d2.state / 'machines' / mid}" in d2.log_text() and "MAC does not verify" in d2.log_text()
    finally:
        assert d2.terminate() == 0


def test_readopted_machine_is_destroyed_cleanly(workdir: Path) -> None:
    d1 = DaemonProcess(workdir).start()
    mid = ok(d1.smolctl("create", str(workdir / "task"))).strip()
    pid = machine_pid(d1, mid)
    d1.kill()
    d2 = DaemonProcess(workdir).start()
    try:
        ok(d2.smolctl("rm", mid))
        assert not pid_alive(pid) and not (d2.state / "machines" / mid).exists()
        assert processes_mentioning(str(d2.state / "machines")) == []
    finally:
        d2.terminate()


def test_sigterm_destroys_every_machine_and_removes_the_socket(workdir: Path) -> None:
    d = DaemonProcess(workdir).start()
    mids = [ok(d.smolctl("create", str(workdir / "task"))).strip() for _ in range(2)]
    pids = [machine_pid(d, m) for m in mids]
    assert d.terminate() == 0
    assert not any(pid_alive(p) for p in pids)
    assert files_under(d.state / "machines") == [] and not d.socket.exists()
    assert "shutting down (destroy machines)" in d.log_text()


def test_sigterm_with_leave_keeps_machines_for_the_next_daemon(workdir: Path) -> None:
    d1 = DaemonProcess(workdir, "--on-shutdown", "leave").start()
    mid = ok(d1.smolctl("create", str(workdir / "task"))).strip()
    pid = machine_pid(d1, mid)
    assert d1.terminate() == 0
    assert pid_alive(pid) and (d1.state / "records" / mid / "machine.json").exists()
    # A daemon that adopts it but then cannot serve (its socket path is a regular file) leaves it alone.
    blocked = DaemonProcess(workdir)
    blocker = workdir / "not-a-socket"
    blocker.write_text("")
    blocked.socket = blocker
    blocked.argv[blocked.argv.index("--socket") + 1] = str(blocker)
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        blocked.start(timeout=15)
    assert pid_alive(pid)
    d2 = DaemonProcess(workdir).start()
    try:
        r = d2.smolctl("exec", mid, "--", "echo", "adopted")
        assert (r.returncode, r.stdout) == (0, b"adopted\n"), r.stderr
    finally:
        assert d2.terminate() == 0
    assert not pid_alive(pid)


def test_sd_notify_ready_socket_mode_and_group(workdir: Path) -> None:
    notify = workdir / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(str(notify))
        srv.settimeout(20)
        group = next((g for g in ("daemon", "nogroup", "users") if _has_group(g)), None)
        extra = ["--group", group] if group else []
        d = DaemonProcess(workdir, *extra, env={"NOTIFY_SOCKET": str(notify)})
        d.start()
        try:
            msg = srv.recv(4096).decode()
            assert "READY=1" in msg.splitlines() and f"MAINPID={d.pid}" in msg
            st = os.stat(d.socket)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
            if group:
                assert st.st_gid == grp.getgrnam(group).gr_gid
            # The VM processes do not inherit the notification socket.
            mid = ok(d.smolctl("create", str(workdir / "task"))).strip()
            environ = Path(f"/proc/{machine_pid(d, mid)}/environ").read_bytes()
            assert b"NOTIFY_SOCKET=" not in environ
        finally:
            assert d.terminate() == 0
        assert "STOPPING=1" in srv.recv(4096).decode()


def _has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def test_a_second_daemon_refuses_a_busy_state_dir_or_socket(workdir: Path) -> None:
    d1 = DaemonProcess(workdir).start()
    try:
        same_state = DaemonProcess(workdir)
        same_state.socket = workdir / "other.sock"
        same_state.argv[same_state.argv.index("--socket") + 1] = str(same_state.socket)
        with pytest.raises(RuntimeError, match="in use by another smold"):
            same_state.start(timeout=15)
        (workdir / "b").mkdir()
        same_socket = DaemonProcess(workdir / "b")
        same_socket.argv[same_socket.argv.index("--socket") + 1] = str(d1.socket)
        with pytest.raises(RuntimeError, match="another daemon is serving on"):
            same_socket.start(timeout=15)
        assert d1.smolctl("ls").returncode == 0  # the first one is unaffected
    finally:
        assert d1.terminate() == 0


def test_bad_options_exit_with_a_one_line_error(workdir: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "smold.daemon", "--max-machines", "0"], capture_output=True)
    assert (r.returncode, r.stderr.decode()) == (2, "smold: error: --max-machines must be at least 1\n")
    r = subprocess.run([sys.executable, "-m", "smold.daemon", "--socket", str(workdir / "s"), "--state-dir",
                        str(workdir / "st"), "--image", "broken"], capture_output=True)
    assert r.returncode == 2 and b"--image wants NAME=KERNEL:INITRAMFS:ROOTFS" in r.stderr
