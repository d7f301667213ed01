"""The daemon with networked machines (host-agent launcher, real namespaces; root, nft, nsenter)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import test_daemon
from daemon_support import DaemonProcess, pid_alive, processes_mentioning, wait_until
from test_daemon import Env, create, run_exec, spec

from smold.api.v1 import smol_pb2 as pb
from smold.net import netns
from smold.net.manager import host_if_name, namespace_name, network_leftovers, remove_network

env = test_daemon.env          # the daemon fixtures, shared
workdir = test_daemon.workdir

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("nft", "nsenter")), reason="needs nft and nsenter"),
]


@pytest.mark.parametrize("env", [{"net_pool": "10.214.2.0/24"}], indirect=True)
async def test_networked_machine_runs_in_its_namespace_reports_and_leaves_nothing(env: Env) -> None:
    m = await create(env, spec(network=pb.NetworkPolicy(allow=["10.251.9.0/24", "10.251.10.1:443"])))
    ns = namespace_name(m.id)
    assert ns in netns.list_namespaces()
    assert netns.link_exists("tap0", ns) and netns.link_exists(host_if_name(m.id))
    # the VM process (here: the agent itself) runs inside the namespace: it sees tap0 and up0, not eth0
    out, _, ex, _ = await run_exec(env, m.id, ["cat", "/proc/net/dev"])
    assert ex.exit_code == 0
    links = {line.split(":")[0].strip() for line in out.decode().splitlines()[2:]}
    assert links == {"lo", "tap0", "up0"}
    got = (await env.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id))).machine
    assert got.HasField("network")
    assert {c.name for c in got.network.counters} >= {"denied_forward", "denied_input", "allowed_forward"}
    record = (env.machines_dir.parent / "records" / m.id / "net.json").read_text()   # out of the VMM's reach
    assert ns in record and not (env.machines_dir / m.id / "net.json").exists()

    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    assert network_leftovers(ns, host_if_name(m.id)) == []


async def test_network_off_means_no_namespace(env: Env) -> None:
    m = await create(env)
    assert namespace_name(m.id) not in netns.list_namespaces()
    got = (await env.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id))).machine
    assert not got.HasField("network")
    out, _, _, _ = await run_exec(env, m.id, ["cat", "/proc/net/dev"])
    assert "tap0" not in out.decode()
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))


async def test_restarted_daemon_removes_orphaned_networks(env: Env) -> None:
    from smold.net import AddressPool, NetworkManager
    from smold.smolfile.model import AllowRule, NetworkPolicy
    mgr = NetworkManager(AddressPool("10.214.3.0/24"), resolve=lambda n: [])
    net = await mgr.setup("m-0ddba11c0ffe", NetworkPolicy((AllowRule("cidr", "10.251.9.0/24"),)))
    if net.dns is not None:
        await net.dns.close()
    # a daemon starting now does not know this machine: its network is an orphan
    await env.daemon.controller.network.clean_orphans(
        keep=[m for m in (f"m-{n[5:]}" for n in netns.list_namespaces() if n.startswith("smol-"))
              if m != "m-0ddba11c0ffe"])
    assert network_leftovers(net.namespace, net.host_if) == []
    with pytest.raises(grpc.aio.AioRpcError):
        await env.stub.GetMachine(pb.GetMachineRequest(machine_id="m-0ddba11c0ffe"))


async def test_the_tap_is_handed_to_the_vm_processs_uid_and_gid() -> None:
    """#19 finding 5: with --jail every networked machine failed: the tap was root's, the jailed VMM's
    TUNSETIFF got EPERM. The daemon now hands it to the VM process's uid and gid (a jailed VMM's own)."""
    from smold.net import AddressPool, NetworkManager
    from smold.net.manager import GUEST_IF
    from smold.smolfile.model import AllowRule, NetworkPolicy
    mgr = NetworkManager(AddressPool("10.214.25.0/24"), resolve=lambda n: [])
    net = await mgr.setup("m-7a9000000001", NetworkPolicy((AllowRule("cidr", "10.251.9.0/24"),)),
                          tap_owner=(64177, 64178))
    try:
        shown = subprocess.run([*net.launch_prefix(), "ip", "-details", "link", "show", GUEST_IF],
                               capture_output=True, text=True, timeout=30, check=True).stdout
        assert "user 64177 group 64178" in shown, shown
    finally:
        await mgr.teardown(net)
    assert network_leftovers(net.namespace, net.host_if) == []


@pytest.mark.parametrize("env", [{"net_pool": "10.214.4.0/24"}], indirect=True)
async def test_run_result_carries_the_network_report_and_run_leaves_nothing(env: Env) -> None:
    sf = spec(network=pb.NetworkPolicy(allow=["10.251.9.0/24"]), task=pb.Command(argv=["true"]),
              checks=[pb.Check(name="t", command=pb.CommandCheck(argv=["true"]))])
    resp = await env.stub.Run(pb.RunRequest(smolfile=sf))
    assert resp.result.passed, resp
    assert resp.HasField("network")
    assert dict((c.name, c.packets) for c in resp.network.counters)["denied_forward"] == 0
    assert network_leftovers(namespace_name(resp.machine_id), host_if_name(resp.machine_id)) == []
    off = await env.stub.Run(pb.RunRequest(smolfile=spec(task=pb.Command(argv=["true"]))))
    assert not off.HasField("network")


DNS_PROBE = """
import socket, struct
q = struct.pack('!HHHHHH', 9, 0x100, 1, 0, 0, 0) + b'\\x04evil\\x04test\\x00' + struct.pack('!HH', 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
s.sendto(q, ('172.16.0.1', 53))
r = s.recv(512)
print(struct.unpack('!H', r[:2])[0], r[3] & 15)
"""


class Restarts:
    """Daemons started as processes on one state directory, killed and restarted like a crashed or reconfigured
    smold; whatever they leave (VM processes, networks of the machines in ``machines``, the directory) goes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.machines: list[str] = []
        self.daemons: list[DaemonProcess] = []

    def task(self, name: str, network: str) -> Path:
        (self.workdir / name).mkdir()
        (self.workdir / name / "Smolfile.toml").write_text(f"memory = 256\ncpus = 1\nnetwork = {network}\n")
        return self.workdir / name

    def daemon(self, *extra: str) -> DaemonProcess:
        d = DaemonProcess(self.workdir, *extra)
        self.daemons.append(d)
        return d.start()

    def create(self, d: DaemonProcess, task: Path) -> tuple[str, int]:
        """A machine created by d: its id and its VM process's pid."""
        m = ok(d.smolctl("create", str(task))).strip()
        self.machines.append(m)
        return m, int(json.loads((d.state / "records" / m / "machine.json").read_text())["pid"])


def ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout.decode()


@pytest.fixture
def restarts() -> Iterator[Restarts]:
    bench = Restarts(Path(tempfile.mkdtemp(prefix="smn-", dir="/tmp")))
    try:
        yield bench
    finally:
        for d in reversed(bench.daemons):
            if d.proc is not None and d.proc.poll() is None:
                d.terminate()
        for pid in processes_mentioning(str(bench.workdir / "state")):
            os.kill(pid, signal.SIGKILL)
        for m in bench.machines:
            with contextlib.suppress(Exception):
                remove_network(namespace_name(m), host_if_name(m))
        shutil.rmtree(bench.workdir, ignore_errors=True)


def test_restarted_daemon_readopts_the_network_and_cleans_up_the_lost_machine(restarts: Restarts) -> None:
    task = restarts.task("task", '{ allow = ["10.251.9.0/24"] }')
    d1 = restarts.daemon("--net-pool", "10.214.5.0/24")
    keep, _ = restarts.create(d1, task)
    lost, lost_pid = restarts.create(d1, task)
    d1.kill()  # a crash: the namespaces stay, the resolver (in the daemon) is gone
    os.kill(lost_pid, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(lost_pid))
    assert {namespace_name(keep), namespace_name(lost)} <= set(netns.list_namespaces())

    d2 = restarts.daemon("--net-pool", "10.214.5.0/24")
    assert network_leftovers(namespace_name(lost), host_if_name(lost)) == []
    out = ok(d2.smolctl("exec", keep, "--", sys.executable, "-c", DNS_PROBE))
    assert out.split() == ["9", "3"]  # the re-adopted machine's resolver answers again: NXDOMAIN
    ok(d2.smolctl("rm", keep))
    assert network_leftovers(namespace_name(keep), host_if_name(keep)) == []


def test_a_daemon_restarted_without_public_network_cleans_up_public_machines_and_keeps_the_rest(
        restarts: Restarts) -> None:
    d1 = restarts.daemon("--net-pool", "10.214.22.0/24")
    public, public_pid = restarts.create(d1, restarts.task("public", '"public"'))
    listed, _ = restarts.create(d1, restarts.task("listed", '{ allow = ["10.251.9.0/24"] }'))
    d1.kill()
    # the operator restarts the daemon with public egress off: the public machine must not keep it
    d2 = restarts.daemon("--net-pool", "10.214.22.0/24", "--no-public-network")
    assert wait_until(lambda: not pid_alive(public_pid))
    assert network_leftovers(namespace_name(public), host_if_name(public)) == []
    assert not (d2.state / "machines" / public).exists()
    assert f"cleaning up machine {public}: it has public egress" in d2.log.read_text(errors="replace")
    assert ok(d2.smolctl("exec", listed, "--", "true")) == ""   # the allowlisted one is kept
    gone = d2.smolctl("exec", public, "--", "true")
    assert gone.returncode != 0
    ok(d2.smolctl("rm", listed))
    assert network_leftovers(namespace_name(listed), host_if_name(listed)) == []


def test_a_forged_net_record_is_not_adopted(restarts: Restarts) -> None:
    """#19 finding 6: net.json sat in the state dir a jailed VMM owns. Before, a restarted daemon re-applied
    whatever policy it recorded (here: everything allowed). Now it is kept in the daemon's records directory,
    and a record without the daemon's MAC is refused there too: the machine is cleaned up."""
    d1 = restarts.daemon("--net-pool", "10.214.23.0/24")
    forged, pid = restarts.create(d1, restarts.task("task", '{ allow = ["10.251.9.0/24"] }'))
    d1.kill()
    record = d1.state / "records" / forged / "net.json"
    data = json.loads(record.read_text())
    data["policy"]["allow"] = ["0.0.0.0/0"]
    record.write_text(json.dumps(data))
    d2 = restarts.daemon("--net-pool", "10.214.23.0/24")
    assert wait_until(lambda: not pid_alive(pid))
    assert not (d2.state / "machines" / forged).exists()
    assert network_leftovers(namespace_name(forged), host_if_name(forged)) == []
    log = d2.log.read_text(errors="replace")
    assert f"cleaning up machine {forged}: its network cannot be re-adopted" in log and "MAC does not verify" in log


@pytest.mark.parametrize("env", [{"net_pool": "10.214.7.0/24"}], indirect=True)
async def test_port_forwards_are_reported_conflicts_refused_and_closed_on_destroy(env: Env) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        fixed = s.getsockname()[1]
    m = await create(env, spec(network=pb.NetworkPolicy(forward=["8080", f"{fixed}:22"])))
    got = (await env.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id))).machine
    ports = {f.guest_port: (f.host_address, f.host_port) for f in got.forwarded_ports}
    assert ports[22] == ("127.0.0.1", fixed) and ports[8080][0] == "127.0.0.1" and ports[8080][1] > 0
    assert got.HasField("network")  # a NIC, with nothing allowed out
    def connect_and_read(port: int) -> bytes:  # (blocking: run off the loop the daemon is serving on)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.settimeout(30)
            return c.recv(1)

    for port in (fixed, ports[8080][1]):  # listening; no 172.16.0.2 behind the fake guest's tap: closed
        assert await asyncio.to_thread(connect_and_read, port) == b""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await create(env, spec(network=pb.NetworkPolicy(forward=[f"{fixed}:23"])))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"cannot forward 127.0.0.1:{fixed} to guest port 23" in (e.value.details() or "")
    assert "choose another host port" in (e.value.details() or "")
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    for port in (fixed, ports[8080][1]):
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(connect_and_read, port)
    assert [x for x in netns.list_namespaces() if x == namespace_name(m.id)] == []


