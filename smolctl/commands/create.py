"""smolctl create SMOLFILE: boot a machine (mounts copied, setup run) and print its id."""

from __future__ import annotations

import argparse

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import smolfile_message
from ..output import to_json

NAME = "create"
HELP = "create a machine from a Smolfile and print its id"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("smolfile", help="a Smolfile.toml, or a directory holding one")
    p.add_argument("--name", default="", help="a name to refer to the machine by (unique)")
    p.add_argument("--json", action="store_true", help="print the machine as JSON")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    req = pb.CreateMachineRequest(name=args.name, smolfile=smolfile_message(args.smolfile))
    resp = stub.CreateMachine(req)
    print(to_json(resp.machine) if args.json else resp.machine.id)
    return 0
