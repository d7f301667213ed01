"""smolctl against a real smold process (host-agent launcher): output, exit codes, one-line errors, examples."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import REPO, DaemonProcess, processes_mentioning, run_smolctl

from smold.smolfile import load_smolfile

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = Path(tempfile.mkdtemp(prefix="smc-", dir="/tmp"))
    proc = DaemonProcess(d, "--max-copy-bytes", str(1 << 20)).start()
    yield proc
    code = proc.terminate()
    leftovers = processes_mentioning(str(proc.state / "machines"))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0 and leftovers == []


@pytest.fixture
def guest(daemon: DaemonProcess) -> Iterator[Path]:
    g = Path(tempfile.mkdtemp(prefix="g-", dir=daemon.workdir))
    yield g
    shutil.rmtree(g, ignore_errors=True)


def smolfile_dir(root: Path, text: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="sf-", dir=root))
    (d / "Smolfile.toml").write_text(text)
    return d


def out(r) -> str:  # type: ignore[no-untyped-def]
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout.decode()


def test_create_ls_exec_logs_rm(daemon: DaemonProcess, guest: Path) -> None:
    sf = smolfile_dir(guest, 'memory = "256M"\ncpus = 1\n[env]\nFROM_SMOLFILE = "yes"\n')
    mid = out(daemon.smolctl("create", str(sf), "--name", "box")).strip()
    assert re.fullmatch(r"m-[0-9a-f]{12}", mid)
    table = out(daemon.smolctl("ls")).splitlines()
    assert table[0].split() == ["ID", "NAME", "STATE", "CPUS", "MEMORY", "IMAGE", "AGE", "PID"]
    assert table[1].split()[:6] == [mid, "box", "running", "1", "256M", "default"]
    assert out(daemon.smolctl("ls", "-q")).split() == [mid]

    r = daemon.smolctl("exec", "-e", "X=1", "-w", str(guest), "box", "--", "sh", "-c",
                       'echo "o $FROM_SMOLFILE $X $(pwd)"; echo e >&2; exit 7')
    assert (r.returncode, r.stdout, r.stderr) == (7, f"o yes 1 {guest}\n".encode(), b"e\n")
    r = daemon.smolctl("exec", "-i", mid, "--", "tr", "a-z", "A-Z", stdin=b"shout\n")
    assert (r.returncode, r.stdout) == (0, b"SHOUT\n")
    r = daemon.smolctl("exec", "-t", "0.3", mid, "--", "sleep", "30")
    assert r.returncode == 124 and b"timed out after 0.3s" in r.stderr
    r = daemon.smolctl("exec", mid, "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + signal.SIGTERM

    logs = out(daemon.smolctl("logs", mid))
    assert "smol-agent" in logs  # the host agent's output stands in for the serial console
    assert out(daemon.smolctl("rm", mid)).strip() == mid
    assert out(daemon.smolctl("ls", "-q")) == ""


def test_cp_files_and_directories_both_ways(daemon: DaemonProcess, guest: Path) -> None:
    mid = out(daemon.smolctl("create", str(smolfile_dir(guest, "memory = 256\n")))).strip()
    src = guest / "host-src"
    (src / "d").mkdir(parents=True)
    (src / "f.txt").write_bytes(b"\x00\xffdata")
    (src / "d" / "x.sh").write_text("#!/bin/sh\n")
    (src / "d" / "x.sh").chmod(0o750)
    try:
        out(daemon.smolctl("cp", str(src / "f.txt"), f"{mid}:{guest}/in/"))
        assert (guest / "in" / "f.txt").read_bytes() == b"\x00\xffdata"
        out(daemon.smolctl("cp", str(src), f"{mid}:{guest}/tree"))
        assert (guest / "tree" / "d" / "x.sh").stat().st_mode & 0o777 == 0o750
        back = guest / "back"
        back.mkdir()
        out(daemon.smolctl("cp", f"{mid}:{guest}/in/f.txt", str(back)))
        assert (back / "f.txt").read_bytes() == b"\x00\xffdata"
        out(daemon.smolctl("cp", "-r", f"{mid}:{guest}/tree", str(guest / "back-tree")))
        assert (guest / "back-tree" / "d" / "x.sh").read_text() == "#!/bin/sh\n"
        r = daemon.smolctl("cp", str(src / "f.txt"), str(guest / "x"))
        assert r.returncode == 2 and r.stderr == b"smolctl: error: cp: exactly one of SRC and DST must be MACHINE:/path\n"
        big = guest / "big"
        big.write_bytes(b"x" * ((1 << 20) + 1))
        r = daemon.smolctl("cp", str(big), f"{mid}:{guest}/big2")
        assert r.returncode == 2 and b"copy cap of 1048576 bytes" in r.stderr and r.stderr.count(b"\n") == 1
    finally:
        out(daemon.smolctl("rm", mid))


def test_verify_and_run_print_results_and_exit_0_or_1(daemon: DaemonProcess, guest: Path) -> None:
    text = f"""memory = 256
