"""The host side of guest networking on real namespaces, with a fake guest instead of a VM (root, nft)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from pyroute2 import IPRoute

from smold.net import AddressPool, ForwardError, NetError, NetworkManager, netns, nft
from smold.net import dns as dnsmsg
from smold.net.manager import GATEWAY, GUEST, host_if_name, namespace_name, network_leftovers
from smold.smolfile.model import AllowRule, NetworkPolicy, PortForward

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("nft", "nsenter")), reason="needs nft and nsenter"),
]

HTTP_PORT = 8080
OTHER_PORT = 9090


def _add_host(tag: str, name: str, subnet: str) -> tuple[str, str]:
    """A namespace ``name`` linked to the root namespace by a veth, holding .2 of subnet (.1 in root)."""
    net = ipaddress.IPv4Network(subnet)
    root_if = f"smt{tag}{name[-1]}"
    netns.create_namespace(name)
    with IPRoute() as ipr:
        ipr.link("add", ifname=root_if, kind="veth", peer=root_if + "p")
        peer = ipr.link_lookup(ifname=root_if + "p")[0]
        ipr.link("set", index=peer, net_ns_fd=str(netns.netns_path(name)))
        idx = ipr.link_lookup(ifname=root_if)[0]
        ipr.addr("add", index=idx, address=str(net.network_address + 1), prefixlen=net.prefixlen)
        ipr.link("set", index=idx, state="up")

    def inside() -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            i = ipr.link_lookup(ifname=root_if + "p")[0]
            ipr.addr("add", index=i, address=str(net.network_address + 2), prefixlen=net.prefixlen)
            ipr.link("set", index=i, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=str(net.network_address + 1))

    netns.in_netns(None, netns.in_netns, name, inside)
    return root_if, str(net.network_address + 2)


def _http_server(ns: str | None, addr: str, port: int) -> subprocess.Popen[bytes]:
    """An HTTP server in namespace ns (None: the host's own)."""
    enter = ["nsenter", f"--net={netns.netns_path(ns)}", "--"] if ns is not None else []
    proc = subprocess.Popen([*enter, sys.executable, "-m", "http.server", "--bind", addr, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait until it listens (probed from inside its namespace)
        def probe() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=1):
                return True
            return False
        if netns.in_netns(ns, probe):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"http server {addr}:{port} in {ns} did not start")


def _remove_hosts(procs: list[subprocess.Popen[bytes]], links: list[str], namespaces: Iterable[str]) -> None:
    """Stop the test hosts' servers, delete their links and namespaces (whatever of them exists)."""
    for p in procs:
        p.kill()
        p.wait()
    for link in links:
        with contextlib.suppress(Exception):
            netns.delete_link(link)
    for ns in namespaces:
        with contextlib.suppress(Exception):
            netns.remove_namespace(ns)


@pytest.fixture
def world() -> Iterator[dict[str, str]]:
    tag = secrets.token_hex(2)
    names = {"a": f"smt-{tag}-a", "b": f"smt-{tag}-b", "g": f"smt-{tag}-g"}
    links: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        la, addr_a = _add_host(tag, names["a"], "10.251.1.0/24")
        links.append(la)
        lb, addr_b = _add_host(tag, names["b"], "10.251.2.0/24")
        links.append(lb)
        netns.create_namespace(names["g"])
        procs += [_http_server(names["a"], addr_a, HTTP_PORT), _http_server(names["a"], addr_a, OTHER_PORT),
                  _http_server(names["b"], addr_b, HTTP_PORT)]
        yield {**names, "addr_a": addr_a, "addr_b": addr_b}
    finally:
        _remove_hosts(procs, links, names.values())


def _attach_fake_guest(vm_ns: str, guest_ns: str) -> None:
    """Move the VM namespace's "guest0" veth end into guest_ns as the guest's eth0 (172.16.0.2/30)."""
    def move() -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="guest0")[0], net_ns_fd=str(netns.netns_path(guest_ns)))

    def configure() -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            i = ipr.link_lookup(ifname="guest0")[0]
            ipr.addr("add", index=i, address=str(GUEST), prefixlen=30)
            ipr.link("set", index=i, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=str(GATEWAY))

    netns.in_netns(vm_ns, move)
    netns.in_netns(guest_ns, configure)


