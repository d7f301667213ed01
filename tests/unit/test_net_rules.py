"""The VM namespace's nftables ruleset as data, its rendering, the allowlist normalization and the pool."""

from __future__ import annotations

import ipaddress
import os
import shutil

import pytest

from smold.net import AddressPool, NetError, PoolExhaustedError
from smold.net import nft as nftcmd
from smold.net.manager import GATEWAY, GUEST, host_if_name, namespace_name, resolve_policy
from smold.net.rules import (
    COUNTER_ALLOWED,
    COUNTER_FORWARD,
    COUNTER_INPUT,
    NON_PUBLIC_V4,
    SET_ALLOW,
    SET_ALLOW_PORT,
    SET_BLOCKED,
    AllowedDestinations,
    build_host_ruleset,
    build_ruleset,
    render,
)
from smold.smolfile import parse_mapping

N = ipaddress.IPv4Network
A = ipaddress.IPv4Address


def policy(*allow: str):  # type: ignore[no-untyped-def]
    return parse_mapping({"network": {"allow": list(allow)}}, base_dir=None).network


def test_allowlist_resolves_names_and_splits_ports() -> None:
    hosts = {"hosta.test": [A("10.251.1.2")], "multi.test": [A("10.0.0.2"), A("10.0.0.1")]}
    r = resolve_policy(policy("10.9.0.0/16", "192.0.2.7:443", "hosta.test:8080", "multi.test", "2001:db8::/32",
                              "missing.test"), lambda n: hosts.get(n, []))
    assert r.allowed.networks == (N("10.0.0.1/32"), N("10.0.0.2/32"), N("10.9.0.0/16"))
    assert r.allowed.ports == ((N("192.0.2.7/32"), 443), (N("10.251.1.2/32"), 8080))
    assert r.names == {"hosta.test": (A("10.251.1.2"),), "multi.test": (A("10.0.0.1"), A("10.0.0.2")),
                       "missing.test": ()}
    assert r.name_ports == {"hosta.test": (8080,), "multi.test": (None,), "missing.test": (None,)}
    assert r.ignored == ("2001:db8::/32",)


def test_overlapping_destinations_are_collapsed() -> None:
    d = AllowedDestinations.of([N("10.0.0.0/8"), N("10.1.2.3/32"), N("192.0.2.0/25"), N("192.0.2.128/25")],
                               [(N("10.5.0.0/16"), 80), (N("172.16.9.0/24"), 80), (N("172.16.9.7/32"), 80)])
    assert d.networks == (N("10.0.0.0/8"), N("192.0.2.0/24"))
    assert d.ports == ((N("172.16.9.0/24"), 80),)   # 10.5/16:80 is inside an any-port network
    assert d.allows(A("10.200.0.1")) and d.allows(A("172.16.9.7"), 80)
    assert not d.allows(A("172.16.9.7"), 81) and not d.allows(A("172.16.9.7")) and not d.allows(A("8.8.8.8"), 80)


def test_ruleset_drops_by_default_and_allows_only_the_sets() -> None:
    allowed = AllowedDestinations.of([N("10.9.0.0/16")], [(N("192.0.2.7/32"), 443)])
    rs = build_ruleset(allowed, gateway=GATEWAY, guest=GUEST)
    fwd, inp = rs.chain("forward"), rs.chain("input")
    assert fwd.policy == "drop" and inp.policy == "drop" and fwd.hook == "forward" and inp.hook == "input"
    assert fwd.rules[0] == "ct state established,related ct mark 1 accept"
    accepts = [r for r in fwd.rules if r.endswith("accept")]
    assert accepts[1:] == [
        'iifname "tap0" ip daddr @allow_v4 counter name "allowed_forward" ct mark set 1 accept',
        'iifname "tap0" meta l4proto { tcp, udp } ip daddr . th dport @allow_v4_port counter name '
        '"allowed_forward" ct mark set 1 accept']
    assert rs.set(SET_ALLOW).elements == ("10.9.0.0/16",)
    assert rs.set(SET_ALLOW_PORT).elements == ("192.0.2.7 . 443",)
    assert any(f'counter name "{COUNTER_FORWARD}"' in r and r.endswith("drop") for r in fwd.rules)
    # the namespace itself: DNS on the gateway only, everything else from the guest counted and dropped
    assert [r for r in inp.rules if r.endswith("accept") and "tap0" in r] == [
        'iifname "tap0" ip daddr 172.16.0.1 udp dport 53 accept',
        'iifname "tap0" ip daddr 172.16.0.1 tcp dport 53 accept']
    assert inp.rules[-2] == f'iifname "tap0" counter name "{COUNTER_INPUT}" drop'
    nat = rs.chain("postrouting")
    assert nat.type == "nat" and nat.rules == ('oifname "up0" ip saddr 172.16.0.2 masquerade',)


