"""smolctl fork MACHINE [-n N]: copy-on-write children of a running machine; prints their ids."""

from __future__ import annotations

import argparse
import sys

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import fail
from ..output import forwarded_ports, to_json

NAME = "fork"
HELP = "fork a running machine into N copy-on-write children and print their ids"
MAX_COUNT = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", help="machine id or name")
    p.add_argument("-n", "--count", type=int, default=1, help=f"number of children, 1 to {MAX_COUNT} (default 1)")
    p.add_argument("--json", action="store_true", help="print each child as JSON")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    if not 1 <= args.count <= MAX_COUNT:
        fail(f"-n: must be 1 to {MAX_COUNT} (got {args.count})")
    resp = stub.Fork(pb.ForkRequest(machine_id=args.machine, count=args.count))
    for m in resp.machines:
        print(to_json(m) if args.json else m.id)
        if not args.json:
            for line in forwarded_ports(m):  # a child listens on ports of its own
                print(f"{m.id}: {line}", file=sys.stderr)
    return 0