task = "echo 42 > {guest}/answer"
[[verifier.checks]]
kind = "file_matches"
path = "{guest}/answer"
content = "42\\n"
"""
    sf = smolfile_dir(guest, text)
    mid = out(daemon.smolctl("create", str(sf))).strip()
    r = daemon.smolctl("verify", mid)
    assert r.returncode == 1 and r.stdout.decode().startswith("FAIL  0/1 checks passed")
    assert f"{guest}/answer does not exist" in r.stdout.decode()
    out(daemon.smolctl("exec", mid, "--", "sh", "-c", f"echo 42 > {guest}/answer"))
    r = daemon.smolctl("verify", "--json", mid)
    assert r.returncode == 0 and json.loads(r.stdout)["passed"] is True
    out(daemon.smolctl("rm", mid))
    os.unlink(guest / "answer")

    r = daemon.smolctl("run", str(sf))
    text_out = r.stdout.decode()
    assert r.returncode == 0 and text_out.startswith("PASS  1/1 checks passed"), text_out
    assert re.search(r"^  ok    task ", text_out, re.M) and re.search(r"^  pass  file_matches: ", text_out, re.M)
    r = daemon.smolctl("run", "--json", str(sf / "Smolfile.toml"))
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["result"]["passed"] is True
    assert [s["name"] for s in doc["steps"]] == ["boot", "task"]
    assert out(daemon.smolctl("ls", "-q")) == ""  # Run destroyed its machine


def test_errors_are_one_line_with_the_reason(daemon: DaemonProcess, guest: Path, tmp_path: Path) -> None:
    cases = [
        (("ls",), None),
        (("rm", "ghost"), "smolctl: error: no machine 'ghost'\n"),
        (("logs", "ghost"), "smolctl: error: no machine 'ghost'\n"),
        (("verify", "ghost"), "smolctl: error: no machine 'ghost'\n"),
        (("create", str(guest / "nowhere")), f"smolctl: error: {guest / 'nowhere'}: no such file\n"),
    ]
    for args, expected in cases:
        r = daemon.smolctl(*args)
        if expected is None:
            assert r.returncode == 0
        else:
            assert (r.returncode, r.stderr.decode()) == (2, expected), args
    r = daemon.smolctl("exec", "ghost", "--", "true")
    assert (r.returncode, r.stderr) == (125, b"smolctl: error: no machine 'ghost'\n")
    bad = smolfile_dir(guest, "memory = 64\n")
    r = daemon.smolctl("run", str(bad))
    assert r.returncode == 2
    assert r.stderr.decode() == f"smolctl: error: {bad / 'Smolfile.toml'}: memory: must be at least 128 MiB " \
                                "(got 64 MiB)\n"
    r = run_smolctl(tmp_path / "nobody-home.sock", "ls")
    assert r.returncode == 2 and r.stderr.startswith(b"smolctl: error: cannot reach smold at ")
    assert r.stderr.count(b"\n") == 1 and b"SMOL_SOCKET" in r.stderr


# --- the examples, with their guest paths moved under a temp dir (the host agent runs on the host) -----------
GUEST_ROOTS = ("work", "task", "tests", "logs")


def relocated_example(name: str, root: Path) -> Path:
    """A copy of examples/NAME whose absolute guest paths (/work, /task, ...) live under root."""
    dst = root / name
    shutil.copytree(REPO / "examples" / name, dst)
    pattern = re.compile(r"(?<![\w./-])/(" + "|".join(GUEST_ROOTS) + r")\b")
    for path in dst.rglob("*"):
        if path.is_file():
            path.write_text(pattern.sub(lambda m: f"{root}/{m.group(1)}", path.read_text()))
    sf = dst / "Smolfile.toml"
    sf.write_text(sf.read_text().replace('kind = "reward"', f'kind = "reward"\npath = "{root}/logs/verifier/reward.txt"'))
    return dst


@pytest.mark.parametrize("name", ["hello-pass", "hello-fail"])
def test_examples_are_valid_smolfiles(name: str) -> None:
    sf = load_smolfile(REPO / "examples" / name / "Smolfile.toml")
    assert sf.image == "default" and sf.task is not None and sf.network.allow == ()
    assert [c.kind for c in sf.checks] == ["command", "file_matches", "reward"]


def test_examples_pass_and_fail_with_evidence(daemon: DaemonProcess, guest: Path) -> None:
    r = daemon.smolctl("run", str(relocated_example("hello-pass", guest / "p")))
    text = r.stdout.decode()
    assert r.returncode == 0 and text.startswith("PASS  3/3 checks passed"), (text, r.stderr)

    r = daemon.smolctl("run", str(relocated_example("hello-fail", guest / "f")))
    text = r.stdout.decode()
    assert r.returncode == 1 and text.startswith("FAIL  0/3 checks passed"), (text, r.stderr)
    assert re.search(r"^  FAIL  test suite .*expected exit 0, got exit 1", text, re.M), text
    assert "AssertionError: Lists differ: ['Fizz', 'Fizz'] != ['FizzBuzz', 'FizzBuzz']" in text
    assert re.search(r"^  FAIL  output .*no match for regex", text, re.M) and "| 15: Fizz" in text
    assert re.search(r"^  FAIL  reward .*reward 0 < threshold 1", text, re.M)


def test_a_check_that_kills_the_guest_agent_is_a_verifier_error_exit_3(daemon: DaemonProcess, guest: Path) -> None:
    """The agent under test may break the harness during verification: the verdict is then verifier_error
    (exit 3, the check marked ERROR with why), never a pass, a plain fail or an INTERNAL error of the daemon."""
    sf = smolfile_dir(guest, 'memory = 256\n[[verifier.checks]]\nkind = "command"\nname = "rigged"\n'
                             'run = "kill -9 $PPID; sleep 5"\n')
    mid = out(daemon.smolctl("create", str(sf))).strip()
    try:
        r = daemon.smolctl("verify", mid)
        text = r.stdout.decode()
        assert r.returncode == 3 and text.startswith("VERIFIER_ERROR  0/1 checks passed"), (text, r.stderr)
        assert re.search(r"^  ERROR  rigged  ", text, re.M), text
        assert "verifier_error: 1 of 1 checks could not be decided: rigged: " in text, text
    finally:
        out(daemon.smolctl("rm", mid))


def test_a_run_whose_setup_fails_is_an_infra_error_exit_4(daemon: DaemonProcess, guest: Path) -> None:
    """No verdict on the agent's work when smol could not run the attempt: INFRA_ERROR, exit 4, and why."""
    sf = smolfile_dir(guest, 'memory = 256\nsetup = ["echo preparing; exit 3"]\ntask = "true"\n'
                             '[[verifier.checks]]\nkind = "command"\nrun = "true"\n')
    r = daemon.smolctl("run", str(sf))
    text = r.stdout.decode()
    assert r.returncode == 4 and text.startswith("INFRA_ERROR  0/0 checks passed"), (text, r.stderr)
    assert "stopped before the verifier: setup[0] failed" in text, text
    r = daemon.smolctl("run", "--json", str(sf))
    assert r.returncode == 4 and json.loads(r.stdout)["outcome"] == "OUTCOME_INFRA_ERROR", r.stdout


