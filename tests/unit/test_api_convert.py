"""Dataclass <-> smol.v1 proto conversions: round trips over the wire format, and inline-spec validation."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from smold.agent import ExecExit, ExecStderr, ExecStdout
from smold.api import convert
from smold.api.machine import MachineInfo, MachineState
from smold.api.v1 import smol_pb2 as pb
from smold.smolfile import PortForward, Smolfile, SmolfileError, digest, parse_smolfile
from smold.verifier import CheckResult, Evidence, VerifyResult

FULL = """
image = "python-3.12"
cpus = 3
memory = "1536M"
network = { allow = ["pypi.org:443", "10.0.0.0/8", "[2001:db8::1]:443"], forward = ["8080", "0.0.0.0:2222:22"] }
setup = ["echo one", ["make", "-C", "/w", ""], { run = "pip install x", timeout = 60.5, cwd = "/w", user = "1000" }]
task = { run = ["python3", "/agent/solve.py"], user = "agent", timeout = 100 }

[mounts]
"agent" = "/agent"
"." = "/w"

[env]
CI = "1"
EMPTY = ""

[timeouts]
boot = 30
verify = 12.5

[[verifier.checks]]
name = "tests"
kind = "command"
run = "pytest -q"
expect_exit = 1
timeout = 20
cwd = "/w"
user = "nobody"

[[verifier.checks]]
kind = "command"
run = ["true"]

[[verifier.checks]]
kind = "file_exists"
path = "/w/out"

[[verifier.checks]]
kind = "file_matches"
path = "/w/a"
content = ""

[[verifier.checks]]
kind = "file_matches"
path = "/w/b"
regex = '^ok$'

[[verifier.checks]]
kind = "file_matches"
path = "/w/c"
sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

[[verifier.checks]]
kind = "http"
url = "http://localhost:8000/health"
contains = "ok"
expect_status = 204

[[verifier.checks]]
kind = "reward"

