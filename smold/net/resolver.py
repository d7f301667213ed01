"""The per-VM DNS resolver: answers A queries for allowed names only (any name for a public policy), from
host-side resolution.

``DnsPolicy`` decides (pure apart from the injected host lookup); ``DnsServer`` serves it over UDP and
TCP (RFC 1035 4.2) on sockets bound to the gateway address inside the VM's namespace. Nothing is ever
forwarded upstream as the guest sent it: a name the Smolfile does not allow gets NXDOMAIN and is counted,
so DNS cannot carry data out of the guest. A public policy, whose guest may reach any public address
anyway, has every name looked up on the host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from . import dns
from .errors import DnsFormatError

log = logging.getLogger("smold.net.resolver")

MAX_DENIED_NAMES = 256       # distinct denied names remembered per machine (the rest only counted)
REFRESH_S = 60.0             # an allowed name is resolved again on the host after this long
RESOLVE_TIMEOUT_S = 5.0
ANSWER_TTL = 30
MAX_INFLIGHT = 64            # UDP queries being answered at once (more are dropped)
MAX_TCP_CLIENTS = 16
TCP_IDLE_S = 10.0
MAX_OPEN_NAMES = 1024        # names a public policy's resolver keeps answers for (the oldest go first)
MAX_ANY_NAME_LOOKUPS = 4     # a public machine's host lookups in flight at once (more: SERVFAIL)
# A public machine's lookups of any name run on threads of their own: names that never resolve (a guest can
# ask for millions) keep these busy, never the daemon's default executor (nft, namespaces, files).
_ANY_NAME_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="smol-dns")

Resolve = Callable[[str], Iterable[ipaddress.IPv4Address]]
OnAddresses = Callable[[str, tuple[ipaddress.IPv4Address, ...]], Awaitable[None]]


def resolve_on_host(name: str) -> tuple[ipaddress.IPv4Address, ...]:
    """The host's IPv4 addresses for ``name`` (getaddrinfo); empty when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    return tuple(sorted({ipaddress.IPv4Address(i[4][0]) for i in infos}))


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


@dataclass(frozen=True)
class DnsStats:
    denied: tuple[tuple[str, int], ...]   # (name, queries) for the first MAX_DENIED_NAMES denied names
    denied_queries: int                   # every denied query, remembered name or not
    malformed: int                        # messages answered FORMERR or dropped


