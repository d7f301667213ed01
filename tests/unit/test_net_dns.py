"""The policy resolver: DNS parsing and building (hostile input), what is answered, what is denied and counted."""

from __future__ import annotations

import asyncio
import ipaddress
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smold.net import dns
from smold.net.errors import DnsFormatError
from smold.net.resolver import MAX_DENIED_NAMES, MAX_OPEN_NAMES, REFRESH_S, DnsPolicy, DnsServer

A = ipaddress.IPv4Address
HOSTS = {"hosta.test": (A("10.251.1.2"),)}


def make_policy(resolve=lambda n: (), on=None, clock=None):  # type: ignore[no-untyped-def]
    kw = {"clock": clock} if clock else {}
    return DnsPolicy(HOSTS, resolve, on, **kw)


def ask(policy: DnsPolicy, msg: bytes, limit: int = dns.MAX_UDP) -> bytes | None:
    return asyncio.run(policy.answer(msg, limit))


def test_allowed_name_gets_its_a_records_case_and_trailing_dot_insensitive() -> None:
    p = make_policy()
    for name in ("hosta.test", "HostA.TEST.", "hOsTa.test"):
        q = dns.build_query(name, ident=0xBEEF)
        r = dns.parse_response(ask(p, q) or b"")
        assert (r.id, r.rcode, r.addresses, r.truncated) == (0xBEEF, dns.RCODE_NOERROR, HOSTS["hosta.test"], False)
    assert p.stats().denied == () and p.denied_queries == 0


def test_other_names_get_nxdomain_and_are_counted() -> None:
    p = make_policy()
    for name in ("evil.test", "aGVsbG8.exfil.evil.test", "evil.test", "sub.hosta.test"):
        r = dns.parse_response(ask(p, dns.build_query(name)) or b"")
        assert r.rcode == dns.RCODE_NXDOMAIN and r.addresses == ()
    assert p.stats().denied == (("agvsbg8.exfil.evil.test", 1), ("evil.test", 2), ("sub.hosta.test", 1))
    assert p.denied_queries == 4


def test_aaaa_of_an_allowed_name_is_empty_and_non_query_opcodes_are_not_implemented() -> None:
    p = make_policy()
    r = dns.parse_response(ask(p, dns.build_query("hosta.test", dns.TYPE_AAAA)) or b"")
    assert r.rcode == dns.RCODE_NOERROR and r.addresses == ()
    notify = bytearray(dns.build_query("hosta.test"))
    notify[2] |= 4 << 3  # opcode 4 (NOTIFY)
    assert dns.parse_response(ask(p, bytes(notify)) or b"").rcode == dns.RCODE_NOTIMP


def test_other_classes_are_denied() -> None:
    q = dns.build_query("hosta.test")[:-2] + struct.pack("!H", 3)  # class CH
    p = make_policy()
    assert dns.parse_response(ask(p, q) or b"").rcode == dns.RCODE_NXDOMAIN
    assert p.denied_queries == 1


def test_malformed_messages_get_formerr_or_are_dropped_and_never_raise() -> None:
    p = make_policy()
    header = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    cases = {
        b"": None, b"\x00" * 11: None,                                # too short to answer
        struct.pack("!HHHHHH", 7, 0x8000, 1, 0, 0, 0): None,           # a response: never answered
        header + b"\x05abc": dns.RCODE_FORMERR,                       # label runs past the end
        header + b"\xc0\x0c\x00\x01\x00\x01": dns.RCODE_FORMERR,      # pointer to itself
        header + b"\x40abc\x00\x00\x01\x00\x01": dns.RCODE_FORMERR,   # reserved label type
        header + b"\x03abc\x00\x00": dns.RCODE_FORMERR,               # question cut short
        header + (b"\x3f" + b"a" * 63) * 5 + b"\x00\x00\x01\x00\x01": dns.RCODE_FORMERR,  # name > 255
        struct.pack("!HHHHHH", 7, 0x0100, 2, 0, 0, 0) + b"\x00" * 10: dns.RCODE_FORMERR,  # two questions
        struct.pack("!HHHHHH", 7, 0x0100, 0, 0, 0, 0): dns.RCODE_FORMERR,                  # none
    }
    for msg, rcode in cases.items():
        out = ask(p, msg)
        if rcode is None:
            assert out is None, msg
        else:
            assert out is not None and dns.parse_response(out).rcode == rcode, msg
    assert p.malformed == len(cases)


