"""Locations of the guest-artifact inputs in the source tree."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GUEST_AGENT_DIR = REPO_ROOT / "guest-agent"
