"""Registry pulls against a real local registry (Debian's docker-registry, images pushed with skopeo) and a
stdlib fake registry that demands bearer tokens and redirects blobs. No KVM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from oci_support import D, F, build_image, sha, write_layout

from smold.oci import images as oci_images
from smold.oci.errors import DigestError, RegistryError
from smold.oci.manifest import OCI_INDEX
from smold.oci.reference import parse_reference
from smold.oci.registry import RegistryClient
from smold.oci.store import OciStore

REPO = Path(__file__).resolve().parents[2]
needs_tools = pytest.mark.skipif(shutil.which("docker-registry") is None or shutil.which("skopeo") is None,
                                 reason="apt-get install docker-registry skopeo")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="building root disks keeps ownership (root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRegistry:
    """docker-registry serving a temp directory on loopback; ``push`` copies an OCI layout in with skopeo."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.storage = workdir / "storage"
        self.host = f"127.0.0.1:{self.port}"
        config = workdir / "config.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
            "http": {"addr": self.host}}))
        self.log = open(workdir / "registry.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (workdir / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {log}") from None
                time.sleep(0.1)

    def push(self, layout: Path, name: str, *, all_platforms: bool = False) -> None:
        cmd = ["skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false", "-q"]
        if all_platforms:
            cmd.append("--all")
        subprocess.run([*cmd, f"oci:{layout}", f"docker://{self.host}/{name}"], check=True, capture_output=True,
                       timeout=120)

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(tmp_path / "registry-run")
    try:
        yield reg
    finally:
        reg.close()


def _image(tmp_path: Path, name: str = "layout", big: int = 0):  # type: ignore[no-untyped-def]
    layers = [[D("etc"), F("etc/os-release", "ID=test\n"), F("etc/deleted-later", "x"), D("data"),
               F("data/blob", os.urandom(big) if big else b"small")],
              [F("etc/.wh.deleted-later"), F("etc/added", "y")]]
    built = build_image(layers, config={"Env": ["PATH=/bin", "GREETING=hi"], "WorkingDir": "/data", "User": "0"})
    return built, write_layout(built, tmp_path / name)


def _debugfs_ls(image: Path, path: str) -> str:
    return subprocess.run(["debugfs", "-R", f"ls -l {path}", str(image)], capture_output=True, text=True,
                          check=True).stdout


@needs_tools
@needs_root
def test_pull_from_local_registry(tmp_path: Path, registry: LocalRegistry) -> None:
    built, layout = _image(tmp_path)
    registry.push(layout, "smol/test:v1")
    store = OciStore(tmp_path / "store")
    r = oci_images.pull(store, f"{registry.host}/smol/test:v1")
    assert r.manifest == built.manifest_digest
    assert r.config.working_dir == "/data" and ("GREETING", "hi") in r.config.env
    etc = _debugfs_ls(r.rootfs, "/etc")
    assert "added" in etc and "os-release" in etc and "deleted-later" not in etc
    assert [e.names for e in oci_images.list_images(store)] == [(f"{registry.host}/smol/test:v1",)]
    # Pinned by digest: served from the cache without asking the registry for anything but nothing.
    client = RegistryClient(parse_reference(f"{registry.host}/smol/test@{built.manifest_digest}"))
    again = oci_images.pull(store, f"{registry.host}/smol/test@{built.manifest_digest}", client=client)
    assert again.rootfs == r.rootfs and client.requests == []


