"""smold's optional TCP listener: TLS plus a bearer token on every call, over loopback, with the host-agent launcher.

A self-signed certificate for 127.0.0.1/localhost is made with the openssl CLI per test; the Unix socket keeps
working without a token; the daemon refuses --tcp without its TLS and token files, and a readable token file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from daemon_support import REPO, UNIT_DIR, fake_image_files, fake_images, start_daemon_task

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc
from smold.daemon import Daemon, DaemonConfig

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")]

TOKEN = "t0k3n-" + "x" * 40


@dataclass
class Tls:
    dir: Path
    cert: Path
    key: Path
    token: Path


@pytest.fixture
def tls() -> Iterator[Tls]:
    d = Path(tempfile.mkdtemp(prefix="smt-", dir="/tmp"))  # short: the Unix socket lives here too
    cert, key, token = d / "cert.pem", d / "key.pem", d / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    os.chmod(key, 0o600)
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    yield Tls(d, cert, key, token)
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class Served:
    daemon: Daemon
    address: str
    tls: Tls


@pytest.fixture
async def served(tls: Tls) -> AsyncIterator[Served]:
    config = DaemonConfig(socket_path=tls.dir / "smold.sock", state_dir=tls.dir / "state", max_machines=4,
                          max_memory_mib=4096, destroy_grace_s=5.0, tcp="127.0.0.1:0", tls_cert=tls.cert,
                          tls_key=tls.key, token_file=tls.token)
    daemon, task = await start_daemon_task(config, fake_images(tls.dir))
    assert daemon.tcp_port > 0
    yield Served(daemon, f"127.0.0.1:{daemon.tcp_port}", tls)
    daemon.stop()
    await asyncio.wait_for(task, 30)
    assert daemon.tcp_server is not None
    with pytest.raises(OSError):  # both servers are gone
        await asyncio.open_connection("127.0.0.1", daemon.tcp_port)


def secure(s: Served, token: str | None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=s.tls.cert.read_bytes())
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.aio.secure_channel(s.address, creds)


async def test_create_exec_destroy_with_token(served: Served) -> None:
    async with secure(served, TOKEN) as ch:
        stub = pb_grpc.SmolStub(ch)
        m = (await stub.CreateMachine(pb.CreateMachineRequest(
            smolfile=pb.Smolfile(spec=pb.SmolfileSpec(memory_mib=256, cpus=1))))).machine
        out = b""
        async for msg in stub.Exec(pb.ExecRequest(machine_id=m.id, argv=["echo", "over tcp"])):
            if msg.WhichOneof("event") == "stdout":
                out += msg.stdout
        assert out == b"over tcp\n"
        await stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=m.id))
        assert not (await stub.ListMachines(pb.ListMachinesRequest())).machines
    # the Unix socket needs no token
    async with grpc.aio.insecure_channel(f"unix:{served.tls.dir / 'smold.sock'}") as ch:
        await pb_grpc.SmolStub(ch).ListMachines(pb.ListMachinesRequest())


@pytest.mark.parametrize("token", [None, "wrong-" + "y" * 40, TOKEN + "x"])
async def test_missing_or_wrong_token_is_unauthenticated(served: Served, token: str | None) -> None:
    async with secure(served, token) as ch:
        stub = pb_grpc.SmolStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListMachines(pb.ListMachinesRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ("missing bearer token" if token is None else "invalid bearer token") in (e.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a server-streaming method is refused the same way
            async for _ in stub.Exec(pb.ExecRequest(machine_id="m-0", argv=["true"])):
                pass
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served.daemon.controller.list_machines() == []


async def test_plaintext_client_cannot_connect(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.SmolStub(ch).ListMachines(pb.ListMachinesRequest(),
                                                     metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_smolctl_over_tcp(served: Served) -> None:
    def smolctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
        full = {k: v for k, v in os.environ.items() if not k.startswith("SMOL_")}
        return subprocess.run([sys.executable, "-m", "smolctl", *args], capture_output=True, timeout=60,
                              env={**full, "PYTHONPATH": str(REPO), **env})

    tls = served.tls
    r = await asyncio.to_thread(smolctl, "--tcp", served.address, "--ca", str(tls.cert),
                                "--token-file", str(tls.token), "ls", "--json", env={})
    assert r.returncode == 0, r.stderr
    env = {"SMOL_TCP": served.address, "SMOL_CA": str(tls.cert), "SMOL_TOKEN_FILE": str(tls.token)}
    r = await asyncio.to_thread(smolctl, "ls", env=env)
    assert r.returncode == 0, r.stderr
    bad = tls.dir / "bad-token"
    bad.write_text("nope-" + "z" * 40)
    r = await asyncio.to_thread(smolctl, "ls", env={**env, "SMOL_TOKEN_FILE": str(bad)})
    assert r.returncode == 2 and r.stderr == b"smolctl: error: invalid bearer token\n"
    r = await asyncio.to_thread(smolctl, "--tcp", served.address, "ls", env={})
    assert r.returncode == 2 and b"--tcp needs --token-file" in r.stderr


def smold(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    k, i, r = fake_image_files(tmp)
    argv = [sys.executable, "-m", "smold.daemon", "--socket", str(tmp / "s.sock"), "--state-dir", str(tmp / "state"),
            "--launcher", "daemon_support:HostAgentLauncher", "--image", f"default={k}:{i}:{r}", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(UNIT_DIR), str(REPO)])}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("drop", ["--tls-cert", "--tls-key", "--token-file"])
def test_tcp_needs_cert_key_and_token(tls: Tls, drop: str) -> None:
    opts = {"--tls-cert": str(tls.cert), "--tls-key": str(tls.key), "--token-file": str(tls.token)}
    del opts[drop]
    r = smold(tls.dir, "--tcp", "127.0.0.1:0", *[x for kv in opts.items() for x in kv])
    assert r.returncode == 2
    assert r.stderr == f"smold: error: --tcp needs {drop} (TCP is served only with TLS and a token)\n"
    assert not (tls.dir / "s.sock").exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_refuses_readable_token_file(tls: Tls, mode: int) -> None:
    os.chmod(tls.token, mode)
    r = smold(tls.dir, "--tcp", "127.0.0.1:0", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
              "--token-file", str(tls.token))
    assert r.returncode == 1
    assert r.stderr == (f"smold: error: --token-file {tls.token}: mode {mode:04o} lets group or others access it; "
                        "chmod 600 it\n")
    assert not (tls.dir / "s.sock").exists() and not (tls.dir / "state").exists()


def test_refuses_short_token_and_tls_options_without_tcp(tls: Tls) -> None:
    tls.token.write_text("short")
    r = smold(tls.dir, "--tcp", "127.0.0.1:0", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
              "--token-file", str(tls.token))
    assert r.returncode == 1 and "at least 32 characters (got 5)" in r.stderr and r.stderr.count("\n") == 1
    r = smold(tls.dir, "--token-file", str(tls.token))
    assert r.returncode == 2 and r.stderr == "smold: error: --token-file only apply with --tcp\n"
    r = smold(tls.dir, "--tcp", "localhost", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
              "--token-file", str(tls.token))
    assert r.returncode == 2 and "--tcp must be HOST:PORT" in r.stderr
