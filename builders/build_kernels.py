#!/usr/bin/env python3
"""Ahead-of-time build of the data plane's Triton kernels to PTX and cubin, without a GPU.

What it is for: the JIT kernels' PTX/cubin in Triton's own calling convention
(scalars after the pointers, two trailing scratch pointers). The TensorRT
plugins need TensorRT's parameter order instead: `build_abi_kernels.py`.
For each kernel and each target (default `sm_121a` GB10, `sm_90a` H100/H200,
`sm_100a`) it writes `<kernel>.<target>.ptx` and `.cubin` and one
`manifest.json` listing, per artifact: kernel and entry name, target, the
ordered parameter signature (including the trailing scratch pointers Triton
appends), the constants baked in, the launch-grid rule, block size, shared
memory, the layout assumptions the divisibility hints encode, and SHA-256 of
every file.

Invariants: the build is deterministic for a given Triton version and
arguments; `TRITON_INTERPRET` is cleared before the kernels are imported (the
interpreter's functions cannot be compiled); a manifest entry's hashes are
those of the files written next to it.

Usage:
    python builders/build_kernels.py --out builders/out \
        [--targets sm_121a,sm_90a,sm_100a] [--dtype bf16] [--num-kv-heads 2] [--head-dim 256]
        [--rotary-dim 64]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

DEFAULT_TARGETS = ("sm_121a", "sm_90a", "sm_100a")
_DTYPES = {"bf16": "*bf16", "fp16": "*fp16"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _capability(target: str) -> int:
    m = re.fullmatch(r"sm_(\d+)a?", target)
    if not m:
        raise ValueError(f"target must look like sm_90a, got {target!r}")
    cap = int(m.group(1))
    if cap < 90:
        raise ValueError(f"target {target!r}: only sm_90 and newer are built")
    return cap


def kernel_specs(dtype: str, num_kv_heads: int, head_dim: int, rotary_dim: int = 64) -> list[dict]:
    """The (kernel, signature, constants, hints, grid rule) tuples to compile.

    The constants are those the JIT launchers pick for large row counts
    (`triton_kernels.copy_rows_for`, `append_blocks_for`).
    """
    from trtllm_mtp_carry.dataplane import triton_kernels as tk

    ptr = _DTYPES[dtype]
    copy_sig = {
        "src_ptr": ptr, "dst_ptr": ptr, "src_row": "i32", "dst_row": "i32", "n": "i32",
        "src_stride": "i32", "dst_stride": "i32", "hidden_size": "i32",
        "ROWS": "constexpr", "BLOCK": "constexpr",
    }
    append_sig = {
        "k_ptr": ptr, "v_ptr": ptr, "keys_ptr": "*i64", "k_cache_ptr": ptr, "v_cache_ptr": ptr,
        "block_table_ptr": "*i32", "inv_freq_ptr": "*fp32",
        "n": "i32", "start_row": "i32", "num_blocks": "i32",
        "num_kv_heads": "i32", "head_dim": "i32", "page_size": "i32",
        "rotary_dim": "i32", "k_s0": "i32", "k_s1": "i32", "k_s2": "constexpr",
        "v_s0": "i32", "v_s1": "i32", "v_s2": "constexpr",
        "ROWS": "constexpr", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr",
        "BLOCK_HALF": "constexpr",
    }
    copy_block = tk.COPY_BLOCK
    blocks = tk.append_blocks_for(1 << 30, num_kv_heads, head_dim, rotary_dim)
    return [
        {
            "name": "hidden_row_copy",
            "fn": tk.hidden_row_copy_kernel,
            "signature": copy_sig,
            "constants": {"ROWS": tk.copy_rows_for(1 << 30, copy_block), "BLOCK": copy_block},
            "divisible_by_16": ["src_ptr", "dst_ptr", "src_stride", "dst_stride", "hidden_size"],
            "grid": "(cdiv(n, ROWS), cdiv(hidden_size, BLOCK), 1)",
            "requires": "pointers 16-byte aligned; src_stride, dst_stride, hidden_size multiples of 16",
        },
        {
            "name": "drafter_row_append",
            "fn": tk.drafter_row_append_kernel,
            "signature": append_sig,
            "constants": {"k_s2": 1, "v_s2": 1, **blocks},
            "divisible_by_16": [
                "k_ptr", "v_ptr", "keys_ptr", "k_cache_ptr", "v_cache_ptr",
                "block_table_ptr", "inv_freq_ptr", "head_dim", "k_s0", "k_s1", "v_s0", "v_s1",
            ],
            "grid": "(cdiv(n, ROWS), 1, 1)",
            "requires": (
                "pointers 16-byte aligned; head_dim and the row/head strides of k and v multiples "
                "of 16, their last dim contiguous (k_s2 = v_s2 = 1 are baked in); "
                f"num_kv_heads <= {blocks['BLOCK_H']}, head_dim <= {blocks['BLOCK_D']}, "
                f"rotary_dim <= {2 * blocks['BLOCK_HALF']}; caches contiguous "
                "[num_blocks, page_size, num_kv_heads, head_dim]; inv_freq from rope.rope_inv_freq"
            ),
        },
    ]


def _ptx_params(ptx: str, entry: str) -> list[str]:
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        return []
    return [p.strip().split()[-1] for p in m.group(1).split(",") if p.strip()]


def build(out: Path, targets: list[str], dtype: str, num_kv_heads: int, head_dim: int,
          num_warps: int = 4, rotary_dim: int = 64) -> dict:
    """Compile every kernel for every target into `out`; write and return the manifest."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for spec in kernel_specs(dtype, num_kv_heads, head_dim, rotary_dim):
        fn = spec["fn"]
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            raise RuntimeError(
                "the data-plane kernels were imported under TRITON_INTERPRET=1; "
                "run the builder in a fresh process"
            )
        names = list(spec["signature"])
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec["divisible_by_16"]}
        for target in targets:
            cap = _capability(target)
            src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constants"],
                            attrs=attrs)
            compiled = triton.compile(
                src, target=GPUTarget("cuda", cap, 32),
                options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": True},
            )
            md = compiled.metadata
            ptx = compiled.asm["ptx"]
            stem = f"{spec['name']}.{dtype}.{target}"
            ptx_path = out / f"{stem}.ptx"
            cubin_path = out / f"{stem}.cubin"
            ptx_path.write_text(ptx)
            cubin_path.write_bytes(compiled.asm["cubin"])
            entries.append({
                "kernel": spec["name"],
                "entry": md.name,
                "target": target,
                "dtype": dtype,
                "signature": [[k, v] for k, v in spec["signature"].items() if v != "constexpr"],
                "num_ptx_params": len(_ptx_params(ptx, md.name)),
                "constants": spec["constants"],
                "divisible_by_16": spec["divisible_by_16"],
                "requires": spec["requires"],
                "grid": spec["grid"],
                "block": [num_warps * 32, 1, 1],
                "num_warps": num_warps,
                "enable_fp_fusion": True,
                "shared_bytes": md.shared,
                "global_scratch_size": getattr(md, "global_scratch_size", 0),
                "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
                "scratch_params": "trailing global/profile scratch pointers: pass null (sizes are 0)",
                "ptx": ptx_path.name,
                "ptx_sha256": _sha256(ptx_path),
                "cubin": cubin_path.name,
                "cubin_sha256": _sha256(cubin_path),
            })
    manifest = {
        "triton_version": triton.__version__,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "artifacts": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--num-kv-heads", type=int, default=2, help="Qwen3-Next MTP: 2")
    p.add_argument("--head-dim", type=int, default=256, help="Qwen3-Next MTP: 256")
    p.add_argument("--rotary-dim", type=int, default=64, help="Qwen3-Next MTP: 64")
    p.add_argument("--num-warps", type=int, default=4)
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        _capability(t)
    manifest = build(args.out, targets, args.dtype, args.num_kv_heads, args.head_dim, args.num_warps,
                     args.rotary_dim)
    for e in manifest["artifacts"]:
        print(f"{e['kernel']:20s} {e['target']:8s} {e['ptx']}  {e['cubin']}  shared={e['shared_bytes']}")
    print(f"manifest: {args.out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
