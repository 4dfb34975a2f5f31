#!/usr/bin/env python3
"""Throughput of the FP8 row format's pack and unpack against a plain copy of the same bytes.

What it is for: issue 31's kernel benchmark. A carried entry is packed once when
it is deposited and unpacked once when it is adopted; this says what each costs
next to copying the bf16 rows, the least a bf16 carry does.

Pairs, one process: every repetition runs each operation once, in an order
rotated from one repetition to the next (no operation always runs first), after
`--warmup` untimed rounds; each operation's ratio to the copy is taken within
its repetition, then the median and the interquartile range (p25-p75) over the
repetitions are printed. Throughput is bytes of bf16 rows per second (rows
`[keys, 2, Hkv, D]`, the same bytes for every line), so a line's GB/s compares
directly with the copy's.

Operations (`kernel`: Triton on CUDA, plain torch on CPU, as `row_format` picks):
- `copy`            dst.copy_(rows): the baseline, bf16 rows to bf16 rows;
- `pack_rows`       rows -> payload + scales;
- `unpack_rows`     payload + scales -> bf16 rows (into a preallocated out);
- `gather_rows`     TensorRT-LLM HND pages -> bf16 rows (the bf16 carry's gather);
- `gather_packed`   HND pages -> packed rows (the fp8 carry's gather);
- `scatter_rows`    bf16 rows -> HND pages (the bf16 carry's adopt);
- `scatter_packed`  packed rows -> HND pages (the fp8 carry's adopt);
- `select_blocks`   the reference pool's K and V blocks -> bf16 copies (`index_select`, what
                    `DrafterKVPool.export_carried` copies);
- `pack_blocks`     the pool's blocks -> packed rows (the reference runtime's fp8 deposit);
- `unpack_blocks`   packed rows -> whole K and V blocks (its fp8 adoption, before the copy in).

Usage: python scripts/bench_row_format.py [--keys N] [--kv-heads H] [--head-dim D] [--reps R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.dataplane.row_format import (  # noqa: E402
    pack_blocks,
    pack_rows,
    row_kernel,
    unpack_blocks,
    unpack_rows,
)
from trtllm_mtp_carry.trtllm.layout import (  # noqa: E402
    gather_packed_rows,
    gather_rows,
    scatter_packed_rows,
    scatter_rows,
)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75) by `statistics.quantiles` (inclusive method)."""
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def run_pairs(ops: dict[str, Callable[[], object]], reps: int, warmup: int,
              device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each op, one call each per repetition, order rotated each repetition."""
    names = list(ops)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for name in names:
            ops[name]()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sync()
            t0 = time.perf_counter()
            ops[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=4096, help="carried keys (rows) per call (default 4096)")
    p.add_argument("--kv-heads", type=int, default=2, help="drafter KV heads (Qwen3-Next: 2)")
    p.add_argument("--head-dim", type=int, default=256, help="head dim (Qwen3-Next: 256)")
    p.add_argument("--tokens-per-block", type=int, default=32, help="TensorRT-LLM page size in keys")
    p.add_argument("--pool-block-size", type=int, default=16, help="reference pool rows per block")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 200 cuda, 41 cpu)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: on a shared CPU, OpenMP waits dominate)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    reps = args.reps or (200 if cuda else 41)
    n, hkv, d, tpb = args.keys, args.kv_heads, args.head_dim, args.tokens_per_block
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    rows = torch.randn(n, 2, hkv, d, generator=g).to(bf16).to(device)
    dst = torch.empty_like(rows)
    packed = pack_rows(rows)
    # draft pages: a shuffled page list over twice the pages needed, keys start mid-page
    lo = tpb // 2
    npages = -(-(lo + n) // tpb)
    buf = torch.randn(2 * npages, 2, hkv, tpb, d, generator=g).to(bf16).to(device)
    pages = torch.randperm(2 * npages, generator=g)[:npages].tolist()

    # the reference runtime's pool: K and V caches of blocks, an entry's blocks shuffled
    bs = args.pool_block_size
    nblocks = -(-n // bs)
    k_cache = torch.randn(2 * nblocks, bs, hkv, d, generator=g).to(bf16).to(device)
    v_cache = torch.randn(2 * nblocks, bs, hkv, d, generator=g).to(bf16).to(device)
    block_ids = torch.randperm(2 * nblocks, generator=g)[:nblocks].tolist()
    block_idx = torch.tensor(block_ids, device=device)

    ops: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(rows),
        "pack_rows": lambda: pack_rows(rows),
        "unpack_rows": lambda: unpack_rows(packed, out=dst),
        "gather_rows": lambda: gather_rows(buf, pages, lo, lo + n),
        "gather_packed": lambda: gather_packed_rows(buf, pages, lo, lo + n),
        "scatter_rows": lambda: scatter_rows(buf, pages, lo, rows),
        "scatter_packed": lambda: scatter_packed_rows(buf, pages, lo, packed),
        "select_blocks": lambda: (k_cache.index_select(0, block_idx), v_cache.index_select(0, block_idx)),
        "pack_blocks": lambda: pack_blocks(k_cache, v_cache, block_ids, n),
        "unpack_blocks": lambda: unpack_blocks(packed, bs),
    }
    times = run_pairs(ops, reps, args.warmup, device)

    nbytes = rows.numel() * rows.element_size()
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device={device} ({name}) kernel={row_kernel(rows)} torch={torch.__version__}")
    print(f"rows [{n}, 2, {hkv}, {d}] bf16 = {nbytes / 2**20:.2f} MiB; packed {packed.nbytes / 2**20:.2f} MiB "
          f"({packed.nbytes / nbytes:.3f}x); reps={reps} warmup={args.warmup}, order rotated per rep")
    print(f"{'operation':16s} {'median us':>10s} {'IQR us':>17s} {'GB/s':>8s}   {'/copy time: median [p25, p75]':s}")
    base = times["copy"]
    for op, ts in times.items():
        q1, med, q3 = quartiles(ts)
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        r1, rm, r3 = quartiles(ratios)
        print(f"{op:16s} {med * 1e6:10.1f} {q1 * 1e6:8.1f}-{q3 * 1e6:<8.1f} {nbytes / med / 1e9:8.2f}   "
              f"{rm:6.2f} [{r1:.2f}, {r3:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