def test_empty_allowlist_renders_sets_without_elements() -> None:
    text = render(build_ruleset(AllowedDestinations(), gateway=GATEWAY, guest=GUEST))
    assert "set allow_v4 { type ipv4_addr; flags interval; }" in text
    assert "elements" not in text
    assert text.startswith("table inet smol {}\ndelete table inet smol\ntable inet smol {\n")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"), reason="nft -c needs root and nft")
def test_rendered_ruleset_is_accepted_by_nft() -> None:
    allowed = AllowedDestinations.of([N("10.9.0.0/16"), N("203.0.113.9/32")], [(N("192.0.2.0/24"), 443),
                                                                              (N("198.51.100.1/32"), 53)])
    nftcmd.check(render(build_ruleset(allowed, gateway=GATEWAY, guest=GUEST)))


def test_a_public_ruleset_accepts_what_is_not_blocked_after_the_allow_entries() -> None:
    allowed = AllowedDestinations.of([N("10.9.0.0/16")], [])
    rs = build_ruleset(allowed, gateway=GATEWAY, guest=GUEST, public=True,
                       blocked=[N("10.213.0.0/16"), N("100.80.0.0/16"), N("198.51.100.1/32")], generation=3)
    fwd = rs.chain("forward").rules
    public = f'iifname "tap0" ip daddr != @{SET_BLOCKED} counter name "{COUNTER_ALLOWED}" ct mark set 3 accept'
    allow = 'iifname "tap0" ip daddr @allow_v4 counter name "allowed_forward" ct mark set 3 accept'
    assert fwd.index(allow) < fwd.index(public) < next(i for i, r in enumerate(fwd) if "denied_l4" in r)
    blocked = [N(e) for e in rs.set(SET_BLOCKED).elements]
    for addr in ("169.254.169.254", "10.213.4.2", "127.0.0.1", "192.168.1.1", "172.20.0.1", "100.64.0.1",
                 "224.0.0.251", "255.255.255.255", "198.51.100.1", "0.0.0.0"):
        assert any(A(addr) in n for n in blocked), addr
    for addr in ("203.0.113.7", "8.8.8.8", "198.51.100.2", "1.1.1.1"):
        assert not any(A(addr) in n for n in blocked), addr
    assert all(any(n.subnet_of(b) for b in blocked) for n in NON_PUBLIC_V4)
    # without public: no blocked set and no accept-anything rule
    plain = build_ruleset(allowed, gateway=GATEWAY, guest=GUEST)
    assert SET_BLOCKED not in {s.name for s in plain.sets}
    assert not any("blocked" in r for r in plain.chain("forward").rules)
    # only connections the current generation accepted stay established
    assert fwd[0] == "ct state established,related ct mark 3 accept"


def test_the_host_table_masquerades_the_pool_and_drops_public_uplinks_to_the_host() -> None:
    rs = build_host_ruleset([N("10.213.0.0/16")], "smh")
    assert rs.set("nat_sources").elements == ("10.213.0.0/16",) and rs.set("public_uplinks").type == ("ifname",)
    assert rs.chain("input").policy == "accept" and rs.chain("input").rules == (
        "iifname @public_uplinks ct state established,related accept",
        'iifname @public_uplinks counter name "denied_host" drop')
    assert rs.chain("postrouting").rules == ('ip saddr @nat_sources oifname != "smh*" masquerade',)
    text = render(rs, replace=False)
    assert text.startswith("create table inet smol_host\ntable inet smol_host {\n")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"), reason="nft -c needs root and nft")
def test_public_and_host_rulesets_are_accepted_by_nft() -> None:
    nftcmd.check(render(build_ruleset(AllowedDestinations.of([N("10.9.0.0/16")], [(N("192.168.3.4/32"), 80)]),
                                      gateway=GATEWAY, guest=GUEST, public=True, blocked=[N("10.213.0.0/16")])))
    # (as a replacing script: "create table" fails under nft -c wherever a daemon already made the table)
    nftcmd.check(render(build_host_ruleset([N("10.213.0.0/16"), N("10.214.0.0/24")], "smh")))


def test_the_pool_skips_uplinks_whose_addresses_the_host_already_has() -> None:
    pool = AddressPool("10.214.0.0/28")   # 4 uplinks
    # another daemon on the same pool holds 10.214.0.1 (index 0) and 10.214.0.6 (index 1's inner end)
    assert pool.allocate("m-a", [A("10.214.0.1"), A("10.214.0.6"), A("192.0.2.2")]).index == 2
    assert pool.allocate("m-b").index == 0
    with pytest.raises(PoolExhaustedError):
        pool.allocate("m-c", [A("10.214.0.5"), A("10.214.0.13")])


def test_denied_set_elements_are_read_from_nft_json() -> None:
    elems = [{"elem": {"val": {"concat": ["10.251.2.2", "tcp", 8080]}, "counter": {"packets": 3, "bytes": 180}}},
             {"concat": ["10.0.0.1", "icmp"]}, {"elem": {"val": {"concat": ["not-an-ip", "tcp", 1]}}}, "junk", {}]
    got = [e for x in elems for e in nftcmd._denied_element(x)]
    assert got == [nftcmd.DeniedElement("10.251.2.2", "tcp", 8080, 3), nftcmd.DeniedElement("10.0.0.1", "icmp", 0, 0)]


