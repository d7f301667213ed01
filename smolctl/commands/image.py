"""smolctl image: the daemon's OCI image cache (pull, ls, rm, prune) and its pre-baked images (bake, bakes, unbake)."""

from __future__ import annotations

import argparse
import json
import os

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import delete_each, smolfile_message
from ..output import Progress, bakes_table, to_json

NAME = "image"
HELP = "OCI images (pull, ls, rm, prune) and pre-baked machines (bake, bakes, unbake)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="image_cmd", metavar="SUBCOMMAND", required=True)
    pull = sub.add_parser("pull", help="pull a registry image (or import a local OCI layout/archive) and build its disk")
    pull.add_argument("ref", help="registry reference (host/repo:tag, repo@sha256:...) or a local path")
    pull.add_argument("--json", action="store_true", help="print the image as JSON")
    ls = sub.add_parser("ls", help="list cached images")
    ls.add_argument("--json", action="store_true", help="print the images as a JSON array")
    rm = sub.add_parser("rm", help="remove an image name (its disk goes at the next prune)")
    rm.add_argument("name", help="a name from 'image ls' or a manifest digest")
    rm.add_argument("--json", action="store_true", help="print the removed names as a JSON array")
    prune = sub.add_parser("prune", help="delete images no name or machine uses, and their blobs")
    prune.add_argument("--json", action="store_true", help="print what was removed and freed as JSON")

    bake = sub.add_parser("bake", help="boot the Smolfile's machine (mounts, setup), snapshot it as a bake; "
                                       "prints its key",
                          description="Create the Smolfile's machine once (boot, mounts, setup), snapshot it "
                                      "into the daemon's bake store and destroy it. Machines created later from "
                                      "a Smolfile with the same image, cpus, memory, network, mounts, env and "
                                      "setup restore the bake instead of booting.")
    bake.add_argument("smolfile", help="a Smolfile.toml, or a directory holding one")
    bake.add_argument("--replace", action="store_true", help="bake again even if a bake with this key exists")
    bake.add_argument("--json", action="store_true", help="print the bake as JSON")
    bakes = sub.add_parser("bakes", help="list pre-baked machines")
    bakes.add_argument("--json", action="store_true", help="print the bakes as a JSON array")
    bakes.add_argument("-q", "--quiet", action="store_true", help="print keys only")
    unbake = sub.add_parser("unbake", help="delete bakes (machines restored from them keep running)")
    unbake.add_argument("keys", nargs="+", metavar="key", help="sha256:<hex>, or a unique prefix of its hex digits")


def _local(ref: str) -> str:
    """Local paths become absolute here: the daemon does not know this shell's working directory."""
    for prefix in ("oci:", "oci-archive:", "docker-archive:"):
        if ref.startswith(prefix):
            return prefix + os.path.abspath(os.path.expanduser(ref[len(prefix):]))
    if ref.startswith(("./", "../", "~", "/")):
        return os.path.abspath(os.path.expanduser(ref))
    return ref


def _row(img: pb.Image) -> str:
    size = f"{img.size_bytes / (1 << 20):.0f} MiB"
    return f"{img.manifest_digest[:19]:19}  {size:>9}  {', '.join(img.names) or '<none>'}"


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    cmd = args.image_cmd
    if cmd == "pull":
        with Progress(f"pulling {args.ref}"):
            img = stub.PullImage(pb.PullImageRequest(ref=_local(args.ref))).image
        print(to_json(img) if args.json else _row(img))
    elif cmd == "ls":
        images = list(stub.ListImages(pb.ListImagesRequest()).images)
        if args.json:
            print(json.dumps([MessageToDict(i, preserving_proto_field_name=True) for i in images], indent=2))
        else:
            print(f"{'MANIFEST':19}  {'SIZE':>9}  NAMES")
            for i in images:
                print(_row(i))
    elif cmd == "rm":
        removed = list(stub.RemoveImage(pb.RemoveImageRequest(name=_local(args.name))).removed)
        if args.json:
            print(json.dumps(removed))
        else:
            for name in removed:
                print(f"removed {name}")
    elif cmd == "prune":
        resp = stub.PruneImages(pb.PruneImagesRequest())
        if args.json:
            print(to_json(resp))
            return 0
        print(f"removed {len(resp.removed)} images and blobs, freed {resp.freed_bytes / (1 << 20):.1f} MiB")
    elif cmd == "bake":
        with Progress(f"baking {args.smolfile}"):
            resp = stub.BakeImage(pb.BakeImageRequest(smolfile=smolfile_message(args.smolfile),
                                                      replace=args.replace))
        print(to_json(resp.bake) if args.json else resp.bake.key)
    elif cmd == "bakes":
        listed = list(stub.ListBakes(pb.ListBakesRequest()).bakes)
        if args.json:
            print(json.dumps([MessageToDict(b, preserving_proto_field_name=True) for b in listed], indent=2))
        elif args.quiet:
            for b in listed:
                print(b.key)
        else:
            print(bakes_table(listed))
    elif cmd == "unbake":
        return delete_each(args.keys, lambda k: stub.DeleteBake(pb.DeleteBakeRequest(key=k)), args.socket)
    return 0
