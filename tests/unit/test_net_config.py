"""The VMM's network flags and NetConfig: validation and the smol.net= kernel argument (docs/networking.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smold.vmm.__main__ import _net_config, _parser
from smold.vmm.machine import MachineConfig, MachineError, NetConfig


def net_from(argv: list[str]) -> NetConfig | None:
    return _net_config(_parser().parse_args(argv))


def test_no_tap_no_nic() -> None:
    assert net_from([]) is None


def test_defaults() -> None:
    cfg = net_from(["--net-tap", "tap0"])
    assert cfg == NetConfig(tap="tap0", mac="06:00:ac:10:00:02", guest="172.16.0.2/30", gateway="172.16.0.1")
    assert cfg is not None
    cfg.validate()
    assert cfg.cmdline_arg() == "smol.net=172.16.0.2/30,172.16.0.1,172.16.0.1"  # dns defaults to the gateway


def test_all_flags() -> None:
    cfg = net_from(["--net-tap", "vm7", "--net-mac", "02:00:00:00:00:07", "--net-guest", "10.1.2.9/24",
                    "--net-gateway", "10.1.2.1", "--net-dns", "10.1.2.53"])
    assert cfg is not None
    cfg.validate()
    assert cfg.mac == "02:00:00:00:00:07"
    assert cfg.cmdline_arg() == "smol.net=10.1.2.9/24,10.1.2.1,10.1.2.53"


@pytest.mark.parametrize("flag", ["--net-mac", "--net-guest", "--net-gateway", "--net-dns"])
def test_addresses_need_a_tap(flag: str) -> None:
    with pytest.raises(SystemExit, match="needs --net-tap"):
        net_from([flag, "x"])


@pytest.mark.parametrize("kw", [
    {"mac": "01:00:00:00:00:01"},                          # multicast
    {"mac": "nonsense"},
    {"guest": "172.16.0.2"},                               # no prefix length
    {"guest": "172.16.0.0/30"},                            # network address
    {"guest": "172.16.0.3/30"},                            # broadcast address
    {"guest": "300.1.1.1/24"},
    {"guest": "fd00::2/64"},                               # IPv4 only
    {"gateway": "172.16.0.5"},                             # outside the guest's network
    {"gateway": "172.16.0.2"},                             # the guest itself
    {"dns": "not-an-ip"},
])
def test_invalid(kw: dict[str, str], tmp_path: Path) -> None:
    cfg = NetConfig(tap="tap0", **kw)
    with pytest.raises(MachineError):
        cfg.validate()
    with pytest.raises(MachineError):  # MachineConfig.validate checks it too
        MachineConfig(kernel=None, state_dir=tmp_path, restore_from=tmp_path, net=cfg).validate()


def test_point_to_point_prefix_allowed() -> None:
    NetConfig(tap="t", guest="192.168.5.0/31", gateway="192.168.5.1").validate()