def test_pool_hands_out_distinct_30s_and_reuses_released_ones() -> None:
    pool = AddressPool("10.213.0.0/29")
    a, b = pool.allocate("m-a"), pool.allocate("m-b")
    assert (a.network, a.host, a.inner) == (N("10.213.0.0/30"), A("10.213.0.1"), A("10.213.0.2"))
    assert b.network == N("10.213.0.4/30")
    with pytest.raises(PoolExhaustedError):
        pool.allocate("m-c")
    pool.release(a.index)
    assert pool.allocate("m-c").network == a.network
    with pytest.raises(NetError):
        pool.reserve(b.index, "m-other")
    assert pool.reserve(b.index, "m-b") == b
    for bad in ("10.213.0.1/16", "2001:db8::/64", "10.0.0.0/31", "nonsense"):
        with pytest.raises(NetError):
            AddressPool(bad)


def test_names_fit_interface_limits() -> None:
    assert namespace_name("m-0123456789ab") == "smol-0123456789ab"
    assert host_if_name("m-0123456789ab") == "smh0123456789ab" and len(host_if_name("m-0123456789ab")) <= 15
    for bad in ("m-XYZ", "m-", "m-0123456789abc", "../etc"):
        with pytest.raises(NetError):
            namespace_name(bad)


def test_vmm_command_carries_the_net_flags_and_the_namespace_only_as_a_prefix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from smold.daemon.images import Image
    from smold.daemon.launcher import LaunchSpec, VmmLauncher
    from smold.net.manager import GUEST_MAC, VmNetwork, resolve_policy
    from smold.smolfile.model import NetworkPolicy

    net = VmNetwork("m-0123456789ab", "smol-0123456789ab", "smh0123456789ab", AddressPool().allocate("m"),
                    resolve_policy(NetworkPolicy(), lambda n: []))
    img = Image("default", tmp_path / "k", tmp_path / "i", tmp_path / "r")
    for restore in (None, tmp_path / "snap"):
        spec = LaunchSpec("m-0123456789ab", tmp_path, img, 1, 256, "h", 60.0, restore_from=restore,
                          net_args=tuple(net.vmm_args()), netns_prefix=tuple(net.launch_prefix()))
        argv = VmmLauncher("/usr/bin/python3").command(spec)
        assert argv[:4] == ["/usr/bin/python3", "-P", "-m", "smold.vmm"]   # what /proc/PID/cmdline will show
        assert argv[-10:] == ["--net-tap", "tap0", "--net-mac", GUEST_MAC, "--net-guest", "172.16.0.2/30",
                              "--net-gateway", "172.16.0.1", "--net-dns", "172.16.0.1"]
        assert "nsenter" not in argv
    assert net.launch_prefix()[0] == "nsenter" and net.launch_prefix()[1].endswith("/smol-0123456789ab")


def test_smolctl_shows_what_the_run_was_refused() -> None:
    from smolctl.output import run_result
    from smold.api.v1 import smol_pb2 as pb

    report = pb.NetworkReport(counters=[pb.NetworkCounter(name="denied_forward", packets=3),
                                        pb.NetworkCounter(name="allowed_forward", packets=9)],
                              denied=[pb.DeniedDestination(address="10.0.0.5", protocol="tcp", port=80, packets=3),
                                      pb.DeniedDestination(address="10.0.0.6", protocol="icmp", packets=1)],
                              denied_names=[pb.DeniedName(name="evil.test", queries=2)], denied_dns_queries=2)
    text = run_result(pb.RunResponse(machine_id="m-1", network=report))
    assert text.splitlines()[-4:] == ["network: 3 packets denied, 2 DNS queries refused",
                                      "  denied  tcp 10.0.0.5:80  (3 packets)",
                                      "  denied  icmp 10.0.0.6  (1 packets)",
                                      "  denied  dns evil.test  (2 queries)"]
    assert "network:" not in run_result(pb.RunResponse(machine_id="m-1"))


def test_addresses_of_a_name_the_policy_no_longer_lists_are_never_allowed() -> None:
    """A lookup that finishes after the machine's policy changed (NetworkManager.update) must not open the new
    policy to the old name's addresses (the name's ports would default to any port)."""
    from smold.net.manager import NetworkManager, VmNetwork
    mgr = NetworkManager(AddressPool("10.214.0.0/28"), resolve=lambda n: [])
    resolved = resolve_policy(policy("10.9.0.0/16"))
    net = VmNetwork("m-0123456789ab", "smol-no-such-namespace", "smh0123456789ab", mgr.pool.allocate("m-x"), resolved)
    mgr._add_name_addresses(net, "old.example.test", [A("203.0.113.9")])   # no nft call (the namespace is absent)
    assert net.resolved == resolved
