"""smolctl image: the daemon's OCI image cache (pull, ls, rm, prune)."""

from __future__ import annotations

import argparse
import json
import os

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

NAME = "image"
HELP = "manage OCI images: pull, ls, rm, prune"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="image_cmd", required=True)
    pull = sub.add_parser("pull", help="pull a registry image (or import a local OCI layout/archive) and build its disk")
    pull.add_argument("ref", help="registry reference (host/repo:tag, repo@sha256:...) or a local path")
    ls = sub.add_parser("ls", help="list cached images")
    ls.add_argument("--json", action="store_true", help="print the images as a JSON array")
    rm = sub.add_parser("rm", help="remove an image name (its disk goes at the next prune)")
    rm.add_argument("name", help="a name from 'image ls' or a manifest digest")
    sub.add_parser("prune", help="delete images no name or machine uses, and their blobs")


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
    if args.image_cmd == "pull":
        img = stub.PullImage(pb.PullImageRequest(ref=_local(args.ref))).image
        print(_row(img))
    elif args.image_cmd == "ls":
        images = list(stub.ListImages(pb.ListImagesRequest()).images)
        if args.json:
            print(json.dumps([MessageToDict(i, preserving_proto_field_name=True) for i in images], indent=2))
        else:
            print(f"{'MANIFEST':19}  {'SIZE':>9}  NAMES")
            for i in images:
                print(_row(i))
    elif args.image_cmd == "rm":
        for name in stub.RemoveImage(pb.RemoveImageRequest(name=_local(args.name))).removed:
            print(f"removed {name}")
    elif args.image_cmd == "prune":
        resp = stub.PruneImages(pb.PruneImagesRequest())
        print(f"removed {len(resp.removed)} images and blobs, freed {resp.freed_bytes / (1 << 20):.1f} MiB")
    return 0