class DnsPolicy:
    """Which names resolve, to what; counts what was denied."""

    def __init__(self, names: Mapping[str, Iterable[ipaddress.IPv4Address]], resolve: Resolve = resolve_on_host,
                 on_addresses: OnAddresses | None = None, clock: Callable[[], float] = time.monotonic,
                 any_name: bool = False) -> None:
        """``names``: the allowed names with their addresses so far; ``any_name`` (a public policy): every
        other name is looked up on the host too (its addresses are not added to the allowed sets)."""
        self._clock = clock
        self._any_name = any_name
        self._any_name_lookups = 0
        self._lookups_lock = threading.Lock()
        self._open: dict[str, tuple[tuple[ipaddress.IPv4Address, ...], float]] = {}
        self._cache: dict[str, tuple[tuple[ipaddress.IPv4Address, ...], float]] = {
            normalize_name(n): (tuple(a), clock()) for n, a in names.items()}
        self._resolve = resolve
        self._on_addresses = on_addresses
        self._denied: dict[str, int] = {}
        self.denied_queries = 0
        self.malformed = 0

    def carry_counts(self, other: DnsPolicy) -> None:
        """Keep the counts of the policy this one replaces (a machine's policy changed)."""
        self._denied = dict(other._denied)
        self.denied_queries = other.denied_queries
        self.malformed = other.malformed

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._cache))

    def stats(self) -> DnsStats:
        return DnsStats(tuple(sorted(self._denied.items())), self.denied_queries, self.malformed)

    def _deny(self, name: str) -> None:
        self.denied_queries += 1
        if name in self._denied or len(self._denied) < MAX_DENIED_NAMES:
            self._denied[name] = self._denied.get(name, 0) + 1

    async def _addresses(self, name: str) -> tuple[ipaddress.IPv4Address, ...]:
        addrs, at = self._cache[name]
        if self._clock() - at < REFRESH_S:
            return addrs
        try:
            fresh = tuple(sorted(set(await asyncio.wait_for(asyncio.to_thread(self._resolve, name),
                                                             RESOLVE_TIMEOUT_S))))
        except (TimeoutError, OSError) as e:
            log.info("resolving %s on the host failed (%s); answering with the last addresses", name, e)
            fresh = ()
        if not fresh:
            return addrs
        new = tuple(a for a in fresh if a not in addrs)
        if new and self._on_addresses is not None:
            await self._on_addresses(name, new)   # allowed by nft before the guest learns them
        merged = tuple(sorted(set(addrs) | set(fresh)))
        self._cache[name] = (merged, self._clock())
        return fresh

    def _lookup_finished(self, _: object) -> None:
        with self._lookups_lock:
            self._any_name_lookups -= 1

    async def _any_name_addresses(self, name: str) -> tuple[ipaddress.IPv4Address, ...] | None:
        """A public policy's lookup of a name it does not list: its addresses (empty: it does not resolve),
        or None when the host's lookup timed out."""
        hit = self._open.get(name)
        if hit is not None and self._clock() - hit[1] < REFRESH_S:
            return hit[0]
        with self._lookups_lock:
            if self._any_name_lookups >= MAX_ANY_NAME_LOOKUPS:
                return None
            self._any_name_lookups += 1
        lookup = _ANY_NAME_POOL.submit(self._resolve, name)
        lookup.add_done_callback(self._lookup_finished)   # when the thread is done: a timed-out one holds its slot
        try:
            addrs = tuple(sorted(set(await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(lookup)),
                                                            RESOLVE_TIMEOUT_S))))
        except (TimeoutError, OSError) as e:
            log.info("resolving %s on the host failed (%s)", name, e)
            return None
        self._open.pop(name, None)
        while len(self._open) >= MAX_OPEN_NAMES:
            self._open.pop(next(iter(self._open)))
        self._open[name] = (addrs, self._clock())
        return addrs

    async def answer(self, msg: bytes, limit: int = dns.MAX_UDP) -> bytes | None:
        """The response to one message, or None to drop it (too short to answer, or itself a response)."""
        try:
            query = dns.parse_query(msg)
        except DnsFormatError:
            self.malformed += 1
            if len(msg) < dns.HEADER.size:
                return None
            bare = dns.Query(struct.unpack_from("!H", msg)[0], struct.unpack_from("!H", msg, 2)[0], 0, None)
            if bare.is_response:
                return None
            return dns.build_response(msg, bare, dns.RCODE_FORMERR, limit=limit)
        if query.is_response:
            self.malformed += 1
            return None
        if query.opcode != dns.OPCODE_QUERY:
            return dns.build_response(msg, dns.Query(query.id, query.flags, 0, None), dns.RCODE_NOTIMP, limit=limit)
        q = query.question
        if q is None:
            self.malformed += 1
            return dns.build_response(msg, query, dns.RCODE_FORMERR, limit=limit)
        name = normalize_name(q.name)
        if (name not in self._cache and not self._any_name) or q.qclass != dns.CLASS_IN:
            self._deny(name if q.qclass == dns.CLASS_IN else f"{name} (class {q.qclass})")
            return dns.build_response(msg, query, dns.RCODE_NXDOMAIN, limit=limit)
        if name not in self._cache:  # a public policy: any name, as the host resolves it
            found = await self._any_name_addresses(name)
            if found is None:
                return dns.build_response(msg, query, dns.RCODE_SERVFAIL, limit=limit)
            if not found:
                return dns.build_response(msg, query, dns.RCODE_NXDOMAIN, limit=limit)
            if q.qtype not in (dns.TYPE_A, dns.TYPE_ANY):
                return dns.build_response(msg, query, dns.RCODE_NOERROR, limit=limit)
            return dns.build_response(msg, query, dns.RCODE_NOERROR, found, ttl=ANSWER_TTL, limit=limit)
        if q.qtype not in (dns.TYPE_A, dns.TYPE_ANY):
            return dns.build_response(msg, query, dns.RCODE_NOERROR, limit=limit)  # no data of that type
        addrs = await self._addresses(name)
        if not addrs:
            return dns.build_response(msg, query, dns.RCODE_SERVFAIL, limit=limit)
        return dns.build_response(msg, query, dns.RCODE_NOERROR, addrs, ttl=ANSWER_TTL, limit=limit)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(self.server.tasks) >= MAX_INFLIGHT:
            return
        self.server.track(self._reply(data, addr))

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        out = await self.server.policy.answer(data[:dns.MAX_TCP], dns.MAX_UDP)
        if out is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(out, addr)

    def error_received(self, exc: Exception) -> None:
        pass


class DnsServer:
    """Serves a DnsPolicy on an already bound UDP socket and listening TCP socket (either may be None)."""

    def __init__(self, policy: DnsPolicy) -> None:
        self.policy = policy
        self.tasks: set[asyncio.Task[None]] = set()
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._clients = 0

    def track(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("DNS query handling failed: %r", task.exception())

    async def start(self, udp: socket.socket | None, tcp: socket.socket | None) -> None:
        loop = asyncio.get_running_loop()
        if udp is not None:
            udp.setblocking(False)
            transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=udp)
            self._udp = transport
        if tcp is not None:
            tcp.setblocking(False)
            self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._clients >= MAX_TCP_CLIENTS:
            writer.close()
            return
        self._clients += 1
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                (n,) = struct.unpack("!H", head)
                msg = await asyncio.wait_for(reader.readexactly(n), TCP_IDLE_S)
                out = await self.policy.answer(msg, dns.MAX_TCP)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            pass
        finally:
            self._clients -= 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
