"""Ahead-of-time build of the plugin kernels: TensorRT-ABI PTX, cubin and a manifest, no GPU.

What it is for: `builders/build_abi_kernels.py` (command line), the AOT
launcher's on-demand build, and the tests. For each kernel, data dtype,
variant and target it compiles `abi_kernels.py` with Triton, removes Triton's
trailing scratch parameters (`ptx.fix_abi`), assembles the fixed PTX with
`ptxas` (the cubin is what that PTX becomes; the PTX is what TensorRT gets)
and writes `manifest.json`.

Variants: `a16` asserts 16-element divisibility of pointers, strides and row
widths (vectorised 16-byte accesses; what the plugins use), `any` asserts
nothing (the launcher's fallback for odd shapes or offset views).

Invariants: deterministic for one Triton version and set of arguments; a
manifest entry's hashes are those of the files written next to it; the
`.entry` parameter list of every PTX equals its ABI (checked before writing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from . import abi
from .ptx import assemble, entry_params, find_ptxas, fix_abi

__all__ = [
    "DEFAULT_TARGETS", "DTYPES", "VARIANTS", "build", "capability", "load_manifest", "pick_artifact",
]

DEFAULT_TARGETS = ("sm_121a", "sm_90a", "sm_100a")
DTYPES = ("bf16", "fp16", "fp32")
VARIANTS = ("a16", "any")
MANIFEST = "manifest.json"

_A16 = {
    "hidden_row_copy": ["src", "dst_in", "dst", "src_stride", "dst_stride", "hidden_size"],
    "drafter_row_append": ["k_new", "v_new", "k_cache_in", "v_cache_in", "k_cache", "v_cache",
                           "head_dim", "k_s0", "k_s1", "v_s0", "v_s1"],
}
_REQUIRES = {
    "a16": "pointers 16-byte aligned; {names} multiples of 16",
    "any": "none beyond the ABI",
}


def capability(target: str) -> int:
    """Compute capability of `sm_XY[a]` as an int (`sm_121a` -> 121); ValueError otherwise."""
    m = re.fullmatch(r"sm_(\d+)a?", target)
    if not m or int(m.group(1)) < 90:
        raise ValueError(f"target must look like sm_90a, sm_100a or sm_121a, got {target!r}")
    return int(m.group(1))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _kernels(num_kv_heads: int, head_dim: int) -> list[tuple[abi.KernelABI, Any, dict[str, int]]]:
    from . import abi_kernels as k

    bh, bd = abi.append_block_shape(num_kv_heads, head_dim)
    return [
        (abi.COPY_ABI, k.hidden_row_copy_abi, {"BLOCK": abi.COPY_BLOCK}),
        (abi.APPEND_ABI, k.drafter_row_append_abi, {"BLOCK_H": bh, "BLOCK_D": bd}),
    ]


def build(out: Path, targets: list[str] | tuple[str, ...] = DEFAULT_TARGETS,
          dtypes: tuple[str, ...] = ("bf16",), num_kv_heads: int = 2, head_dim: int = 256,
          variants: tuple[str, ...] = VARIANTS, kernels: tuple[str, ...] | None = None) -> dict:
    """Compile every (kernel, dtype, variant, target) into `out`; write and return the manifest.

    The append kernel is specialised on `(num_kv_heads, head_dim)` rounded up to powers of two;
    it serves any smaller shape (its lanes are masked). Appending to an existing manifest
    keeps entries for other keys.
    """
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {d!r}")
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {v!r}")
    caps = {t: capability(t) for t in targets}
    ptxas = find_ptxas()
    out.mkdir(parents=True, exist_ok=True)
    old = load_manifest(out) if (out / MANIFEST).exists() else {"artifacts": []}
    entries: dict[tuple, dict] = {_key(e): e for e in old["artifacts"]}
    for kabi, fn, consts in _kernels(num_kv_heads, head_dim):
        if kernels is not None and kabi.name not in kernels:
            continue
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            raise RuntimeError("the ABI kernels were imported under TRITON_INTERPRET=1; "
                               "build in a fresh process")
        names = kabi.names()
        for dtype in dtypes:
            if kabi is abi.APPEND_ABI and dtype == "fp32":
                continue  # the drafter cache is bf16/fp16 only (dataplane.checks.CACHE_DTYPES)
            sig = kabi.signature(dtype) | {c: "constexpr" for c in consts}
            for variant in variants:
                hinted = _A16[kabi.name] if variant == "a16" else []
                attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in hinted}
                for target in targets:
                    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
                    compiled = triton.compile(
                        src, target=GPUTarget("cuda", caps[target], 32),
                        options={"num_warps": abi.NUM_WARPS, "num_stages": 1,
                                 "enable_fp_fusion": True},
                    )
                    md = compiled.metadata
                    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
                        raise RuntimeError(f"{md.name}: Triton asked for scratch memory, "
                                           "which TensorRT cannot pass")
                    ptx = fix_abi(compiled.asm["ptx"], md.name, kabi)
                    cubin = assemble(ptx, target, ptxas)
                    stem = _stem(kabi.name, dtype, variant, target, consts)
                    (out / f"{stem}.ptx").write_text(ptx)
                    (out / f"{stem}.cubin").write_bytes(cubin)
                    e = {
                        "kernel": kabi.name, "entry": md.name, "target": target,
                        "dtype": dtype, "variant": variant, "constants": consts,
                        "params": [[p.name, p.role, p.triton_type(dtype), p.ptx_type()]
                                   for p in kabi.params],
                        "entry_params": [ty for _, ty in entry_params(ptx, md.name)],
                        "aliases": [list(a) for a in kabi.aliases],
                        "requires": _REQUIRES[variant].format(names=", ".join(hinted)),
                        "launch": ("grid (n, cdiv(hidden_size, BLOCK), 1)"
                                   if kabi is abi.COPY_ABI else "grid (n, 1, 1)"),
                        "block": [abi.NUM_WARPS * 32, 1, 1],
                        "shared_bytes": md.shared,
                        "ptx": f"{stem}.ptx", "ptx_sha256": _sha256(ptx.encode()),
                        "cubin": f"{stem}.cubin", "cubin_sha256": _sha256(cubin),
                    }
                    entries[_key(e)] = e
    manifest = {"triton_version": triton.__version__, "ptxas": str(ptxas),
                "artifacts": sorted(entries.values(), key=lambda e: _stem(
                    e["kernel"], e["dtype"], e["variant"], e["target"], e["constants"]))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _stem(kernel: str, dtype: str, variant: str, target: str, consts: dict[str, int]) -> str:
    shape = "" if kernel == "hidden_row_copy" else f".h{consts['BLOCK_H']}d{consts['BLOCK_D']}"
    return f"{kernel}{shape}.{dtype}.{variant}.{target}"


def _key(e: dict) -> tuple:
    return (e["kernel"], e["dtype"], e["variant"], e["target"],
            tuple(sorted(e["constants"].items())))


def load_manifest(directory: Path) -> dict:
    """The manifest of a build directory, its files' hashes verified (ValueError on mismatch)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no {MANIFEST} in {directory}: run builders/build_abi_kernels.py")
    manifest = json.loads(path.read_text())
    for e in manifest["artifacts"]:
        for kind in ("ptx", "cubin"):
            data = (Path(directory) / e[kind]).read_bytes()
            if _sha256(data) != e[f"{kind}_sha256"]:
                raise ValueError(f"{e[kind]}: SHA-256 differs from {MANIFEST}")
    return manifest


def pick_artifact(manifest: dict | None, kernel: str, dtype: str, variant: str, target: str,
                  shape: tuple[int, int] | None = None) -> dict | None:
    """The manifest entry for this kernel/dtype/variant/target, or None.

    For the append kernel `shape = (num_kv_heads, head_dim)`: the entry with the smallest
    baked tile that still covers it (lanes past the real shape are masked).
    """
    if manifest is None:
        return None
    fits = [e for e in manifest["artifacts"]
            if (e["kernel"], e["dtype"], e["variant"], e["target"]) == (kernel, dtype, variant, target)
            and (shape is None or (e["constants"]["BLOCK_H"] >= shape[0]
                                   and e["constants"]["BLOCK_D"] >= shape[1]))]
    return min(fits, key=lambda e: sorted(e["constants"].values()), default=None)
