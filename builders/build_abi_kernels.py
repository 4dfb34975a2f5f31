#!/usr/bin/env python3
"""Build the TensorRT plugins' kernels ahead of time: ABI-exact PTX + cubin per target, and a manifest.

What it is for: the artifacts `trtllm_mtp_carry.plugins` hands TensorRT and the
AOT launcher runs (`TRTLLM_MTP_CARRY_KERNELS=aot`). No GPU needed. For each
kernel, dtype, variant (`a16`, `any`) and target (default `sm_121a` GB10,
`sm_90a` H100/H200, `sm_100a` B200) it writes `<stem>.ptx` (`.entry`
parameters exactly the plugin's inputs, int32 extras, outputs) and `<stem>.cubin`
(that PTX assembled by ptxas), and `manifest.json` (entry, ordered parameters
with roles and types, aliases, constants, launch rule, block, shared memory,
SHA-256 of both files). See builders/README.md.

Usage:
    python builders/build_abi_kernels.py --out builders/out \
        [--targets sm_121a,sm_90a,sm_100a] [--dtypes bf16,fp16,fp32] \
        [--num-kv-heads 2] [--head-dim 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.kernels.build import (  # noqa: E402
    DEFAULT_TARGETS,
    DTYPES,
    VARIANTS,
    build,
    capability,
)


def _csv(s: str) -> list[str]:
    return [t.strip() for t in s.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build_abi_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--num-kv-heads", type=int, default=2, help="Qwen3-Next MTP: 2")
    p.add_argument("--head-dim", type=int, default=256, help="Qwen3-Next MTP: 256")
    args = p.parse_args(argv)
    targets, dtypes, variants = _csv(args.targets), _csv(args.dtypes), _csv(args.variants)
    try:
        for t in targets:
            capability(t)
    except ValueError as e:
        p.error(str(e))
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if args.num_kv_heads < 1 or args.head_dim < 1:
        p.error(f"--num-kv-heads and --head-dim must be >= 1, got {args.num_kv_heads}, {args.head_dim}")
    manifest = build(args.out, targets, tuple(dtypes), args.num_kv_heads, args.head_dim,
                     tuple(variants))
    for e in manifest["artifacts"]:
        print(f"{e['kernel']:20s} {e['dtype']:5s} {e['variant']:4s} {e['target']:8s} "
              f"{len(e['params'])} params  shared={e['shared_bytes']}  {e['ptx']}")
    print(f"manifest: {args.out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
