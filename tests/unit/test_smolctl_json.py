"""smolctl info; --json on smolctl rm, cp and logs (the other commands' --json are tested with them), and the progress ticker."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import pytest
from daemon_support import DaemonProcess, daemon_in_tempdir

from smolctl.output import Progress

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with daemon_in_tempdir("cjson-") as proc:
        yield proc


def test_cp_logs_rm_json(daemon: DaemonProcess) -> None:
    sf = daemon.workdir / "Smolfile.toml"
    sf.write_text("")
    mid = daemon.smolctl("create", str(sf)).stdout.decode().strip()
    src = daemon.workdir / "f.txt"
    src.write_text("hello")
    guest = daemon.workdir / "guest"
    r = daemon.smolctl("cp", "--json", str(src), f"{mid}:{guest}/f.txt")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"src": str(src), "dst": f"{mid}:{guest}/f.txt", "size_bytes": 5}
    back = daemon.workdir / "back.txt"
    r = daemon.smolctl("cp", "--json", f"{mid}:{guest}/f.txt", str(back))
    assert json.loads(r.stdout)["size_bytes"] == 5 and back.read_text() == "hello"
    logs = json.loads(daemon.smolctl("logs", "--json", mid).stdout)
    assert logs["machine"] == mid and logs["state"] == "running" and isinstance(logs["console_tail"], str)
    r = daemon.smolctl("rm", "--json", mid, "no-such-machine")
    assert r.returncode == 2
    out = json.loads(r.stdout)
    assert [(x["machine"], x["destroyed"]) for x in out] == [(mid, True), ("no-such-machine", False)]
    assert "no-such-machine" in out[1]["error"] and r.stderr == b""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_ticks_on_a_terminal_and_erases_its_line() -> None:
    out = _Tty()
    with Progress("pulling x", stream=out, interval=0.01):
        time.sleep(0.1)
    text = out.getvalue()
    assert text.startswith("\r\x1b[K| pulling x 0s") and text.count("pulling x") >= 3
    assert text.endswith("\r\x1b[K")


def test_progress_is_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("pulling x", stream=out, interval=0.01):
        time.sleep(0.05)
    assert out.getvalue() == ""


def test_info_shows_the_limits_and_what_is_in_use(daemon: DaemonProcess) -> None:
    sf = daemon.workdir / "Smolfile-info.toml"
    sf.write_text("memory = 256\n")
    mid = daemon.smolctl("create", str(sf)).stdout.decode().strip()
    try:
        doc = json.loads(daemon.smolctl("info", "--json").stdout)
        assert doc["live_machines"] == 1 and doc["memory_in_use_mib"] == 256 and doc["max_machines"] == 32, doc
        assert doc["public_network"] is True and doc["default_memory_mib"] == 1024
        text = daemon.smolctl("info").stdout.decode()
        assert "machines: 1 of 32" in text and "public network: allowed" in text, text
    finally:
        daemon.smolctl("rm", mid)
