"""Generate the committed gRPC stubs (smold/api/v1/) from proto/smol/v1/*.proto; --check fails when stale.

    python -m smold.api.codegen            # regenerate smold/api/v1/*_pb2*.py[i]
    python -m smold.api.codegen --check    # regenerate into a temp dir, diff, exit 1 if they differ

Uses grpcio-tools' bundled protoc (grpc_tools.protoc), pinned in pyproject.toml so that the output is
reproducible: another grpcio-tools version may emit different code and make --check fail.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE = "smol/v1"  # directory under proto/, = proto package smol.v1
OUT_DIR = REPO_ROOT / "smold" / "api" / "v1"
# Files in OUT_DIR that are written by hand, not by protoc.
HANDWRITTEN = frozenset({"__init__.py"})

# protoc writes absolute imports of sibling modules (`from smol.v1 import smol_pb2 as ...`); the stubs
# live in the package smold.api.v1, so those become package-relative.
_ABS_IMPORT = re.compile(rf"^from {re.escape(PROTO_PACKAGE.replace('/', '.'))} import (\w+)", re.M)
_ABS_IMPORT_MODULE = re.compile(rf"^import {re.escape(PROTO_PACKAGE.replace('/', '.'))}\.(\w+)", re.M)


class CodegenError(Exception):
    """protoc failed or produced something unexpected."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[str]:
    """The .proto files of the API, relative to proto_root, sorted."""
    files = sorted(p.relative_to(proto_root).as_posix() for p in (proto_root / PROTO_PACKAGE).glob("*.proto"))
    if not files:
        raise CodegenError(f"no .proto files under {proto_root / PROTO_PACKAGE}")
    return files


def fix_imports(source: str) -> str:
    """Rewrite protoc's absolute imports of sibling generated modules into package-relative ones."""
    source = _ABS_IMPORT.sub(r"from . import \1", source)
    return _ABS_IMPORT_MODULE.sub(r"from . import \1", source)


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """Run protoc into a scratch dir; write the import-fixed stubs into out_dir. Returns name -> text."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="smol-codegen-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *proto_files(proto_root),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise CodegenError(f"protoc exited with {rc}: {' '.join(args)}")
        gen_dir = Path(scratch) / PROTO_PACKAGE
        outputs = {p.name: fix_imports(p.read_text()) for p in sorted(gen_dir.iterdir()) if p.is_file()}
    if not outputs:
        raise CodegenError("protoc produced no files")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        (out_dir / name).write_text(text)
    return outputs


def generated_names(directory: Path) -> set[str]:
    """Names of the generated stub files present in directory."""
    return {
        p.name
        for p in directory.iterdir()
        if p.is_file() and p.name not in HANDWRITTEN and re.fullmatch(r"\w+_pb2(_grpc)?\.pyi?", p.name)
    }


def check(committed_dir: Path = OUT_DIR, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate into a temp dir and compare with committed_dir; returns diff lines (empty: up to date)."""
    with tempfile.TemporaryDirectory(prefix="smol-codegen-check-") as tmp:
        fresh = generate(Path(tmp), proto_root)
    diff: list[str] = []
    present = generated_names(committed_dir) if committed_dir.is_dir() else set()
    for name in sorted(set(fresh) | present):
        path = committed_dir / name
        old = path.read_text() if path.is_file() else ""
        new = fresh.get(name, "")
        if old != new:
            diff.extend(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    fromfile=f"committed/{name}" if name in present else "/dev/null",
                    tofile=f"generated/{name}" if name in fresh else "/dev/null",
                )
            )
    return diff


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smold.api.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail (exit 1, print a diff) if stubs are stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check()
            if diff:
                sys.stdout.writelines(line if line.endswith("\n") else line + "\n" for line in diff)
                print(
                    f"error: the stubs in {OUT_DIR.relative_to(REPO_ROOT)} are stale; "
                    "run `python -m smold.api.codegen` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"{OUT_DIR.relative_to(REPO_ROOT)}: up to date")
            return 0
        stale = generated_names(OUT_DIR) if OUT_DIR.is_dir() else set()
        written = generate(OUT_DIR)
        for name in sorted(stale - set(written)):  # a removed .proto leaves no orphan stubs behind
            (OUT_DIR / name).unlink()
        for name in sorted(written):
            print(f"wrote {(OUT_DIR / name).relative_to(REPO_ROOT)}")
        return 0
    except CodegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
