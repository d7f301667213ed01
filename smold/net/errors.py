"""Typed errors of the per-VM host networking (namespaces, nftables, the DNS resolver)."""

from __future__ import annotations


class NetError(Exception):
    """A machine's host-side network could not be set up, read or torn down."""


class PoolExhaustedError(NetError):
    """Every /30 of the uplink address pool is in use."""


class ForwardError(NetError):
    """A port forward's host address and port cannot be listened on (in use, not an address of this host)."""


class NftError(NetError):
    """The ``nft`` command failed (its stderr is in the message)."""


class DnsFormatError(ValueError):
    """A DNS message is malformed or exceeds a bound (the resolver answers FORMERR or drops it)."""
