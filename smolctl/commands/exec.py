"""smolctl exec MACHINE -- CMD...: run a command in a machine, stream its output, exit with its code."""

from __future__ import annotations

import argparse
import sys

from smold.api.v1 import smol_pb2 as pb
from smold.api.v1 import smol_pb2_grpc as pb_grpc

from ..client import fail, write_err

NAME = "exec"
HELP = "run a command in a machine (exits with its exit code; 128+N if killed by signal N; 124 on timeout)"
TIMEOUT_EXIT = 124
ERROR_EXIT = 125  # smolctl's own failures, told apart from the command's exit codes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--stdin", action="store_true", help="send smolctl's stdin (read to EOF first)")
    p.add_argument("-e", "--env", action="append", default=[], metavar="NAME=VALUE", help="set a variable")
    p.add_argument("-w", "--cwd", default="", help="working directory in the guest (default /)")
    p.add_argument("-u", "--user", default="", help="user name or uid in the guest (default root)")
    p.add_argument("-t", "--timeout", type=float, help="seconds; the command's process group is killed then")
    p.add_argument("machine", help="machine id or name")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments (after --)")


def run(args: argparse.Namespace, stub: pb_grpc.SmolStub) -> int:
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        fail("exec: no command given (smolctl exec MACHINE -- CMD ...)", ERROR_EXIT)
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            fail(f"exec: --env wants NAME=VALUE (got {item!r})", ERROR_EXIT)
        env[name] = value
    req = pb.ExecRequest(machine_id=args.machine, argv=argv, env=env, cwd=args.cwd, user=args.user,
                         stdin=sys.stdin.buffer.read() if args.stdin else b"")
    if args.timeout is not None:
        req.timeout_seconds = args.timeout
    out, err = sys.stdout.buffer, sys.stderr.buffer
    for msg in stub.Exec(req):
        which = msg.WhichOneof("event")
        if which == "stdout":
            out.write(msg.stdout)
            out.flush()
        elif which == "stderr":
            err.write(msg.stderr)
            err.flush()
        elif which == "exit":
            e = msg.exit
            if e.timed_out:
                write_err(f"smolctl: command timed out after {args.timeout:g}s\n")
                return TIMEOUT_EXIT
            if e.HasField("signal"):
                return 128 + e.signal
            return e.exit_code
    fail("exec: the stream ended without an exit status", ERROR_EXIT)
