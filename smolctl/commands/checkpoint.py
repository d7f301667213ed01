"""smolctl checkpoint ls | rm NAME...: the daemon's named checkpoints (smolctl snapshot writes them)."""

from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import delete_each
from ..output import checkpoints_table

NAME = "checkpoint"
HELP = "list and remove named checkpoints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND", required=True)
    ls = sub.add_parser("ls", help="list checkpoints")
    ls.add_argument("--json", action="store_true", help="print the checkpoints as a JSON array")
    ls.add_argument("-q", "--quiet", action="store_true", help="print names only")
    rm = sub.add_parser("rm", help="delete checkpoints (machines restored from them keep running)")
    rm.add_argument("names", nargs="+", metavar="name")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    if args.checkpoint_command == "ls":
        cps = list(stub.ListCheckpoints(pb.ListCheckpointsRequest()).checkpoints)
        if args.json:
            print(json.dumps([MessageToDict(c, preserving_proto_field_name=True) for c in cps], indent=2))
        elif args.quiet:
            for c in cps:
                print(c.name)
        else:
            print(checkpoints_table(cps))
        return 0
    return delete_each(args.names, lambda n: stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(name=n)), args.socket)
