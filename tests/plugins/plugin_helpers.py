"""Constants shared by the plugin tests (the repository root, the default build targets)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("sm_121a", "sm_90a", "sm_100a")
