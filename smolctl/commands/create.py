"""smolctl create SMOLFILE | --from-checkpoint NAME: boot (or restore) a machine and print its id."""

from __future__ import annotations

import argparse
import sys

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import fail, smolfile_message
from ..output import Progress, forwarded_ports, to_json

NAME = "create"
HELP = "create a machine from a Smolfile (or restore a checkpoint) and print its id"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("smolfile", nargs="?", help="a Smolfile.toml, or a directory holding one")
    p.add_argument("--from-checkpoint", metavar="NAME", default="",
                   help="restore this checkpoint (smolctl snapshot) instead of booting; no SMOLFILE then")
    p.add_argument("--name", default="", help="a name to refer to the machine by (unique)")
    p.add_argument("--json", action="store_true", help="print the machine as JSON")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    if args.from_checkpoint:
        if args.smolfile is not None:
            fail("give a SMOLFILE or --from-checkpoint, not both")
        req = pb.CreateMachineRequest(name=args.name, from_checkpoint=args.from_checkpoint)
    elif args.smolfile is None:
        fail("a SMOLFILE (or --from-checkpoint NAME) is required")
    else:
        req = pb.CreateMachineRequest(name=args.name, smolfile=smolfile_message(args.smolfile))
    with Progress("creating"):
        resp = stub.CreateMachine(req)
    print(to_json(resp.machine) if args.json else resp.machine.id)
    if not args.json:
        for line in forwarded_ports(resp.machine):  # stdout stays the id alone, for scripts
            print(line, file=sys.stderr)
    return 0
