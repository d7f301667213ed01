"""DNS messages (RFC 1035 section 4) parsed and built with the stdlib: just enough for the policy resolver.

The input is hostile: every read is bounds-checked, compression pointers may only point backwards and are
followed at most MAX_POINTERS times, names are capped at 255 octets (RFC 1035 2.3.4), and any violation
raises DnsFormatError (never another exception).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from .errors import DnsFormatError

HEADER = struct.Struct("!HHHHHH")   # RFC 1035 4.1.1: ID, flags, QDCOUNT, ANCOUNT, NSCOUNT, ARCOUNT
MAX_NAME = 255
MAX_LABEL = 63
MAX_POINTERS = 16
MAX_UDP = 512           # RFC 1035 4.2.1 (no EDNS0: the resolver never advertises a larger size)
MAX_TCP = 65535

TYPE_A = 1
TYPE_AAAA = 28
TYPE_ANY = 255
CLASS_IN = 1

OPCODE_QUERY = 0
RCODE_NOERROR = 0
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
RCODE_NXDOMAIN = 3
RCODE_NOTIMP = 4
RCODE_REFUSED = 5

FLAG_QR = 0x8000
FLAG_AA = 0x0400
FLAG_TC = 0x0200
FLAG_RD = 0x0100
FLAG_RA = 0x0080


@dataclass(frozen=True)
class Question:
    name: str       # lower-case, no trailing dot, non-printable octets escaped as \DDD (RFC 4343 2.1)
    qtype: int
    qclass: int
    end: int        # offset just past the question (where the answer section starts)


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    qdcount: int
    question: Question | None

    @property
    def opcode(self) -> int:
        return (self.flags >> 11) & 0xF

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_QR)


def _label_text(raw: bytes) -> str:
    out = []
    for b in raw.lower():
        c = chr(b)
        out.append(c if c.isascii() and (c.isalnum() or c in "-_*") else f"\\{b:03d}")
    return "".join(out)


def read_name(msg: bytes, offset: int) -> tuple[str, int]:
    """The (escaped, lower-case) name at ``offset`` and the offset just past it in the original stream."""
    labels, end = read_labels(msg, offset)
    return ".".join(_label_text(label) for label in labels), end


def read_labels(msg: bytes, offset: int) -> tuple[list[bytes], int]:
    """The raw labels of the name at ``offset`` (compression pointers followed) and the offset just past it."""
    labels: list[bytes] = []
    length = 0
    pos = offset
    end: int | None = None
    jumps = 0
    while True:
        if pos >= len(msg):
            raise DnsFormatError("name runs past the end of the message")
        n = msg[pos]
        if n & 0xC0 == 0xC0:  # RFC 1035 4.1.4 compression pointer
            if pos + 1 >= len(msg):
                raise DnsFormatError("truncated compression pointer")
            target = ((n & 0x3F) << 8) | msg[pos + 1]
            if end is None:
                end = pos + 2
            jumps += 1
            if jumps > MAX_POINTERS or target >= pos:
                raise DnsFormatError("compression pointer loops or points forward")
            pos = target
            continue
        if n & 0xC0:
            raise DnsFormatError(f"unsupported label type 0x{n & 0xC0:02x}")
        if n == 0:
            return labels, (end if end is not None else pos + 1)
        if pos + 1 + n > len(msg):
            raise DnsFormatError("label runs past the end of the message")
        length += n + 1
        if length > MAX_NAME:
            raise DnsFormatError("name longer than 255 octets")
        labels.append(msg[pos + 1:pos + 1 + n])
        pos += 1 + n


def parse_query(msg: bytes) -> Query:
    """The header and (when QDCOUNT is 1) the question; DnsFormatError when even the header is unusable or
    the question is malformed. Other sections are ignored."""
    if len(msg) < HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    ident, flags, qd, _an, _ns, _ar = HEADER.unpack_from(msg)
    question = None
    if qd == 1:
        name, pos = read_name(msg, HEADER.size)
        if pos + 4 > len(msg):
            raise DnsFormatError("question runs past the end of the message")
        qtype, qclass = struct.unpack_from("!HH", msg, pos)
        question = Question(name, qtype, qclass, pos + 4)
    return Query(ident, flags, qd, question)


def encode_name(name: str) -> bytes:
    """A plain (unescaped, ASCII) name in wire form."""
    out = bytearray()
    for label in name.rstrip(".").split(".") if name.strip(".") else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) <= MAX_LABEL:
            raise DnsFormatError(f"bad label {label!r}")
        out += bytes([len(raw)]) + raw
    out.append(0)
    if len(out) > MAX_NAME:
        raise DnsFormatError("name longer than 255 octets")
    return bytes(out)


def build_response(msg: bytes, query: Query, rcode: int, answers: tuple[ipaddress.IPv4Address, ...] = (),
                   ttl: int = 60, limit: int = MAX_UDP) -> bytes:
    """A response to ``query`` (whose wire form is ``msg``): the question echoed when there is one, A
    records for ``answers`` (name by pointer to the question, RFC 1035 4.1.4), TC set when they do not
    fit in ``limit`` octets."""
    opcode = query.opcode
    flags = FLAG_QR | (opcode << 11) | (query.flags & FLAG_RD) | FLAG_RA | (rcode & 0xF)
    q = query.question
    question = b""
    if q is not None:
        # The question goes back uncompressed: a pointer in the query refers to the query's own bytes (its
        # header included, which differs in the response), so copying it would make the echoed name point at
        # our flags. A guest's fuzzer found this (tests/unit/test_net_dns.py).
        labels, name_end = read_labels(msg, HEADER.size)
        question = b"".join(bytes([len(label)]) + label for label in labels) + b"\0" + msg[name_end:q.end]
    records = [struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, ttl, 4) + a.packed for a in answers]
    room = limit - HEADER.size - len(question)
    fitting = []
    for r in records:
        if room < len(r):
            flags |= FLAG_TC
            break
        fitting.append(r)
        room -= len(r)
    header = HEADER.pack(query.id, flags, 1 if q is not None else 0, len(fitting), 0, 0)
    return header + question + b"".join(fitting)


def build_query(name: str, qtype: int = TYPE_A, ident: int = 0x1234, rd: bool = True) -> bytes:
    """A standard query (tests and clients)."""
    return HEADER.pack(ident, FLAG_RD if rd else 0, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype,
                                                                                                   CLASS_IN)


@dataclass(frozen=True)
class Response:
    id: int
    rcode: int
    truncated: bool
    addresses: tuple[ipaddress.IPv4Address, ...]


def parse_response(msg: bytes) -> Response:
    """A response's id, rcode and A records (tests and clients)."""
    if len(msg) < HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    ident, flags, qd, an, _ns, _ar = HEADER.unpack_from(msg)
    pos = HEADER.size
    for _ in range(qd):
        _, pos = read_name(msg, pos)
        pos += 4
    addrs = []
    for _ in range(an):
        _, pos = read_name(msg, pos)
        if pos + 10 > len(msg):
            raise DnsFormatError("record runs past the end")
        rtype, rclass, _ttl, rdlen = struct.unpack_from("!HHIH", msg, pos)
        pos += 10
        if pos + rdlen > len(msg):
            raise DnsFormatError("rdata runs past the end")
        if rtype == TYPE_A and rclass == CLASS_IN and rdlen == 4:
            addrs.append(ipaddress.IPv4Address(msg[pos:pos + 4]))
        pos += rdlen
    return Response(ident, flags & 0xF, bool(flags & FLAG_TC), tuple(addrs))