@pytest.mark.parametrize("env", [{"net_pool": "10.214.9.0/24"}], indirect=True)
async def test_a_public_machine_has_its_uplink_in_the_hosts_table_until_destroyed(env: Env) -> None:
    from smold.net import nft
    from smold.net.rules import HOST_TABLE, SET_PUBLIC_UPLINKS
    m = await create(env, spec(network=pb.NetworkPolicy(public=True)))
    assert host_if_name(m.id) in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
    got = (await env.stub.GetMachine(pb.GetMachineRequest(machine_id=m.id))).machine
    assert got.HasField("network")
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
    assert host_if_name(m.id) not in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
    assert network_leftovers(namespace_name(m.id), host_if_name(m.id)) == []


@pytest.mark.parametrize("env", [{"net_pool": "10.214.10.0/24", "public_network": False}], indirect=True)
async def test_a_daemon_without_public_network_refuses_public_machines(env: Env) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await create(env, spec(network=pb.NetworkPolicy(public=True)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "smold --no-public-network" in (e.value.details() or "")
    assert (await env.stub.ListMachines(pb.ListMachinesRequest())).machines == []   # nothing was made
    m = await create(env, spec(network=pb.NetworkPolicy(allow=["10.251.9.0/24"])))   # an allowlist still works
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))


