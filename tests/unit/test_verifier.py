"""The verifier against a real guest agent running on the host (Unix socket), one test per behaviour."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from test_agent import AgentProcess

import smold.verifier.runner as runner_mod
from smold.agent import AgentClient, AgentRequestError, connect_unix
from smold.smolfile import (
    CommandCheck,
    FileExistsCheck,
    FileMatchesCheck,
    HttpCheck,
    RewardCheck,
    digest,
    parse_smolfile,
)
from smold.verifier import (
    OUTPUT_TAIL_BYTES,
    CheckResult,
    TailBuffer,
    parse_reward,
    run_one,
    tail_text,
    verify,
    verify_smolfile,
)
from smold.verifier.errors import RewardFormatError

pytestmark = pytest.mark.timeout(60)

needs_python3 = pytest.mark.skipif(shutil.which("python3") is None, reason="the http probe runs python3")


# --- a real agent on a Unix socket (test_agent.AgentProcess) ------------------------------------------


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smolvf-", dir="/tmp"))  # AF_UNIX paths are limited to 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(workdir: Path) -> Iterator[AgentProcess]:
    a = AgentProcess(workdir)
    yield a
    alive = a.proc.poll() is None
    a.stop()
    assert alive, f"agent died during the test: {a.log.read_text()}"


@pytest.fixture
async def client(agent: AgentProcess) -> AsyncIterator[AgentClient]:
    c = await connect_unix(agent.path)
    yield c
    await c.close()


async def one(client: AgentClient, check, timeout: float = 20.0, env=None) -> CheckResult:
    result = await verify(client, [check], timeout=timeout, env=env)
    assert len(result.checks) == 1
    assert result.passed == result.checks[0].passed
    return result.checks[0]


# --- command ------------------------------------------------------------------------------------------------
async def test_command_check_passes_on_expected_exit_and_keeps_output(client):
    r = await one(client, CommandCheck(name="t", run="echo ran-ok; echo to-stderr >&2; exit 0"))
    assert r.passed and r.kind == "command" and r.name == "t"
    assert r.evidence.exit_code == 0
    assert "ran-ok" in r.evidence.output_tail and "to-stderr" in r.evidence.output_tail
    assert r.evidence.duration_ms >= 0


async def test_command_check_fails_on_other_exit_code(client):
    r = await one(client, CommandCheck(name="t", run=("sh", "-c", "echo boom; exit 3")))
    assert not r.passed
    assert r.evidence.exit_code == 3
    assert r.evidence.detail == "expected exit 0, got exit 3"
    assert "boom" in r.evidence.output_tail


async def test_command_check_expect_nonzero_exit(client):
    assert (await one(client, CommandCheck(name="t", run="exit 7", expect_exit=7))).passed
    assert not (await one(client, CommandCheck(name="t", run="exit 0", expect_exit=7))).passed


async def test_command_check_uses_cwd_and_env(client, workdir):
    check = CommandCheck(name="t", run='test "$(pwd)" = "$WANT" && test "$TOKEN" = abc', cwd=str(workdir))
    assert (await one(client, check, env={"WANT": str(workdir), "TOKEN": "abc"})).passed
    assert not (await one(client, check, env={"WANT": str(workdir), "TOKEN": "xyz"})).passed


async def test_command_check_killed_by_signal(client):
    r = await one(client, CommandCheck(name="t", run="kill -KILL $$"))
    assert not r.passed and r.evidence.exit_code is None
    assert r.evidence.detail == "killed by signal 9"


async def test_command_check_timeout_kills_and_fails(client):
    t0 = time.monotonic()
    r = await one(client, CommandCheck(name="t", run="echo started; sleep 30", timeout=0.5))
    assert time.monotonic() - t0 < 10
    assert not r.passed and r.evidence.timed_out
    assert "timed out after 0.5s" in r.evidence.detail
    assert "started" in r.evidence.output_tail


async def test_output_tail_is_last_4k_of_interleaved_output(client):
    script = "printf 'x%.0s' $(seq 10000); printf ERR >&2; printf END"
    r = await one(client, CommandCheck(name="t", run=script))
    tail = r.evidence.output_tail
    assert len(tail.encode()) == OUTPUT_TAIL_BYTES
    assert tail.endswith("ERREND") or tail.endswith("ENDERR")  # stderr/stdout order is the agent's
    assert set(tail[:-6]) == {"x"}


async def test_non_utf8_output_is_replaced_not_fatal(client):
    r = await one(client, CommandCheck(name="t", run=r"printf 'ok \377\376 done'"))
    assert r.passed and r.evidence.output_tail == "ok \ufffd\ufffd done"


async def test_agent_error_fails_the_check_with_the_reason(client, workdir):
    r = await one(client, CommandCheck(name="t", run=("/nonexistent/tool",)))
    assert not r.passed and r.evidence.detail.startswith("agent error: ENOENT")
    r = await one(client, CommandCheck(name="t", run="true", cwd=str(workdir / "missing")))
    assert not r.passed and "ENOENT" in r.evidence.detail


async def test_closed_connection_fails_every_check_without_raising(client, workdir):
    await client.close()
    checks = [CommandCheck(name="a", run="true"), FileExistsCheck(name="b", path=str(workdir))]
    result = await verify(client, checks, timeout=10)
    assert not result.passed
    assert [c.passed for c in result.checks] == [False, False]
    assert all(c.evidence.detail.startswith("agent error:") for c in result.checks)


# --- files --------------------------------------------------------------------------------------------------
async def test_file_exists(client, workdir):
    (workdir / "full").write_text("data")
    (workdir / "empty").write_bytes(b"")
    (workdir / "dir").mkdir()
    (workdir / "dangling").symlink_to(workdir / "nowhere")
    for name, detail in [("full", "regular file"), ("empty", "empty regular file"), ("dir", "directory")]:
        r = await one(client, FileExistsCheck(name="t", path=str(workdir / name)))
        assert r.passed, r
        assert r.evidence.detail.endswith(f"({detail})")
    for name in ("missing", "dangling", "full/below-a-file"):
        r = await one(client, FileExistsCheck(name="t", path=str(workdir / name)))
        assert not r.passed and r.evidence.detail.endswith("does not exist"), r


async def test_file_exists_special_file(client):
    r = await one(client, FileExistsCheck(name="t", path="/dev/null"))
    assert r.passed and "not a regular file" in r.evidence.detail


async def test_file_matches_content(client, workdir):
    f = workdir / "out.txt"
    f.write_text("hello world\n")
    ok = await one(client, FileMatchesCheck(name="t", path=str(f), content="hello world\n"))
    assert ok.passed and "hello world" in ok.evidence.output_tail
    bad = await one(client, FileMatchesCheck(name="t", path=str(f), content="hello there\n"))
    assert not bad.passed and "first difference at byte 6" in bad.evidence.detail
    short = await one(client, FileMatchesCheck(name="t", path=str(f), content="hello world"))
    assert not short.passed and "prefix" in short.evidence.detail


async def test_file_matches_regex_multiline(client, workdir):
    f = workdir / "log"
    f.write_text("start\nresult: 42 passed\nend\n")
    ok = await one(client, FileMatchesCheck(name="t", path=str(f), regex=r"^result: \d+ passed$"))
    assert ok.passed and "'result: 42 passed'" in ok.evidence.detail
    bad = await one(client, FileMatchesCheck(name="t", path=str(f), regex=r"^\d+ failed"))
    assert not bad.passed and "no match" in bad.evidence.detail


async def test_file_matches_sha256(client, workdir):
    data = bytes(range(256)) * 10
    f = workdir / "blob"
    f.write_bytes(data)
    good = hashlib.sha256(data).hexdigest()
    assert (await one(client, FileMatchesCheck(name="t", path=str(f), sha256=good))).passed
    r = await one(client, FileMatchesCheck(name="t", path=str(f), sha256="0" * 64))
    assert not r.passed and good in r.evidence.detail


async def test_file_matches_missing_file_and_directory(client, workdir):
    r = await one(client, FileMatchesCheck(name="t", path=str(workdir / "nope"), content="x"))
    assert not r.passed and r.evidence.detail.endswith("does not exist")
    r = await one(client, FileMatchesCheck(name="t", path=str(workdir), content="x"))
    assert not r.passed and "EISDIR" in r.evidence.detail


# --- reward -------------------------------------------------------------------------------------------------
async def test_reward_txt_threshold(client, workdir):
    f = workdir / "reward.txt"
    f.write_text("0.75\n")
    r = await one(client, RewardCheck(name="t", path=str(f), threshold=0.5))
    assert r.passed and r.evidence.detail.startswith("reward 0.75 >= threshold 0.5")
    r = await one(client, RewardCheck(name="t", path=str(f)))
    assert not r.passed and r.evidence.detail.startswith("reward 0.75 < threshold 1")
    assert r.evidence.output_tail == "0.75\n"


async def test_reward_json_forms(client, workdir):
    f = workdir / "reward.json"
    for doc, threshold, passed in [
        ({"reward": 1.0, "other": 0.0}, 1.0, True),  # "reward" wins over the mean
        ({"a": 1.0, "b": 0.5}, 0.75, True),  # mean
        ({"a": 1.0, "b": 0.4}, 0.75, False),
        (0.9, 0.9, True),
    ]:
        f.write_text(json.dumps(doc))
        r = await one(client, RewardCheck(name="t", path=str(f), threshold=threshold))
        assert r.passed is passed, (doc, r)


async def test_reward_missing_and_malformed(client, workdir):
    r = await one(client, RewardCheck(name="t", path=str(workdir / "reward.txt")))
    assert not r.passed and r.evidence.detail.startswith("no reward file")
    (workdir / "reward.txt").write_text("great job")
    r = await one(client, RewardCheck(name="t", path=str(workdir / "reward.txt"), threshold=0.0))
    assert not r.passed and "not a number" in r.evidence.detail


def test_parse_reward_rules():
    assert parse_reward("/r/reward.txt", b"  1\n") == 1.0
    assert parse_reward("/r/reward.json", b'{"x": 1, "y": 0}') == 0.5
    for path, data in [
        ("/r/reward.txt", b""),
        ("/r/reward.txt", b"nan"),
        ("/r/reward.txt", b"inf"),
        ("/r/reward.json", b"{}"),
        ("/r/reward.json", b'{"reward": "1"}'),
        ("/r/reward.json", b'{"reward": true}'),
        ("/r/reward.json", b'{"a": 1, "b": "x"}'),
        ("/r/reward.json", b"[1]"),
        ("/r/reward.json", b"{"),
        ("/r/reward.txt", b"\xff"),
    ]:
        with pytest.raises(RewardFormatError):
            parse_reward(path, data)


class FakeFiles:
    """A guest with only files (for paths the host cannot create, like /logs/verifier)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.reads: list[str] = []

    def exec(self, argv, env=None, cwd=None, user=None, stdin=None, timeout=None):
        raise AssertionError("no exec expected")

    async def read_file(self, path: str, max_size: int) -> bytes:
        self.reads.append(path)
        if path not in self.files:
            raise AgentRequestError("ENOENT", f"cannot open {path!r}", 2)
        return self.files[path]