def _http_get(addr: str, port: int) -> str:
    """GET / (as the guest); "ok" or the error's class name."""
    try:
        with socket.create_connection((addr, port), timeout=2) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = s.recv(64)
        return "ok" if data.startswith(b"HTTP/1.0 200") else f"bad reply {data!r}"
    except OSError as e:
        return type(e).__name__


def _dns(name: str, tcp: bool = False) -> dnsmsg.Response:
    q = dnsmsg.build_query(name, ident=0x4242)
    if tcp:
        with socket.create_connection((str(GATEWAY), 53), timeout=3) as s:
            s.sendall(len(q).to_bytes(2, "big") + q)
            n = int.from_bytes(s.recv(2), "big")
            buf = b""
            while len(buf) < n:
                buf += s.recv(n - len(buf))
            return dnsmsg.parse_response(buf)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(q, (str(GATEWAY), 53))
        return dnsmsg.parse_response(s.recv(512))


async def test_allowlist_enforced_reported_and_torn_down(world: dict[str, str]) -> None:
    addr_a = ipaddress.IPv4Address(world["addr_a"])
    hosts = {"hosta.test": [addr_a]}
    mgr = NetworkManager(AddressPool("10.214.0.0/24"), resolve=lambda n: hosts.get(n, []))
    policy = NetworkPolicy((AllowRule("host", "hosta.test", HTTP_PORT),))
    mid = f"m-{secrets.token_hex(6)}"
    net = await mgr.setup(mid, policy, guest_link="veth")
    try:
        _attach_fake_guest(net.namespace, world["g"])
        g = world["g"]

        async def as_guest(fn, *args):  # type: ignore[no-untyped-def]
            return await asyncio.to_thread(netns.in_netns, g, fn, *args)

        assert await as_guest(_http_get, world["addr_a"], HTTP_PORT) == "ok"
        assert await as_guest(_http_get, world["addr_b"], HTTP_PORT) != "ok"
        assert await as_guest(_http_get, world["addr_a"], OTHER_PORT) != "ok"
        # the namespace itself: only DNS on the gateway (no other port there)
        assert await as_guest(_http_get, str(GATEWAY), 22) != "ok"

        ok = await as_guest(_dns, "HostA.test.")
        assert ok.rcode == dnsmsg.RCODE_NOERROR and ok.addresses == (addr_a,)
        ok_tcp = await as_guest(_dns, "hosta.test", True)
        assert ok_tcp.addresses == (addr_a,)
        bad = await as_guest(_dns, "secret-data.evil.test")
        assert bad.rcode == dnsmsg.RCODE_NXDOMAIN and bad.addresses == ()

        report = await mgr.report(net)
        counters = dict(report.counters)
        assert counters["denied_forward"] >= 2
        assert counters["denied_input"] >= 1
        assert counters["allowed_forward"] >= 1
        denied = {(d.address, d.protocol, d.port) for d in report.denied}
        assert (world["addr_b"], "tcp", HTTP_PORT) in denied
        assert (world["addr_a"], "tcp", OTHER_PORT) in denied
        assert (str(GATEWAY), "tcp", 22) in denied
        assert (world["addr_a"], "tcp", HTTP_PORT) not in denied
        assert dict(report.denied_names) == {"secret-data.evil.test": 1}
    finally:
        await mgr.teardown(net)
    assert network_leftovers(net.namespace, net.host_if) == []
    assert net.namespace not in netns.list_namespaces()
    assert not netns.link_exists(net.host_if)
    assert mgr.pool.in_use() == {}


