"""Throwaway network namespaces with a TAP for the guest and small TCP servers inside (tests and bench only)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

HOST_ADDR = "172.16.0.1"
HOST_CIDR = f"{HOST_ADDR}/30"
GUEST_ADDR = "172.16.0.2"
TAP = "smoltap0"
# A fixed MAC for the host end of the TAP: a restored clone's ARP cache then stays valid in its new namespace.
TAP_MAC = "06:00:ac:10:00:01"

# Serves files from a directory over HTTP on PORT, and on PORT+1 a sink that answers the sha256 of what the
# client sent before shutting down its side; on PORT+2 a source that sends N MiB of zeros (N: first line).
SERVER = r'''
import hashlib, http.server, socket, socketserver, sys, threading
addr, port, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Quiet(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **kw):
        super().__init__(*a, directory=root, **kw)
    def log_message(self, *a):
        pass

class Sink(socketserver.BaseRequestHandler):
    def handle(self):
        h, n = hashlib.sha256(), 0
        while True:
            b = self.request.recv(1 << 16)
            if not b:
                break
            h.update(b)
            n += len(b)
        self.request.sendall(f"{n} {h.hexdigest()}\n".encode())

class Source(socketserver.StreamRequestHandler):
    def handle(self):
        mib = int(self.rfile.readline() or b"0")
        chunk = bytes(1 << 20)
        for _ in range(mib):
            self.wfile.write(chunk)

class T(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

servers = [http.server.ThreadingHTTPServer((addr, port), Quiet), T((addr, port + 1), Sink), T((addr, port + 2), Source)]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("LISTENING", flush=True)
sys.stdin.read()
'''


def sh(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def usable() -> str | None:
    """Why these namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a TAP)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "no iproute2 'ip' command"
    return None


class NetNs:
    """``ip netns add smoltest-XXXX`` with lo up and a TAP addressed 172.16.0.1/30; ``close`` removes it all."""

    def __init__(self, tag: str = "") -> None:
        self.name = f"smoltest-{tag}{secrets.token_hex(3)}"
        self.servers: list[subprocess.Popen[str]] = []
        sh("ip", "netns", "add", self.name)
        try:
            self.exec("ip", "link", "set", "lo", "up")
            self.exec("ip", "tuntap", "add", "dev", TAP, "mode", "tap")
            self.exec("ip", "link", "set", TAP, "address", TAP_MAC)
            self.exec("ip", "addr", "add", HOST_CIDR, "dev", TAP)
            self.exec("ip", "link", "set", TAP, "up")
        except BaseException:
            self.close()
            raise

    def exec(self, *argv: str) -> str:
        return sh("ip", "netns", "exec", self.name, *argv)

    def prefix(self) -> list[str]:
        """Prepend to a command line to run it in this namespace."""
        return ["ip", "netns", "exec", self.name]

    def serve(self, root: Path, port: int) -> None:
        """Start the HTTP/sink/source servers on HOST_ADDR:port..port+2 inside the namespace."""
        p = subprocess.Popen([*self.prefix(), sys.executable, "-c", SERVER, HOST_ADDR, str(port), str(root)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.servers.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "LISTENING":
            raise RuntimeError(f"test server did not start: {line!r} {p.stderr.read() if p.stderr else ''}")

    def close(self) -> None:
        for p in self.servers:
            p.kill()
            p.wait()
        self.servers.clear()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        for _ in range(50):
            if self.name not in sh("ip", "netns", "list"):
                return
            time.sleep(0.1)

    def exists(self) -> bool:
        return any(line.split()[0] == self.name for line in sh("ip", "netns", "list").splitlines() if line.strip())
