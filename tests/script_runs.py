"""Run one of the repository's scripts/ as a user would: a fresh interpreter at the repository root.

The child sees the repository on PYTHONPATH and none of this process's TRTLLM_MTP_CARRY_*
settings (the suite pins some process-wide in conftest.py; a script reads its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python scripts/<name> args...`: its exit status, stdout and stderr (text)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRTLLM_MTP_CARRY_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)