[[verifier.checks]]
kind = "reward"
path = "/r.json"
threshold = 0.0
"""


def wire(msg):
    """Serialize and parse back, as a message crossing the socket would."""
    return type(msg).FromString(msg.SerializeToString())


# --- Smolfile spec --------------------------------------------------------------------------------------------
def test_smolfile_spec_round_trip():
    s = parse_smolfile(FULL, base_dir="/srv/task")
    msg = wire(convert.smolfile_to_spec_proto(s))
    assert msg.memory_mib == 1536 and msg.cpus == 3 and msg.base_dir == "/srv/task"
    assert msg.checks[0].command.shell == "pytest -q" and list(msg.checks[1].command.argv) == ["true"]
    assert list(msg.network.forward) == ["127.0.0.1:0:8080", "0.0.0.0:2222:22"]
    back = convert.smolfile_from_spec_proto(msg)
    assert back == s
    assert digest(back) == digest(s)


def test_defaults_round_trip_and_empty_spec_is_the_default_smolfile():
    assert convert.smolfile_from_spec_proto(pb.SmolfileSpec()) == Smolfile()
    s = parse_smolfile("", base_dir=None)
    assert convert.smolfile_from_spec_proto(wire(convert.smolfile_to_spec_proto(s))) == s


def test_unset_optional_fields_get_defaults_but_explicit_zero_is_an_error():
    assert convert.smolfile_from_spec_proto(pb.SmolfileSpec(image="x")).memory_mib == 1024
    with pytest.raises(SmolfileError) as info:
        convert.smolfile_from_spec_proto(pb.SmolfileSpec(memory_mib=0))
    assert str(info.value) == "<inline spec>: memory: must be at least 128 MiB (got 0 MiB)"
    with pytest.raises(SmolfileError) as info:
        convert.smolfile_from_spec_proto(pb.SmolfileSpec(cpus=0))
    assert str(info.value) == "<inline spec>: cpus: must be between 1 and 64 (got 0)"


def test_inline_spec_is_validated_like_toml():
    bad_check = pb.SmolfileSpec(checks=[pb.Check(file_exists=pb.FileExistsCheck(path="relative"))])
    with pytest.raises(SmolfileError) as info:
        convert.smolfile_from_spec_proto(bad_check)
    assert str(info.value) == "<inline spec>: [verifier.checks[0]].path: must be absolute"

    no_kind = pb.SmolfileSpec(checks=[pb.Check(name="x")])
    with pytest.raises(SmolfileError, match=r"\[verifier.checks\[0\]\].kind: no check kind set"):
        convert.smolfile_from_spec_proto(no_kind)

    both = pb.SmolfileSpec(setup=[pb.Command(shell="make", argv=["make"])])
    with pytest.raises(SmolfileError, match=r"\[setup\[0\]\].run: set only one of 'shell' and 'argv'"):
        convert.smolfile_from_spec_proto(both)

    neither = pb.SmolfileSpec(task=pb.Command())
    with pytest.raises(SmolfileError, match=r"\[task\].run: must not be empty"):
        convert.smolfile_from_spec_proto(neither)

    dup = pb.SmolfileSpec(
        base_dir="/b",
        mounts=[pb.Mount(host_path="a", guest_path="/x"), pb.Mount(host_path="a", guest_path="/y")],
    )
    with pytest.raises(SmolfileError, match=r"\[mounts\]\.a: duplicate host path"):
        convert.smolfile_from_spec_proto(dup)

    no_base = pb.SmolfileSpec(mounts=[pb.Mount(host_path="a", guest_path="/x")])
    with pytest.raises(SmolfileError, match="mounts need a base directory"):
        convert.smolfile_from_spec_proto(no_base)

    matcher = pb.SmolfileSpec(checks=[pb.Check(file_matches=pb.FileMatchesCheck(path="/a"))])
    with pytest.raises(SmolfileError, match="needs exactly one of 'content', 'regex', 'sha256'"):
        convert.smolfile_from_spec_proto(matcher)

    with pytest.raises(SmolfileError, match=r"\[network\].allow\[0\]: invalid CIDR"):
        convert.smolfile_from_spec_proto(pb.SmolfileSpec(network=pb.NetworkPolicy(allow=["10.0.0.1/8"])))


def test_a_public_network_crosses_the_wire():
    for text in ('network = "public"', 'network = {public = true, allow = ["10.1.2.3:80"], forward = ["8080"]}',
                 'network = "closed"'):
        s = parse_smolfile(text, base_dir=None)
        spec = convert.smolfile_to_spec_proto(s)
        assert spec.network.public != spec.network.closed
        assert convert.smolfile_from_spec_proto(wire(spec)) == s


def test_a_set_network_policy_request_is_validated_like_a_smolfiles_network():
    assert convert.network_policy_from_proto(pb.NetworkPolicy()).closed
    assert convert.network_policy_from_proto(pb.NetworkPolicy(closed=True)).closed
    p = convert.network_policy_from_proto(pb.NetworkPolicy(allow=["pypi.org:443"], public=True))
    assert p.public and [str(r) for r in p.allow] == ["pypi.org:443"] and not p.closed
    with pytest.raises(SmolfileError, match=r"\[network\].allow\[0\]: invalid CIDR"):
        convert.network_policy_from_proto(pb.NetworkPolicy(allow=["10.0.0.1/8"]))
    with pytest.raises(SmolfileError, match="takes no allow, forward or public"):
        convert.network_policy_from_proto(pb.NetworkPolicy(allow=["pypi.org"], closed=True))


def test_smolfile_message_toml_or_spec():
    toml = pb.Smolfile(toml=pb.SmolfileToml(text=FULL, base_dir="/srv/task", filename="t/Smolfile.toml"))
    from_toml = convert.smolfile_from_proto(wire(toml))
    assert from_toml == parse_smolfile(FULL, base_dir="/srv/task")
    spec = pb.Smolfile(spec=convert.smolfile_to_spec_proto(from_toml))
    assert convert.smolfile_from_proto(wire(spec)) == from_toml

    bad = pb.Smolfile(toml=pb.SmolfileToml(text="cpus = 0", filename="t/Smolfile.toml"))
    with pytest.raises(SmolfileError) as info:
        convert.smolfile_from_proto(bad)
    assert str(info.value) == "t/Smolfile.toml: cpus: must be between 1 and 64 (got 0)"

    with pytest.raises(SmolfileError, match="no Smolfile given"):
        convert.smolfile_from_proto(pb.Smolfile())


def test_verify_request_checks():
    s = parse_smolfile(FULL, base_dir="/srv/task")
    msgs = [wire(convert.check_to_proto(c)) for c in s.checks]
    assert convert.checks_from_proto(msgs) == s.checks
    with pytest.raises(SmolfileError) as info:
        convert.checks_from_proto([pb.Check(http=pb.HttpCheck(url="http://example.com/"))])
    assert info.value.file == "<request checks>" and info.value.key == "[verifier.checks[0]].url"


# --- results --------------------------------------------------------------------------------------------------
def test_verify_result_round_trip_keeps_exit_code_presence():
    result = VerifyResult(
        passed=False,
        checks=(
            CheckResult("tests", "command", False, Evidence(1, "FAILED x\n", 1234, "expected exit 0, got exit 1")),
            CheckResult("zero", "command", True, Evidence(0, "", 5, "exit 0 as expected")),
            CheckResult("f", "file_exists", True, Evidence(None, "", 3, "/a exists (directory)")),
            CheckResult("slow", "command", False, Evidence(None, "…\ufffd", 9000, "timed out after 9s", True)),
        ),
        image_digest="sha256:" + "a" * 64,
        smolfile_digest="sha256:" + "b" * 64,
        duration_ms=10242,
    )
    msg = wire(convert.verify_result_to_proto(result))
    assert [c.evidence.HasField("exit_code") for c in msg.checks] == [True, True, False, False]
    assert convert.verify_result_from_proto(msg) == result


def test_machine_round_trip():
    m = MachineInfo(
        id="m-1",
        name="web",
        state=MachineState.FAILED,
        cpus=2,
        memory_mib=1024,
        image="default",
        created_at=datetime(2025, 5, 6, 7, 8, 9, 123456, tzinfo=UTC),
        image_digest="sha256:i",
        smolfile_digest="sha256:s",
        failure_reason="VMM exited with signal 9",
        console_tail="[    0.1] Kernel panic\n",
        forwarded_ports=(PortForward(8080, 41234), PortForward(22, 2222, "0.0.0.0")),
    )
    msg = wire(convert.machine_to_proto(m))
    assert [(f.host_address, f.host_port, f.guest_port) for f in msg.forwarded_ports] == [
        ("127.0.0.1", 41234, 8080), ("0.0.0.0", 2222, 22)]
    assert msg.state == pb.MACHINE_STATE_FAILED and msg.created_at.seconds == int(m.created_at.timestamp())
    assert convert.machine_from_proto(msg) == m
    for state in MachineState:
        assert convert.machine_state_from_proto(convert.machine_state_to_proto(state)) is state


def test_machine_conversion_errors():
    naive = MachineInfo("m", "n", MachineState.RUNNING, 1, 128, "default", datetime(2025, 1, 1))
    with pytest.raises(convert.ConversionError, match="timezone-aware"):
        convert.machine_to_proto(naive)
    with pytest.raises(convert.ConversionError, match="unspecified"):
        convert.machine_from_proto(pb.Machine(id="m", created_at={"seconds": 1}))
    with pytest.raises(convert.ConversionError, match="created_at"):
        convert.machine_from_proto(pb.Machine(id="m", state=pb.MACHINE_STATE_RUNNING))


def test_exec_events_round_trip():
    events = [
        ExecStdout(b"\x00\xffbinary"),
        ExecStderr(b"err"),
        ExecExit(exit_code=0, signal=None, timed_out=False, duration=1.5),
        ExecExit(exit_code=None, signal=9, timed_out=True, duration=0.25),
    ]
    msgs = [wire(convert.exec_event_to_proto(e)) for e in events]
    assert [m.WhichOneof("event") for m in msgs] == ["stdout", "stderr", "exit", "exit"]
    assert msgs[2].exit.HasField("exit_code") and not msgs[2].exit.HasField("signal")
    assert msgs[3].exit.signal == 9 and msgs[3].exit.duration_ms == 250
    assert [convert.exec_event_from_proto(m) for m in msgs] == events
    with pytest.raises(convert.ConversionError):
        convert.exec_event_from_proto(pb.ExecResponse())


def test_an_undecided_check_travels_as_a_verifier_error_with_its_outcome():
    undecided = CheckResult("suite", "command", False, Evidence(None, "", 2, "agent error: EPROTO: bad"), True)
    failed = CheckResult("file", "file_exists", False, Evidence(None, "", 1, "/a is missing"))
    for checks, outcome, word in [((undecided, failed), pb.OUTCOME_VERIFIER_ERROR, "could not be decided"),
                                  ((failed,), pb.OUTCOME_FAIL, "checks failed")]:
        result = VerifyResult(passed=False, checks=checks)
        msg = wire(convert.verify_result_to_proto(result))
        assert msg.outcome == outcome and word in msg.outcome_detail
        assert convert.verify_result_from_proto(msg) == result
    ok = VerifyResult(passed=True, checks=(CheckResult("z", "command", True, Evidence(0, "", 1, "exit 0")),))
    msg = wire(convert.verify_result_to_proto(ok))
    assert msg.outcome == pb.OUTCOME_PASS and msg.outcome_detail == "all 1 checks passed"


def test_verifier_mounts_round_trip_in_an_inline_spec_and_are_validated():
    s = parse_smolfile('[mounts]\n"task" = "/task"\n[verifier.mounts]\n"tests" = "/tests"\n"t2" = "/t2"\n',
                       base_dir="/srv/t")
    msg = wire(convert.smolfile_to_spec_proto(s))
    assert [(m.host_path, m.guest_path) for m in msg.verifier_mounts] == [("tests", "/tests"), ("t2", "/t2")]
    assert convert.smolfile_from_spec_proto(msg) == s
    msg.verifier_mounts.add(host_path="tests", guest_path="/again")
    with pytest.raises(SmolfileError) as info:
        convert.smolfile_from_spec_proto(msg)
    assert info.value.key == "[verifier.mounts].tests" and info.value.reason == "duplicate host path"
