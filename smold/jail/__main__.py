"""CLI: ``python -m smold.jail [options] -- VMM ARGV...``: run one VMM process inside its jail (root only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cgroup import Limits
from .jailer import JailError, JailSpec, run_jailed


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m smold.jail", description=__doc__)
    ap.add_argument("--name", required=True, help="jail and cgroup name (the machine id)")
    ap.add_argument("--uid", type=int, required=True, help="unprivileged uid the VMM runs as")
    ap.add_argument("--gid", type=int, required=True, help="its gid")
    ap.add_argument("--state-dir", type=Path, required=True, help="the VM's state directory (read-write)")
    ap.add_argument("--jail-base", type=Path, default=Path("/run/smol-jail"),
                    help="jail roots are JAIL_BASE/NAME (empty mount points)")
    ap.add_argument("--ro", type=Path, action="append", default=[], help="a path bound read-only (repeatable)")
    ap.add_argument("--rw", type=Path, action="append", default=[], help="a path bound read-write (repeatable)")
    ap.add_argument("--memory-bytes", type=int, help="cgroup memory limit (no cgroup without it)")
    ap.add_argument("--cpus", type=float, default=1.0, help="cgroup CPU quota in cores")
    ap.add_argument("--pids", type=int, default=256, help="cgroup task limit")
    ap.add_argument("--cgroup-parent", default="smol")
    ap.add_argument("--nofile", type=int, default=4096)
    ap.add_argument("--nproc", type=int, default=4096)
    ap.add_argument("--keep-netns", action="store_true",
                    help="stay in the current network namespace (default: a new, empty one)")
    ap.add_argument("argv", nargs="+", help="the command to run jailed (after --)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    limits = Limits(args.memory_bytes, args.cpus, args.pids) if args.memory_bytes else None
    spec = JailSpec(name=args.name, uid=args.uid, gid=args.gid, state_dir=args.state_dir.absolute(),
                    jail_base=args.jail_base.absolute(), read_only=tuple(p.absolute() for p in args.ro),
                    read_write=tuple(p.absolute() for p in args.rw), limits=limits,
                    cgroup_parent=args.cgroup_parent, nofile=args.nofile, nproc=args.nproc,
                    keep_netns=args.keep_netns)
    try:
        return run_jailed(spec, args.argv)
    except (JailError, OSError) as e:
        print(f"smol-jail: {e}", file=sys.stderr)
        return 125


if __name__ == "__main__":
    sys.exit(main())
