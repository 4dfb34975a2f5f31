#!/usr/bin/env python3
"""Build a TensorRT engine that runs both plugins (AOT) for one model shape; needs `tensorrt`.

What it is for: the deployable proof that the plugins build into an engine
that runs without Python. The network takes the inputs of both plugins and
returns the three aliased buffers:

    store_out   = hidden_row_copy(src [n, H], dst_row [1], store [capacity, H])
    k_cache_out, v_cache_out = drafter_row_append(k_new, v_new [n, Hkv, D], keys [n],
        block_table [max_blocks], inv_freq [rotary_dim/2], start_row [1],
        k_cache, v_cache [num_blocks, block_size, Hkv, D])

`n` is dynamic in [1, --max-rows]. The engine is written to `--out` with a
JSON sidecar (`<out>.json`) holding the shapes, so `scripts/run_trt_engine.py`
can run it with the plain TensorRT runtime, without the plugin module.
Aliased plugin I/O needs `trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03` (set here).

Usage:
    python builders/build_engine.py --kernel-dir builders/out --out builders/out/carry.engine \
        [--target sm_121a] [--hidden-size 2048] [--kv-heads 2] [--head-dim 256]
        [--rotary-dim 64] [--block-size 64] [--num-blocks 64] [--max-blocks 16]
        [--capacity 4096] [--max-rows 512] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry import plugins  # noqa: E402


def build_engine(args: argparse.Namespace) -> dict:
    """Build and serialize the engine; return the sidecar dict (shapes, names)."""
    trt, _ = plugins.require_tensorrt()
    plugins.register_plugins(args.kernel_dir, args.target)
    dt = {"bf16": trt.bfloat16, "fp16": trt.float16}[args.dtype]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    H, hkv, hd = args.hidden_size, args.kv_heads, args.head_dim
    cache = (args.num_blocks, args.block_size, hkv, hd)
    i32 = trt.int32
    src = network.add_input("src", dt, (-1, H))
    dst_row = network.add_input("dst_row", i32, (1,))
    store = network.add_input("store", dt, (args.capacity, H))
    k_new = network.add_input("k_new", dt, (-1, hkv, hd))
    v_new = network.add_input("v_new", dt, (-1, hkv, hd))
    keys = network.add_input("keys", i32, (-1,))
    table = network.add_input("block_table", i32, (args.max_blocks,))
    inv_freq = network.add_input("inv_freq", trt.float32, (args.rotary_dim // 2,))
    start_row = network.add_input("start_row", i32, (1,))
    k_cache = network.add_input("k_cache", dt, cache)
    v_cache = network.add_input("v_cache", dt, cache)

    copy = plugins.add_hidden_row_copy(network, src, dst_row, store)
    copy.get_output(0).name = "store_out"
    append = plugins.add_drafter_row_append(network, k_new, v_new, keys, table, inv_freq,
                                            start_row, k_cache, v_cache)
    append.get_output(0).name = "k_cache_out"
    append.get_output(1).name = "v_cache_out"
    for t in (copy.get_output(0), append.get_output(0), append.get_output(1)):
        network.mark_output(t)

    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    opt = min(64, args.max_rows)
    profile.set_shape("src", (1, H), (opt, H), (args.max_rows, H))
    for name in ("k_new", "v_new"):
        profile.set_shape(name, (1, hkv, hd), (opt, hkv, hd), (args.max_rows, hkv, hd))
    profile.set_shape("keys", (1,), (opt,), (args.max_rows,))
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError("TensorRT failed to build the engine (see the log above)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(blob))
    side = {"dtype": args.dtype, "hidden_size": H, "kv_heads": hkv, "head_dim": hd,
            "rotary_dim": args.rotary_dim, "rope_theta": args.rope_theta,
            "block_size": args.block_size, "num_blocks": args.num_blocks,
            "max_blocks": args.max_blocks, "capacity": args.capacity, "max_rows": args.max_rows,
            "aliases": {"store_out": "store", "k_cache_out": "k_cache", "v_cache_out": "v_cache"},
            "tensorrt": trt.__version__, "target": plugins.register_plugins(args.kernel_dir,
                                                                            args.target)["target"]}
    Path(str(out) + ".json").write_text(json.dumps(side, indent=2) + "\n")
    return side


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build_engine", description=__doc__.split("\n")[0])
    p.add_argument("--kernel-dir", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--target", default=None, help="default: the current GPU")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--rotary-dim", type=int, default=64)
    p.add_argument("--rope-theta", type=float, default=1.0e7)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--max-blocks", type=int, default=16)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--max-rows", type=int, default=512)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.hidden_size % 16 or args.head_dim % 16:
        p.error(f"--hidden-size and --head-dim must be multiples of 16, got "
                f"{args.hidden_size}, {args.head_dim}")
    if args.rotary_dim < 2 or args.rotary_dim % 2 or args.rotary_dim > args.head_dim:
        p.error(f"--rotary-dim must be even and in [2, head_dim], got {args.rotary_dim}")
    for name in ("kv_heads", "block_size", "num_blocks", "max_blocks", "capacity", "max_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        side = build_engine(args)
    except (RuntimeError, ValueError) as e:
        print(f"build_engine: error: {e}", file=sys.stderr)
        return 2
    print(f"engine: {args.out} ({side['target']}, TensorRT {side['tensorrt']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
