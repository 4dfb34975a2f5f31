#!/usr/bin/env python3
"""Run an engine from `builders/build_engine.py` with the plain TensorRT runtime and check it.

What it is for: the proof that the AOT plugins need no Python at run time. The
engine is deserialized with `tensorrt.Runtime` only; `trtllm_mtp_carry.plugins`
is never imported (checked at the end). Inputs are random, with a row count
that is not a multiple of the block size, a shuffled (scattered) block table
and a start row in the middle of a block; the outputs are compared with the
plain-torch references:
  - hidden store: bit for bit, every row outside the written ones unchanged;
  - drafter caches: V and K's non-rotary columns bit for bit, K's rotary columns
    within one BF16/FP16 rounding of the reference, untouched slots unchanged.
Prints one PASS/FAIL line per check; exit status 1 on any failure.

Usage: python scripts/run_trt_engine.py ENGINE [--rows 77] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.dataplane.reference import (  # noqa: E402
    drafter_row_append_reference,
    hidden_row_copy_reference,
)
from trtllm_mtp_carry.dataplane.rope import rope_inv_freq  # noqa: E402


def close_16bit(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one 16-bit-float rounding (relative) plus float32-angle slack, as the CPU tests."""
    rtol = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = (out.double() - ref.double()).abs()
    return bool((err <= rtol * ref.double().abs() + 2e-3).all())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine", type=Path)
    p.add_argument("--rows", type=int, default=77)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import tensorrt as trt

    side = json.loads(Path(str(args.engine) + ".json").read_text())
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[side["dtype"]]
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    n = min(args.rows, side["max_rows"])
    H, hkv, hd, P = side["hidden_size"], side["kv_heads"], side["head_dim"], side["block_size"]
    rd, theta = side["rotary_dim"], side["rope_theta"]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt).to(dev)

    def poison(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(dt).to(dev)

    src = rnd(n, H)
    dst_row = min(side["capacity"] - n, 123)
    store = poison(side["capacity"], H)
    k_new, v_new = rnd(n, hkv, hd), rnd(n, hkv, hd)
    keys = (torch.randint(1, 4, (n,), generator=g).cumsum(0) + 5).to(torch.int32).to(dev)
    table = torch.randperm(side["num_blocks"], generator=g)[: side["max_blocks"]].to(torch.int32).to(dev)
    start_row = P // 2 + 1  # mid-block
    if start_row + n > side["max_blocks"] * P:
        n_fit = side["max_blocks"] * P - start_row
        raise SystemExit(f"--rows {n} does not fit the block table (at most {n_fit})")
    cache_shape = (side["num_blocks"], P, hkv, hd)
    k_cache, v_cache = poison(*cache_shape), poison(*cache_shape)
    inv = rope_inv_freq(rd, theta, dev)

    store_ref, k_ref, v_ref = store.clone(), k_cache.clone(), v_cache.clone()
    hidden_row_copy_reference(src, 0, store_ref, dst_row, n)
    drafter_row_append_reference(k_new, v_new, keys, k_ref, v_ref, table, start_row, rd, theta)

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(args.engine.read_bytes())
    ctx = engine.create_execution_context()
    scalars = {"dst_row": torch.tensor([dst_row], dtype=torch.int32, device=dev),
               "start_row": torch.tensor([start_row], dtype=torch.int32, device=dev)}
    tensors = {"src": src, "store": store, "k_new": k_new, "v_new": v_new, "keys": keys,
               "block_table": table, "inv_freq": inv, "k_cache": k_cache, "v_cache": v_cache,
               **scalars}
    for name, t in tensors.items():
        ctx.set_input_shape(name, tuple(t.shape))
        ctx.set_tensor_address(name, t.data_ptr())
    for out, inp in side["aliases"].items():
        ctx.set_tensor_address(out, tensors[inp].data_ptr())  # aliased: same buffer
    stream = torch.cuda.current_stream()
    if not ctx.execute_async_v3(stream.cuda_stream):
        raise SystemExit("execute_async_v3 failed")
    stream.synchronize()

    checks = {
        "store bit-exact (written and untouched rows)": torch.equal(
            store.view(torch.int16), store_ref.view(torch.int16)),
        "v_cache bit-exact (written and untouched slots)": torch.equal(
            v_cache.view(torch.int16), v_ref.view(torch.int16)),
        "k_cache non-rotary columns and untouched slots bit-exact": torch.equal(
            k_cache[..., rd:].contiguous().view(torch.int16),
            k_ref[..., rd:].contiguous().view(torch.int16)),
    }
    rows = torch.arange(start_row, start_row + n, device=dev)
    slots = table.long()[rows // P] * P + rows % P
    kf, kr = k_cache.view(-1, hkv, hd), k_ref.view(-1, hkv, hd)
    checks["k_cache rotary columns within one 16-bit rounding"] = close_16bit(
        kf[slots, :, :rd], kr[slots, :, :rd])
    untouched = torch.ones(kf.shape[0], dtype=torch.bool, device=dev)
    untouched[slots] = False
    checks["k_cache untouched slots bit-exact"] = torch.equal(
        kf[untouched].view(torch.int16), kr[untouched].view(torch.int16))
    checks["plugin module not imported"] = "trtllm_mtp_carry.plugins" not in sys.modules
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} trt engine: {what} (n={n}, H={H}, Hkv={hkv}, D={hd})")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
