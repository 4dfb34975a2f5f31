#!/usr/bin/env python3
"""Time the data plane's two kernels against plain-torch baselines on the device found.

What it is for: a quick check that the kernels run near memory bandwidth. For
each kernel it prints the time per call, the effective bandwidth (bytes read +
written per second) and the ratio to a large device-to-device copy measured in
the same run. On CUDA "ours" is the Triton kernel (through the custom op); on
CPU the custom op runs the plain-torch reference.

Baselines: `index_copy_` for the hidden-row copy; for the drafter-row append,
gather (block table -> slots, cos/sin cache rows) + RoPE + scatter (`index_copy_`).

Bytes counted: copy 2*n*hidden*2; append reads K,V and keys and writes K,V
(block table and frequency table are ignored).

Usage: python scripts/bench_kernels.py [--rows N] [--hidden H] [--reps R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.dataplane.ops import drafter_row_append, hidden_row_copy  # noqa: E402
from trtllm_mtp_carry.dataplane.rope import rope_inv_freq  # noqa: E402


def timeit(fn, reps: int, device: torch.device) -> float:
    """Median seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def big_copy_seconds(nbytes: int, reps: int, device: torch.device) -> float:
    """Seconds per call of one `nbytes` device-to-device copy (buffers freed after)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    return timeit(lambda: b.copy_(a), reps, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=None, help="rows per call (default: 4096 cuda, 1024 cpu)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-Next: 2048)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--rotary-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="timed reps (default: 50 cuda, 5 cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: on a shared CPU, OpenMP waits dominate)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    n = args.rows or (4096 if cuda else 1024)
    reps = args.reps or (50 if cuda else 5)
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    impl = "triton" if cuda else "reference"
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device={device} ({name}) rows={n} reps={reps}")

    # Large device-to-device copy: the bandwidth ceiling of this run.
    big = (256 if cuda else 32) << 20
    t = big_copy_seconds(big, reps, device)
    ceiling = 2 * big / t
    print(f"{'d2d copy (' + str(big >> 20) + ' MiB)':48s} {t * 1e6:10.1f} us  {ceiling / 1e9:8.2f} GB/s  1.00")

    def report(name: str, secs: float, nbytes: int) -> None:
        bw = nbytes / secs
        print(f"{name:48s} {secs * 1e6:10.1f} us  {bw / 1e9:8.2f} GB/s  {bw / ceiling:4.2f}")

    # hidden_row_copy: store rows [start, start + n) -> contiguous append input.
    h = args.hidden
    cap = 4 * n
    store = torch.randn(cap, h, generator=g).to(bf16).to(device)
    out = torch.empty(n, h, dtype=bf16, device=device)
    start = n + 3
    idx = torch.arange(n, device=device)
    copy_bytes = 2 * n * h * 2
    report(f"hidden_row_copy ({impl})", timeit(lambda: hidden_row_copy(store, start, out, 0, n), reps, device), copy_bytes)
    src_view = store[start : start + n]
    report("hidden_row_copy baseline index_copy_",
           timeit(lambda: out.index_copy_(0, idx, src_view), reps, device), copy_bytes)

    # drafter_row_append: n rows, RoPE on K at key + 1, scattered through a shuffled block table.
    hkv, d, rd, bs = args.kv_heads, args.head_dim, args.rotary_dim, args.block_size
    nblocks = 2 * ((n + bs - 1) // bs) + 1
    k_cache = torch.zeros(nblocks, bs, hkv, d, dtype=bf16, device=device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(nblocks, generator=g)[: (n + bs - 1) // bs + 1].to(torch.int32).to(device)
    k = torch.randn(n, hkv, d, generator=g).to(bf16).to(device)
    v = torch.randn(n, hkv, d, generator=g).to(bf16).to(device)
    keys = (torch.arange(n) * 2 + 100).to(device)
    row0 = 5
    append_bytes = 4 * n * hkv * d * 2 + 8 * n
    report(f"drafter_row_append ({impl})",
           timeit(lambda: drafter_row_append(k, v, keys, k_cache, v_cache, table, row0, rd, 1e7), reps, device),
           append_bytes)

    # Baseline: precomputed cos/sin cache (as engines keep it), gathered per position.
    max_pos = int(keys.max()) + 2
    ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * rope_inv_freq(rd, 1e7, device)
    cos_cache, sin_cache = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    rows = torch.arange(row0, row0 + n, device=device)

    def baseline() -> None:
        slots = table.long()[rows // bs] * bs + rows % bs
        pos = keys + 1
        cos, sin = cos_cache[pos][:, None, :], sin_cache[pos][:, None, :]
        x = k[..., :rd].float()
        rot = torch.cat([-x[..., rd // 2 :], x[..., : rd // 2]], -1)
        kr = torch.cat([(x * cos + rot * sin).to(bf16), k[..., rd:]], -1)
        kf.index_copy_(0, slots, kr)
        vf.index_copy_(0, slots, v)

    report("drafter_row_append baseline gather+rope+scatter", timeit(baseline, reps, device), append_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
