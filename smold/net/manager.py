"""Per-VM host networking: namespace, veth uplink, tap, nftables policy and DNS resolver, set up and torn down.

Layout for machine ``m-<hex>`` (docs/networking.md, "Host side"):

    root namespace                       namespace smol-<hex>                      guest
    smh<hex> 10.213.N.1/30  <-- veth -->  up0 10.213.N.2/30 (default route)
                                          tap0 172.16.0.1/30 (gateway, DNS)  <-->  eth0 172.16.0.2/30

Every guest gets the same addresses and MAC (each lives in its own namespace), so forked and restored
clones need no re-addressing; only the /30 uplink differs per machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute

from smold.api.machine import DeniedDestination, NetworkReport
from smold.authrecord import RecordKey
from smold.smolfile import SmolfileError, parse_mapping
from smold.smolfile.model import NetworkPolicy, PortForward

from . import netns, nft
from .errors import NetError
from .forward import PortForwarder
from .pool import DEFAULT_POOL, AddressPool, Uplink
from .resolver import DnsPolicy, DnsServer, Resolve, normalize_name, resolve_on_host
from .rules import (
    COUNTERS,
    GUEST_IF,
    HOST_TABLE,
    SET_ALLOW,
    SET_ALLOW_PORT,
    SET_DENIED_L4,
    SET_DENIED_OTHER,
    SET_NAT_SOURCES,
    SET_PUBLIC_UPLINKS,
    TABLE,
    UPLINK_IF,
    AllowedDestinations,
    build_host_ruleset,
    build_ruleset,
    network_element,
    port_element,
    render,
    render_chains,
    render_update,
)

log = logging.getLogger("smold.net")

NS_PREFIX = "smol-"
HOST_IF_PREFIX = "smh"
PEER_IF_PREFIX = "smp"           # the namespace end's name while it is still in the root namespace
GUEST_NET = ipaddress.IPv4Network("172.16.0.0/30")
GATEWAY = ipaddress.IPv4Address("172.16.0.1")
GUEST = ipaddress.IPv4Address("172.16.0.2")
GUEST_MAC = "02:73:6d:6f:6c:02"  # locally administered; the same in every namespace
# The gateway's (tap0's) MAC, also the same everywhere: a fork child or restored copy keeps the ARP entry it
# had for its gateway, which must stay valid in its new namespace.
GATEWAY_MAC = "02:73:6d:6f:6c:01"
NET_FILE = "net.json"            # in the daemon's record directory of the machine: what a restarted daemon re-adopts


def machine_suffix(machine_id: str) -> str:
    """The 12 hex digits of ``m-<12 hex>`` (interface names are at most 15 characters)."""
    suffix = machine_id.removeprefix("m-")
    if not suffix or len(suffix) > 12 or not all(c in "0123456789abcdef" for c in suffix):
        raise NetError(f"machine id {machine_id!r} is not of the form m-<up to 12 hex digits>")
    return suffix


def namespace_name(machine_id: str) -> str:
    return NS_PREFIX + machine_suffix(machine_id)


def host_if_name(machine_id: str) -> str:
    return HOST_IF_PREFIX + machine_suffix(machine_id)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A NetworkPolicy with its names resolved on the host: the nft destinations and the DNS names."""

    allowed: AllowedDestinations
    names: dict[str, tuple[ipaddress.IPv4Address, ...]]
    name_ports: dict[str, tuple[int | None, ...]]   # None: any port
    ignored: tuple[str, ...] = ()                    # rules that cannot apply (IPv6: the guest has none)
    public: bool = False                             # also every public IPv4 address (NetworkPolicy.public)