async def test_reward_default_path_prefers_txt_then_json():
    txt, js = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"
    guest = FakeFiles({js: b'{"reward": 1}'})
    r = (await verify(guest, [RewardCheck(name="r")])).checks[0]
    assert r.passed and guest.reads == [txt, js] and js in r.evidence.detail
    guest = FakeFiles({txt: b"0", js: b'{"reward": 1}'})  # reward.txt present: reward.json not consulted
    r = (await verify(guest, [RewardCheck(name="r")])).checks[0]
    assert not r.passed and guest.reads == [txt]
    r = (await verify(FakeFiles({}), [RewardCheck(name="r")])).checks[0]
    assert not r.passed and r.evidence.detail == f"no reward file (looked for {txt}, {js})"


# --- http ---------------------------------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            body, status = b"service is healthy\n", 200
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/health")
            self.end_headers()
            return
        else:
            body, status = b"nothing here", 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_python3
async def test_http_check_status_and_body(client, http_port):
    url = f"http://127.0.0.1:{http_port}/health"
    r = await one(client, HttpCheck(name="h", url=url, contains="healthy"))
    assert r.passed, r
    assert r.evidence.detail == f"{url}: status 200, body contains 'healthy'"
    assert r.evidence.output_tail == "service is healthy\n"
    r = await one(client, HttpCheck(name="h", url=url, contains="unhealthy"))
    assert not r.passed and "does not contain 'unhealthy'" in r.evidence.detail


