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


# Module order: longest first, so that under `-n 2 --dist loadfile` the run does not end with one worker busy on
# a long module while the other idles; a module not listed runs after these. The seconds are those measured on
# the 2-core PVM host (2026-12-03); this order is also the one CI's VM tier ran green with in the KVM rig, where
# the modules take 30-130 s each (docs/performance.md). The first daemon module that needs the default image at
# 512 MiB boots it and bakes its base; the later ones restore it (microvm.VM_CPUS keeps their sizes equal).
MODULE_SECONDS = {
    "test_jail_oom_vm.py": 1070, "test_net_guest.py": 820, "test_linux_guest.py": 610, "test_run_task_vm.py": 550,
    "test_daemon_vm.py": 500, "test_inspect_vm.py": 420, "test_snapshot.py": 370, "test_net_policy_vm.py": 320,
    "test_oci_vm.py": 130, "test_net_host.py": 80, "test_daemon_bake_vm.py": 60, "test_daemon_fork_vm.py": 60,
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
    if report.failed and report.when == "call":  # the VM tier keeps what a failed test's daemons logged
        from evidence import save_failure_evidence  # noqa: PLC0415  (tests/evidence.py)

        saved = save_failure_evidence(item.nodeid, call.start)
        for path in saved:  # the last lines of each in the report itself: CI's output is all a later reader gets
            tail = path.read_bytes()[-3000:].decode("utf-8", "replace")
            report.sections.append((f"evidence {path.name}", f"(whole tail: {path})\n{tail}"))
    if report.skipped and not hasattr(report, "wasxfail") and ci_forbids_skips():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI, which counts as a failure (a CI machine must have every tool, root "
                           f"and KVM the tests need): {reason}")
