"""The project installs beside PyPI's smolmachines (the Smol Machines SDK: a top-level ``smol`` package and Harbor
0.26's built-in ``smol`` environment): both import, and Harbor still finds and checks its built-in environment.

Issue #17 (naming): the SDK package is ``smolsdk``, the distribution ``smold``, the Harbor environment type
``smold``; none of them is a name on PyPI. The real smolmachines wheel (pinned by hash, cached under
~/.cache/smol) and this checkout are installed with pip into one target directory, which Harbor's interpreter
(``$SMOL_HARBOR_PYTHON``, as in test_harbor_cli.py) then imports from.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARBOR_PYTHON = os.environ.get("SMOL_HARBOR_PYTHON", "")
SMOLMACHINES = "smolmachines==1.32.2"
SMOLMACHINES_WHEEL = "smolmachines-1.32.2-cp39-abi3-manylinux_2_28_x86_64.whl"
SMOLMACHINES_SHA256 = "81b104e2622aa0b187b6b7054397c391151b83db2638a16d0e54c517684f0dc2"

if not HARBOR_PYTHON and os.environ.get("CI"):
    raise RuntimeError("CI must set SMOL_HARBOR_PYTHON (.ci/harbor-python builds it)")
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not HARBOR_PYTHON, reason="SMOL_HARBOR_PYTHON is not set (.ci/harbor-python)")]


def smolmachines_wheel() -> Path:
    """The pinned wheel, from the cache if its hash matches, else downloaded (pip checks the hash)."""
    cache = Path(os.environ.get("SMOL_CACHE_DIR", Path.home() / ".cache" / "smol")) / "wheels"
    wheel = cache / SMOLMACHINES_WHEEL
    if wheel.is_file() and hashlib.sha256(wheel.read_bytes()).hexdigest() == SMOLMACHINES_SHA256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    req = cache / "smolmachines.req"
    req.write_text(f"{SMOLMACHINES} --hash=sha256:{SMOLMACHINES_SHA256}\n")
    subprocess.run([str(Path(HARBOR_PYTHON).parent / "pip"), "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "--require-hashes", "-r", str(req), "-d", str(cache)], check=True, timeout=300)
    return wheel


def test_the_project_installs_beside_smolmachines_and_harbors_smol_environment_still_works(tmp_path: Path) -> None:
    src = tmp_path / "src"   # a copy of the package sources, so that the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("smold", "smolctl", "smolsdk", "guest-agent"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    site = tmp_path / "site"
    pip = Path(HARBOR_PYTHON).parent / "pip"
    r = subprocess.run([str(pip), "install", "-q", "--no-deps", "--target", str(site), str(smolmachines_wheel()),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # no file of ours lands in smolmachines' package (nor anything of theirs in ours)
    record = next(site.glob("smold-*.dist-info")) / "RECORD"
    ours = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert "smol" not in ours and {"smolsdk", "smold", "smolctl"} <= ours, ours

    probe = textwrap.dedent("""
        from importlib.metadata import entry_points
        import smol, smol.async_machine, smolsdk, smolsdk.harbor_env
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.environment_type import EnvironmentType
        builtin = EnvironmentFactory.get_environment_class(EnvironmentType.SMOL)
        EnvironmentFactory.run_preflight(EnvironmentType.SMOL, kwargs={})
        ours = EnvironmentFactory.get_environment_class(import_path="smolsdk.harbor_env:SmolEnvironment")
        harbor_envs = {e.name: e.value for e in entry_points(group="harbor.environments")}
        print(smol.__file__, smolsdk.__file__, builtin.__module__, getattr(builtin.type(), "value", builtin.type()),
              ours.type().value,
              harbor_envs.get("smol"), sep="|")
    """)
    r = subprocess.run([HARBOR_PYTHON, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    smol_file, sdk_file, builtin_module, builtin_type, our_type, entry = r.stdout.strip().split("|")
    assert smol_file == str(site / "smol" / "__init__.py")        # smolmachines' smol, not shadowed
    assert sdk_file == str(site / "smolsdk" / "__init__.py")
    assert (builtin_module, builtin_type) == ("harbor.environments.smol", "smol")
    assert our_type == "smold"                                     # not Harbor's "smol"
    assert entry == "smol.harbor:SmolEnvironment"                  # smolmachines' own registration, intact
