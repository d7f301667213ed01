"""smolctl image bake SMOLFILE | ls | rm KEY...: pre-baked images (CreateMachine and Run restore a matching one)."""

from __future__ import annotations

import argparse
import json

import grpc
from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import ERROR_EXIT, rpc_error_message, smolfile_message, socket_path, write_err
from ..output import bakes_table, to_json

NAME = "image"
HELP = "pre-baked images: bake a Smolfile's machine once, list and remove bakes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="image_command", metavar="SUBCOMMAND", required=True)
    bake = sub.add_parser("bake", help="boot the Smolfile's machine (mounts, setup), snapshot it as a bake; "
                                       "prints its key",
                          description="Create the Smolfile's machine once (boot, mounts, setup), snapshot it "
                                      "into the daemon's bake store and destroy it. Machines created later from "
                                      "a Smolfile with the same image, cpus, memory, network, mounts, env and "
                                      "setup restore the bake instead of booting.")
    bake.add_argument("smolfile", help="a Smolfile.toml, or a directory holding one")
    bake.add_argument("--replace", action="store_true", help="bake again even if a bake with this key exists")
    bake.add_argument("--json", action="store_true", help="print the bake as JSON")
    for name in ("ls", "bakes"):
        ls = sub.add_parser(name, help="list bakes" + (" (same as ls)" if name == "bakes" else ""))
        ls.add_argument("--json", action="store_true", help="print the bakes as a JSON array")
        ls.add_argument("-q", "--quiet", action="store_true", help="print keys only")
    rm = sub.add_parser("rm", help="delete bakes (machines restored from them keep running)")
    rm.add_argument("keys", nargs="+", metavar="key", help="sha256:<hex>, or a unique prefix of its hex digits")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    cmd = args.image_command
    if cmd == "bake":
        resp = stub.BakeImage(pb.BakeImageRequest(smolfile=smolfile_message(args.smolfile), replace=args.replace))
        print(to_json(resp.bake) if args.json else resp.bake.key)
        return 0
    if cmd in ("ls", "bakes"):
        bakes = list(stub.ListBakes(pb.ListBakesRequest()).bakes)
        if args.json:
            print(json.dumps([MessageToDict(b, preserving_proto_field_name=True) for b in bakes], indent=2))
        elif args.quiet:
            for b in bakes:
                print(b.key)
        else:
            print(bakes_table(bakes))
        return 0
    code = 0
    for key in args.keys:
        try:
            stub.DeleteBake(pb.DeleteBakeRequest(key=key))
        except grpc.RpcError as e:
            write_err(f"smolctl: error: {rpc_error_message(e, socket_path(args.socket))}\n")
            code = ERROR_EXIT
        else:
            print(key)
    return code
