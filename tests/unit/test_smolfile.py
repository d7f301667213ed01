"""Smolfile parsing: the schema, defaults, precise errors, mounts on disk, digests, and the docs' examples."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from smold.smolfile import (
    AllowRule,
    Command,
    CommandCheck,
    FileExistsCheck,
    FileMatchesCheck,
    HttpCheck,
    Limits,
    Mount,
    RewardCheck,
    Smolfile,
    SmolfileError,
    Timeouts,
    boot_state_digest,
    check_mount_sources,
    digest,
    load_smolfile,
    parse_mapping,
    parse_smolfile,
    render_key,
    to_mapping,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "smolfile.md"
BASE = "/srv/task"


def parse(text: str, **kw) -> Smolfile:
    return parse_smolfile(text, base_dir=kw.pop("base_dir", BASE), **kw)


def error(text: str, **kw) -> SmolfileError:
    with pytest.raises(SmolfileError) as info:
        parse(text, **kw)
    return info.value


def check_toml(body: str) -> str:
    return "[[verifier.checks]]\n" + body + "\n"


# --- defaults and the full schema ---------------------------------------------------------------------------
def test_empty_file_gives_all_defaults():
    s = parse("")
    assert s == Smolfile(base_dir=BASE)
    assert (s.image, s.cpus, s.memory_mib, s.network.enabled, s.task) == ("default", 2, 1024, False, None)
    assert s.timeouts == Timeouts(boot=300.0, setup=600.0, task=1800.0, verify=600.0)


def test_full_smolfile_parses_into_dataclasses():
    s = parse(
        """
image = "python-3.12"
cpus = 4
memory = "2G"
network = { allow = ["PyPI.org:443", "192.0.2.10", "[2001:db8::1]:443", "10.0.0.0/8"] }
setup = ["echo one", ["make", "-C", "/w", ""], { run = "pip install x", timeout = 60, cwd = "/w", user = 1000 }]
task = { run = ["python3", "/agent/solve.py"], user = "agent" }

[mounts]
"./agent/" = "/agent"
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

[[verifier.checks]]
kind = "file_matches"
path = "/w/out"
sha256 = "sha256:9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08"

[[verifier.checks]]
kind = "http"
url = "http://localhost:8000/health"
contains = "ok"

