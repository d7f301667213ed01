"""CI's VM tier in the KVM rig: each test's outcome leaves the rig as it ends; after a rig failure, only unfinished tests run again.

    scripts/vm-tier [--out DIR] [--tries N] [--try-timeout S] [--budget S] -- PYTEST COMMAND...

The pytest command runs in ``scripts/kvm-rig`` with DIR shared read-write (``--share``) and pytest-reportlog
writing one JSON line per test phase into it (``DIR/vm-tier-try-K.jsonl``): a line reaches this host as the
phase ends, so when the rig itself dies (status 125: its kernel panicked under TCG, it hung, it timed out
booting) the tests that finished keep their outcomes. The run then says so, lists what passed, what failed (with
its traceback) and what never finished, and starts a fresh rig for the unfinished tests only (``--deselect``
for every finished one). A test that failed is reported and never run again; a failure fails the tier, as does
a rig that fails in every try, or in ``--stall`` tries in a row without one test finishing (the same test kills
each rig: a fresh rig would not help). Fresh rigs are started while each one makes progress, up to ``--tries``
and within ``--budget``. Stdlib only, like scripts/kvm_rig.py: it runs before anything else is known to
work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EXIT_RIG = 125            # scripts/kvm_rig.py: the rig itself failed
EXIT_NO_TESTS = 5         # pytest: nothing collected (every test deselected)
RIG = str(Path(__file__).resolve().parent / "kvm-rig")


@dataclasses.dataclass
class Outcome:
    """One test's result as the report log tells it: passed, failed, error (setup or teardown), skipped."""

    nodeid: str
    outcome: str
    attempt: int
    duration: float = 0.0
    detail: str = ""            # the failure's traceback (pytest's long representation), for the summary


def longrepr_text(longrepr: object) -> str:
    """A failure's text from pytest's serialized long representation (a string, or reprtraceback/reprcrash)."""
    if isinstance(longrepr, str):
        return longrepr
    if isinstance(longrepr, list):          # a skip: (path, line, reason)
        return str(longrepr[-1]) if longrepr else ""
    if not isinstance(longrepr, dict):
        return "" if longrepr is None else str(longrepr)
    lines: list[str] = []
    tb = longrepr.get("reprtraceback")
    if isinstance(tb, dict):
        for entry in tb.get("reprentries") or []:
            data = entry.get("data") if isinstance(entry, dict) else None
            if isinstance(data, dict):
                lines.extend(str(line) for line in data.get("lines") or [])
    crash = longrepr.get("reprcrash")
    if isinstance(crash, dict) and crash.get("message"):
        lines.append(f"{crash.get('path')}:{crash.get('lineno')}: {crash.get('message')}")
    return "\n".join(lines)


