"""smolctl rm MACHINE...: destroy machines (every process, socket and file they had)."""

from __future__ import annotations

import argparse
import json

import grpc

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import ERROR_EXIT, rpc_error_message, socket_path, write_err

NAME = "rm"
HELP = "destroy machines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("machines", nargs="+", metavar="machine", help="machine ids or names")
    p.add_argument("--json", action="store_true", help='print [{"machine", "destroyed", "error"}] as JSON')


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    code = 0
    results = []
    for ref in args.machines:
        try:
            stub.DestroyMachine(pb.DestroyMachineRequest(machine_id=ref))
        except grpc.RpcError as e:
            message = rpc_error_message(e, socket_path(args.socket))
            results.append({"machine": ref, "destroyed": False, "error": message})
            if not args.json:
                write_err(f"smolctl: error: {message}\n")
            code = ERROR_EXIT
        else:
            results.append({"machine": ref, "destroyed": True, "error": ""})
            if not args.json:
                print(ref)
    if args.json:
        print(json.dumps(results, indent=2))
    return code