async def test_orphans_are_removed() -> None:
    mgr = NetworkManager(AddressPool("10.214.1.0/24"), resolve=lambda n: [])
    mid = f"m-{secrets.token_hex(6)}"
    net = await mgr.setup(mid, NetworkPolicy((AllowRule("cidr", "10.251.9.0/24"),)))
    assert net.namespace in netns.list_namespaces()
    assert netns.link_exists("tap0", net.namespace)
    # a new daemon (fresh manager) finds it orphaned: nothing of it must survive
    if net.dns is not None:
        await net.dns.close()
    fresh = NetworkManager(AddressPool("10.214.1.0/24"))
    others = [f"m-{ns[5:]}" for ns in netns.list_namespaces() if ns.startswith("smol-") and ns != net.namespace]
    removed = await fresh.clean_orphans(keep=others)  # never another test's or daemon's namespace
    assert net.namespace in removed
    assert network_leftovers(net.namespace, net.host_if) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_port_forwards_reach_the_guest_survive_a_restart_and_go_with_the_network(
        world: dict[str, str], tmp_path: Path) -> None:
    """network.forward: a host port relays to the guest's port through the namespace; a port in use fails
    the setup and leaves nothing; a fork child (auto_ports) listens elsewhere; a restarted daemon listens on
    the same ports again; teardown closes them."""
    fixed = _free_port()
    policy = NetworkPolicy(forward=(PortForward(HTTP_PORT), PortForward(OTHER_PORT, fixed)))
    mgr = NetworkManager(AddressPool("10.214.5.0/24"), resolve=lambda n: [])
    mid = f"m-{secrets.token_hex(6)}"
    net = await mgr.setup(mid, policy, guest_link="veth", state_dir=tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    others: list[NetworkManager] = []
    try:
        auto, fixed_fwd = net.forwarded_ports
        assert (auto.guest_port, auto.host_address) == (HTTP_PORT, "127.0.0.1") and auto.host_port > 0
        assert fixed_fwd == PortForward(OTHER_PORT, fixed)
        _attach_fake_guest(net.namespace, world["g"])
        procs.append(_http_server(world["g"], str(GUEST), HTTP_PORT))
        assert await asyncio.to_thread(_http_get, "127.0.0.1", auto.host_port) == "ok"
        # nothing listens on the guest's OTHER_PORT: the host side is closed without a reply
        assert await asyncio.to_thread(_http_get, "127.0.0.1", fixed) != "ok"
        # forwards let nothing new out of the guest
        counters = dict((await mgr.report(net)).counters)
        assert counters["allowed_forward"] == 0

        # another machine wanting the same fixed port: refused, and nothing of it is left
        other = NetworkManager(AddressPool("10.214.6.0/24"), resolve=lambda n: [])
        others.append(other)
        mid2 = f"m-{secrets.token_hex(6)}"
        with pytest.raises(ForwardError, match=f"cannot forward 127.0.0.1:{fixed} to guest port {OTHER_PORT}: "):
            await other.setup(mid2, policy, guest_link="veth")
        assert network_leftovers(namespace_name(mid2), host_if_name(mid2)) == [] and other.pool.in_use() == {}
        # ... unless it is a fork child: then every forward listens on a free port
        child = await other.setup(mid2, policy, guest_link="veth", auto_ports=True)
        assert {f.host_port for f in child.forwarded_ports}.isdisjoint({auto.host_port, fixed})
        await other.teardown(child)

        # the daemon restarts: its listeners died with it; the new one listens on the recorded ports again
        assert net.forwarder is not None and net.dns is not None
        await net.forwarder.close()
        await net.dns.close()
        assert await asyncio.to_thread(_http_get, "127.0.0.1", auto.host_port) == "ConnectionRefusedError"
        fresh = NetworkManager(AddressPool("10.214.5.0/24"), resolve=lambda n: [],
                               record_key=mgr.record_key)   # a restarted daemon: the same key
        others.append(fresh)
        net = await fresh.adopt(mid, policy, tmp_path)
        assert net.forwarded_ports == (auto, fixed_fwd)
        assert await asyncio.to_thread(_http_get, "127.0.0.1", auto.host_port) == "ok"
        mgr = fresh
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await mgr.teardown(net)
    for port in (auto.host_port, fixed):
        assert await asyncio.to_thread(_http_get, "127.0.0.1", port) == "ConnectionRefusedError"
    assert network_leftovers(net.namespace, net.host_if) == []


_PEER_ECHO = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
while True:
    c, peer = s.accept()
    c.sendall(("HTTP/1.0 200 peer " + peer[0] + "\\r\\n").encode())
    c.close()
"""


def _peer_seen_by(addr: str, port: int) -> str:
    """The source address a peer-echo server at addr:port saw for our connection, or the error's name."""
    try:
        with socket.create_connection((addr, port), timeout=2) as s:
            data = s.recv(128).decode()
        return data.split()[3] if data.startswith("HTTP/1.0 200 peer ") else f"bad reply {data!r}"
    except OSError as e:
        return type(e).__name__


@contextlib.contextmanager
def internet_hosts(tag: str, internet: str, metadata: str, host_port: int) -> Iterator[dict[str, str]]:
    """An "internet" host (.2 of the subnet ``internet``, a server on HTTP_PORT that echoes its peer's
    address), a link-local host (.2 of ``metadata``, an HTTP server on HTTP_PORT), and an HTTP server of the
    host itself on all its addresses at ``host_port``."""
    names = {"i": f"smt-{tag}-i", "m": f"smt-{tag}-m"}
    links: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        li, addr_i = _add_host(tag, names["i"], internet)
        links.append(li)
        lm, addr_m = _add_host(tag, names["m"], metadata)
        links.append(lm)
        procs.append(subprocess.Popen(["nsenter", f"--net={netns.netns_path(names['i'])}", "--", sys.executable,
                                       "-c", _PEER_ECHO, addr_i, str(HTTP_PORT)]))
        procs += [_http_server(names["m"], addr_m, HTTP_PORT), _http_server(None, "0.0.0.0", host_port)]
        host_i = str(ipaddress.IPv4Network(internet).network_address + 1)
        deadline = time.monotonic() + 20
        while _peer_seen_by(addr_i, HTTP_PORT) != host_i and time.monotonic() < deadline:
            time.sleep(0.1)   # until the echo server listens (seen from the host: its own address on that link)
        yield {"addr_i": addr_i, "addr_m": addr_m, "link_i": li, "host_i": host_i}
    finally:
        _remove_hosts(procs, links, names.values())


@pytest.fixture
def internet(world: dict[str, str]) -> Iterator[dict[str, str]]:
    """Beside the world: internet_hosts at 203.0.113.0/24, 169.254.10.0/30 and the host's port OTHER_PORT."""
    with internet_hosts(world["g"].split("-")[1], "203.0.113.0/24", "169.254.10.0/30", OTHER_PORT) as hosts:
        yield hosts


PUBLISHED_PORT = 8181
DNAT_TABLE = "smt_published"


def _publish_port(address: str, port: int, to_addr: str, to_port: int) -> None:
    """As Docker publishes a container's port: DNAT address:port to to_addr:to_port in the host's prerouting."""
    script = (f"table ip {DNAT_TABLE} {{\n chain prerouting {{ type nat hook prerouting priority dstnat; }}\n}}\n"
              f"add rule ip {DNAT_TABLE} prerouting ip daddr {address} tcp dport {port} dnat to {to_addr}:{to_port}\n")
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, capture_output=True)


