"""The ahead-of-time build: PTX/cubin per target without a GPU, and a manifest that matches."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "builders" / "build_kernels.py"), "--out", str(out),
         "--targets", "sm_121a,sm_90a"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_ptx_names_its_target(build_dir):
    for kernel in ("hidden_row_copy", "drafter_row_append"):
        for target in ("sm_121a", "sm_90a"):
            ptx = (build_dir / f"{kernel}.bf16.{target}.ptx").read_text()
            assert f".target {target}" in ptx
            assert f".entry {kernel}_kernel" in ptx
            assert (build_dir / f"{kernel}.bf16.{target}.cubin").stat().st_size > 0


def test_manifest_matches_files(build_dir):
    manifest = json.loads((build_dir / "manifest.json").read_text())
    arts = manifest["artifacts"]
    assert {(a["kernel"], a["target"]) for a in arts} == {
        (k, t) for k in ("hidden_row_copy", "drafter_row_append") for t in ("sm_121a", "sm_90a")
    }
    for a in arts:
        for kind in ("ptx", "cubin"):
            data = (build_dir / a[kind]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == a[f"{kind}_sha256"]
        # the PTX entry takes the signature plus Triton's two trailing scratch pointers
        assert a["num_ptx_params"] == len(a["signature"]) + 2
        assert a["grid"] and a["block"][0] == 32 * a["num_warps"]
    append = next(a for a in arts if a["kernel"] == "drafter_row_append")
    assert append["constants"] == {"k_s2": 1, "v_s2": 1, "ROWS": 8, "BLOCK_H": 2, "BLOCK_D": 256,
                                   "BLOCK_HALF": 32}
    assert append["grid"] == "(cdiv(n, ROWS), 1, 1)"
    copy = next(a for a in arts if a["kernel"] == "hidden_row_copy")
    assert copy["constants"] == {"ROWS": 4, "BLOCK": 1024}
    assert [n for n, _ in append["signature"]][:3] == ["k_ptr", "v_ptr", "keys_ptr"]
