"""smolctl info: the daemon's limits and what of them is in use (GetDaemonInfo)."""

from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

NAME = "info"
HELP = "show the daemon's limits and what is in use"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the fields as a JSON object")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    r = stub.GetDaemonInfo(pb.GetDaemonInfoRequest())
    if args.json:
        print(json.dumps(MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                         indent=2))
        return 0
    print(f"machines: {r.live_machines} of {r.max_machines}")
    print(f"memory:   {r.memory_in_use_mib} of {r.max_memory_mib} MiB (a machine gets {r.default_memory_mib} MiB "
          "unless its Smolfile says otherwise)")
    print(f"cpus:     at most {r.max_cpus} per machine")
    print(f"public network: {'allowed' if r.public_network else 'refused (smold --no-public-network)'}")
    return 0