[[verifier.checks]]
kind = "reward"
"""
    )
    assert s.image == "python-3.12" and s.cpus == 4 and s.memory_mib == 2048
    assert s.network.allow == (
        AllowRule("host", "pypi.org", 443),
        AllowRule("cidr", "192.0.2.10/32"),
        AllowRule("cidr", "2001:db8::1/128", 443),
        AllowRule("cidr", "10.0.0.0/8"),
    )
    assert s.setup == (
        Command("echo one"),
        Command(("make", "-C", "/w", "")),
        Command("pip install x", timeout=60.0, cwd="/w", user="1000"),
    )
    assert s.setup[0].argv == ("sh", "-c", "echo one")
    assert s.task == Command(("python3", "/agent/solve.py"), user="agent")
    assert s.mounts == (Mount("agent", "/agent"), Mount(".", "/w"))
    assert s.host_path(s.mounts[0]) == Path("/srv/task/agent")
    assert s.environ == {"CI": "1", "EMPTY": ""}
    assert s.timeouts == Timeouts(boot=30.0, setup=600.0, task=1800.0, verify=12.5)
    assert s.checks == (
        CommandCheck(name="tests", run="pytest -q", expect_exit=1, timeout=20.0),
        FileMatchesCheck(
            name="file_matches: /w/out",
            path="/w/out",
            sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        ),
        HttpCheck(name="http: http://localhost:8000/health", url="http://localhost:8000/health", contains="ok"),
        RewardCheck(name="reward: reward.txt|reward.json"),
    )
    assert s.checks[3].candidate_paths == ("/logs/verifier/reward.txt", "/logs/verifier/reward.json")


# --- error rendering ----------------------------------------------------------------------------------------
def test_error_message_names_file_key_and_reason():
    toml = check_toml('kind = "command"\nrun = "true"\n') * 2 + check_toml('kind = "file_exists"\npath = "x"\n')
    e = error(toml.replace('run = "true"', 'run = "a"', 1), filename="Smolfile.toml")
    assert str(e) == "Smolfile.toml: [verifier.checks[2]].path: must be absolute"
    assert (e.file, e.key, e.reason) == ("Smolfile.toml", "[verifier.checks[2]].path", "must be absolute")


@pytest.mark.parametrize(
    "path, shown",
    [
        (["cpus"], "cpus"),
        (["setup", 1], "setup[1]"),
        (["setup", 1, "timeout"], "[setup[1]].timeout"),
        (["timeouts", "boot"], "[timeouts].boot"),
        (["verifier", "checks", 2], "[verifier].checks[2]"),
        (["verifier", "checks", 2, "path"], "[verifier.checks[2]].path"),
        (["network", "allow", 0], "[network].allow[0]"),
        (["mounts", "../x"], '[mounts]."../x"'),
        (["env", "A B"], '[env]."A B"'),
    ],
)
def test_render_key(path, shown):
    assert render_key(path) == shown


def test_whole_file_errors_have_no_key():
    e = error("a = 1\nb = 2\nimage x")
    assert e.key == "" and str(e) == (
        "Smolfile.toml: invalid TOML: Expected '=' after a key in a key/value pair (at line 3, column 7)"
    )
    with pytest.raises(SmolfileError, match="not valid UTF-8"):
        parse_smolfile(b"image = '\xff'", base_dir=BASE)
    with pytest.raises(SmolfileError, match="larger than"):
        parse_smolfile("#" * (2 << 20), base_dir=BASE)
    with pytest.raises(SmolfileError, match="base directory must be an absolute path"):
        parse_smolfile("", base_dir="relative/dir")


# --- unknown keys -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "toml, key, reason",
    [
        ('imag = "x"', "imag", "unknown key (did you mean 'image'?)"),
        ("[timeouts]\nboto = 3", "[timeouts].boto", "unknown key (did you mean 'boot'?)"),
        ("network = {alow = []}", "[network].alow", "unknown key (did you mean 'allow'?)"),
        ('setup = [{run = "x", timout = 3}]', "[setup[0]].timout", "unknown key (did you mean 'timeout'?)"),
        ('task = {run = "x", shell = true}', "[task].shell", "unknown key (expected one of run, timeout, cwd, user)"),
        ("[verifier]\ncheck = []", "[verifier].check", "unknown key (did you mean 'checks'?)"),
        (
            check_toml('kind = "command"\nrun = "x"\nexpect_exitcode = 1'),
            "[verifier.checks[0]].expect_exitcode",
            "unknown key (did you mean 'expect_exit'?)",
        ),
        (
            check_toml('kind = "file_exists"\npath = "/x"\nregex = "a"'),
            "[verifier.checks[0]].regex",
            'not a key of kind = "file_exists" (allowed: kind, name, timeout, path)',
        ),
    ],
)
def test_unknown_keys_are_errors(toml, key, reason):
    e = error(toml)
    assert (e.key, e.reason) == (key, reason)


# --- scalars ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, mib",
    [("512", 512), ('"512M"', 512), ('"512MiB"', 512), ('"2G"', 2048), ('"2gib"', 2048), ('" 3 G "', 3072)],
)
def test_memory_forms(value, mib):
    assert parse(f"memory = {value}").memory_mib == mib


@pytest.mark.parametrize(
    "value, reason",
    [
        ("64", "must be at least 128 MiB (got 64 MiB)"),
        ('"127M"', "must be at least 128 MiB (got 127 MiB)"),
        ("0", "must be at least 128 MiB (got 0 MiB)"),
        ('"65G"', "must be at most 65536 MiB on this host (got 66560 MiB)"),
        ('"2GB"', "has unknown unit 'GB': use M/MiB or G/GiB, 1024-based (got '2GB')"),
        ('"512"', "needs a unit: use M/MiB or G/GiB, 1024-based (got '512')"),
        ('"1.5G"', 'must be an integer (MiB) or a size like "512M" or "2G" (got \'1.5G\')'),
        ("1.5", 'must be an integer (MiB) or a string like "2G", not a float'),
        ("true", 'must be an integer (MiB) or a string like "2G", not a boolean'),
    ],
)
def test_memory_errors(value, reason):
    e = error(f"memory = {value}")
    assert (e.key, e.reason) == ("memory", reason)


def test_limits_are_configurable():
    limits = Limits(max_memory_mib=1024, max_cpus=4)
    assert parse('memory = "1G"\ncpus = 4', limits=limits).memory_mib == 1024
    assert error('memory = "2G"', limits=limits).reason == "must be at most 1024 MiB on this host (got 2048 MiB)"
    assert error("cpus = 5", limits=limits).reason == "must be between 1 and 4 (got 5)"


@pytest.mark.parametrize(
    "toml, key, reason",
    [
        ("cpus = 0", "cpus", "must be between 1 and 64 (got 0)"),
        ("cpus = 65", "cpus", "must be between 1 and 64 (got 65)"),
        ("cpus = true", "cpus", "must be an integer, not a boolean"),
        ('cpus = "2"', "cpus", "must be an integer, not a string"),
        ('image = ""', "image", "must not be empty"),
        ('image = "bad name"', "image", "is not a valid image name (got 'bad name')"),
        ("image = 3", "image", "must be a string, not an integer"),
        ("[timeouts]\nboot = 0", "[timeouts].boot", "must be more than 0 and at most 86400 seconds (got 0)"),
        ("[timeouts]\ntask = 100000", "[timeouts].task", "must be more than 0 and at most 86400 seconds (got 100000)"),
        ('[timeouts]\nsetup = "1m"', "[timeouts].setup", "must be a number, not a string"),
        ("[timeouts]\nverify = nan", "[timeouts].verify", "must be a finite number"),
        ("timeouts = 5", "timeouts", "must be a table, not an integer"),
        ("[env]\n1A = 'x'", "[env].1A", "invalid variable name (letters, digits and '_', not starting with a digit)"),
        ('[env]\n"A B" = "x"', '[env]."A B"', "invalid variable name (letters, digits and '_', not starting with a digit)"),
        ("[env]\nN = 1", "[env].N", "must be a string, not an integer"),
        ('[env]\nN = "a\\u0000b"', "[env].N", "must not contain NUL characters"),
    ],
)
def test_scalar_errors(toml, key, reason):
    e = error(toml)
    assert (e.key, e.reason) == (key, reason)


def test_timeouts_are_floats_whatever_was_written():
    t = parse("[timeouts]\nboot = 30\nverify = 1.5").timeouts
    assert (t.boot, t.verify) == (30.0, 1.5) and isinstance(t.boot, float)


# --- commands -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "toml, key, reason",
    [
        ('setup = "make"', "setup", "must be an array of commands, not a string"),
        ("setup = [[]]", "setup[0]", "must not be an empty array"),
        ('setup = [""]', "setup[0]", "must not be empty"),
        ('setup = [["", "x"]]', "setup[0][0]", "must not be empty"),
        ('setup = [["ls", 3]]', "setup[0][1]", "must be a string, not an integer"),
        ("setup = [3]", "setup[0]", "must be a string (run with sh -c) or an array of strings, not an integer"),
        ("setup = [{timeout = 3}]", "setup[0]", "missing key 'run'"),
        ('setup = ["ok", {run = "x", timeout = -1}]', "[setup[1]].timeout", "must be more than 0 and at most 86400 seconds (got -1)"),
        ('task = {run = "x", cwd = "work"}', "[task].cwd", "must be absolute"),
        ('task = {run = "x", cwd = "/a/../b"}', "[task].cwd", "must be normalized, without '.', '..' or repeated '/' (got '/a/../b', use '/b')"),
        ('task = {run = "x", user = "bad user"}', "[task].user", "must be a user name or numeric uid (got 'bad user')"),
        ('task = {run = "x", user = -1}', "[task].user", "must be between 0 and 4294967294 (got -1)"),
    ],
)
def test_command_errors(toml, key, reason):
    e = error(toml)
    assert (e.key, e.reason) == (key, reason)


# --- network ------------------------------------------------------------------------------------------------
def test_network_off_and_allow_rules_round_trip_as_text():
    assert not parse('network = "off"').network.enabled
    entries = ["pypi.org:443", "192.0.2.10", "192.0.2.10:80", "[2001:db8::1]:443", "2001:db8::1", "10.0.0.0/8", "localhost"]
    rules = parse(f"network = {{allow = {entries!r}}}".replace("'", '"')).network.allow
    assert [str(r) for r in rules] == entries
    assert [r.kind for r in rules] == ["host", "cidr", "cidr", "cidr", "cidr", "cidr", "host"]


@pytest.mark.parametrize(
    "entry, reason",
    [
        ("10.0.0.1/8", "invalid CIDR '10.0.0.1/8': 10.0.0.1/8 has host bits set"),
        ("999.1.1.1", "'999.1.1.1' is not a CIDR, an IP address or a DNS name (optionally with :port)"),
        ("*.example.com", "'*.example.com' is not a CIDR, an IP address or a DNS name (optionally with :port)"),
        ("pypi.org:0", "invalid port in 'pypi.org:0': must be 1..65535"),
        ("pypi.org:70000", "invalid port in 'pypi.org:70000': must be 1..65535"),
        ("pypi.org:https", "invalid port in 'pypi.org:https': must be 1..65535"),
        ("[::1", "invalid entry '[::1': expected [IPv6] or [IPv6]:port"),
        ("[nothex]:80", "invalid IPv6 address in '[nothex]:80'"),
        ("", "must not be empty"),
    ],
)
def test_network_entry_errors(entry, reason):
    e = error(f'network = {{allow = ["ok.example", "{entry}"]}}')
    assert (e.key, e.reason) == ("[network].allow[1]", reason)


def test_public_network():
    s = parse('network = "public"')
    assert s.network.enabled and s.network.public and s.network.allow == ()
    s = parse('network = {public = true, allow = ["10.20.0.5:8080"], forward = ["80"]}')
    assert s.network.public and [str(r) for r in s.network.allow] == ["10.20.0.5:8080"] and s.network.forward
    assert not parse('network = {public = false, allow = ["pypi.org"]}').network.public
    assert error("network = {public = false}").reason == "missing key 'allow'"
    e = error('network = {public = "yes"}')
    assert (e.key, e.reason) == ("[network].public", "must be true or false, not a string")
    assert digest(parse('network = "public"')) == digest(parse("network = {public = true}"))
    assert digest(parse('network = "public"')) != digest(parse('network = {allow = ["0.0.0.0/0"]}'))


def test_closed_network_is_a_nic_with_nothing_allowed():
    s = parse('network = "closed"')
    assert s.network.enabled and s.network.closed and not s.network.public and s.network.allow == ()
    assert digest(s) != digest(parse('network = "off"'))
    e = error('network = {closed = true}')
    assert (e.key, e.reason) == ("[network].closed", "unknown key (expected one of allow, forward, public)")


def test_network_policy_errors():
    assert error('network = "on"').reason == ("must be \"off\", \"public\", \"closed\" or a table {allow = [...]} "
                                              "(got 'on')")
    assert error("network = {allow = []}").reason == 'must not be empty (write network = "off" to disable networking)'
    assert error("network = {}").reason == "missing key 'allow'"
    e = error('network = {allow = ["PyPI.org", "pypi.org."]}')
    assert (e.key, e.reason) == ("[network].allow[1]", "duplicate entry 'pypi.org'")


def test_port_forwards_parse_with_defaults_and_round_trip():
    from smold.smolfile import PortForward, to_mapping
    from smold.smolfile.digest import digest
    s = parse('network = {forward = ["8080", 9000, "18080:80", "0:81", "0.0.0.0:2222:22"]}')
    assert s.network.enabled and s.network.allow == ()
    assert s.network.forward == (PortForward(8080), PortForward(9000), PortForward(80, 18080), PortForward(81),
                                 PortForward(22, 2222, "0.0.0.0"))
    assert [str(f) for f in s.network.forward] == ["127.0.0.1:0:8080", "127.0.0.1:0:9000", "127.0.0.1:18080:80",
                                                   "127.0.0.1:0:81", "0.0.0.0:2222:22"]
    assert parse_mapping(to_mapping(s), base_dir=s.base_dir) == s
    both = parse('network = {allow = ["10.0.0.0/8"], forward = ["8080"]}')
    assert both.network.allow and both.network.forward
    # a Smolfile without forwards keeps the digest it had before forwards existed (bakes stay valid)
    plain = parse('network = {allow = ["10.0.0.0/8"]}')
    assert "forward" not in to_mapping(plain)["network"]
    assert digest(plain) != digest(both)


@pytest.mark.parametrize(
    "entry, reason",
    [
        ('"0"', "invalid port in '0': must be 1..65535"),
        ('"70000"', "invalid port in '70000': must be 1..65535"),
        ('"80:http"', "invalid port in '80:http': must be 1..65535"),
        ('"99999:80"', "invalid port in '99999:80': must be 1..65535"),
        ('"localhost:80:80"', "invalid forward 'localhost:80:80': the host address must be an IPv4 address (got 'localhost')"),
        ('"::1:80:80"', "invalid forward '::1:80:80': expected GUEST_PORT, HOST_PORT:GUEST_PORT or HOST_ADDRESS:HOST_PORT:GUEST_PORT"),
        ('""', "must not be empty"),
        ("true", "must be a string, not a boolean"),
    ],
)
def test_port_forward_entry_errors(entry, reason):
    e = error(f'network = {{forward = ["8080", {entry}]}}')
    assert (e.key, e.reason) == ("[network].forward[1]", reason)


def test_port_forward_list_errors():
    e = error('network = {forward = ["18080:80", "127.0.0.1:18080:81"]}')
    assert (e.key, e.reason) == ("[network].forward[1]", "host 127.0.0.1:18080 is already forwarded")
    e = error('network = {forward = ["80", "127.0.0.1:0:80"]}')
    assert (e.key, e.reason) == ("[network].forward[1]", "duplicate entry '127.0.0.1:0:80'")
    assert error('network = {forward = "80"}').reason == "must be an array of strings, not a string"
    e = error("network = {allow = [], forward = []}")
    assert (e.key, e.reason) == ("[network].allow", 'must not be empty (write network = "off" to disable networking)')
    assert error('network = {forwards = ["80"]}').reason.startswith("unknown key")


# --- mounts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mounts, key, reason",
    [
        ('"/etc" = "/x"', '[mounts]."/etc"', "host path must be relative to the Smolfile's directory"),
        ('".." = "/x"', '[mounts].".."', "host path escapes the Smolfile's directory"),
        ('"a/../../b" = "/x"', '[mounts]."a/../../b"', "host path escapes the Smolfile's directory"),
        ('"src" = "app"', "[mounts].src", "must be absolute"),
        ('"src" = "/"', "[mounts].src", "cannot copy onto the guest's root directory"),
        ('"src" = "/a"\n"./src/" = "/b"', '[mounts]."./src/"', "same host path as the mount of 'src'"),
        ('"a" = "/w"\n"b" = "/w/sub"', "[mounts].b", "guest path '/w/sub' overlaps '/w' (mount of 'a')"),
        ('"a" = "/w/sub"\n"b" = "/w"', "[mounts].b", "guest path '/w' overlaps '/w/sub' (mount of 'a')"),
        ('"a" = "/w"\n"b" = "/w"', "[mounts].b", "guest path '/w' overlaps '/w' (mount of 'a')"),
    ],
)
def test_mount_errors(mounts, key, reason):
    e = error("[mounts]\n" + mounts)
    assert (e.key, e.reason) == (key, reason)


def test_mounts_with_a_common_prefix_do_not_overlap():
    s = parse('[mounts]\n"a" = "/w"\n"b" = "/work"')
    assert [m.guest for m in s.mounts] == ["/w", "/work"]


def test_mounts_need_a_base_directory():
    e = error('[mounts]\n"a" = "/w"', base_dir=None)
    assert (e.key, e.reason) == ("mounts", "mounts need a base directory (where the Smolfile is)")
    assert parse("cpus = 1", base_dir=None).base_dir is None


def test_load_smolfile_checks_mount_sources_on_disk(tmp_path):
    (tmp_path / "agent").mkdir()
    (tmp_path / "input.csv").write_text("a,b\n")
    sf_path = tmp_path / "Smolfile.toml"
    sf_path.write_text('[mounts]\n"agent" = "/agent"\n"input.csv" = "/data/input.csv"\n')
    s = load_smolfile(sf_path)
    assert s.base_dir == str(tmp_path)
    assert [s.host_path(m) for m in s.mounts] == [tmp_path / "agent", tmp_path / "input.csv"]

    sf_path.write_text('[mounts]\n"missing" = "/m"\n')
    with pytest.raises(SmolfileError) as info:
        load_smolfile(sf_path)
    assert info.value.key == "[mounts].missing"
    assert info.value.reason == f"host path {tmp_path / 'missing'} does not exist"


def test_symlink_escaping_the_base_directory_is_rejected(tmp_path):
    base = tmp_path / "task"
    base.mkdir()
    (tmp_path / "secret").mkdir()
    (base / "link").symlink_to(tmp_path / "secret")
    (base / "inside").symlink_to(base)  # resolves to the base itself: allowed
    s = parse('[mounts]\n"link" = "/l"', base_dir=str(base))  # lexically fine
    with pytest.raises(SmolfileError) as info:
        check_mount_sources(s)
    assert info.value.key == "[mounts].link"
    assert info.value.reason == f"host path resolves to {tmp_path / 'secret'}, outside {base}"
    check_mount_sources(parse('[mounts]\n"inside" = "/i"', base_dir=str(base)))


def test_load_smolfile_unreadable(tmp_path):
    with pytest.raises(SmolfileError) as info:
        load_smolfile(tmp_path / "nope.toml")
    assert info.value.file == str(tmp_path / "nope.toml")
    assert info.value.reason.startswith("cannot read")


# --- checks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, key, reason",
    [
        ('run = "x"', "[verifier].checks[0]", "missing key 'kind' (one of command, file_exists, file_matches, http, reward)"),
        (
            'kind = "commnd"',
            "[verifier.checks[0]].kind",
            "unknown check kind 'commnd' (one of command, file_exists, file_matches, http, reward); did you mean 'command'?",
        ),
        ('kind = "command"', "[verifier].checks[0]", 'missing key \'run\' (required for kind = "command")'),
        ('kind = "command"\nrun = "x"\nexpect_exit = 256', "[verifier.checks[0]].expect_exit", "must be between 0 and 255 (got 256)"),
        ('kind = "file_exists"\npath = "/a/./b"', "[verifier.checks[0]].path", "must be normalized, without '.', '..' or repeated '/' (got '/a/./b', use '/a/b')"),
        ('kind = "file_exists"\npath = "//a"', "[verifier.checks[0]].path", "must be normalized, without '.', '..' or repeated '/' (got '//a', use '/a')"),
        ('kind = "file_matches"\npath = "/a"', "[verifier].checks[0]", "needs exactly one of 'content', 'regex', 'sha256'"),
        ('kind = "file_matches"\npath = "/a"\ncontent = ""\nregex = "x"', "[verifier].checks[0]", "needs exactly one of 'content', 'regex', 'sha256' (got content, regex)"),
        ('kind = "file_matches"\npath = "/a"\nregex = "(unclosed"', "[verifier.checks[0]].regex", "invalid regular expression: missing ), unterminated subpattern at position 0"),
        ('kind = "file_matches"\npath = "/a"\nsha256 = "abc"', "[verifier.checks[0]].sha256", "must be 64 hexadecimal digits"),
        ('kind = "http"\nurl = "https://127.0.0.1/"', "[verifier.checks[0]].url", "must be an http:// URL on 127.0.0.1, localhost or [::1] (it is fetched inside the guest) (got 'https://127.0.0.1/')"),
        ('kind = "http"\nurl = "http://example.com/"', "[verifier.checks[0]].url", "must be an http:// URL on 127.0.0.1, localhost or [::1] (it is fetched inside the guest) (got 'http://example.com/')"),
        ('kind = "http"\nurl = "http://10.0.0.1/"', "[verifier.checks[0]].url", "must be an http:// URL on 127.0.0.1, localhost or [::1] (it is fetched inside the guest) (got 'http://10.0.0.1/')"),
        ('kind = "http"\nurl = "http://u:p@localhost/"', "[verifier.checks[0]].url", "must not contain credentials (got 'http://u:p@localhost/')"),
        ('kind = "http"\nurl = "http://localhost:99999/"', "[verifier.checks[0]].url", "must be an http:// URL on 127.0.0.1, localhost or [::1] (it is fetched inside the guest): Port out of range 0-65535 (got 'http://localhost:99999/')"),
        ('kind = "http"\nurl = "http://localhost/"\nexpect_status = 99', "[verifier.checks[0]].expect_status", "must be between 100 and 599 (got 99)"),
        ('kind = "http"\nurl = "http://localhost/"\ncontains = ""', "[verifier.checks[0]].contains", "must not be empty"),
        ('kind = "reward"\npath = "reward.txt"', "[verifier.checks[0]].path", "must be absolute"),
        ('kind = "reward"\nthreshold = "high"', "[verifier.checks[0]].threshold", "must be a number, not a string"),
        ('kind = "reward"\ntimeout = 0', "[verifier.checks[0]].timeout", "must be more than 0 and at most 86400 seconds (got 0)"),
        ('kind = "reward"\nname = ""', "[verifier.checks[0]].name", "must not be empty"),
        ('kind = "reward"\nname = "a\\nb"', "[verifier.checks[0]].name", "must not contain control characters"),
    ],
)
def test_check_errors(body, key, reason):
    e = error(check_toml(body))
    assert (e.key, e.reason) == (key, reason)


def test_checks_must_be_an_array_of_tables():
    e = error('[verifier]\nchecks = "all"')
    assert (e.key, e.reason) == ("[verifier].checks", "must be an array of tables ([[verifier.checks]]), not a string")
    e = error("[verifier]\nchecks = [1]")
    assert (e.key, e.reason) == ("[verifier].checks[0]", "must be a table, not an integer")


def test_check_names_default_and_must_be_unique():
    s = parse(
        check_toml('kind = "command"\nrun = ["pytest", "-q"]')
        + check_toml('kind = "file_exists"\npath = "/a"')
        + check_toml('kind = "http"\nurl = "http://[::1]:80/"')
        + check_toml('kind = "reward"\npath = "/r.json"')
        + check_toml('kind = "command"\nrun = "' + "x" * 100 + '"')
    )
    assert [c.name for c in s.checks] == [
        "command: pytest -q",
        "file_exists: /a",
        "http: http://[::1]:80/",
        "reward: /r.json",
        "command: " + "x" * 57 + "...",
    ]
    e = error(check_toml('kind = "file_exists"\npath = "/a"') * 2)
    assert (e.key, e.reason) == (
        "[verifier.checks[1]].name",
        "duplicate check name 'file_exists: /a' (same as checks[0]); give each check a distinct name",
    )
    e = error(check_toml('kind = "reward"\nname = "x"') + check_toml('kind = "file_exists"\npath = "/a"\nname = "x"'))
    assert e.key == "[verifier.checks[1]].name"


def test_file_matches_content_may_be_empty():
    (c,) = parse(check_toml('kind = "file_matches"\npath = "/a"\ncontent = ""')).checks
    assert isinstance(c, FileMatchesCheck) and c.content == "" and c.regex is None


def test_file_exists_check():
    (c,) = parse(check_toml('kind = "file_exists"\npath = "/a/b/"\ntimeout = 5')).checks
    assert c == FileExistsCheck(name="file_exists: /a/b", path="/a/b", timeout=5.0)


# --- digest and canonical form ------------------------------------------------------------------------------
EXAMPLE = """
memory = "2G"
task = "make"
network = {allow = ["pypi.org:443"]}
[env]
A = "1"
B = "2"
[[verifier.checks]]
kind = "command"
run = "make test"
"""


def test_digest_ignores_form_but_not_meaning():
    a = parse(EXAMPLE)
    same = parse(
        """
