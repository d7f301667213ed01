"""smolctl logs MACHINE: print the end of a machine's serial console log."""

from __future__ import annotations

import argparse
import json
import sys

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import terminal_safe, write_err

NAME = "logs"
HELP = "print the end of a machine's console log"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("machine", help="machine id or name")
    p.add_argument("-c", "--bytes", type=int, default=65536, help="how much of the log's end to fetch (64 KiB)")
    p.add_argument("-n", "--lines", type=int, help="print only the last N lines")
    p.add_argument("--json", action="store_true",
                   help='print {"machine", "state", "failure_reason", "console_tail"} as JSON')


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    m = stub.GetMachine(pb.GetMachineRequest(machine_id=args.machine, console_tail_bytes=max(1, args.bytes))).machine
    text = m.console_tail
    if args.lines is not None:
        text = "".join(text.splitlines(keepends=True)[-args.lines:]) if args.lines > 0 else ""
    if args.json:
        from ..output import state_name
        print(json.dumps({"machine": m.id, "state": state_name(m.state), "failure_reason": m.failure_reason,
                          "console_tail": text}, indent=2))
        return 0
    if sys.stdout.isatty():   # the guest's console: shown, not obeyed (a file or pipe gets it byte for byte)
        text = terminal_safe(text)
    sys.stdout.write(text)
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")
    if m.failure_reason:
        write_err(f"smolctl: machine {m.id} failed: {m.failure_reason}\n")
    return 0
