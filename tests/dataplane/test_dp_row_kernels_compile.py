"""The packed row formats' Triton kernels compiled for real GPU targets, one suite over both formats.

The interpreter accepts kernels the compiler refuses (a plain-float global, for one) and computes
with numpy; compiling for the real targets (no GPU needed) pins what a GPU will run: IEEE division
(`div.rn`, never a reciprocal or an approximate division), the e4m3 rounding `(a + M) - M` not
folded, bf16 rounded to nearest even; and each format's own conversions (FP8's `e4m3x2` cast on
values already on its grid; NVFP4's codes by integer arithmetic, no float8/float4 conversion).
A format joins by adding one entry to `KERNELS` and its own checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_COMPILE = """
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
mod = importlib.import_module(spec["module"])
common = {n: "i32" for n in ("num_vectors", "head_dim", "heads", "groups", "first_key", "rows_per_block",
                             "s_row", "s_slot", "s_group", "s_head", "s_d")}
common |= {n: "constexpr" for n in spec["constexprs"]}
out = {}
for cap in spec["caps"]:
    for name, (kernel, pointers) in spec["kernels"].items():
        src = ASTSource(fn=getattr(mod, kernel), signature={**pointers, **common}, constexprs=spec["constexprs"])
        ptx = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
        out[f"{name}.sm_{cap}"] = sorted(set(re.findall(r"^\\s*((?:div|rcp|cvt|add|sub)\\.[\\w.]+)", ptx, re.M)))
json.dump(out, sys.stdout)
"""

_U8 = {"payload_ptr": "*u8", "scales_ptr": "*u8", "gscales_ptr": "*u8"}
KERNELS = {  # format -> what `_COMPILE` compiles: module, targets, constexprs, kernels with their pointers
    "fp8": {
        "module": "trtllm_mtp_carry.dataplane.triton_kernels",
        "caps": [90, 121],  # Hopper, GB10 (FP8 conversions need 8.9 or later)
        "constexprs": {"PAGED": True, "SPLIT": True, "BLOCK_V": 32, "BLOCK_D": 128},
        "kernels": {
            "pack": ("fp8_pack_kernel", {"src0_ptr": "*bf16", "src1_ptr": "*bf16", "table_ptr": "*i64",
                                         "payload_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}),
            "unpack": ("fp8_unpack_kernel", {"payload_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "dst0_ptr": "*bf16",
                                             "dst1_ptr": "*bf16", "table_ptr": "*i64"}),
        },
    },
    "nvfp4": {
        "module": "trtllm_mtp_carry.dataplane.nvfp4_kernels",
        "caps": [80, 90, 121],  # Ampere, Hopper, GB10
        "constexprs": {"PAGED": True, "SPLIT": True, "BLOCK_V": 16, "NB": 16},
        "kernels": {
            "pack": ("nvfp4_pack_kernel", {"src0_ptr": "*bf16", "src1_ptr": "*bf16", "table_ptr": "*i64", **_U8}),
            "unpack": ("nvfp4_unpack_kernel", {**_U8, "dst0_ptr": "*bf16", "dst1_ptr": "*bf16",
                                               "table_ptr": "*i64"}),
        },
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(KERNELS))
def test_row_format_kernels_compile_for_their_gpus_with_ieee_division_and_rounding_casts(fmt) -> None:
    spec = KERNELS[fmt]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout)
    assert sorted(ops) == sorted(f"{k}.sm_{cap}" for k in ("pack", "unpack") for cap in spec["caps"])
    for cap in spec["caps"]:
        pack, unpack = ops[f"pack.sm_{cap}"], ops[f"unpack.sm_{cap}"]
        assert "div.rn.f32" in pack and not any(op.startswith(("div.full", "div.approx")) for op in pack)
        assert any(op.startswith("sub.f32") for op in pack)  # (a + M) - M, the e4m3 rounding, not folded
        assert "cvt.rn.bf16.f32" in unpack  # round to nearest even, as torch's cast
        if fmt == "fp8":
            assert "cvt.rn.satfinite.e4m3x2.f32" in pack  # exact here: the values are on e4m3's grid
            assert "add.f32" in pack and "sub.f32" in pack
        else:
            assert not any(op.startswith(("div.full", "div.approx", "rcp")) for op in pack + unpack)
            assert not any("e4m3" in op or "e2m1" in op for op in pack + unpack)  # codes by integer arithmetic