# written differently, meaning the same
task = "make"
memory = 2048
cpus = 2
image = "default"
network = {allow = ["PYPI.ORG:443"]}
[env]
A = "1"
B = "2"
[timeouts]
boot = 300.0
[[verifier.checks]]
name = "command: make test"
kind = "command"
run = "make test"
expect_exit = 0
""",
        base_dir="/elsewhere",
    )
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest(a))
    assert digest(a) == digest(same)
    for change in [
        ('memory = "2G"', 'memory = "3G"'),
        ('task = "make"', 'task = ["make"]'),
        ('B = "2"', 'B = "3"'),
        ('run = "make test"', 'run = "make test"\nexpect_exit = 1'),
        ('"pypi.org:443"', '"pypi.org:80"'),
    ]:
        changed = parse(EXAMPLE.replace(*change))
        assert digest(changed) != digest(a), change


def test_to_mapping_round_trips_through_the_parser():
    s = parse(EXAMPLE + '\n[mounts]\n"src" = "/w"\n' + check_toml('kind = "reward"\nthreshold = 0.5'))
    again = parse_mapping(to_mapping(s), base_dir=s.base_dir)
    assert again == s and digest(again) == digest(s)


# --- the documentation ----------------------------------------------------------------------------------------
def test_every_toml_example_in_the_docs_is_valid():
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) >= 10
    for block in blocks:
        parse(block)  # raises SmolfileError with the offending key if the docs drift


def test_documented_error_messages_are_the_real_ones():
    inputs = [
        "memory = 64",
        "[timeouts]\nboto = 3",
        check_toml('kind = "reward"\nname = "r0"')
        + check_toml('kind = "reward"\nname = "r1"')
        + check_toml('kind = "file_exists"\npath = "etc"'),
        check_toml('kind = "commnd"'),
        '[mounts]\n"../secrets" = "/s"',
        'network = {allow = ["pypi.org", "10.0.0.1/8"]}',
        "a = 1\nb = 2\nimage\n",
    ]
    text = DOCS.read_text()
    documented = re.search(r"## Errors.*?```text\n(.*?)```", text, re.S)
    assert documented is not None
    lines = documented.group(1).splitlines()
    assert [str(error(toml)) for toml in inputs] == lines


@pytest.mark.parametrize("image", [
    "default", "debian:bookworm-slim", "ghcr.io/org/img:1.0", "127.0.0.1:5000/a/b@sha256:" + "a" * 64,
    "./img", "../images/x.tar", "/abs/layout", "oci:./dir:tag", "oci-archive:/x/y.tar",
])
def test_image_accepts_registry_refs_and_local_paths(image: str) -> None:
    assert parse_smolfile(f'image = "{image}"'.encode(), base_dir=BASE).image == image


@pytest.mark.parametrize("image", ["-x", "~/img", "a b", ".hidden", "x" * 256])
def test_image_rejects_malformed(image: str) -> None:
    with pytest.raises(SmolfileError):
        parse_smolfile(f'image = "{image}"'.encode(), base_dir=BASE)


# --- [verifier.mounts] ----------------------------------------------------------------------------------------
def test_verifier_mounts_parse_round_trip_and_leave_other_digests_alone(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "tests").mkdir()
    text = '[mounts]\n"task" = "/task"\n[verifier.mounts]\n"tests" = "/tests"\n'
    (tmp_path / "Smolfile.toml").write_text(text)
    s = load_smolfile(tmp_path / "Smolfile.toml")
    assert [(m.host, m.guest) for m in s.verifier_mounts] == [("tests", "/tests")]
    assert [(p, m.host) for p, m in s.all_mounts] == [(("mounts",), "task"), (("verifier", "mounts"), "tests")]
    without = parse('[mounts]\n"task" = "/task"\n', base_dir=str(tmp_path))
    assert digest(s) != digest(without)
    # a Smolfile without them digests as before they existed (no empty "mounts" under "verifier")
    assert "mounts" not in to_mapping(without)["verifier"]
    assert to_mapping(s)["verifier"]["mounts"] == {"tests": "/tests"}
    # they are not part of the machine's state at create time, so not of its bake
    assert boot_state_digest(s) == boot_state_digest(without)
    (tmp_path / "tests").rmdir()
    with pytest.raises(SmolfileError) as info:
        load_smolfile(tmp_path / "Smolfile.toml")
    assert info.value.key == "[verifier.mounts].tests" and "does not exist" in info.value.reason


@pytest.mark.parametrize(
    "toml, reason",
    [
        ('[verifier.mounts]\n".." = "/x"', "host path escapes the Smolfile's directory"),
        ('[mounts]\n"a" = "/w"\n[verifier.mounts]\n"t" = "/w/tests"',
         "guest path '/w/tests' overlaps '/w' (mount of 'a'): a verifier mount may not replace or sit inside a "
         "task mount"),
        ('[mounts]\n"." = "/w"\n[verifier.mounts]\n"t" = "/t"',
         "host path 't' overlaps the task mount of '.', which would copy it into the guest before the task: narrow "
         "that mount"),
        ('[mounts]\n"t/x" = "/x"\n[verifier.mounts]\n"t" = "/t"',
         "host path 't' overlaps the task mount of 't/x', which would copy it into the guest before the task: "
         "narrow that mount"),
    ],
)
def test_verifier_mount_errors(toml, reason):
    e = error(toml)
    assert e.key.startswith("[verifier.mounts].") and e.reason == reason
    assert [m.host for m in parse('[mounts]\n"tx" = "/x"\n[verifier.mounts]\n"t" = "/t"').verifier_mounts] == ["t"]


# --- [verifier] outputs (sealed verification) ------------------------------------------------------------------
def test_verifier_outputs_parse_round_trip_and_leave_other_digests_alone():
    s = parse('[verifier]\noutputs = ["/app", "/logs/agent", "/home/u/work", "/tmp/x y"]\n')
    assert s.verifier_outputs == ("/app", "/logs/agent", "/home/u/work", "/tmp/x y") and s.sealed
    without = parse("")
    assert not without.sealed and digest(s) != digest(without)
    assert "outputs" not in to_mapping(without)["verifier"]  # digests of Smolfiles without them are unchanged
    assert parse_mapping(to_mapping(s), base_dir=BASE) == s
    assert boot_state_digest(s) == boot_state_digest(without)  # what the task's work lands in is not a boot input
    from smold.api import convert  # noqa: PLC0415

    assert convert.smolfile_from_spec_proto(convert.smolfile_to_spec_proto(s)) == s


@pytest.mark.parametrize(
    "toml, key, fragment",
    [
        ('[verifier]\noutputs = "/app"', "[verifier].outputs", "must be an array of absolute guest paths"),
        ('[verifier]\noutputs = []', "[verifier].outputs", "at least one guest path"),
        ('[verifier]\noutputs = ["app"]', "[verifier].outputs[0]", "must be absolute"),
        ('[verifier]\noutputs = ["/app/../etc"]', "[verifier].outputs[0]", "must be normalized"),
        ('[verifier]\noutputs = ["/"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/usr/local/app"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/etc"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/root/out"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/logs"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/logs/verifier/x"]', "[verifier].outputs[0]", "is or holds system files"),
        ('[verifier]\noutputs = ["/app", "/app/sub"]', "[verifier].outputs[1]", "overlaps outputs[0] '/app'"),
        ('[verifier]\noutputs = ["/w"]\n[verifier.mounts]\n"t" = "/w/tests"', "[verifier].outputs[0]",
         "overlaps the verifier mount at '/w/tests'"),
        ('[verifier]\noutputs = ["/app"]\n[[verifier.checks]]\nkind = "http"\nurl = "http://127.0.0.1:8000/"',
         "[verifier].checks[0]", "an http check needs the task's machine"),
    ],
)
def test_verifier_output_errors(toml, key, fragment):
    e = error(toml)
    assert e.key == key and fragment in e.reason, (e.key, e.reason)


def test_verifier_image_parses_round_trips_and_makes_the_verifier_smolfile():
    s = parse('setup = ["true"]\ntask = "run"\n[mounts]\n"t" = "/task"\n'
              '[verifier]\nimage = "ghcr.io/acme/checker:1"\noutputs = ["/app"]\n[verifier.mounts]\n"v" = "/tests"\n'
              '[[verifier.checks]]\nname = "a"\nkind = "file_exists"\npath = "/app/a"\n')
    assert s.verifier_image == "ghcr.io/acme/checker:1" and s.image == "default"
    v = s.verifier_smolfile()
    assert v.image == "ghcr.io/acme/checker:1" and v.mounts == () and v.setup == () and v.task is None
    assert v.checks == s.checks and v.verifier_mounts == s.verifier_mounts and v.verifier_outputs == s.verifier_outputs
    without = replace(s, verifier_image="")
    assert without.verifier_smolfile() is without and digest(s) != digest(without)
    assert "image" not in to_mapping(without)["verifier"]  # digests of Smolfiles without one are unchanged
    assert parse_mapping(to_mapping(s), base_dir=BASE) == s
    assert boot_state_digest(s) == boot_state_digest(without)  # the task's machine boots the same either way
    from smold.api import convert  # noqa: PLC0415

    assert convert.smolfile_from_spec_proto(convert.smolfile_to_spec_proto(s)) == s


@pytest.mark.parametrize(
    "toml, fragment",
    [
        ('[verifier]\nimage = "checker"', "a verifier image needs [verifier] outputs"),
        ('[verifier]\nimage = ""\noutputs = ["/app"]', "must not be empty"),
        ('[verifier]\nimage = 3\noutputs = ["/app"]', "must be a string"),
        ('[verifier]\nimage = "bad name!"\noutputs = ["/app"]', "is not a valid image name"),
    ],
)
def test_verifier_image_errors(toml, fragment):
    e = error(toml)
    assert e.key == "[verifier].image" and fragment in e.reason, (e.key, e.reason)
