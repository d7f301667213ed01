"""smolctl results [ID]: the daemon's stored Run and Verify results (a list, or one with its evidence)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import terminal_safe
from ..output import VERDICT_EXIT, results_table, stored_result, stored_verdict, to_json
from .run import parse_labels

NAME = "results"
HELP = "list stored Run and Verify results, or show one (exit status: its verdict's, as smolctl run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", help="a result id (r-...): show it with its evidence")
    p.add_argument("--wait", type=float, metavar="SECONDS",
                   help="with ID: wait up to SECONDS for a Run still running to end")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="list only results carrying this label (repeatable)")
    p.add_argument("--kind", choices=("run", "verify"), default="", help="list only this kind")
    p.add_argument("--limit", type=int, default=0, help="list at most this many, newest first (default 100)")
    p.add_argument("--json", action="store_true", help="print StoredResult messages as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="list ids only")
    p.add_argument("-v", "--verbose", action="store_true", help="show output tails of passing steps and checks")
    p.add_argument("--prune", action="store_true",
                   help="remove finished results (with --label: only those) and their artifacts; --older-than "
                        "is required")
    p.add_argument("--older-than", metavar="AGE", type=_age,
                   help="with --prune: those that ended more than AGE ago: 30m, 12h, 7d, or 0 for all")
    p.add_argument("--artifact", metavar="NAME",
                   help="with ID: save this kept artifact of the Run (e.g. outputs.tar, verifier-logs.tar)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="with --artifact: where to save it ('-': standard output; default: NAME here, never "
                        "overwritten)")


def _age(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age (e.g. 90s, 30m, 12h, 7d, 0)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    if args.prune or args.older_than is not None:
        if not args.prune or args.older_than is None or args.id:
            print("smolctl results: --prune needs --older-than AGE (0: every finished result) and no ID",
                  file=sys.stderr)
            return 2
        resp = stub.PruneResults(pb.PruneResultsRequest(older_than_seconds=args.older_than,
                                                        labels=parse_labels(args.label)))
        print(f"removed {resp.removed} results, freed {resp.freed_bytes} bytes of artifacts")
        return 0
    if args.artifact or args.output:
        return _artifact(args, stub)
    if args.id:
        result = stub.GetResult(pb.GetResultRequest(id=args.id, wait_seconds=args.wait)).result
        print(to_json(result) if args.json else terminal_safe(stored_result(result, verbose=args.verbose)))
        return VERDICT_EXIT[stored_verdict(result)]
    results = list(stub.ListResults(pb.ListResultsRequest(labels=parse_labels(args.label), kind=args.kind,
                                                           limit=max(0, args.limit))).results)
    if args.json:
        print(json.dumps([MessageToDict(r, preserving_proto_field_name=True) for r in results], indent=2))
    elif args.quiet:
        for r in results:
            print(r.id)
    else:
        print(terminal_safe(results_table(results)))
    return 0


def _artifact(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    if not args.id or not args.artifact:
        print("smolctl results: --artifact NAME needs a result ID, and -o goes with --artifact", file=sys.stderr)
        return 2
    resp = stub.GetArtifact(pb.GetArtifactRequest(result_id=args.id, name=args.artifact))
    if args.output == "-":
        sys.stdout.buffer.write(resp.content)
        sys.stdout.flush()
        return 0
    dest = Path(args.output or args.artifact)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        print(f"smolctl results: {dest} exists; choose another with -o FILE", file=sys.stderr)
        return 2
    with os.fdopen(fd, "wb") as f:
        f.write(resp.content)
    print(f"{dest}: {len(resp.content)} bytes, sha256 {resp.sha256}", file=sys.stderr)
    return 0