@needs_tools
@needs_root
def test_pull_manifest_list_picks_amd64(tmp_path: Path, registry: LocalRegistry) -> None:
    amd, _ = _image(tmp_path, "amd")
    arm = build_image([[F("arm-only", "arm")]])
    arm_cfg = json.loads(arm.blobs[arm.config_digest])
    arm_cfg["architecture"] = "arm64"
    cfg_bytes = json.dumps(arm_cfg).encode()
    manifest = json.loads(arm.blobs[arm.manifest_digest])
    del arm.blobs[arm.config_digest], arm.blobs[arm.manifest_digest]
    manifest["config"].update(digest=sha(cfg_bytes), size=len(cfg_bytes))
    m_bytes = json.dumps(manifest).encode()
    arm.blobs[sha(cfg_bytes)] = cfg_bytes
    arm.blobs[sha(m_bytes)] = m_bytes
    amd_m = amd.blobs[amd.manifest_digest]
    amd.blobs.update(arm.blobs)
    amd.index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": manifest["mediaType"], "digest": sha(m_bytes), "size": len(m_bytes),
         "platform": {"os": "linux", "architecture": "arm64"}},
        {"mediaType": manifest["mediaType"], "digest": amd.manifest_digest, "size": len(amd_m),
         "platform": {"os": "linux", "architecture": "amd64"}}]}
    # skopeo wants the index itself as a blob named in index.json
    idx_bytes = json.dumps(amd.index).encode()
    amd.blobs[sha(idx_bytes)] = idx_bytes
    amd.index = {"schemaVersion": 2, "manifests": [{"mediaType": OCI_INDEX, "digest": sha(idx_bytes),
                                                    "size": len(idx_bytes)}]}
    layout = write_layout(amd, tmp_path / "multi")
    registry.push(layout, "smol/multi:latest", all_platforms=True)
    store = OciStore(tmp_path / "store")
    client = RegistryClient(parse_reference(f"{registry.host}/smol/multi"))
    r = oci_images.pull(store, f"{registry.host}/smol/multi", client=client)
    assert r.manifest == amd.manifest_digest
    assert not any(d in p for _, p in client.requests for d in (sha(cfg_bytes),))  # arm blobs never fetched
    assert "arm-only" not in _debugfs_ls(r.rootfs, "/")


@needs_tools
@needs_root
def test_tampered_registry_blob_rejected(tmp_path: Path, registry: LocalRegistry) -> None:
    built, layout = _image(tmp_path)
    registry.push(layout, "smol/tampered:v1")
    blob = registry.blob_file(built.layer_digests[1])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x55
    blob.write_bytes(bytes(data))
    store = OciStore(tmp_path / "store")
    with pytest.raises(DigestError):
        oci_images.pull(store, f"{registry.host}/smol/tampered:v1")
    assert store.images() == [] and store.refs() == []
    assert not store.blob_path(built.layer_digests[1]).exists()


@needs_tools
def test_unknown_tag_is_registry_error(tmp_path: Path, registry: LocalRegistry) -> None:
    with pytest.raises(RegistryError, match="404|MANIFEST_UNKNOWN|NAME_UNKNOWN"):
        oci_images.pull(OciStore(tmp_path / "store"), f"{registry.host}/smol/nothing:v1")


