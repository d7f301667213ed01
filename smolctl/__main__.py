"""CLI: ``smolctl [--socket PATH | --tcp HOST:PORT ...] COMMAND ...``: drive smold (see docs/daemon.md)."""

from __future__ import annotations

import argparse
import sys

import grpc

from .client import CtlError, connect, endpoint, rpc_error_message, write_err
from .commands import COMMANDS


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="smolctl", description="Drive smold: disposable microVMs with a verifier.")
    ap.add_argument("--socket", help="smold's Unix socket (default: $SMOL_SOCKET, else /run/smold/smold.sock)")
    ap.add_argument("--tcp", metavar="HOST:PORT", help="reach smold over TCP with TLS instead (default: $SMOL_TCP)")
    ap.add_argument("--ca", metavar="FILE",
                    help="PEM CA certificate(s) to trust for --tcp (default: $SMOL_CA, else the system's)")
    ap.add_argument("--token-file", metavar="FILE",
                    help="file holding the bearer token for --tcp (default: $SMOL_TOKEN_FILE)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in COMMANDS:
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(module=mod)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    error_exit = getattr(args.module, "ERROR_EXIT", 2)
    try:
        path = endpoint(args.socket, args.tcp, args.ca, args.token_file)
        channel, stub = connect(path)
    except CtlError as e:
        write_err(f"smolctl: error: {e}\n")
        return e.exit_code
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
