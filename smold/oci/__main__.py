"""``python -m smold.oci pull|import|ls|rm|prune``: the image cache from the command line (no daemon needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import OciError
from .images import default_store, import_local, list_images, prune, pull, remove
from .store import OciStore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m smold.oci", description=__doc__)
    p.add_argument("--store", type=Path, help="cache directory (default: $SMOL_CACHE_DIR/oci or ~/.cache/smol/oci)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("pull", help="pull a registry image and build its root disk")
    sp.add_argument("ref")
    sp.add_argument("--cached", action="store_true", help="reuse a cached tag instead of asking the registry")
    si = sub.add_parser("import", help="import an OCI layout directory or archive / docker save tarball")
    si.add_argument("path")
    sub.add_parser("ls", help="list cached images")
    sr = sub.add_parser("rm", help="remove an image name")
    sr.add_argument("name")
    sub.add_parser("prune", help="delete images and blobs no name refers to")
    a = p.parse_args(argv)
    store = OciStore(a.store) if a.store else default_store()
    try:
        if a.cmd == "pull":
            r = pull(store, a.ref, refresh=not a.cached)
            print(f"{r.spec} {r.manifest} {r.rootfs}")
        elif a.cmd == "import":
            r = import_local(store, a.path if a.path.startswith(("/", ".", "~", "oci")) else f"./{a.path}")
            print(f"{r.spec} {r.manifest} {r.rootfs}")
        elif a.cmd == "ls":
            for e in list_images(store):
                print(f"{e.manifest[:19]}  {e.size >> 20:6d} MiB  {', '.join(e.names) or '<none>'}")
        elif a.cmd == "rm":
            for name in remove(store, a.name):
                print(f"removed {name}")
        elif a.cmd == "prune":
            removed, freed = prune(store)
            print(f"removed {len(removed)} images/blobs, freed {freed >> 20} MiB")
    except OciError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