def read_report_log(path: Path, attempt: int) -> dict[str, Outcome]:
    """The tests that finished in one try, from its report log: a test is finished when its teardown was
    reported (or a phase failed, which ends it as far as its outcome goes). A torn last line (the rig died
    while it was being written) is ignored."""
    phases: dict[str, dict[str, dict]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("$report_type") != "TestReport":
            continue
        nodeid, when = data.get("nodeid"), data.get("when")
        if isinstance(nodeid, str) and when in ("setup", "call", "teardown"):
            phases.setdefault(nodeid, {})[when] = data
    done: dict[str, Outcome] = {}
    for nodeid, by_when in phases.items():
        failed = [w for w in ("setup", "call", "teardown") if by_when.get(w, {}).get("outcome") == "failed"]
        if not failed and "teardown" not in by_when:
            continue                    # still running when the rig died
        duration = sum(float(d.get("duration") or 0) for d in by_when.values())
        if failed:
            when = failed[0]
            kind = "failed" if when == "call" else "error"
            done[nodeid] = Outcome(nodeid, kind, attempt, duration,
                                   f"({when}) " + longrepr_text(by_when[when].get("longrepr")))
        elif skipped := [d for w in ("setup", "call") if (d := by_when.get(w, {})).get("outcome") == "skipped"]:
            done[nodeid] = Outcome(nodeid, "skipped", attempt, duration, longrepr_text(skipped[0].get("longrepr")))
        else:
            done[nodeid] = Outcome(nodeid, "passed", attempt, duration)
    return done


def collect(pytest_cmd: list[str]) -> list[str] | None:
    """The test ids the command would run, collected here (no KVM needed to collect); None if that fails."""
    # one -q, whatever the command's verbosity: pytest then prints one test id a line
    argv = [a for a in pytest_cmd if not a.startswith(("--junitxml", "--report-log"))
            and a not in ("-q", "-qq", "--quiet", "-v", "-vv", "--verbose")]
    try:    # -n 0: pytest-xdist's workers are not needed to list the tests
        proc = subprocess.run([*argv, "--collect-only", "-q", "-n", "0"], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    return ids if proc.returncode == 0 else None


def say(msg: str) -> None:
    print(f"vm-tier: {msg}", flush=True)


def summary(results: dict[str, Outcome], expected: list[str] | None, attempt: int | None = None) -> str:
    """Passed/failed/never-finished lists; failures with their tracebacks."""
    chosen = {k: v for k, v in results.items() if attempt is None or v.attempt == attempt}
    by: dict[str, list[Outcome]] = {}
    for o in chosen.values():
        by.setdefault(o.outcome, []).append(o)
    out = [", ".join(f"{len(v)} {k}" for k, v in sorted(by.items())) or "no test finished"]
    for o in sorted(by.get("passed", []), key=lambda o: o.nodeid):
        out.append(f"  passed  {o.nodeid} ({o.duration:.1f} s, try {o.attempt})")
    for kind in ("failed", "error", "skipped"):
        for o in sorted(by.get(kind, []), key=lambda o: o.nodeid):
            out.append(f"  {kind.upper()}  {o.nodeid} (try {o.attempt})")
            out.extend("      " + line for line in o.detail.splitlines()[-60:])
    if expected is not None:
        missing = [t for t in expected if t not in results]
        if missing:
            out.append(f"  not finished ({len(missing)}):")
            out.extend(f"    {t}" for t in missing)
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vm-tier", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out", help="where the report logs, junit files and consoles go")
    p.add_argument("--tries", type=int, default=3, help="rigs to start at most (a rig failure starts the next)")
    p.add_argument("--stall", type=int, default=2,
                   help="rig failures in a row without a finished test that end the tier (default 2)")
    p.add_argument("--try-timeout", type=float, default=1500, help="seconds for one rig run")
    p.add_argument("--budget", type=float, default=0, help="seconds for all tries together (0: no limit)")
    p.add_argument("--rig", default=RIG, help=argparse.SUPPRESS)   # tests: a stand-in that runs the command here
    p.add_argument("--rig-arg", action="append", default=[], help="an extra argument for scripts/kvm-rig")
    p.add_argument("pytest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.pytest and args.pytest[0] == "--":
        args.pytest = args.pytest[1:]
    if not args.pytest:
        p.error("no pytest command given")
    if args.tries < 1 or args.stall < 1:
        p.error("--tries and --stall must be at least 1 (0 would end the tier before any rig ran)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SMOL_VM_TIER_OUT"] = str(out)  # a failed test copies its daemons' logs there (tests/evidence.py)
    started = time.monotonic()
    expected = collect(args.pytest)
    if expected is None:
        say("could not collect the tests here; the list of tests that never finished will be missing")
    else:
        say(f"{len(expected)} tests to run")
    results: dict[str, Outcome] = {}
    rc = EXIT_RIG
    stalled = 0                             # rig failures in a row that finished no test
    rigs = 0                                # rigs started
    for attempt in range(1, args.tries + 1):
        timeout = args.try_timeout
        if args.budget:
            left = args.budget - (time.monotonic() - started)
            if left < 300 and attempt > 1:
                say(f"only {left:.0f} s of the tier's budget left: no further try")
                break
            timeout = min(timeout, left)
        report = out / f"vm-tier-try-{attempt}.jsonl"
        report.unlink(missing_ok=True)
        deselect = [arg for nodeid in sorted(results) for arg in ("--deselect", nodeid)]
        if results:
            say(f"try {attempt}: a fresh rig for the {len(expected) - len(results) if expected else 'unfinished'} "
                f"unfinished tests (the {len(results)} finished ones are not run again)")
        cmd = [args.rig, "--timeout", f"{timeout:.0f}", "--keep-console", str(out / f"rig-console-{attempt}.log"),
               "--share", str(out), *args.rig_arg, "--",
               *args.pytest, f"--report-log={report}", f"--junitxml={out / f'vm-tier-junit-{attempt}.xml'}",
               *deselect]
        rigs += 1
        rc = subprocess.call(cmd)
        finished = read_report_log(report, attempt)
        results.update(finished)
        if rc == EXIT_NO_TESTS and results:
            rc = 0                          # the rig died after the last test: nothing was left to run
        if rc != EXIT_RIG:
            break
        say(f"the KVM rig failed (status 125, above) in try {attempt}, after {len(finished)} finished tests:\n"
            + summary(results, expected, attempt))
        stalled = 0 if finished else stalled + 1
        if stalled >= args.stall:
            say(f"{stalled} rigs in a row failed before any test finished: no further try")
            break
    failed = sorted(k for k, v in results.items() if v.outcome in ("failed", "error"))
    say("summary of every try:\n" + summary(results, expected))
    if rc == EXIT_RIG:
        say(f"the KVM rig failed in every try ({rigs}): CI fails rather than pass without its VM tests")
        return EXIT_RIG
    if failed:
        say(f"{len(failed)} tests failed (each run once, never retried): " + " ".join(failed))
        return rc or 1
    if expected is not None:
        missing = [t for t in expected if t not in results]
        if missing and rc == 0:
            say(f"{len(missing)} tests never reported an outcome")
            return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