@needs_tools
@needs_root
def test_concurrent_pulls_fetch_once(tmp_path: Path, registry: LocalRegistry) -> None:
    built, layout = _image(tmp_path, big=1 << 20)
    registry.push(layout, "smol/conc:v1")
    store = OciStore(tmp_path / "store")
    ref = parse_reference(f"{registry.host}/smol/conc:v1")
    clients = [RegistryClient(ref) for _ in range(3)]
    results: list[object] = []
    threads = [threading.Thread(target=lambda c=c: results.append(oci_images.pull(store, ref, refresh=False, client=c)))
               for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len({r.rootfs for r in results}) == 1  # type: ignore[attr-defined]
    blob_gets = [p for c in clients for m, p in c.requests if p.startswith("blobs/")]
    assert sorted(blob_gets) == sorted(f"blobs/{d}" for d in [built.config_digest, *built.layer_digests])
    assert len(store.images()) == 1


@needs_tools
@needs_root
def test_kill_mid_pull_then_retry(tmp_path: Path, registry: LocalRegistry) -> None:
    built, layout = _image(tmp_path, big=3 << 20)
    registry.push(layout, "smol/killed:v1")
    store_dir = tmp_path / "store"
    ref = f"{registry.host}/smol/killed:v1"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMOL_PULL_RATE_LIMIT": str(1 << 20)}
    proc = subprocess.Popen([sys.executable, "-m", "smold.oci", "--store", str(store_dir), "pull", ref], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    big_layer = max(built.layer_digests, key=lambda d: len(built.blobs[d]))
    partial = store_dir / "tmp" / f"{big_layer.split(':')[1]}.partial"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size > 256 << 10):
        assert proc.poll() is None, proc.stdout.read()  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "pull never started downloading"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    have = partial.stat().st_size
    assert 0 < have < len(built.blobs[big_layer])
    store = OciStore(store_dir)
    assert store.get_ref(ref) is None and store.images() == []  # nothing half-published
    client = RegistryClient(parse_reference(ref), rate_limit=0)
    r = oci_images.pull(store, ref, client=client)
    assert r.manifest == built.manifest_digest
    assert client.bytes_received < sum(len(built.blobs[d]) for d in [built.config_digest, *built.layer_digests])
    assert store.blob_path(big_layer).read_bytes() == built.blobs[big_layer]
    assert not partial.exists()


# --- bearer-token auth and redirects (stdlib fake registry) ------------------------------------------------
class FakeRegistry(ThreadingHTTPServer):
    token = "tok-123"

    def __init__(self, blobs: dict[str, bytes], manifests: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.blobs, self.manifests = blobs, manifests
        self.log: list[tuple[str, str | None]] = []  # (path, Authorization)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeRegistry

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        auth = self.headers.get("Authorization")
        self.server.log.append((self.path, auth))
        if self.path.startswith("/token?"):
            assert "scope=repository%3Aa%2Fb%3Apull" in self.path and "service=fake" in self.path
            self._send(200, json.dumps({"token": self.server.token}).encode())
            return
        if self.path.startswith("/storage/"):
            if auth is not None:  # blob storage must never see the registry's token
                self._send(400, b"credentials leaked to storage")
                return
            data = self.server.blobs[self.path.split("/")[-1]]
            rng = self.headers.get("Range")
            if rng:
                start = int(rng.split("=")[1].rstrip("-"))
                self._send(206, data[start:], {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
            else:
                self._send(200, data)
            return
        if auth != f"Bearer {self.server.token}":
            self._send(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"auth"}]}', {
                "WWW-Authenticate": f'Bearer realm="http://{self.server.host}/token",service="fake",'
                                    'scope="repository:a/b:pull"'})
            return
        parts = self.path.split("/")  # /v2/a/b/(manifests|blobs)/ref
        kind, ref = parts[-2], parts[-1]
        if kind == "manifests" and ref in self.server.manifests:
            self._send(200, self.server.manifests[ref], {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        elif kind == "blobs" and ref in self.server.blobs:
            self._send(307, b"", {"Location": f"/storage/{ref}"})
        else:
            self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"unknown"}]}')


@needs_root
def test_bearer_token_auth_and_redirect(tmp_path: Path) -> None:
    built = build_image([[F("hello", "world")]])
    manifests = {"v1": built.blobs[built.manifest_digest], built.manifest_digest: built.blobs[built.manifest_digest]}
    server = FakeRegistry(dict(built.blobs), manifests)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        store = OciStore(tmp_path / "store")
        client = RegistryClient(parse_reference(f"{server.host}/a/b:v1"))
        r = oci_images.pull(store, f"{server.host}/a/b:v1", client=client)
        assert r.manifest == built.manifest_digest
        assert "hello" in _debugfs_ls(r.rootfs, "/")
        tokens = [p for p, _ in server.log if p.startswith("/token")]
        assert len(tokens) == 1  # one token serves every later request
        assert all(a is None for p, a in server.log if p.startswith("/storage/"))
    finally:
        server.shutdown()
        server.server_close()
