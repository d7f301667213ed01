"""smolctl snapshot MACHINE NAME: save a running machine as a named checkpoint (create --from-checkpoint)."""

from __future__ import annotations

import argparse

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..output import to_json

NAME = "snapshot"
HELP = "save a running machine as a named checkpoint and print its path"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", help="machine id or name")
    p.add_argument("name", help="checkpoint name: [a-z0-9][a-z0-9._-]{0,62}")
    p.add_argument("--json", action="store_true", help="print the checkpoint as JSON")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    resp = stub.Snapshot(pb.SnapshotRequest(machine_id=args.machine, name=args.name))
    c = resp.checkpoint
    print(to_json(c) if args.json else f"{c.name}\t{c.path}\t{c.size_bytes}")
    return 0
