"""Shared pytest configuration: KVM tests need /dev/kvm (skipped without it, failed under CI); one bake store."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

# The integration tests' daemons share one bake store (``smold --bakes-dir``, tests/integration/microvm.py
# shared_bakes_args): the first module whose machine has to boot bakes its image's base, and every later module
# restores that (seconds) instead of booting (minutes on an emulated-KVM host). Made here, in the controlling
# process, before pytest-xdist starts its workers (they inherit the environment), and removed at the end of the
# run; never kept between runs (a bake is tied to this checkout's VMM). SMOL_TEST_BAKES set by the caller is
# used as it is and left in place.
BAKES_ENV = "SMOL_TEST_BAKES"
_made_bakes: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or os.environ.get(BAKES_ENV):
        return
    path = tempfile.mkdtemp(prefix="smol-test-bakes-", dir="/tmp")
    os.environ[BAKES_ENV] = path
    _made_bakes.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _made_bakes:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(BAKES_ENV) == path:
            del os.environ[BAKES_ENV]
    _made_bakes.clear()


def kvm_usable() -> bool:
    return os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)


# Seconds each integration module took in the KVM rig, where CI runs them (junit times of a `.ci/run`, 2 workers,
# 2026-12-04; docs/kvm-rig.md). The modules run longest first, so that under `-n 2 --dist loadfile` the run does
# not end with one worker busy on a long module while the other idles; a module not listed runs after these.
# The first daemon module that needs the default image at 512 MiB boots it and bakes its base; the later ones
# restore it (tests/integration/microvm.py: VM_CPUS keeps their sizes equal).
MODULE_SECONDS = {
    "test_daemon_vm.py": 132, "test_jail_oom_vm.py": 128, "test_net_policy_vm.py": 124, "test_run_task_vm.py": 115,
    "test_daemon_bake_vm.py": 79, "test_oci_vm.py": 62, "test_inspect_vm.py": 62, "test_snapshot.py": 61,
    "test_fork_memory.py": 51, "test_daemon_fork_vm.py": 46, "test_net_host.py": 42, "test_console_flood_vm.py": 40,
    "test_net_guest.py": 34, "test_linux_guest.py": 28, "test_net_tap.py": 3,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.name, 0))   # stable: a module's tests keep their order
    if kvm_usable():
        return
    skip = pytest.mark.skip(reason="/dev/kvm is not available")
    for item in items:
        if "kvm" in item.keywords:
            item.add_marker(skip)


# Under CI (CI set, as .ci/run and the KVM rig run it) a test may not skip: a skip there means a missing tool,
# root or KVM, i.e. a CI machine that does not test what it claims to, and it fails the test instead. Tests that
# only apply to some hosts are selected by .ci/run's tiers (markers), not skipped.
def ci_forbids_skips() -> bool:
    return bool(os.environ.get("CI"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail") and ci_forbids_skips():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI, which counts as a failure (a CI machine must have every tool, root "
                           f"and KVM the tests need): {reason}")
