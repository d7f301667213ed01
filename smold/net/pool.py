"""Per-VM /30 uplink subnets handed out from one configurable pool (e.g. 10.213.0.0/16)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import NetError, PoolExhaustedError

DEFAULT_POOL = "10.213.0.0/16"


@dataclass(frozen=True)
class Uplink:
    """One VM's /30 on its veth pair: ``host`` on the root-namespace end, ``inner`` on the namespace end."""

    index: int
    network: ipaddress.IPv4Network

    @property
    def host(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 1

    @property
    def inner(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 2

    @property
    def prefixlen(self) -> int:
        return self.network.prefixlen


class AddressPool:
    """Allocates /30 subnets of ``cidr`` by index (lowest free first); ``reserve`` re-claims a known one."""

    def __init__(self, cidr: str = DEFAULT_POOL) -> None:
        try:
            net = ipaddress.ip_network(cidr, strict=True)
        except ValueError as e:
            raise NetError(f"address pool {cidr!r}: {e}") from None
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
            raise NetError(f"address pool {cidr!r}: must be an IPv4 network of /30 or larger")
        self.network = net
        self.size = net.num_addresses // 4
        self._used: dict[int, str] = {}

    def uplink(self, index: int) -> Uplink:
        if not 0 <= index < self.size:
            raise NetError(f"uplink index {index} is outside the pool {self.network} ({self.size} subnets)")
        base = self.network.network_address + 4 * index
        return Uplink(index, ipaddress.IPv4Network((base, 30)))

    def allocate(self, owner: str, in_use: Iterable[ipaddress.IPv4Address] = ()) -> Uplink:
        """The lowest free /30, now owned by ``owner`` (a machine id). ``in_use``: addresses the host already
        has (another daemon's machines on the same pool): a /30 holding one of them is skipped."""
        taken = set(in_use)
        for index in range(self.size):
            if index not in self._used:
                uplink = self.uplink(index)
                if uplink.host in taken or uplink.inner in taken:
                    continue
                self._used[index] = owner
                return uplink
        raise PoolExhaustedError(f"address pool {self.network} is exhausted ({self.size} machines have a network)")

    def reserve(self, index: int, owner: str) -> Uplink:
        """Claim a specific /30 (re-adopting a machine after a daemon restart)."""
        uplink = self.uplink(index)
        holder = self._used.get(index)
        if holder is not None and holder != owner:
            raise NetError(f"uplink {uplink.network} is already used by {holder}")
        self._used[index] = owner
        return uplink

    def release(self, index: int) -> None:
        self._used.pop(index, None)

    def in_use(self) -> dict[int, str]:
        return dict(self._used)