def resolve_policy(policy: NetworkPolicy, resolve: Resolve = resolve_on_host) -> ResolvedPolicy:
    nets: list[ipaddress.IPv4Network] = []
    ports: list[tuple[ipaddress.IPv4Network, int]] = []
    names: dict[str, set[ipaddress.IPv4Address]] = {}
    name_ports: dict[str, set[int | None]] = {}
    ignored: list[str] = []
    for rule in policy.allow:
        if rule.kind == "cidr":
            net = ipaddress.ip_network(rule.value)
            if not isinstance(net, ipaddress.IPv4Network):
                ignored.append(str(rule))
                continue
            targets = [net]
        else:
            name = normalize_name(rule.value)
            addrs = set(resolve(name))
            names.setdefault(name, set()).update(addrs)
            name_ports.setdefault(name, set()).add(rule.port)
            targets = [ipaddress.IPv4Network(a) for a in addrs]
        for t in targets:
            if rule.port is None:
                nets.append(t)
            else:
                ports.append((t, rule.port))
    return ResolvedPolicy(
        AllowedDestinations.of(nets, ports),
        {n: tuple(sorted(a)) for n, a in names.items()},
        {n: tuple(sorted(p, key=lambda x: -1 if x is None else x)) for n, p in name_ports.items()},
        tuple(ignored), policy.public)


@dataclass
class VmNetwork:
    """One machine's live host-side network."""

    machine_id: str
    namespace: str
    host_if: str
    uplink: Uplink
    resolved: ResolvedPolicy
    guest_link: str = "tap"    # "tap" for a VMM; "veth" when a test's fake guest stands in for it
    policy: NetworkPolicy = field(default_factory=NetworkPolicy)   # the policy in force (NetworkManager.update)
    generation: int = 1        # 1 at create, one more at each update (rules.build_ruleset's connection marks)
    dns: DnsServer | None = None
    forwarder: PortForwarder | None = None  # the Smolfile's network.forward (None: no forwards)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tap_owner: tuple[int, int] | None = None   # the VM process's uid and gid (a jailed VMM's own); None: ours

    @property
    def forwarded_ports(self) -> tuple[PortForward, ...]:
        return self.forwarder.bound if self.forwarder is not None else ()

    @property
    def allowed(self) -> AllowedDestinations:
        return self.resolved.allowed

    def launch_prefix(self) -> list[str]:
        """Run a command inside the namespace (the VMM: it attaches to the tap there)."""
        return ["nsenter", f"--net={netns.netns_path(self.namespace)}", "--"]

    def vmm_args(self) -> list[str]:
        """The VMM's --net-* flags (the net-dev contract; docs/networking.md)."""
        return ["--net-tap", GUEST_IF, "--net-mac", GUEST_MAC, "--net-guest", f"{GUEST}/{GUEST_NET.prefixlen}",
                "--net-gateway", str(GATEWAY), "--net-dns", str(GATEWAY)]

    def record(self) -> dict[str, object]:
        return {"namespace": self.namespace, "host_if": self.host_if, "uplink_index": self.uplink.index,
                "guest_link": self.guest_link,
                "forwards": self.forwarder.record() if self.forwarder is not None else {},
                "policy": {"allow": [str(r) for r in self.policy.allow], "public": self.policy.public},
                "generation": self.generation}