def test_compression_loops_are_bounded() -> None:
    header = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    # a chain of backward pointers, each to the one before: fine up to MAX_POINTERS jumps, refused beyond
    def chain(n: int) -> tuple[bytes, int]:
        msg = header + b"\x00"
        prev = 12
        for _ in range(n):
            here = len(msg)
            msg += struct.pack("!H", 0xC000 | prev)
            prev = here
        return msg, prev

    msg, last = chain(dns.MAX_POINTERS)
    assert dns.read_name(msg, last) == ("", last + 2)
    msg, last = chain(dns.MAX_POINTERS + 1)
    with pytest.raises(DnsFormatError):
        dns.read_name(msg, last)
    # a valid backward pointer completes a name; the stream continues after the pointer
    msg = header + b"\x01a\x00" + b"\x01b\xc0\x0c"
    assert dns.read_name(msg, 15) == ("b.a", 19)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_get_a_bounded_answer_or_none(data: bytes) -> None:
    out = ask(make_policy(), data)
    assert out is None or len(out) <= dns.MAX_UDP


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_questions_after_a_valid_header_never_raise(tail: bytes) -> None:
    msg = struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + tail
    out = ask(make_policy(), msg)
    assert out is not None and dns.parse_response(out).id == 1


def test_a_compressed_question_is_echoed_uncompressed() -> None:
    # Found by the fuzz test above: the question's name is a pointer into the query's header (offset 1). Copied
    # verbatim, it pointed at the response's flags (0x81: an unsupported label type) instead.
    msg = struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x01\x00\x01\x00\x01"
    out = ask(make_policy(), msg)
    assert out is not None
    resp = dns.parse_response(out)
    assert resp.id == 1
    assert out[12:19] == b"\x01\x01\x00" + b"\x00\x01\x00\x01"   # the label, the root, QTYPE A, QCLASS IN
    assert dns.read_name(out, 12)[0] == dns.read_name(msg, 12)[0] == "\\001"


def test_many_answers_are_truncated_to_fit_udp() -> None:
    many = tuple(A(f"10.0.{i // 256}.{i % 256}") for i in range(100))
    p = DnsPolicy({"big.test": many}, lambda n: ())
    r = dns.parse_response(ask(p, dns.build_query("big.test")) or b"")
    assert r.truncated and 0 < len(r.addresses) < 100
    full = asyncio.run(p.answer(dns.build_query("big.test"), dns.MAX_TCP))
    assert dns.parse_response(full or b"").addresses == many


def test_denied_names_are_bounded() -> None:
    p = make_policy()
    for i in range(MAX_DENIED_NAMES + 50):
        ask(p, dns.build_query(f"n{i}.evil.test"))
    assert len(p.stats().denied) == MAX_DENIED_NAMES and p.denied_queries == MAX_DENIED_NAMES + 50


def test_stale_names_are_resolved_again_and_new_addresses_allowed_first() -> None:
    now = [0.0]
    added: list[tuple[str, tuple[A, ...]]] = []

    async def on(name: str, addrs: tuple[A, ...]) -> None:
        added.append((name, addrs))

    p = make_policy(resolve=lambda n: [A("10.251.1.3")], on=on, clock=lambda: now[0])
    assert dns.parse_response(ask(p, dns.build_query("hosta.test")) or b"").addresses == (A("10.251.1.2"),)
    now[0] = REFRESH_S + 1
    assert dns.parse_response(ask(p, dns.build_query("hosta.test")) or b"").addresses == (A("10.251.1.3"),)
    assert added == [("hosta.test", (A("10.251.1.3"),))]