def _add_address(link: str, address: str) -> None:
    with IPRoute() as ipr:
        ipr.addr("add", index=ipr.link_lookup(ifname=link)[0], address=address, prefixlen=32)


async def test_public_egress_reaches_the_internet_never_the_host_metadata_or_private_ranges(
        world: dict[str, str], internet: dict[str, str]) -> None:
    """network = "public": the guest reaches an "internet" host (203.0.113.0/24, masqueraded on the way out, so
    its replies need no route back to the pool), resolves any name; it never reaches a private host, the
    link-local range (cloud metadata), or any address of the host itself (one added after the machine was set
    up is caught by the host's table), unless an allow entry names the private destination. (The real
    169.254.169.254 is tests/integration/test_run_task_vm.py's, on a real VM.)"""
    from smold.net.rules import HOST_TABLE, SET_PUBLIC_UPLINKS

    addr_i, addr_m = internet["addr_i"], internet["addr_m"]
    late = "203.0.113.77"
    hosts = {"www.internet.test": [ipaddress.IPv4Address(addr_i)]}
    mgr = NetworkManager(AddressPool("10.214.8.0/24"), resolve=lambda n: hosts.get(n, []))
    policy = NetworkPolicy((AllowRule("cidr", f"{world['addr_a']}/32", HTTP_PORT),), public=True)
    mid = f"m-{secrets.token_hex(6)}"
    net = await mgr.setup(mid, policy, guest_link="veth")
    try:
        _attach_fake_guest(net.namespace, world["g"])
        members = await asyncio.to_thread(nft.set_elements, None, SET_PUBLIC_UPLINKS, HOST_TABLE)
        assert net.host_if in members
        # an address the host gains after the machine's rules were made
        await asyncio.to_thread(_add_address, internet["link_i"], late)

        async def as_guest(fn, *args):  # type: ignore[no-untyped-def]
            return await asyncio.to_thread(netns.in_netns, world["g"], fn, *args)

        # the internet: reached, and it sees the host's address, not the machine's pool
        assert await as_guest(_peer_seen_by, addr_i, HTTP_PORT) == "203.0.113.1"
        # private ranges: not reached, except the one the allow entry names (at its port only)
        assert await as_guest(_http_get, world["addr_a"], HTTP_PORT) == "ok"
        assert await as_guest(_http_get, world["addr_a"], OTHER_PORT) != "ok"
        assert await as_guest(_http_get, world["addr_b"], HTTP_PORT) != "ok"
        # the metadata service and the host itself: never
        assert await as_guest(_http_get, addr_m, HTTP_PORT) != "ok"
        for host_addr in ("203.0.113.1", "10.251.1.1", late, str(net.uplink.host)):
            assert await asyncio.to_thread(_http_get, host_addr, OTHER_PORT) == "ok"   # it does serve
            assert await as_guest(_http_get, host_addr, OTHER_PORT) != "ok", host_addr
        # a port the host publishes for a container (Docker's DNAT in prerouting, to B) on the late address:
        # forwarded, so never seen by input; the host table's prerouting chain drops it before the DNAT
        assert "prerouting" in await asyncio.to_thread(nft.chain_names, None, HOST_TABLE)
        await asyncio.to_thread(_publish_port, late, PUBLISHED_PORT, world["addr_b"], HTTP_PORT)
        assert await as_guest(_http_get, late, PUBLISHED_PORT) != "ok"
        # DNS: any name, as the host resolves it
        ok = await as_guest(_dns, "WWW.internet.test")
        assert ok.rcode == dnsmsg.RCODE_NOERROR and ok.addresses == (ipaddress.IPv4Address(addr_i),)
        assert (await as_guest(_dns, "nowhere.test")).rcode == dnsmsg.RCODE_NXDOMAIN

        report = await mgr.report(net)
        denied = {(d.address, d.protocol, d.port) for d in report.denied}
        assert {(world["addr_b"], "tcp", HTTP_PORT), (addr_m, "tcp", HTTP_PORT),
                ("203.0.113.1", "tcp", OTHER_PORT)} <= denied
        assert (late, "tcp", OTHER_PORT) not in denied   # it left the namespace: the host's table dropped it
        host_counters = await asyncio.to_thread(nft.read_counters, None, HOST_TABLE)
        assert host_counters["denied_host"] >= 1
        assert report.denied_names == ()
    finally:
        await mgr.teardown(net)
        subprocess.run(["nft", "delete", "table", "ip", DNAT_TABLE], capture_output=True, check=False)
    assert network_leftovers(net.namespace, net.host_if) == []
    assert net.host_if not in await asyncio.to_thread(nft.set_elements, None, SET_PUBLIC_UPLINKS, HOST_TABLE)


