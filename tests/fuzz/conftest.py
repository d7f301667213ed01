"""Bounded fuzzing (hypothesis): hostile bytes into the guest-facing parsers and the snapshot file parser.

``SMOL_FUZZ_EXAMPLES`` sets the examples per test (default 150, sized for CI); raise it for a longer run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))   # virtio_driver, test_snapshot_format

settings.register_profile(
    "smol-fuzz", max_examples=int(os.environ.get("SMOL_FUZZ_EXAMPLES", "150")), deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture])
settings.load_profile("smol-fuzz")
