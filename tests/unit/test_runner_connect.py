"""The runner's per-attempt connect timeouts while a guest boots stay bounded for any number of attempts."""

from __future__ import annotations

from smold.vmm.runner import connect_attempt_timeout


def test_a_restored_guest_gets_growing_then_capped_timeouts() -> None:
    assert [connect_attempt_timeout(n, True) for n in range(1, 7)] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_thousands_of_refused_attempts_do_not_overflow() -> None:
    # CI of 25d4a1d: a restored guest refused every connection at once; the 1024th attempt computed
    # 0.5 * 2 ** 1024, which overflows a float, and the runner failed instead of reporting the boot timeout.
    for n in (1023, 1024, 1025, 10**6):
        assert connect_attempt_timeout(n, True) == 5.0
        assert connect_attempt_timeout(n, False) == 5.0


def test_a_cold_boot_waits_five_seconds_per_attempt() -> None:
    assert connect_attempt_timeout(1, False) == 5.0
