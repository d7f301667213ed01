"""Per-VM host networking: namespace, uplink, tap, nftables allowlist and a policy DNS resolver."""

from .errors import DnsFormatError, ForwardError, NetError, NftError, PoolExhaustedError
from .manager import GATEWAY, GUEST, GUEST_MAC, NetworkManager, VmNetwork, namespace_name, resolve_policy
from .pool import DEFAULT_POOL, AddressPool, Uplink

__all__ = [
    "DEFAULT_POOL", "GATEWAY", "GUEST", "GUEST_MAC", "AddressPool", "DnsFormatError", "ForwardError", "NetError",
    "NetworkManager", "NftError", "PoolExhaustedError", "Uplink", "VmNetwork", "namespace_name",
    "resolve_policy",
]
