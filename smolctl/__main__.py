"""CLI: ``smolctl [--socket PATH] COMMAND ...``: drive smold over its Unix socket (see docs/daemon.md)."""

from __future__ import annotations

import argparse
import sys

import grpc

from .client import CtlError, connect, rpc_error_message, socket_path, write_err
from .commands import COMMANDS


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="smolctl", description="Drive smold: disposable microVMs with a verifier.")
    ap.add_argument("--socket", help="smold's Unix socket (default: $SMOL_SOCKET, else /run/smold/smold.sock)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in COMMANDS:
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(module=mod)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    path = socket_path(args.socket)
    error_exit = getattr(args.module, "ERROR_EXIT", 2)
    channel, stub = connect(path)
    try:
        return int(args.module.run(args, stub))
    except CtlError as e:
        write_err(f"smolctl: error: {e}\n")
        return e.exit_code
    except grpc.RpcError as e:
        write_err(f"smolctl: error: {rpc_error_message(e, path)}\n")
        return int(error_exit)
    except KeyboardInterrupt:
        write_err("smolctl: interrupted\n")
        return 130
    except BrokenPipeError:
        return 141
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