@needs_python3
async def test_http_check_status_mismatch_and_expected_404(client, http_port):
    url = f"http://localhost:{http_port}/missing"
    r = await one(client, HttpCheck(name="h", url=url))
    assert not r.passed and "expected status 200, got status 404" in r.evidence.detail
    assert r.evidence.output_tail == "nothing here"
    assert (await one(client, HttpCheck(name="h", url=url, expect_status=404))).passed


@needs_python3
async def test_http_check_does_not_follow_redirects(client, http_port):
    url = f"http://127.0.0.1:{http_port}/moved"
    assert (await one(client, HttpCheck(name="h", url=url, expect_status=302))).passed
    assert not (await one(client, HttpCheck(name="h", url=url))).passed


@needs_python3
async def test_http_check_connection_refused(client):
    r = await one(client, HttpCheck(name="h", url=f"http://127.0.0.1:{free_port()}/"))
    assert not r.passed and r.evidence.detail.startswith("request failed:")
    assert "refused" in r.evidence.detail.lower()


# --- the whole verifier -------------------------------------------------------------------------------------
async def test_verify_passes_only_if_all_pass(client, workdir):
    (workdir / "f").write_text("x")
    good = [CommandCheck(name="a", run="true"), FileExistsCheck(name="b", path=str(workdir / "f"))]
    result = await verify(client, good, image_digest="sha256:img", smolfile_digest="sha256:sf")
    assert result.passed and [c.name for c in result.checks] == ["a", "b"]
    assert (result.image_digest, result.smolfile_digest) == ("sha256:img", "sha256:sf")
    result = await verify(client, [*good, CommandCheck(name="c", run="false")])
    assert not result.passed and [c.name for c in result.failed] == ["c"]