class NetworkManager:
    """Creates and removes machines' networks; owns the uplink pool. Blocking work runs in threads."""

    def __init__(self, pool: AddressPool | None = None, resolve: Resolve = resolve_on_host,
                 enable_forwarding: bool = True, host_rules: bool = True,
                 record_key: RecordKey | None = None) -> None:
        self.pool = pool or AddressPool(DEFAULT_POOL)
        self.resolve = resolve
        self.enable_forwarding = enable_forwarding
        self.host_rules = host_rules   # the host's table (rules.build_host_ruleset); off only for tests
        self._pool_in_host_table = False
        self._host_chains_checked = False
        self.networks: dict[str, VmNetwork] = {}
        # net.json sits in the daemon's record directory of the machine (out of its VMM's reach), and is
        # authenticated as well: a restarted daemon adopts only a record of its own (the daemon sets its key here)
        self.record_key = record_key or RecordKey.generate()

    def _write_record(self, state_dir: Path, net: VmNetwork) -> None:
        self.record_key.write(state_dir / NET_FILE, net.record(), f"{NET_FILE} {net.machine_id}")

    # --- set up -------------------------------------------------------------------------------------------
    async def setup(self, machine_id: str, policy: NetworkPolicy, *, guest_link: str = "tap",
                    state_dir: Path | None = None, auto_ports: bool = False,
                    tap_owner: tuple[int, int] | None = None) -> VmNetwork:
        """Namespace, uplink, guest link, nftables policy, DNS resolver and port forwards for one machine; on
        any failure everything created so far is removed again. ``auto_ports``: forwards listen on free
        ports whatever the Smolfile fixes (a fork child, whose parent holds those). ``tap_owner``: the uid and
        gid the tap is handed to (a jailed VMM's, which cannot attach to root's tap: #19 finding 5)."""
        if not policy.enabled:
            raise NetError("networking is off for this machine")
        if guest_link not in ("tap", "veth"):
            raise NetError(f"guest link must be 'tap' or 'veth' (got {guest_link!r})")
        resolved = await asyncio.to_thread(resolve_policy, policy, self.resolve)
        for r in resolved.ignored:
            log.warning("machine %s: allow rule %s ignored (the guest has IPv4 only)", machine_id, r)
        host_now = await asyncio.to_thread(netns.host_addresses)
        uplink = self.pool.allocate(machine_id, (n.network_address for n in host_now))
        net = VmNetwork(machine_id, namespace_name(machine_id), host_if_name(machine_id), uplink, resolved,
                        guest_link, policy, tap_owner=tap_owner)
        self.networks[machine_id] = net
        try:
            await asyncio.to_thread(self._create_links, net)
            await asyncio.to_thread(nft.apply, net.namespace, render(self.ruleset(net, host_now)))
            await asyncio.to_thread(self._host_rules, net)
            await self._start_dns(net)
            if policy.forward:
                net.forwarder = PortForwarder(machine_id, net.namespace, GUEST, policy.forward, auto_ports=auto_ports)
                await net.forwarder.start()
            if state_dir is not None:
                await asyncio.to_thread(self._write_record, state_dir, net)
        except BaseException:
            await self.teardown(net)
            raise
        log.info("machine %s: network namespace %s, uplink %s%s", machine_id, net.namespace, uplink.network,
                 " (public egress)" if resolved.public else "")
        return net

    async def adopt(self, machine_id: str, policy: NetworkPolicy, state_dir: Path) -> VmNetwork:
        """Take over a machine's network left by an earlier daemon (namespace and rules still there): claim
        its uplink and serve DNS again."""
        try:
            rec = self.record_key.read(state_dir / NET_FILE, f"{NET_FILE} {machine_id}")
            index = int(rec["uplink_index"])
            generation = int(rec.get("generation", 1))
            policy = _recorded_policy(rec.get("policy"), policy)
        except (OSError, ValueError, KeyError, TypeError, SmolfileError) as e:
            raise NetError(f"machine {machine_id}: no usable {NET_FILE}: {e}") from None
        net = VmNetwork(machine_id, namespace_name(machine_id), host_if_name(machine_id),
                        self.pool.reserve(index, machine_id),
                        await asyncio.to_thread(resolve_policy, policy, self.resolve),
                        str(rec.get("guest_link", "tap")), policy, generation)
        self.networks[machine_id] = net
        try:
            if not netns.namespace_exists(net.namespace) or not await asyncio.to_thread(
                    nft.table_exists, net.namespace):
                raise NetError(f"machine {machine_id}: its namespace {net.namespace} or nft table is gone")
            if "policy" in rec:   # the recorded policy, in force whether or not the last change got applied
                host_now = await asyncio.to_thread(netns.host_addresses)
                await asyncio.to_thread(nft.apply, net.namespace, render_update(self.ruleset(net, host_now)))
            await asyncio.to_thread(self._allow_resolved, net)
            await asyncio.to_thread(self._host_rules, net)
            if not net.resolved.public and self.host_rules:
                await asyncio.to_thread(remove_public_uplink, net.host_if)
            await self._start_dns(net)
        except BaseException:
            self.networks.pop(machine_id, None)
            self.pool.release(index)
            raise
        if policy.forward:  # on the ports it had; a port taken meanwhile costs the forwards, not the machine
            forwarder = PortForwarder(machine_id, net.namespace, GUEST, policy.forward)
            ports = rec.get("forwards")
            try:
                await forwarder.start({str(k): int(v) for k, v in ports.items()} if isinstance(ports, dict) else None)
            except (NetError, ValueError, TypeError) as e:
                log.warning("machine %s: its port forwards cannot be restored: %s", machine_id, e)
            else:
                net.forwarder = forwarder
        return net

    def ruleset(self, net: VmNetwork, host_addresses: Iterable[ipaddress.IPv4Network] = ()):  # type: ignore[no-untyped-def]
        """The namespace's ruleset; a public one also blocks the pool and ``host_addresses``."""
        blocked = [self.pool.network, *host_addresses] if net.resolved.public else []
        return build_ruleset(net.allowed, gateway=GATEWAY, guest=GUEST, public=net.resolved.public, blocked=blocked,
                             generation=net.generation)

    # --- change ---------------------------------------------------------------------------------------------
    async def update(self, net: VmNetwork, policy: NetworkPolicy, state_dir: Path | None = None) -> None:
        """Give a running machine another policy: an allowlist, public egress, or nothing at all (its NIC stays,
        nothing passes). The namespace's chains and allowed sets are replaced in one nft transaction; its
        counters and denied sets are kept (the report covers every policy the machine had); connections the
        old policy let through and the new one does not are cut (``generation``); its resolver answers by the
        new policy. Port forwards are fixed at create: ``policy.forward`` must be empty or unchanged."""
        if policy.forward and policy.forward != net.policy.forward:
            raise NetError("port forwards are fixed when the machine is created; leave forward out of the new policy")
        policy = NetworkPolicy(policy.allow, net.policy.forward, policy.public,
                               closed=not (policy.allow or policy.public))
        resolved = await asyncio.to_thread(resolve_policy, policy, self.resolve)
        for r in resolved.ignored:
            log.warning("machine %s: allow rule %s ignored (the guest has IPv4 only)", net.machine_id, r)
        # Shielded: a client that leaves mid-change must not leave the rules and what the daemon knows of them
        # apart (the nft transaction runs in a thread that a cancellation would not stop).
        await asyncio.shield(self._update(net, policy, resolved, state_dir))
        log.info("machine %s: network policy %d: %s", net.machine_id, net.generation, _describe(policy))

    async def _update(self, net: VmNetwork, policy: NetworkPolicy, resolved: ResolvedPolicy,
                      state_dir: Path | None) -> None:
        async with net.lock:
            host_now = await asyncio.to_thread(netns.host_addresses)
            was_public, old = net.resolved.public, (net.resolved, net.policy)
            # A generation is never used twice, even when this change fails: connections some policy accepted
            # under a number never outlive a later change. Recorded before the rules change (write-ahead): a
            # daemon that dies in between re-applies the recorded policy when it re-adopts the machine.
            net.resolved, net.policy, net.generation = resolved, policy, net.generation + 1
            try:
                if state_dir is not None:
                    await asyncio.to_thread(self._write_record, state_dir, net)
                if resolved.public and not was_public:   # the host out of reach before the guest can go public
                    await asyncio.to_thread(self._host_rules, net)
                await asyncio.to_thread(nft.apply, net.namespace, render_update(self.ruleset(net, host_now)))
            except BaseException:
                net.resolved, net.policy = old   # the old rules are still in force (one nft transaction)
                if resolved.public and not was_public and self.host_rules:
                    await asyncio.to_thread(remove_public_uplink, net.host_if)
                if state_dir is not None:
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(self._write_record, state_dir, net)
                raise
            if was_public and not resolved.public and self.host_rules:
                await asyncio.to_thread(remove_public_uplink, net.host_if)
            if net.dns is not None:
                net.dns.policy = self._dns_policy(net, carry=net.dns.policy)

    def _host_rules(self, net: VmNetwork) -> None:
        """The host's table (created if missing, else given this pool), and a public machine's uplink in it
        before its guest can send anything: the host itself is then out of its reach."""
        if not self.host_rules:
            return
        host = build_host_ruleset([self.pool.network], HOST_IF_PREFIX)
        if not nft.table_exists(None, HOST_TABLE):
            try:
                nft.apply(None, render(host, replace=False))
            except NetError:
                if not nft.table_exists(None, HOST_TABLE):  # not another daemon's creation racing ours
                    raise
        elif not self._host_chains_checked:   # a table an older daemon made: add the chains it lacks
            have = nft.chain_names(None, HOST_TABLE)
            missing = [c for c in host.chains if c.name not in have]
            if missing:
                nft.apply(None, render_chains(host, missing))
        self._host_chains_checked = True
        if not self._pool_in_host_table:
            try:
                nft.add_elements(None, SET_NAT_SOURCES, [network_element(self.pool.network)], table=HOST_TABLE)
            except NetError as e:  # another daemon's pool overlapping ours: its element masquerades ours too
                log.info("pool %s not added to the host's nat_sources: %s", self.pool.network, e)
            self._pool_in_host_table = True
        if net.resolved.public:
            nft.add_elements(None, SET_PUBLIC_UPLINKS, [f'"{net.host_if}"'], table=HOST_TABLE)

    def _create_links(self, net: VmNetwork) -> None:
        if self.enable_forwarding and netns.read_sysctl("net.ipv4.ip_forward") != "1":
            log.warning("enabling net.ipv4.ip_forward on the host (guest networking routes through it)")
            netns.write_sysctl("net.ipv4.ip_forward", "1")
        netns.create_namespace(net.namespace)
        peer = PEER_IF_PREFIX + machine_suffix(net.machine_id)
        with IPRoute() as ipr:
            try:
                ipr.link("add", ifname=net.host_if, kind="veth", peer=peer)
                peer_idx = ipr.link_lookup(ifname=peer)[0]
                ipr.link("set", index=peer_idx, net_ns_fd=str(netns.netns_path(net.namespace)))
                host_idx = ipr.link_lookup(ifname=net.host_if)[0]
                ipr.addr("add", index=host_idx, address=str(net.uplink.host), prefixlen=net.uplink.prefixlen)
                ipr.link("set", index=host_idx, state="up")
            except Exception as e:
                raise NetError(f"cannot create the uplink {net.host_if}: {e}") from None
        netns.in_netns(net.namespace, _configure_namespace, net, peer)

    def _allow_resolved(self, net: VmNetwork) -> None:
        """Re-adoption: make sure the names' current addresses are in the allowed sets."""
        for name, addrs in net.resolved.names.items():
            self._add_name_addresses(net, name, addrs)

    def _add_name_addresses(self, net: VmNetwork, name: str, addrs: Iterable[ipaddress.IPv4Address]) -> None:
        if name not in net.resolved.name_ports:   # a name of a policy replaced meanwhile (update): allow nothing
            return
        plain: list[str] = []
        with_port: list[str] = []
        nets = list(net.resolved.allowed.networks)
        ports = list(net.resolved.allowed.ports)
        for a in addrs:
            for port in net.resolved.name_ports.get(name, (None,)):
                if net.allowed.allows(a, port):
                    continue
                if port is None:
                    plain.append(network_element(ipaddress.IPv4Network(a)))
                    nets.append(ipaddress.IPv4Network(a))
                else:
                    with_port.append(port_element(ipaddress.IPv4Network(a), port))
                    ports.append((ipaddress.IPv4Network(a), port))
        nft.add_elements(net.namespace, SET_ALLOW, plain)
        nft.add_elements(net.namespace, SET_ALLOW_PORT, with_port)
        net.resolved = ResolvedPolicy(AllowedDestinations.of(nets, ports), net.resolved.names,
                                      net.resolved.name_ports, net.resolved.ignored, net.resolved.public)

    def _dns_policy(self, net: VmNetwork, carry: DnsPolicy | None = None) -> DnsPolicy:
        """The resolver's policy for the machine's current network policy (``carry``: the one it replaces,
        whose counts of denied names it keeps)."""
        async def on_addresses(name: str, addrs: tuple[ipaddress.IPv4Address, ...]) -> None:
            async with net.lock:
                await asyncio.to_thread(self._add_name_addresses, net, name, addrs)

        policy = DnsPolicy(net.resolved.names, self.resolve, on_addresses, any_name=net.resolved.public)
        if carry is not None:
            policy.carry_counts(carry)
        return policy

    async def _start_dns(self, net: VmNetwork) -> None:
        policy = self._dns_policy(net)
        udp, tcp = await asyncio.to_thread(netns.in_netns, net.namespace, _dns_sockets)
        server = DnsServer(policy)
        try:
            await server.start(udp, tcp)
        except BaseException:
            udp.close()
            tcp.close()
            raise
        net.dns = server

    # --- report -------------------------------------------------------------------------------------------
    async def report(self, net: VmNetwork) -> NetworkReport:
        """Named counters, denied destinations and denied DNS names of one machine."""
        def read() -> tuple[dict[str, int], list[nft.DeniedElement]]:
            counters = nft.read_counters(net.namespace)
            denied = nft.read_denied(net.namespace, SET_DENIED_L4) + nft.read_denied(net.namespace, SET_DENIED_OTHER)
            return counters, denied

        counters, denied = await asyncio.to_thread(read)
        stats = net.dns.policy.stats() if net.dns is not None else None
        return NetworkReport(
            counters=tuple((name, counters.get(name, 0)) for name in COUNTERS),
            denied=tuple(sorted((DeniedDestination(d.address, d.protocol, d.port, d.packets) for d in denied),
                                key=lambda d: (d.address, d.protocol, d.port))),
            denied_names=stats.denied if stats else (),
            denied_dns_queries=stats.denied_queries if stats else 0)

    # --- tear down ----------------------------------------------------------------------------------------
    async def teardown(self, net: VmNetwork) -> None:
        """Stop the port forwards and the resolver, delete the uplink and the namespace (with its tap and nft
        table)."""
        if net.forwarder is not None:
            await net.forwarder.close()
            net.forwarder = None
        if net.dns is not None:
            await net.dns.close()
            net.dns = None
        await asyncio.to_thread(remove_network, net.namespace, net.host_if)
        if self.host_rules:   # whatever its policy says: an interrupted change may have left it there
            await asyncio.to_thread(remove_public_uplink, net.host_if)
        self.pool.release(net.uplink.index)
        self.networks.pop(net.machine_id, None)

    async def teardown_machine(self, machine_id: str) -> None:
        net = self.networks.get(machine_id)
        if net is not None:
            await self.teardown(net)
        else:
            await asyncio.to_thread(remove_network, namespace_name(machine_id), host_if_name(machine_id))
            if self.host_rules:
                await asyncio.to_thread(remove_public_uplink, host_if_name(machine_id))

    def leftovers(self, machine_id: str) -> list[str]:
        """What of a machine's network still exists (should be nothing after teardown)."""
        return network_leftovers(namespace_name(machine_id), host_if_name(machine_id))

    async def clean_orphans(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove namespaces and uplinks of machines not in ``keep`` (a restarted daemon's leftovers)."""
        keep_suffixes = {machine_suffix(m) for m in keep}
        keep_suffixes |= {machine_suffix(m) for m in self.networks}

        def clean() -> list[str]:
            removed = []
            for ns in netns.list_namespaces():
                if ns.startswith(NS_PREFIX) and ns[len(NS_PREFIX):] not in keep_suffixes:
                    remove_network(ns, HOST_IF_PREFIX + ns[len(NS_PREFIX):])
                    if self.host_rules:
                        remove_public_uplink(HOST_IF_PREFIX + ns[len(NS_PREFIX):])
                    removed.append(ns)
            for link in netns.list_links(HOST_IF_PREFIX) + netns.list_links(PEER_IF_PREFIX):
                if link[3:] not in keep_suffixes and len(link) == 15:
                    netns.delete_link(link)
                    removed.append(link)
            return removed

        removed = await asyncio.to_thread(clean)
        for r in removed:
            log.info("removed orphaned network %s", r)
        return removed


def _configure_namespace(net: VmNetwork, peer: str) -> None:
    """In the machine's namespace: lo, the uplink, the default route, forwarding, and the guest link."""
    netns.write_sysctl("net.ipv4.ip_forward", "1")
    with IPRoute() as ipr:
        try:
            lo = ipr.link_lookup(ifname="lo")[0]
            ipr.link("set", index=lo, state="up")
            up = ipr.link_lookup(ifname=peer)[0]
            ipr.link("set", index=up, ifname=UPLINK_IF)
            ipr.addr("add", index=up, address=str(net.uplink.inner), prefixlen=net.uplink.prefixlen)
            ipr.link("set", index=up, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=str(net.uplink.host))
            if net.guest_link == "tap":
                netns.create_tap(GUEST_IF, *(net.tap_owner or (os.getuid(), os.getgid())))
            else:  # a test's fake guest: the peer "guest0" is moved into the test's guest namespace
                ipr.link("add", ifname=GUEST_IF, kind="veth", peer="guest0")
            g = ipr.link_lookup(ifname=GUEST_IF)[0]
            ipr.link("set", index=g, address=GATEWAY_MAC)
            ipr.addr("add", index=g, address=str(GATEWAY), prefixlen=GUEST_NET.prefixlen)
            ipr.link("set", index=g, state="up")
        except NetError:
            raise
        except Exception as e:
            raise NetError(f"cannot configure namespace {net.namespace}: {e}") from None


def _dns_sockets() -> tuple[socket.socket, socket.socket]:
    """UDP and TCP sockets on the gateway's port 53 (made in the namespace's thread; they stay there)."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for s in (udp, tcp):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((str(GATEWAY), 53))
        tcp.listen(16)
    except OSError as e:
        udp.close()
        tcp.close()
        raise NetError(f"cannot bind the DNS resolver to {GATEWAY}:53: {e}") from None
    return udp, tcp


def remove_network(namespace: str, host_if: str) -> None:
    """Delete the uplink (both veth ends) and the namespace; the tap and nft table go with the namespace."""
    with contextlib.suppress(NetError):
        netns.delete_link(host_if)
    if netns.namespace_exists(namespace):
        with contextlib.suppress(NetError):  # if the namespace lingers, the tap must not keep it busy
            netns.in_netns(namespace, netns._delete_link, GUEST_IF)
        netns.remove_namespace(namespace)


def _describe(policy: NetworkPolicy) -> str:
    parts = (["public"] if policy.public else []) + [str(r) for r in policy.allow]
    return ", ".join(parts) or "nothing allowed"


def _recorded_policy(recorded: object, created: NetworkPolicy) -> NetworkPolicy:
    """The policy net.json records (the last NetworkManager.update's), with the forwards of ``created``; a
    record without one (written before updates existed): ``created``."""
    if recorded is None:
        return created
    if not isinstance(recorded, dict) or not isinstance(recorded.get("allow", []), list):
        raise ValueError(f"policy: not an object with an allow list: {recorded!r}")
    allow, public = list(recorded.get("allow", [])), recorded.get("public", False) is True
    if not allow and not public:
        return NetworkPolicy(forward=created.forward, closed=True)
    parsed = parse_mapping({"network": {"allow": allow, "public": public}}, base_dir=None).network
    return NetworkPolicy(parsed.allow, created.forward, parsed.public)


def remove_public_uplink(host_if: str) -> None:
    """Take a machine's uplink out of the host table's public set (nothing if it is not there)."""
    with contextlib.suppress(NetError):
        nft.delete_elements(None, SET_PUBLIC_UPLINKS, [f'"{host_if}"'], table=HOST_TABLE)


def network_leftovers(namespace: str, host_if: str) -> list[str]:
    out = []
    if netns.namespace_exists(namespace):
        out.append(f"network namespace {namespace} still exists")
        with contextlib.suppress(NetError):
            if netns.link_exists(GUEST_IF, namespace):
                out.append(f"tap {GUEST_IF} in {namespace} still exists")
        if nft.table_exists(namespace, TABLE):
            out.append(f"nft table {TABLE} in {namespace} still exists")
    if netns.link_exists(host_if):
        out.append(f"veth {host_if} still exists")
    return out