def test_verifier_mounts_are_in_only_while_the_checks_run(daemon: DaemonProcess, guest: Path) -> None:
    """[verifier.mounts] (host agent: guest paths are host paths): the task does not see them, what it planted at
    their path (a file, a symlink out) is replaced, and after a Verify they are gone again."""
    d = guest / "task"
    (d / "tests").mkdir(parents=True)
    (d / "tests" / "check.sh").write_text("echo genuine\n")
    dest, seen, elsewhere = guest / "t", guest / "seen", guest / "elsewhere"
    elsewhere.mkdir()
    (d / "Smolfile.toml").write_text(f'''memory = 256
task = "if [ -e {dest} ]; then echo seen; else echo absent; fi > {seen}; ln -s {elsewhere} {dest}"
[verifier.mounts]
"tests" = "{dest}"
[[verifier.checks]]
kind = "command"
run = "test ! -L {dest} && sh {dest}/check.sh"
''')
    r = daemon.smolctl("run", str(d))
    text = r.stdout.decode()
    assert r.returncode == 0 and text.startswith("PASS  1/1 checks passed"), (text, r.stderr)
    assert seen.read_text() == "absent\n"
    assert list(elsewhere.iterdir()) == []          # the copy did not follow the task's symlink
    assert not re.search(r"^  ok    mount", text, re.M)   # not a create-time step

    shutil.rmtree(dest)
    mid = out(daemon.smolctl("create", str(d))).strip()
    try:
        assert not dest.exists()
        dest.write_text("planted by the agent")
        r = daemon.smolctl("verify", mid)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert not dest.exists()                      # removed once the checks ended
    finally:
        out(daemon.smolctl("rm", mid))