async def test_verify_with_no_checks_does_not_pass(client):
    result = await verify(client, [])
    assert not result.passed and result.checks == ()


async def test_checks_run_in_order_and_see_earlier_side_effects(client, workdir):
    marker = workdir / "marker"
    checks = [
        CommandCheck(name="make", run=f"echo made > {marker}"),
        FileMatchesCheck(name="see", path=str(marker), content="made\n"),
    ]
    assert (await verify(client, checks)).passed


async def test_total_timeout_leaves_later_checks_unrun(client, workdir):
    marker = workdir / "ran"
    checks = [
        CommandCheck(name="slow", run="sleep 30"),
        CommandCheck(name="after", run=f"touch {marker}"),
    ]
    t0 = time.monotonic()
    result = await verify(client, checks, timeout=1.0)
    assert time.monotonic() - t0 < 10
    slow, after = result.checks
    assert not slow.passed and slow.evidence.timed_out
    assert not after.passed and after.evidence.detail.startswith("not run")
    assert not marker.exists()


async def test_unresponsive_agent_is_a_timed_out_check(monkeypatch):
    class Hanging(FakeFiles):
        async def read_file(self, path: str, max_size: int) -> bytes:
            await asyncio.sleep(3600)
            return b""

    monkeypatch.setattr(runner_mod, "AGENT_GRACE_S", 0.05)
    t0 = time.monotonic()
    r = await run_one(Hanging({}), FileExistsCheck(name="f", path="/x"), timeout=0.2)
    assert time.monotonic() - t0 < 5
    assert not r.passed and r.evidence.timed_out and "did not answer" in r.evidence.detail


