"""smolctl verify MACHINE: run the machine's verifier now; exit 0 on pass, 1 on fail."""

from __future__ import annotations

import argparse

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import terminal_safe
from ..output import to_json, verdict_exit, verify_result, verify_summary

NAME = "verify"
HELP = "run a machine's verifier against its current state (exit 0 pass, 1 fail)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", help="machine id or name")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="show output tails of passing checks too")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    result = stub.Verify(pb.VerifyRequest(machine_id=args.machine)).result
    if args.json:
        print(to_json(result))
    else:
        print(verify_summary(result))
        print(terminal_safe("\n".join(verify_result(result, verbose=args.verbose))))
    return verdict_exit(result)
