"""CLI: build (or find in the cache) the base guest kernel, initramfs and rootfs, and print their paths."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from smold.images.artifacts import KINDS, resolve
from smold.images.cache import CACHE_ENV
from smold.images.errors import ImageBuildError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smold.images.build_base", description=__doc__)
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"cache root (default: ${CACHE_ENV} or ~/.cache/smol)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache has the artifact")
    ap.add_argument("--only", choices=KINDS, action="append",
                    help="build just this artifact (repeatable; default: all three)")
    args = ap.parse_args(argv)
    kinds = args.only or list(KINDS)
    try:
        for kind in kinds:
            t0 = time.monotonic()
            path = resolve(kind, cache_dir=args.cache_dir, force=args.force)
            dt = time.monotonic() - t0
            print(f"{kind}={path}", flush=True)
            print(f"[smol.images] {kind}: {path.stat().st_size / 2**20:.1f} MiB, {dt:.1f}s",
                  file=sys.stderr, flush=True)
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
