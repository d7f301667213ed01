"""scripts/vm_tier.py against a stand-in rig that runs the command here: outcomes from the report log, the
summary after a rig failure, and the next try running only the unfinished tests (the real rig: tests/rig)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vm_tier_support import REPO, TESTS, VM_TIER, write_suite

sys.path.insert(0, str(REPO / "scripts"))
import vm_tier  # noqa: E402

# The stand-in: scripts/kvm-rig's options, then the command run here, its status returned (125 from the dying
# test is what the real rig returns when its kernel panics).
STAND_IN = '''#!/usr/bin/env python3
import subprocess, sys
argv = sys.argv[1:]
cut = argv.index("--")
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(" ".join(argv[:cut]) + "\\n")
sys.exit(subprocess.call(argv[cut + 1:]))
'''


def tier(tmp_path: Path, *extra: str, fail: bool = False, tries: int = 3,
         die_always: bool = False) -> tuple[subprocess.CompletedProcess[str], Path]:
    suite = write_suite(tmp_path / "suite")
    rig = tmp_path / "rig"
    rig.write_text(STAND_IN)
    rig.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "SMOL_TIER_MARK": str(out / "mark"), "SMOL_TIER_FAIL": "1" if fail else "0",
           "SMOL_TIER_DIE_ALWAYS": "1" if die_always else "0"}
    env.pop("CI", None)
    proc = subprocess.run([*VM_TIER, "--out", str(out), "--rig", str(rig), "--tries", str(tries), *extra, "--",
                           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def ran(report: Path) -> list[str]:
    """The test ids a try's report log shows run (a call or a failed setup)."""
    ids = []
    for line in report.read_text().splitlines():
        data = json.loads(line)
        if data.get("$report_type") == "TestReport" and data["when"] == "setup":
            ids.append(data["nodeid"])
    return ids


def test_after_a_rig_failure_only_the_unfinished_tests_run_again_and_the_tier_passes(tmp_path: Path) -> None:
    proc, out = tier(tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "vm-tier: 4 tests to run" in text
    assert "the KVM rig failed (status 125, above) in try 1, after 2 finished tests" in text
    # the first try's summary names what passed and what never finished
    first = text.split("in try 1")[1].split("vm-tier: try 2")[0]
    assert "passed  test_tier.py::test_first" in first and "passed  test_tier.py::test_fails_if_asked" in first
    assert "not finished (2):" in first and "test_tier.py::test_dies" in first and "test_tier.py::test_after" in first
    assert ran(out / "vm-tier-try-1.jsonl") == TESTS[:3]
    assert ran(out / "vm-tier-try-2.jsonl") == TESTS[2:]        # the finished ones were not run again
    assert not (out / "vm-tier-try-3.jsonl").exists()
    calls = (tmp_path / "rig.calls").read_text().splitlines()
    assert len(calls) == 2 and all(f"--share {out}" in c for c in calls)
    assert "4 passed" in text.split("summary of every try")[1]


def test_a_test_that_failed_before_the_rig_died_is_reported_with_its_traceback_and_never_rerun(tmp_path: Path) -> None:
    proc, out = tier(tmp_path, fail=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "FAILED  test_tier.py::test_fails_if_asked (try 1)" in text
    assert "this test fails when SMOL_TIER_FAIL=1" in text            # its traceback, though pytest never summarised
    assert ran(out / "vm-tier-try-2.jsonl") == TESTS[2:]
    assert "1 tests failed (each run once, never retried): test_tier.py::test_fails_if_asked" in text


def test_a_rig_that_fails_every_try_fails_the_tier(tmp_path: Path) -> None:
    proc, _ = tier(tmp_path, "--rig-arg=--unused", tries=1)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 125, text
    assert "the KVM rig failed in every try (1)" in text
    assert "not finished (2):" in text


def test_rigs_that_die_before_any_test_finishes_end_the_tier_before_its_tries_run_out(tmp_path: Path) -> None:
    proc, out = tier(tmp_path, tries=6, die_always=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 125, text
    # try 1 finished two tests; tries 2 and 3 died in test_dies before any finished: a fourth would too
    assert ran(out / "vm-tier-try-2.jsonl") == TESTS[2:3] and ran(out / "vm-tier-try-3.jsonl") == TESTS[2:3]
    assert len((tmp_path / "rig.calls").read_text().splitlines()) == 3
    assert "2 rigs in a row failed before any test finished: no further try" in text
    assert "the KVM rig failed in every try (3)" in text


def test_each_rig_that_makes_progress_earns_another_until_the_tries_run_out(tmp_path: Path) -> None:
    # tries=2 with a test that always dies: try 1 finishes two tests, try 2 none, and the tries are spent
    proc, out = tier(tmp_path, tries=2, die_always=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 125, text
    assert len((tmp_path / "rig.calls").read_text().splitlines()) == 2
    assert "no further try" not in text and "the KVM rig failed in every try (2)" in text


@pytest.mark.parametrize("torn", [True, False])
def test_report_log_outcomes(tmp_path: Path, torn: bool) -> None:
    def line(nodeid: str, when: str, outcome: str, longrepr: object = None) -> str:
        return json.dumps({"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": outcome,
                           "duration": 0.5, "longrepr": longrepr})
    crash = {"reprcrash": {"path": "t.py", "lineno": 3, "message": "AssertionError: boom"},
             "reprtraceback": {"reprentries": [{"data": {"lines": [">   assert 0"]}}]}}
    lines = [json.dumps({"$report_type": "SessionStart"}),
             line("t::ok", "setup", "passed"), line("t::ok", "call", "passed"), line("t::ok", "teardown", "passed"),
             line("t::bad", "setup", "passed"), line("t::bad", "call", "failed", crash),
             line("t::err", "setup", "failed", "fixture broke"),
             line("t::skip", "setup", "skipped", ["t.py", 1, "Skipped: no"]), line("t::skip", "teardown", "passed"),
             line("t::running", "setup", "passed"), line("t::running", "call", "passed")]
    text = "\n".join(lines) + ("\n{\"$report_type\": \"TestRep" if torn else "\n")
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    got = vm_tier.read_report_log(path, 2)
    assert {k: v.outcome for k, v in got.items()} == {"t::ok": "passed", "t::bad": "failed", "t::err": "error",
                                                      "t::skip": "skipped"}
    assert "assert 0" in got["t::bad"].detail and "AssertionError: boom" in got["t::bad"].detail
    assert got["t::err"].detail == "(setup) fixture broke" and got["t::skip"].detail == "Skipped: no"
    assert all(o.attempt == 2 for o in got.values())
    assert vm_tier.read_report_log(tmp_path / "absent.jsonl", 1) == {}


@pytest.mark.parametrize("flag", ["--tries", "--stall"])
def test_zero_tries_or_stall_is_refused_before_any_rig(tmp_path: Path, flag: str) -> None:
    proc = subprocess.run([*VM_TIER, "--out", str(tmp_path), flag, "0", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be at least 1" in proc.stderr, proc.stderr