_LINE_ECHO = """
import socket, sys, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
def serve(c):
    with c:
        while data := c.recv(64):
            c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
ECHO_PORT = 7070


def _echo_once(sock: socket.socket, data: bytes) -> str:
    """Send data on an open connection; "echoed" or what went wrong."""
    try:
        sock.sendall(data)
        return "echoed" if sock.recv(64) == data else "bad reply"
    except OSError as e:
        return type(e).__name__


def _connect(addr: str, port: int) -> socket.socket:
    s = socket.create_connection((addr, port), timeout=3)
    s.settimeout(3)
    return s


async def test_a_running_machines_policy_changes_atomically_cuts_old_connections_and_survives_adoption(
        world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """network = "closed" (a NIC, nothing allowed), then an allowlist, then closed again, then public: each
    change is in force at once; a connection the old policy let through and the new one does not is cut, one
    both allow lives on; a change nft refuses leaves the old policy in force;
    the counters and denied destinations of every policy stay in the report; a restarted daemon re-adopts the
    policy in force, not the one the machine was created with."""
    from smold.net.rules import HOST_TABLE, SET_PUBLIC_UPLINKS

    addr_a = world["addr_a"]
    echo = subprocess.Popen(["nsenter", f"--net={netns.netns_path(world['a'])}", "--", sys.executable, "-c",
                             _LINE_ECHO, addr_a, str(ECHO_PORT)])
    mgr = NetworkManager(AddressPool("10.214.15.0/24"), resolve=lambda n: [])
    created = NetworkPolicy(closed=True)
    mid = f"m-{secrets.token_hex(6)}"
    net = await mgr.setup(mid, created, guest_link="veth", state_dir=tmp_path)
    try:
        _attach_fake_guest(net.namespace, world["g"])

        async def as_guest(fn, *args):  # type: ignore[no-untyped-def]
            return await asyncio.to_thread(netns.in_netns, world["g"], fn, *args)

        assert await as_guest(_http_get, addr_a, HTTP_PORT) != "ok"              # closed: nothing passes
        await mgr.update(net, NetworkPolicy((AllowRule("cidr", f"{addr_a}/32"),)), tmp_path)
        assert net.generation == 2
        assert await as_guest(_http_get, addr_a, HTTP_PORT) == "ok"              # in force at once
        assert await as_guest(_http_get, world["addr_b"], HTTP_PORT) != "ok"
        conn = await as_guest(_connect, addr_a, ECHO_PORT)
        try:
            assert await asyncio.to_thread(_echo_once, conn, b"one") == "echoed"
            both = NetworkPolicy((AllowRule("cidr", f"{addr_a}/32"), AllowRule("cidr", f"{world['addr_b']}/32")))
            await mgr.update(net, both, tmp_path)                                   # a wider allowlist
            assert await asyncio.to_thread(_echo_once, conn, b"kept") == "echoed"  # allowed by both: it lives
            assert await as_guest(_http_get, world["addr_b"], HTTP_PORT) == "ok"
            # a change that fails (nft refuses it) leaves the policy in force, in the rules and in net.json
            real_apply = nft.apply
            monkeypatch.setattr(nft, "apply", lambda *a, **k: (_ for _ in ()).throw(NetError("refused")))
            with pytest.raises(NetError, match="refused"):
                await mgr.update(net, NetworkPolicy(), tmp_path)
            monkeypatch.setattr(nft, "apply", real_apply)
            assert net.policy == both and net.generation == 4   # a failed change's number is never reused
            assert json.loads((tmp_path / "net.json").read_text())["policy"]["allow"] == [
                addr_a, world["addr_b"]]
            assert await asyncio.to_thread(_echo_once, conn, b"still") == "echoed"
            assert await as_guest(_http_get, world["addr_b"], HTTP_PORT) == "ok"
            await mgr.update(net, NetworkPolicy(), tmp_path)                        # closed again
            assert await asyncio.to_thread(_echo_once, conn, b"two") != "echoed"   # the open connection is cut
        finally:
            conn.close()
        assert await as_guest(_http_get, addr_a, HTTP_PORT) != "ok"
        report = await mgr.report(net)
        denied = {(d.address, d.protocol, d.port) for d in report.denied}
        # what the first closed policy and the allowlist denied is still reported
        assert {(addr_a, "tcp", HTTP_PORT), (world["addr_b"], "tcp", HTTP_PORT)} <= denied
        assert dict(report.counters)["allowed_forward"] >= 2

        await mgr.update(net, NetworkPolicy(public=True), tmp_path)
        members = await asyncio.to_thread(nft.set_elements, None, SET_PUBLIC_UPLINKS, HOST_TABLE)
        assert net.host_if in members
        with pytest.raises(NetError, match="port forwards are fixed"):
            await mgr.update(net, NetworkPolicy(forward=(PortForward(80),)), tmp_path)
        assert net.resolved.public and net.generation == 6     # a refused change changes nothing

        # a restarted daemon: the policy in force (public), not the created one (closed)
        assert net.dns is not None
        await net.dns.close()
        fresh = NetworkManager(AddressPool("10.214.15.0/24"), resolve=lambda n: [],
                               record_key=mgr.record_key)   # a restarted daemon: the same key
        adopted = await fresh.adopt(mid, created, tmp_path)
        assert adopted.policy.public and adopted.generation == 6
        mgr, net = fresh, adopted
        await mgr.update(net, NetworkPolicy(), tmp_path)
        members = await asyncio.to_thread(nft.set_elements, None, SET_PUBLIC_UPLINKS, HOST_TABLE)
        assert net.host_if not in members and net.generation == 7
    finally:
        echo.kill()
        echo.wait()
        await mgr.teardown(net)
    assert network_leftovers(net.namespace, net.host_if) == []
