"""The daemon connects only to sockets its VM process made, at fixed paths (#19 finding 6: a jailed VMM writes
ready.json and its state dir, and once pointed the root daemon at any host Unix socket)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from smold.agent import AgentConnectError
from smold.daemon import launcher as launcher_mod
from smold.daemon.errors import LaunchError
from smold.daemon.launcher import CONTROL_FILE, VSOCK_FILE, VmmLauncher
from smold.unixsock import UnsafeSocketError, pinned


@pytest.fixture
def service(tmp_path: Path) -> Iterator[socket.socket]:
    """A host service's listening socket (what a hostile VMM would point the daemon at), non-blocking."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "host-service.sock"))
    s.listen()
    s.setblocking(False)
    yield s
    s.close()


def connected(s: socket.socket) -> bool:
    try:
        s.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def test_pinned_reaches_the_socket_it_checked(tmp_path: Path, service: socket.socket) -> None:
    with pinned(service.getsockname(), os.geteuid()) as p:
        c = socket.socket(socket.AF_UNIX)
        c.connect(p)
        c.close()
    assert connected(service)


@pytest.mark.parametrize("kind", ["symlink", "file", "owner"])
def test_pinned_refuses_what_is_not_the_owners_own_socket(tmp_path: Path, service: socket.socket,
                                                          kind: str) -> None:
    path = tmp_path / "vsock.sock"
    owner = os.geteuid()
    if kind == "symlink":
        path.symlink_to(service.getsockname())
    elif kind == "file":
        path.write_text("")
    else:
        path = Path(service.getsockname())
        owner += 1
    with pytest.raises(UnsafeSocketError, match={"symlink": "is a symlink", "file": "not a socket",
                                                 "owner": "belongs to uid"}[kind]):
        with pinned(path, owner):
            pass
    assert not connected(service)


def test_the_launcher_ignores_ready_json_and_never_follows_a_planted_symlink(tmp_path: Path,
                                                                             service: socket.socket) -> None:
    """Before: VmmLauncher.connect went to ready.json's vsock_path, and a symlink at vsock.sock was followed."""
    state = tmp_path / "machine"
    state.mkdir()
    hostile_ready = {"vsock_path": service.getsockname(), "agent_port": 22}
    (state / "ready.json").write_text(json.dumps(hostile_ready))
    launcher = VmmLauncher()
    with pytest.raises(AgentConnectError):               # no vsock.sock at the fixed path: nothing to reach
        asyncio.run(launcher.connect(state, hostile_ready, timeout=2))
    (state / VSOCK_FILE).symlink_to(service.getsockname())
    with pytest.raises(AgentConnectError, match="is a symlink"):
        asyncio.run(launcher.connect(state, hostile_ready, timeout=2))
    assert not connected(service)


def test_a_snapshot_is_never_asked_of_a_socket_the_control_path_links_to(tmp_path: Path,
                                                                        service: socket.socket) -> None:
    state = tmp_path / "machine"
    state.mkdir()
    (state / CONTROL_FILE).symlink_to(service.getsockname())
    with pytest.raises(LaunchError, match="is a symlink"):
        asyncio.run(VmmLauncher().snapshot(state, tmp_path / "snap", timeout=2))
    assert not connected(service)


def test_the_launchers_fixed_names_are_the_vmms() -> None:
    from smold.vmm import machine, runner
    assert launcher_mod.AGENT_VSOCK_PORT == runner.AGENT_VSOCK_PORT
    assert VSOCK_FILE == machine.VSOCK_FILE
    assert launcher_mod.CONTROL_FILE == runner.CONTROL_FILE
    from smold.snapshot import store
    assert launcher_mod.SNAPSHOT_NAMES == {store.STATE_FILE, store.MEMORY_FILE}



@pytest.mark.skipif(os.geteuid() != 0, reason="chowns directories to the jail's uids (root)")
def test_each_jailed_vm_gets_its_own_uid_and_gid_kept_in_its_state_dirs_owner(tmp_path: Path) -> None:
    """#19 finding 5: every jailed VMM ran as the one --jail-uid, so a VMM a guest took over could signal,
    trace or write every other machine's VMM and files."""
    machines = tmp_path / "machines"
    machines.mkdir()
    jailed = VmmLauncher(jail=launcher_mod.JailOptions(uid=64100, gid=64300))
    a, b, c = (machines / n for n in ("m-a", "m-b", "m-c"))
    for d in (a, b, c):
        d.mkdir()
    assert jailed.vmm_ids(a) == (os.geteuid(), os.getegid())          # nothing assigned yet: root's
    assert jailed.assign_vmm_ids(a) == (64100, 64300)
    assert jailed.assign_vmm_ids(b) == (64101, 64301)
    assert jailed.assign_vmm_ids(a) == (64100, 64300)                 # assigned once
    assert (a.stat().st_uid, a.stat().st_gid) == (64100, 64300)
    assert VmmLauncher(jail=launcher_mod.JailOptions(uid=64100, gid=64300)).vmm_ids(b) == (64101, 64301)  # a restart
    a.rmdir()                                                         # a destroyed machine frees its pair
    assert jailed.assign_vmm_ids(c) == (64100, 64300)
    os.chown(b, 12345, 12345)                                         # not root's, not the jail's
    with pytest.raises(LaunchError, match="owned by uid 12345"):
        jailed.vmm_ids(b)
    assert VmmLauncher().assign_vmm_ids(b) == (os.geteuid(), os.getegid())   # unjailed: the daemon's own
    image = types.SimpleNamespace(kernel=Path("/k"), initramfs=Path("/i"), rootfs=Path("/r"))
    argv = jailed.command(launcher_mod.LaunchSpec("m-c", c, image, 1, 256, "h", 60.0))  # type: ignore[arg-type]
    assert argv[argv.index("--uid") + 1] == "64100" and argv[argv.index("--gid") + 1] == "64300"


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns directories to the jail's uids (root)")
def test_the_jails_uid_range_running_out_fails_the_create_plainly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "JAIL_IDS", 2)
    jailed = VmmLauncher(jail=launcher_mod.JailOptions(uid=64100, gid=64100))
    for n in "abc":
        (tmp_path / n).mkdir()
    jailed.assign_vmm_ids(tmp_path / "a")
    jailed.assign_vmm_ids(tmp_path / "b")
    with pytest.raises(launcher_mod.JailIdsExhaustedError, match="all 2 jail uids from 64100 are in use"):
        jailed.assign_vmm_ids(tmp_path / "c")


def test_the_vmm_gets_a_minimal_environment_not_the_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    """#19 finding 5: the daemon's environment (here a cloud key) was passed to every VMM."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "daemon-secret")
    monkeypatch.setenv("PYTHONPATH", "/src/smol")
    env = VmmLauncher().environment()
    assert "AWS_SECRET_ACCESS_KEY" not in env and env["PYTHONPATH"] == "/src/smol"
    assert set(env) == {"PATH", "LANG", "PYTHONPATH"}
