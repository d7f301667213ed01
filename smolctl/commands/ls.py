"""smolctl ls: list machines (id, name, state, size, image, age, VM process)."""

from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import terminal_safe
from ..output import machines_table

NAME = "ls"
HELP = "list machines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the machines as a JSON array")
    p.add_argument("-q", "--quiet", action="store_true", help="print ids only")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    machines = list(stub.ListMachines(pb.ListMachinesRequest()).machines)
    if args.json:
        print(json.dumps([MessageToDict(m, preserving_proto_field_name=True) for m in machines], indent=2))
    elif args.quiet:
        for m in machines:
            print(m.id)
    else:
        print(terminal_safe(machines_table(machines)))
    return 0