def test_a_public_policy_answers_any_name_as_the_host_resolves_it() -> None:
    now = [0.0]
    looked_up: list[str] = []
    added: list[str] = []

    def resolve(name: str) -> list[A]:
        looked_up.append(name)
        if name == "slow.test":
            raise TimeoutError("the host's resolver did not answer")
        return {"www.example.test": [A("203.0.113.7")], "meta.test": [A("169.254.169.254")]}.get(name, [])

    async def on(name: str, addrs: tuple[A, ...]) -> None:
        added.append(name)

    p = DnsPolicy(HOSTS, resolve, on, clock=lambda: now[0], any_name=True)
    r = dns.parse_response(ask(p, dns.build_query("WWW.Example.test.")) or b"")
    assert (r.rcode, r.addresses) == (dns.RCODE_NOERROR, (A("203.0.113.7"),))
    # an answer is not a permission: a private address resolves, and the namespace's rules still drop it
    assert dns.parse_response(ask(p, dns.build_query("meta.test")) or b"").addresses == (A("169.254.169.254"),)
    assert dns.parse_response(ask(p, dns.build_query("nowhere.test")) or b"").rcode == dns.RCODE_NXDOMAIN
    assert dns.parse_response(ask(p, dns.build_query("slow.test")) or b"").rcode == dns.RCODE_SERVFAIL
    aaaa = dns.parse_response(ask(p, dns.build_query("www.example.test", dns.TYPE_AAAA)) or b"")
    assert (aaaa.rcode, aaaa.addresses) == (dns.RCODE_NOERROR, ())
    # listed names keep their own path (their addresses go to the allowed sets first); nothing is denied
    assert dns.parse_response(ask(p, dns.build_query("hosta.test")) or b"").addresses == HOSTS["hosta.test"]
    assert added == [] and p.denied_queries == 0 and p.stats().denied == ()
    looked_up.clear()
    ask(p, dns.build_query("www.example.test"))
    assert looked_up == []                      # answered from the cache
    now[0] = REFRESH_S + 1
    ask(p, dns.build_query("www.example.test"))
    assert looked_up == ["www.example.test"]    # and looked up again once stale


def test_a_public_policys_cache_is_bounded() -> None:
    p = DnsPolicy({}, lambda n: [A("203.0.113.1")], any_name=True)
    for i in range(MAX_OPEN_NAMES + 20):
        ask(p, dns.build_query(f"n{i}.example.test"))
    assert len(p._open) == MAX_OPEN_NAMES and "n0.example.test" not in p._open


def test_a_public_policys_host_lookups_are_bounded() -> None:
    """Names that never resolve hold at most MAX_ANY_NAME_LOOKUPS threads of the resolver's own pool; more queries
    get SERVFAIL at once, and the slots come back when the host's lookups end."""
    import threading

    from smold.net.resolver import MAX_ANY_NAME_LOOKUPS
    release = threading.Event()

    def resolve(name: str) -> list[A]:
        if name.startswith("hang"):
            release.wait(30)
        return [A("203.0.113.5")]

    p = DnsPolicy({}, resolve, any_name=True)

    async def main() -> list[int]:
        hanging = [asyncio.ensure_future(p.answer(dns.build_query(f"hang{i}.test"))) for i in range(MAX_ANY_NAME_LOOKUPS)]
        await asyncio.sleep(0.2)
        extra = dns.parse_response(await p.answer(dns.build_query("one-more.test")) or b"").rcode
        release.set()
        done = [dns.parse_response(r or b"").rcode for r in await asyncio.gather(*hanging)]
        await asyncio.sleep(0.2)
        after = dns.parse_response(await p.answer(dns.build_query("later.test")) or b"").rcode
        return [extra, *done, after]

    codes = asyncio.run(main())
    assert codes == [dns.RCODE_SERVFAIL] + [dns.RCODE_NOERROR] * MAX_ANY_NAME_LOOKUPS + [dns.RCODE_NOERROR]


def test_server_answers_over_udp_and_tcp() -> None:
    import socket

    async def main() -> None:
        p = make_policy()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        server = DnsServer(p)
        await server.start(udp, tcp)
        loop = asyncio.get_running_loop()
        try:
            c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            c.setblocking(False)
            await loop.sock_connect(c, udp.getsockname())
            await loop.sock_sendall(c, dns.build_query("hosta.test", ident=5))
            r = dns.parse_response(await asyncio.wait_for(loop.sock_recv(c, 512), 5))
            assert r.id == 5 and r.addresses == HOSTS["hosta.test"]
            c.close()
            reader, writer = await asyncio.open_connection(*tcp.getsockname())
            q = dns.build_query("evil.test", ident=6)
            writer.write(struct.pack("!H", len(q)) + q)
            n = struct.unpack("!H", await reader.readexactly(2))[0]
            r = dns.parse_response(await reader.readexactly(n))
            assert r.id == 6 and r.rcode == dns.RCODE_NXDOMAIN
            writer.close()
        finally:
            await server.close()
        assert p.stats().denied == (("evil.test", 1),)

    asyncio.run(main())