async def test_verify_smolfile_end_to_end(client, workdir):
    (workdir / "answer.txt").write_text("42\n")
    (workdir / "reward.txt").write_text("1")
    toml = f"""
[env]
GREETING = "hello"

[timeouts]
verify = 30

[[verifier.checks]]
name = "greeting"
kind = "command"
run = 'test "$GREETING" = hello'

[[verifier.checks]]
kind = "file_matches"
path = "{workdir}/answer.txt"
regex = '^42$'

[[verifier.checks]]
kind = "reward"
path = "{workdir}/reward.txt"
"""
    smolfile = parse_smolfile(toml, base_dir=str(workdir))
    result = await verify_smolfile(client, smolfile, image_digest="sha256:abc")
    assert result.passed, result
    assert result.smolfile_digest == digest(smolfile) and result.image_digest == "sha256:abc"
    assert [c.kind for c in result.checks] == ["command", "file_matches", "reward"]
    assert result.checks[1].name == f"file_matches: {workdir}/answer.txt"


# --- output tails -------------------------------------------------------------------------------------------
def test_tail_text_does_not_start_mid_character():
    data = "é".encode() * 3000  # 2 bytes each: a 4096-byte cut lands on a character boundary or not
    assert tail_text(data, 4095) == "é" * 2047
    assert tail_text(data, 4096) == "é" * 2048
    assert tail_text(b"short", 4096) == "short"


def test_tail_buffer_keeps_last_bytes_across_chunks():
    buf = TailBuffer(10)
    for i in range(100):
        buf.add(str(i % 10).encode() * 3)
    assert buf.text() == "6777888999"
    assert buf.total == 300
    buf2 = TailBuffer(10)
    buf2.add(b"abc")
    buf2.add(b"0123456789XYZ")
    assert buf2.text() == "3456789XYZ"


# --- a hostile agent: malformed frames during verification are verifier errors, never exceptions -------------
HOSTILE_REPLIES = {
    "started without pid": [("STARTED", b"{}")],
    "started with a text pid": [("STARTED", b'{"pid": "one"}')],
    "started not json": [("STARTED", b"\xff\xfe not json")],
    "started a json array": [("STARTED", b"[1, 2]")],
    "exit with a text code": [("STARTED", b'{"pid": 7}'), ("EXIT", b'{"exit_code": "0"}')],
    "exit with a nan duration": [("STARTED", b'{"pid": 7}'), ("EXIT", b'{"exit_code": 0, "duration": NaN}')],
    "exit not json": [("STARTED", b'{"pid": 7}'), ("EXIT", b"\x00\x01")],
    "result for exec": [("RESULT", b"{}")],
}


async def _hostile_agent(path: str, replies: list[tuple[str, bytes]]) -> asyncio.AbstractServer:
    from smol_agent import protocol as P

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = P.FrameDecoder()
        while True:
            data = await reader.read(65536)
            if not data:
                break
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                mtype, _flags, rid, _payload = frame
                if mtype == P.MsgType.HELLO:
                    writer.write(P.pack_json(P.MsgType.HELLO_OK, rid, {"major": P.PROTOCOL_MAJOR, "minor": 1}))
                elif mtype == P.MsgType.EXEC:
                    for name, payload in replies:
                        writer.write(P.pack_frame(getattr(P.MsgType, name), rid, payload))
                await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(serve, path)


@pytest.mark.parametrize("case", sorted(HOSTILE_REPLIES))
async def test_malformed_agent_frames_make_an_undecided_check_not_an_exception(workdir: Path, case: str) -> None:
    path = str(workdir / "hostile.sock")
    server = await _hostile_agent(path, HOSTILE_REPLIES[case])
    try:
        client = await connect_unix(path)
        try:
            result = await verify(client, [CommandCheck(name="suite", run="pytest")], timeout=10)
        finally:
            await client.close()
    finally:
        server.close()
    (check,) = result.checks
    assert not result.passed and not check.passed
    assert check.error, check
    assert result.outcome == "verifier_error"
    assert "suite" in result.outcome_detail and "could not be decided" in result.outcome_detail
