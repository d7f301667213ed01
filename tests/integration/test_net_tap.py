"""TapBackend against a real TAP in a throwaway namespace (root, no KVM): ARP to the host end and back."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns import TAP, TAP_MAC, NetNs, usable

pytestmark = pytest.mark.skipif(usable() is not None, reason=str(usable()))

# Runs inside the namespace: attach to the TAP, ask who has 172.16.0.1, expect the host's ARP reply;
# then check the fd is non-blocking (recv returns None when nothing waits) and a missing TAP is refused.
PROBE = r'''
import select, socket, sys
from smold.devices.net.backend import TapBackend, NetBackendError, open_tap
tap = TapBackend(sys.argv[1])
mine = bytes.fromhex("0600ac100002")
arp = (b"\xff" * 6 + mine + b"\x08\x06" + bytes.fromhex("0001080006040001") + mine
       + socket.inet_aton("172.16.0.2") + bytes(6) + socket.inet_aton("172.16.0.1"))
for i in range(100):
    if i % 10 == 0:
        tap.send(arp)  # again: right after attaching, the kernel drops its reply until linkwatch activates the queue
    select.select([tap.fd], [], [], 0.1)
    f = tap.recv()
    if f and f[12:14] == b"\x08\x06" and f[20:22] == b"\x00\x02":
        print("reply", f[6:12].hex(), socket.inet_ntoa(f[28:32]), f[:6].hex())
        break
else:
    print("no reply")
while tap.recv() is not None:
    pass
print("empty", tap.recv())
try:
    open_tap("smolnotthere0")
except NetBackendError as e:
    print("missing", e)
tap.close()
'''


def test_tap_backend_talks_to_the_host() -> None:
    ns = NetNs("t")
    try:
        r = subprocess.run([*ns.prefix(), sys.executable, "-c", PROBE, TAP], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == f"reply {TAP_MAC.replace(':', '')} 172.16.0.1 0600ac100002", r.stdout
        assert lines[1] == "empty None"
        assert lines[2].startswith("missing no network interface")
    finally:
        ns.close()
    assert not ns.exists()
