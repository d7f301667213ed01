#!/usr/bin/env python3
"""Benchmark: TCP throughput and connect latency between the guest (virtio-net on a TAP) and a host server.

Usage (root): .venv/bin/python bench/net.py [--snapshot DIR] [--mib 4] [--connects 20] [--json]

Creates a throwaway network namespace with a TAP at 172.16.0.1/30 (tests/integration/netns.py), starts
the test servers there (a source that sends N MiB, a sink that hashes what it gets, an HTTP server),
then boots the default guest in that namespace with ``--net-tap`` (or restores --snapshot DIR, a snapshot
of a VM with a NIC). One python3 script runs in the guest and times, with the guest's monotonic clock:
  * download: N MiB host -> guest (one TCP stream, recv into a buffer);
  * upload: N MiB guest -> host (sendall, then wait for the sink's byte count);
  * connect: TCP handshake to the host (create_connection), median and p90 of --connects tries.
The peer, measured in the same run, is the same script run natively on the host inside the namespace
against the same servers over its own 172.16.0.1 address (no VM, no virtio-net): the ratio shows what the
VM path costs. Copy the results to docs/performance.md. Every VM boot is wrapped in /work/wt/vmlock by the
caller on shared development hosts.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from create import host_info  # noqa: E402
from microvm import Microvm  # noqa: E402
from netns import HOST_ADDR, TAP, NetNs, usable  # noqa: E402

from smold.images.artifacts import Artifacts, default_artifacts  # noqa: E402

PORT = 8080

CLIENT = r'''
import json, socket, statistics, sys, time
host, port, mib, connects = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {}
lat = []
for _ in range(connects):
    t = time.monotonic()
    s = socket.create_connection((host, port), timeout=60)
    lat.append(time.monotonic() - t)
    s.close()
lat.sort()
out["connect_ms_median"] = statistics.median(lat) * 1000
out["connect_ms_p90"] = lat[min(len(lat) - 1, int(len(lat) * 0.9))] * 1000
s = socket.create_connection((host, port + 2), timeout=300)
t = time.monotonic()
s.sendall(b"%d\n" % mib)
buf = bytearray(1 << 16)
got = 0
while True:
    n = s.recv_into(buf)
    if not n:
        break
    got += n
dt = time.monotonic() - t
assert got == mib << 20, got
out["download_mib_s"] = mib / dt
s = socket.create_connection((host, port + 1), timeout=300)
chunk = bytes(1 << 20)
t = time.monotonic()
for _ in range(mib):
    s.sendall(chunk)
s.shutdown(socket.SHUT_WR)
reply = s.makefile().readline()
dt = time.monotonic() - t
assert int(reply.split()[0]) == mib << 20, reply
out["upload_mib_s"] = mib / dt
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshot", type=Path, help="restore this snapshot (taken of a VM with a NIC) instead of booting")
    ap.add_argument("--mib", type=int, default=4, help="MiB per direction (default 4)")
    ap.add_argument("--connects", type=int, default=20)
    ap.add_argument("--boot-timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    why = usable()
    if why:
        print(f"bench/net.py: {why}", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="smol-net-bench-"))
    ns = NetNs("bench")
    vm: Microvm | None = None
    result: dict[str, Any] = {"host": host_info(), "mib": args.mib, "connects": args.connects}
    try:
        (work / "www").mkdir()
        (work / "www" / "index.html").write_text(secrets.token_hex(8))
        ns.serve(work / "www", PORT)
        client = [str(HOST_ADDR), str(PORT), str(args.mib), str(args.connects)]
        peer = ns.exec(sys.executable, "-c", CLIENT, *client)
        result["peer_host_in_namespace"] = json.loads(peer)

        t0 = time.monotonic()
        if args.snapshot is not None:
            vm = Microvm(Artifacts(Path(), Path(), Path()), state_dir=work / "vm")
            vm.argv = [sys.executable, "-m", "smold.vmm", "--restore", str(args.snapshot), "--state-dir",
                       str(work / "vm"), "--net-tap", TAP]
        else:
            vm = Microvm(default_artifacts(build=True), cpus=1, memory_mib=512, state_dir=work / "vm",
                         console_log=work / "console.log", extra_args=["--net-tap", TAP])
        vm.argv = ns.prefix() + vm.argv
        vm.start(timeout=args.boot_timeout)
        result["vm_ready_s"] = round(time.monotonic() - t0, 1)
        r = vm.run(["python3", "-c", CLIENT, *client], timeout=1800)
        if r.exit_code != 0:
            print(r.stderr.decode(errors="replace"), file=sys.stderr)
            return 1
        guest = json.loads(r.stdout)
        result["guest_virtio_net"] = guest
        peer_d = result["peer_host_in_namespace"]
        result["ratio_peer_over_guest"] = {
            "download": peer_d["download_mib_s"] / guest["download_mib_s"],
            "upload": peer_d["upload_mib_s"] / guest["upload_mib_s"],
            "connect": guest["connect_ms_median"] / peer_d["connect_ms_median"],
        }
    finally:
        if vm is not None:
            vm.kill()
        ns.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    g, p = result["guest_virtio_net"], result["peer_host_in_namespace"]
    print(result["host"])
    print(f"VM ready in {result['vm_ready_s']} s ({'restore' if args.snapshot else 'boot'})")
    print(f"{'':28} {'guest (virtio-net)':>20} {'host peer':>12} {'ratio':>8}")
    for key, label, unit in (("download_mib_s", f"download {args.mib} MiB", "MiB/s"),
                             ("upload_mib_s", f"upload {args.mib} MiB", "MiB/s"),
                             ("connect_ms_median", "connect median", "ms"),
                             ("connect_ms_p90", "connect p90", "ms")):
        ratio = p[key] / g[key] if unit == "MiB/s" else g[key] / p[key]
        print(f"{label:28} {g[key]:>14.2f} {unit:5} {p[key]:>8.2f} {unit:5} {ratio:>7.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