def test_a_reward_file_the_task_planted_is_never_read(daemon: DaemonProcess, guest: Path) -> None:
    """The reward checks read what this verification's checks wrote: a reward file the task left is removed first."""
    reward = guest / "logs" / "reward.txt"
    planted = smolfile_dir(guest, f'memory = 256\ntask = "mkdir -p {reward.parent} && echo 1 > {reward}"\n'
                                  f'[[verifier.checks]]\nkind = "reward"\npath = "{reward}"\n')
    r = daemon.smolctl("run", str(planted))
    text = r.stdout.decode()
    assert r.returncode == 1 and text.startswith("FAIL  0/1 checks passed"), (text, r.stderr)
    assert f"no reward file (looked for {reward})" in text, text
    honest = smolfile_dir(guest, f'memory = 256\ntask = "mkdir -p {reward.parent} && echo 1 > {reward}"\n'
                                 f'[[verifier.checks]]\nkind = "command"\nname = "tests"\nrun = "echo 1 > {reward}"\n'
                                 f'[[verifier.checks]]\nkind = "reward"\npath = "{reward}"\n')
    r = daemon.smolctl("run", str(honest))
    assert r.returncode == 0 and r.stdout.decode().startswith("PASS  2/2 checks passed"), (r.stdout, r.stderr)


def test_a_verifier_mount_swapped_for_a_symlink_after_create_is_not_copied(daemon: DaemonProcess,
                                                                           guest: Path) -> None:
    """The daemon reads verifier mount sources at verification time, so it checks them again then: a source a
    client replaced by a symlink out of the task directory is refused (verifier_error), and nothing is copied."""
    d = guest / "swap"
    (d / "tests").mkdir(parents=True)
    secret = guest / "secret"
    secret.mkdir()
    (secret / "key").write_text("not for the guest")
    dest = guest / "vt"
    (d / "Smolfile.toml").write_text(f'memory = 256\n[verifier.mounts]\n"tests" = "{dest}"\n'
                                     f'[[verifier.checks]]\nkind = "command"\nrun = "true"\n')
    mid = out(daemon.smolctl("create", str(d))).strip()
    try:
        (d / "tests").rmdir()
        (d / "tests").symlink_to(secret)
        r = daemon.smolctl("verify", mid)
        text = r.stdout.decode()
        assert r.returncode == 3 and text.startswith("VERIFIER_ERROR"), (text, r.stderr)
        assert f"host path resolves to {secret}, outside {d}" in text, text
        assert not dest.exists()
    finally:
        out(daemon.smolctl("rm", mid))


def test_guest_text_is_shown_not_obeyed_by_the_terminal(daemon: DaemonProcess, guest: Path) -> None:
    """Issue #19 (8): a guest's output in smolctl's human output cannot steer the terminal (OSC 52 writes the
    clipboard, CSI sequences rewrite the screen, a carriage return or a bidi override hides what came before);
    --json keeps the bytes, escaped by JSON."""
    attack = r"printf 'ok\033]52;c;ZXZpbA==\007\033[2J\rhidden\342\200\256evil\n'; exit 1"
    sf = smolfile_dir(guest, f'memory = 256\n[[verifier.checks]]\nname = "loud"\nkind = "command"\n'
                             f"run = '''{attack}'''\n")
    for cmd in (("run", str(sf)), ("run", "-v", str(sf))):
        r = daemon.smolctl(*cmd)
        text = r.stdout.decode()
        assert r.returncode == 1 and "ok\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J" in text, text
        assert "hidden\\u202eevil" in text, text   # the carriage return became a line break: nothing is hidden
        assert not any(c in text for c in "\x1b\x07\r\u202e"), text
    doc = json.loads(daemon.smolctl("run", "--json", str(sf)).stdout)
    assert "\x1b]52;c;ZXZpbA==\x07" in doc["result"]["checks"][0]["evidence"]["output_tail"]


def test_terminal_safe_escapes_controls_only() -> None:
    from smolctl.client import terminal_safe
    assert terminal_safe("plain\ttext\nnext line, ünïcödé ✓") == "plain\ttext\nnext line, ünïcödé ✓"
    assert terminal_safe("a\r\nb\x00\x7f\x9b\u2066") == "a\nb\\x00\\x7f\\x9b\\u2066"
