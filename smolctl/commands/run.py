"""smolctl run SMOLFILE: create, set up, run the task, verify, destroy; print the result (exit 0 pass, 1 fail)."""

from __future__ import annotations

import argparse

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import fail, smolfile_message, terminal_safe
from ..output import Progress, run_result, to_json, verdict_exit

NAME = "run"
HELP = "run a task in a fresh machine and print the verifier's result (exit 0 pass, 1 fail)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("smolfile", help="a Smolfile.toml, or a directory holding one")
    p.add_argument("--name", default="", help="name of the (short-lived) machine")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="keep this label with the stored result (repeatable; smolctl results --label finds it)")
    p.add_argument("--detach", action="store_true",
                   help="print the stored result's id at once and exit 0; smolctl results ID --wait S has the verdict")
    p.add_argument("--json", action="store_true", help="print the whole RunResponse as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="show output tails of passing steps and checks")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    req = pb.RunRequest(smolfile=smolfile_message(args.smolfile), name=args.name, labels=parse_labels(args.label),
                        detach=args.detach)
    if args.detach:
        resp = stub.Run(req)
        print(to_json(resp) if args.json else resp.result_id)
        return 0
    with Progress(f"running {args.smolfile}"):
        resp = stub.Run(req)
    print(to_json(resp) if args.json else terminal_safe(run_result(resp, verbose=args.verbose)))
    return verdict_exit(resp)


def parse_labels(items: list[str]) -> dict[str, str]:
    """--label KEY=VALUE options as a dict (the daemon checks keys and values)."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels
