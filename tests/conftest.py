"""Shared pytest configuration: skip KVM tests where /dev/kvm is unusable."""

from __future__ import annotations

import os

import pytest


def kvm_usable() -> bool:
    return os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if kvm_usable():
        return
    skip = pytest.mark.skip(reason="/dev/kvm is not available")
    for item in items:
        if "kvm" in item.keywords:
            item.add_marker(skip)