@pytest.mark.parametrize("env", [{"net_pool": "10.214.16.0/24"}], indirect=True)
async def test_set_network_policy_changes_a_running_machines_policy(env: Env) -> None:
    from smold.net import nft
    from smold.net.rules import HOST_TABLE, SET_PUBLIC_UPLINKS
    m = await create(env, spec(network=pb.NetworkPolicy(closed=True)))
    assert host_if_name(m.id) not in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
    got = (await env.stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(
        machine_id=m.id, policy=pb.NetworkPolicy(public=True)))).machine
    assert got.id == m.id and got.HasField("network")
    assert host_if_name(m.id) in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
    await env.stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(machine_id=m.id, policy=pb.NetworkPolicy(
        allow=["10.251.9.0/24"])))
    assert host_if_name(m.id) not in nft.set_elements(None, SET_PUBLIC_UPLINKS, HOST_TABLE)
    net_json = (env.machines_dir.parent / "records" / m.id / "net.json").read_text()
    assert '"allow": ["10.251.9.0/24"]' in net_json and '"generation": 3' in net_json

    async def refused(machine: str, policy: pb.NetworkPolicy) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await env.stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(machine_id=machine, policy=policy))
        return e.value.code(), e.value.details() or ""

    code, why = await refused(m.id, pb.NetworkPolicy(allow=["10.0.0.1/8"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid CIDR" in why
    code, why = await refused(m.id, pb.NetworkPolicy(forward=["8080"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "port forwards are fixed" in why
    code, why = await refused(m.id, pb.NetworkPolicy(closed=True, public=True))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "takes no allow, forward or public" in why
    off = await create(env)   # networking off: no NIC to open
    code, why = await refused(off.id, pb.NetworkPolicy(public=True))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and 'network = "closed"' in why
    code, _ = await refused("m-000000000000", pb.NetworkPolicy())
    assert code == grpc.StatusCode.NOT_FOUND
    for mid in (m.id, off.id):
        await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=mid))
    assert network_leftovers(namespace_name(m.id), host_if_name(m.id)) == []


@pytest.mark.parametrize("env", [{"net_pool": "10.214.17.0/24", "public_network": False}], indirect=True)
async def test_a_daemon_without_public_network_refuses_to_make_a_machine_public(env: Env) -> None:
    m = await create(env, spec(network=pb.NetworkPolicy(closed=True)))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await env.stub.SetNetworkPolicy(pb.SetNetworkPolicyRequest(machine_id=m.id,
                                                                   policy=pb.NetworkPolicy(public=True)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--no-public-network" in (e.value.details() or "")
    await env.stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))

