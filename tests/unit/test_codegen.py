"""The committed smol.v1 stubs: up to date with the .proto, package-relative, and the API's shape."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smold.api import codegen

pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) generates the stubs")
pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto():
    assert codegen.check() == [], "run `python -m smold.api.codegen` and commit the result"


def test_check_cli_passes_on_the_committed_tree():
    proc = subprocess.run(
        [sys.executable, "-m", "smold.api.codegen", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def test_check_reports_edited_missing_and_stray_stubs(tmp_path):
    committed = tmp_path / "v1"
    shutil.copytree(codegen.OUT_DIR, committed)
    grpc_stub = committed / "smol_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text().replace("from . import smol_pb2", "from . import smol_pb2  # edited"))
    (committed / "smol_pb2.pyi").unlink()
    (committed / "old_pb2.py").write_text("# left over\n")
    (committed / "helpers.py").write_text("# not generated: ignored\n")
    diff = "".join(codegen.check(committed))
    assert "+from . import smol_pb2 as" in diff and "-from . import smol_pb2  # edited" in diff
    assert "--- /dev/null" in diff and "+++ generated/smol_pb2.pyi" in diff
    assert "--- committed/old_pb2.py" in diff and "+++ /dev/null" in diff
    assert "helpers.py" not in diff


def test_check_detects_a_proto_change(tmp_path):
    proto_root = tmp_path / "proto"
    shutil.copytree(codegen.PROTO_ROOT, proto_root)
    proto = proto_root / "smol" / "v1" / "smol.proto"
    proto.write_text(proto.read_text().replace("string console_tail = 11;", "string console_tail = 11;\n  string zone = 12;"))
    diff = "".join(codegen.check(codegen.OUT_DIR, proto_root))
    assert "zone" in diff


def test_fix_imports_makes_sibling_imports_package_relative():
    src = "import grpc\nfrom smol.v1 import smol_pb2 as smol_dot_v1_dot_smol__pb2\nimport smol.v1.other_pb2\n"
    assert codegen.fix_imports(src) == (
        "import grpc\nfrom . import smol_pb2 as smol_dot_v1_dot_smol__pb2\nfrom . import other_pb2\n"
    )
    assert "from google.protobuf import timestamp_pb2" in codegen.fix_imports(
        "from google.protobuf import timestamp_pb2 as x\n"
    )


def test_service_shape():
    from smold.api.v1 import smol_pb2, smol_pb2_grpc

    service = smol_pb2.DESCRIPTOR.services_by_name["Smol"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "CreateMachine", "GetMachine", "ListMachines", "Exec", "CopyIn", "CopyOut",
        "Verify", "DestroyMachine", "SetNetworkPolicy", "Run", "Fork", "Snapshot", "ListCheckpoints", "DeleteCheckpoint",
        "BakeImage", "ListBakes", "DeleteBake", "PullImage", "ListImages", "RemoveImage", "PruneImages",
        "GetResult", "ListResults", "GetArtifact", "PruneResults", "GetDaemonInfo",
    }  # fmt: skip
    for name, method in methods.items():
        assert method.input_type.name == f"{name}Request"
        assert method.output_type.name == f"{name}Response"
        assert method.server_streaming is (name == "Exec")
        assert not method.client_streaming
    assert smol_pb2.DESCRIPTOR.package == "smol.v1"
    assert hasattr(smol_pb2_grpc, "SmolStub") and hasattr(smol_pb2_grpc, "add_SmolServicer_to_server")
