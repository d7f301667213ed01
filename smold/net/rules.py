"""The nftables ruleset of one VM's namespace, built as data (``Ruleset``) and rendered for ``nft -f``.

Inside the namespace the guest's link (``tap0``) has the gateway address and ``up0`` leads to the host.
Forwarded traffic is dropped unless the guest opened it towards an allowed destination (a CIDR, or a
CIDR and port); the namespace itself accepts from the guest only DNS to the gateway's resolver. Denied
attempts are counted by named counters (one per dropping rule) and recorded in dynamic sets keyed by
destination (``denied_l4``: address . protocol . port, ``denied_other``: address . protocol), each
element with its own counter, so the report can say what the guest tried to reach. Guest traffic leaving
through ``up0`` is masqueraded to the namespace's uplink address. A public policy also accepts new guest
connections to any IPv4 address outside ``blocked_v4`` (``NON_PUBLIC_V4`` and the machines' pool); allowed
destinations are accepted before that set is looked at, so an allow entry opens a private range. Syntax:
nft(8), "SETS", "COUNTER", "DYNAMIC SETS" ("add @set { ... }" from the packet path), "MASQUERADE".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

TABLE = "smol"
FAMILY = "inet"
GUEST_IF = "tap0"
UPLINK_IF = "up0"
DNS_PORT = 53
DENIED_SET_SIZE = 1024
LOG_RATE = "5/second"

# the named counters, one per rule that drops (read back for the report)
COUNTER_FORWARD = "denied_forward"    # guest -> a destination not allowed
COUNTER_INPUT = "denied_input"        # guest -> the namespace itself, other than its DNS resolver
COUNTER_SPOOF = "denied_spoof"        # guest packets with a source address that is not the guest's
COUNTER_INBOUND = "denied_inbound"    # unsolicited traffic from the host side towards the guest
COUNTER_ALLOWED = "allowed_forward"   # new guest connections that were allowed
COUNTERS = (COUNTER_FORWARD, COUNTER_INPUT, COUNTER_SPOOF, COUNTER_INBOUND, COUNTER_ALLOWED)
SET_ALLOW = "allow_v4"
SET_ALLOW_PORT = "allow_v4_port"
SET_DENIED_L4 = "denied_l4"
SET_DENIED_OTHER = "denied_other"
SET_BLOCKED = "blocked_v4"

# What a public policy never reaches unless an allow entry names it: this host's and other private networks,
# loopback, link-local (169.254.169.254 is the cloud metadata service), shared address space (carrier NAT),
# IETF protocol assignments, benchmarking, multicast, reserved and broadcast (RFC 6890 and its registry).
# 168.63.129.16 is Azure's platform address (WireServer, DNS, health probes): public, but the host's own.
NON_PUBLIC_V4 = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4", "168.63.129.16/32"))


@dataclass(frozen=True)
class AllowedDestinations:
    """Where the guest may connect: whole networks, or a network at one TCP/UDP port (IPv4 only: the guest
    has no IPv6 address)."""

    networks: tuple[ipaddress.IPv4Network, ...] = ()
    ports: tuple[tuple[ipaddress.IPv4Network, int], ...] = ()

    @classmethod
    def of(cls, networks: Iterable[ipaddress.IPv4Network],
           ports: Iterable[tuple[ipaddress.IPv4Network, int]]) -> AllowedDestinations:
        """Normalized: overlapping networks collapsed (nft rejects overlapping interval elements), a
        network+port already covered by an any-port network dropped, sorted."""
        nets = tuple(ipaddress.collapse_addresses(networks))
        by_port: dict[int, list[ipaddress.IPv4Network]] = {}
        for net, port in ports:
            if not any(net.subnet_of(n) for n in nets):
                by_port.setdefault(port, []).append(net)
        pairs = tuple(sorted(((n, p) for p, group in by_port.items() for n in ipaddress.collapse_addresses(group)),
                             key=lambda np: (np[1], np[0])))
        return cls(nets, pairs)

    def allows(self, address: ipaddress.IPv4Address, port: int | None = None) -> bool:
        """Whether the guest may reach ``address`` (at ``port``; None: any port)."""
        if any(address in n for n in self.networks):
            return True
        return port is not None and any(address in n and p == port for n, p in self.ports)


@dataclass(frozen=True)
class NftSet:
    name: str
    type: tuple[str, ...]
    flags: tuple[str, ...] = ()
    elements: tuple[str, ...] = ()
    size: int | None = None
    counter: bool = False


@dataclass(frozen=True)
class NftChain:
    name: str
    type: str
    hook: str
    priority: str
    policy: str
    rules: tuple[str, ...]


@dataclass(frozen=True)
class Ruleset:
    """One table: its named counters, sets and base chains (rules in nft syntax, in order)."""

    family: str
    table: str
    counters: tuple[str, ...]
    sets: tuple[NftSet, ...]
    chains: tuple[NftChain, ...] = field(default=())

    def chain(self, name: str) -> NftChain:
        for c in self.chains:
            if c.name == name:
                return c
        raise KeyError(name)

    def set(self, name: str) -> NftSet:
        for s in self.sets:
            if s.name == name:
                return s
        raise KeyError(name)


def network_element(net: ipaddress.IPv4Network) -> str:
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def port_element(net: ipaddress.IPv4Network, port: int) -> str:
    return f"{network_element(net)} . {port}"


def blocked_networks(extra: Iterable[ipaddress.IPv4Network] = ()) -> tuple[ipaddress.IPv4Network, ...]:
    """``NON_PUBLIC_V4`` and ``extra`` (the machines' pool), collapsed for an interval set."""
    return tuple(ipaddress.collapse_addresses([*NON_PUBLIC_V4, *extra]))


def build_ruleset(allowed: AllowedDestinations, *, gateway: ipaddress.IPv4Address,
                  guest: ipaddress.IPv4Address, guest_if: str = GUEST_IF, uplink_if: str = UPLINK_IF,
                  table: str = TABLE, public: bool = False,
                  blocked: Iterable[ipaddress.IPv4Network] = (), generation: int = 1) -> Ruleset:
    """The ruleset for one VM namespace (see the module docstring). ``public``: also every IPv4 address
    outside ``blocked_networks(blocked)``. ``generation``: the policy's number (1 at create, one more at each
    change): a forwarded connection is marked with the generation that accepted it, and only connections of
    the current one stay established, so a policy change also cuts what the old policy let through."""
    tcp_udp = "meta l4proto { tcp, udp }"
    g = f'iifname "{guest_if}"'
    public_sets = (NftSet(SET_BLOCKED, ("ipv4_addr",), ("interval",),
                          tuple(network_element(n) for n in blocked_networks(blocked))),) if public else ()
    mark = f"ct mark set {generation}"
    public_rules = (f"{g} ip daddr != @{SET_BLOCKED} counter name \"{COUNTER_ALLOWED}\" {mark} accept",) if public else ()
    sets = (
        NftSet(SET_ALLOW, ("ipv4_addr",), ("interval",), tuple(network_element(n) for n in allowed.networks)),
        NftSet(SET_ALLOW_PORT, ("ipv4_addr", "inet_service"), ("interval",),
               tuple(port_element(n, p) for n, p in allowed.ports)),
        NftSet(SET_DENIED_L4, ("ipv4_addr", "inet_proto", "inet_service"), ("dynamic",), size=DENIED_SET_SIZE,
               counter=True),
        NftSet(SET_DENIED_OTHER, ("ipv4_addr", "inet_proto"), ("dynamic",), size=DENIED_SET_SIZE, counter=True),
        *public_sets,
    )
    forward = NftChain("forward", "filter", "forward", "filter", "drop", (
        f"ct state established,related ct mark {generation} accept",
        f"{g} ip saddr != {guest} counter name \"{COUNTER_SPOOF}\" drop",
        f"{g} ip daddr @{SET_ALLOW} counter name \"{COUNTER_ALLOWED}\" {mark} accept",
        f"{g} {tcp_udp} ip daddr . th dport @{SET_ALLOW_PORT} counter name \"{COUNTER_ALLOWED}\" {mark} accept",
        *public_rules,
        f"{g} {tcp_udp} add @{SET_DENIED_L4} {{ ip daddr . meta l4proto . th dport }}",
        f"{g} meta nfproto ipv4 meta l4proto != {{ tcp, udp }} add @{SET_DENIED_OTHER} {{ ip daddr . meta l4proto }}",
        f"{g} counter name \"{COUNTER_FORWARD}\" limit rate {LOG_RATE} log prefix \"smol-deny \" drop",
        f"{g} drop",
        f'iifname "{uplink_if}" counter name "{COUNTER_INBOUND}" drop',
    ))
    input_ = NftChain("input", "filter", "input", "filter", "drop", (
        'iif "lo" accept',
        "ct state established,related accept",
        f"{g} ip daddr {gateway} udp dport {DNS_PORT} accept",
        f"{g} ip daddr {gateway} tcp dport {DNS_PORT} accept",
        f"{g} meta nfproto ipv4 meta l4proto != {{ tcp, udp }} add @{SET_DENIED_OTHER} {{ ip daddr . meta l4proto }}",
        f"{g} {tcp_udp} add @{SET_DENIED_L4} {{ ip daddr . meta l4proto . th dport }}",
        f"{g} counter name \"{COUNTER_INPUT}\" drop",
        f'iifname "{uplink_if}" counter name "{COUNTER_INBOUND}" drop',
    ))
    # the namespace originates nothing but the resolver's replies (established) and ARP
    output = NftChain("output", "filter", "output", "filter", "accept", ())
    postrouting = NftChain("postrouting", "nat", "postrouting", "srcnat", "accept", (
        f'oifname "{uplink_if}" ip saddr {guest} masquerade',
    ))
    return Ruleset(FAMILY, table, COUNTERS, sets, (forward, input_, output, postrouting))


# The host's own table (in the daemon's namespace), shared by every machine of every daemon on the host:
HOST_TABLE = "smol_host"
SET_PUBLIC_UPLINKS = "public_uplinks"   # host ends (smh<hex>) of the uplinks of machines with a public policy
SET_NAT_SOURCES = "nat_sources"         # the daemons' address pools: masqueraded when they leave the host
COUNTER_HOST = "denied_host"            # new connections from a public machine to the host itself


def build_host_ruleset(nat_sources: Iterable[ipaddress.IPv4Network], uplink_prefix: str) -> Ruleset:
    """The host's table: traffic from the pools leaving the host is masqueraded (so allowed and public
    destinations beyond it answer), and a machine with a public policy reaches none of the host's own
    addresses (whatever they are; its namespace's rules already keep it off private ranges)."""
    up = f"iifname @{SET_PUBLIC_UPLINKS}"
    sets = (NftSet(SET_PUBLIC_UPLINKS, ("ifname",)),
            NftSet(SET_NAT_SOURCES, ("ipv4_addr",), ("interval",),
                   tuple(network_element(n) for n in ipaddress.collapse_addresses(nat_sources))))
    # Before destination NAT (dstnat is -100): a port the host publishes for a container (Docker, Kubernetes)
    # is DNATed in prerouting and forwarded, so it never reaches input; what is addressed to the host goes here.
    prerouting = NftChain("prerouting", "filter", "prerouting", "-150", "accept", (
        f"{up} fib daddr type local ct state established,related accept",
        f"{up} fib daddr type local counter name \"{COUNTER_HOST}\" drop",
    ))
    input_ = NftChain("input", "filter", "input", "filter", "accept", (
        f"{up} ct state established,related accept",
        f"{up} counter name \"{COUNTER_HOST}\" drop",
    ))
    postrouting = NftChain("postrouting", "nat", "postrouting", "srcnat", "accept", (
        f'ip saddr @{SET_NAT_SOURCES} oifname != "{uplink_prefix}*" masquerade',
    ))
    return Ruleset(FAMILY, HOST_TABLE, (COUNTER_HOST,), sets, (prerouting, input_, postrouting))


def _set_body(s: NftSet, elements: bool = True) -> str:
    body = [f"type {' . '.join(s.type)};"]
    if s.flags:
        body.append(f"flags {', '.join(s.flags)};")
    if s.size is not None:
        body.append(f"size {s.size};")
    if s.counter:
        body.append("counter;")
    if elements and s.elements:
        body.append(f"elements = {{ {', '.join(s.elements)} }};")
    return " ".join(body)


def render_update(rs: Ruleset) -> str:
    """An ``nft -f`` script (atomic) that gives the existing table of this name the ruleset's chains and the
    elements of its static sets, keeping its named counters and dynamic sets: what was denied before a
    policy change stays in the report."""
    t = f"{rs.family} {rs.table}"
    out = [f"add counter {t} {name}" for name in rs.counters]
    for s in rs.sets:
        out.append(f"add set {t} {s.name} {{ {_set_body(s, elements=False)} }}")
        if "dynamic" not in s.flags:
            out.append(f"flush set {t} {s.name}")
            if s.elements:
                out.append(f"add element {t} {s.name} {{ {', '.join(s.elements)} }}")
    for c in rs.chains:
        out.append(f"add chain {t} {c.name} {{ type {c.type} hook {c.hook} priority {c.priority}; "
                   f"policy {c.policy}; }}")
        out.append(f"flush chain {t} {c.name}")
        out.extend(f"add rule {t} {c.name} {r}" for r in c.rules)
    return "\n".join(out) + "\n"


def render_chains(rs: Ruleset, chains: Iterable[NftChain]) -> str:
    """An ``nft -f`` script that adds these chains of the ruleset (with their counters and sets, if missing)
    to its existing table."""
    t = f"{rs.family} {rs.table}"
    out = [f"add counter {t} {name}" for name in rs.counters]
    out += [f"add set {t} {s.name} {{ {_set_body(s, elements=False)} }}" for s in rs.sets]
    for c in chains:
        out.append(f"add chain {t} {c.name} {{ type {c.type} hook {c.hook} priority {c.priority}; "
                   f"policy {c.policy}; }}")
        out.extend(f"add rule {t} {c.name} {r}" for r in c.rules)
    return "\n".join(out) + "\n"


def render(rs: Ruleset, replace: bool = True) -> str:
    """The ruleset as an ``nft -f`` script that (re)creates the table atomically (``replace``; else one that
    creates it and fails if it exists)."""
    head = ([f"table {rs.family} {rs.table} {{}}", f"delete table {rs.family} {rs.table}"] if replace
            else [f"create table {rs.family} {rs.table}"])
    out = [*head, f"table {rs.family} {rs.table} {{"]
    for name in rs.counters:
        out.append(f"\tcounter {name} {{ }}")
    for s in rs.sets:
        out.append(f"\tset {s.name} {{ {_set_body(s)} }}")
    for c in rs.chains:
        out.append(f"\tchain {c.name} {{")
        out.append(f"\t\ttype {c.type} hook {c.hook} priority {c.priority}; policy {c.policy};")
        out.extend(f"\t\t{r}" for r in c.rules)
        out.append("\t}")
    out.append("}")
    return "\n".join(out) + "\n"
