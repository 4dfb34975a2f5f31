#!/usr/bin/env python3
"""The data plane's two kernels against torch baselines: per-call cost and kernel bandwidth.

What it is for: the figures issue 36 sets targets for, at Qwen3-Next's shapes
(hidden 2048; drafter KV Hkv=2, D=256, rotary 64; bf16), per row count
(default 512, 4k, 64k, 256k rows), for `hidden_row_copy` and `drafter_row_append`
on every backend found (`op`: what the store and the pools call, `ops.*_direct`
with the default backend; `triton-kernel`: the Triton copy kernel itself; `aot`:
the TensorRT plugins' PTX through the CUDA driver, where cuda-python and a
compiler for the PTX are present):

- per call, CPU side included (sync, call, sync: what a warm turn pays on the
  executor's critical path), paired sample by sample with one torch
  `index_copy_` of the same bytes (the copy: the n rows; the append: its K and
  V rows through one flat index). Target at 512 rows: <= 1.5x index_copy_.
- kernel time: a CUDA graph of `--launches` calls replayed and timed with CUDA
  events (Python launch cost not counted), paired round by round with a
  device-to-device copy of the same bytes in the same run; reported as the
  fraction of that copy's bandwidth. Target from 64k rows up: >= 0.85.

Method: one process, warm-up first (compiles, caches), medians and IQR of the
paired ratios. The appends run with `check_data=False`, as the pools call them.
Besides the human table it prints `FIGURE<TAB>name<TAB>value<TAB>target<TAB>verdict`
lines (the GPU figures convention; `scripts/gpu_smoke.sh` collects them). On a
CPU the same loops run (kernel time = wall time against a CPU copy) and every
verdict is INFO: the targets are GPU targets.

Usage: python3 scripts/bench_kernels.py [--rows 512 4096 65536 262144] [--reps 100]
       [--rounds 7] [--launches 20] [--backends op triton-kernel aot]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.dataplane import ops  # noqa: E402

BACKENDS = ("op", "triton-kernel", "aot")
PER_CALL_TARGET = 1.5  # x one index_copy_ of the same bytes, at 512 rows
BW_TARGET = 0.85  # of the same-run D2D copy, from 64k rows up
BW_FROM_ROWS = 65536


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of the samples."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def per_call(ours: Callable[[], None], base: Callable[[], None], reps: int,
             cuda: bool) -> tuple[list[float], list[float]]:
    """Seconds per call (sync, call, sync), paired sample by sample, after warm-up."""
    def once(fn: Callable[[], None]) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):
        once(ours)
        once(base)
    a, b = [], []
    for _ in range(reps):
        a.append(once(ours))
        b.append(once(base))
    return a, b


def kernel_times(ours: Callable[[], None], d2d: Callable[[], None], rounds: int, launches: int,
                 cuda: bool) -> tuple[list[float], list[float], str]:
    """Seconds per launch of the kernels alone: CUDA graphs of `launches` calls, paired rounds."""
    def replay_of(fn: Callable[[], None]) -> tuple[Callable[[], None], str]:
        fn()
        if not cuda:
            return fn, "wall"
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(launches):
                    fn()
            return g.replay, "cuda-graph"
        except Exception as e:  # noqa: BLE001 - the method is reported with the figure
            torch.cuda.synchronize()

            def plain() -> None:
                for _ in range(launches):
                    fn()
            return plain, f"events, graph capture failed ({type(e).__name__})"

    (ro, how), (rd, _) = replay_of(ours), replay_of(d2d)
    per = launches if cuda else 1
    a, b = [], []
    for _ in range(2):
        ro()
        rd()
    for _ in range(rounds):
        for fn, out in ((ro, a), (rd, b)):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) * 1e-3 / per)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return a, b, how


def rows_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def figure(name: str, value: str, target: str, verdict: str) -> None:
    print(f"FIGURE\t{name}\t{value}\t{target}\t{verdict}", flush=True)


@contextlib.contextmanager
def backend_env(backend: str) -> Iterator[None]:
    """`TRTLLM_MTP_CARRY_KERNELS` set for the backend (`aot`) or unset, restored after.

    Set around a whole measurement, not per call, so the timings hold no environment writes.
    """
    old = os.environ.get(ops.KERNELS_ENV)
    if backend == "aot":
        os.environ[ops.KERNELS_ENV] = "aot"
    else:
        os.environ.pop(ops.KERNELS_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ops.KERNELS_ENV, None)
        else:
            os.environ[ops.KERNELS_ENV] = old


def aot_available(device: torch.device) -> str | None:
    """None when the AOT backend can run here, else why not."""
    if device.type != "cuda":
        return "no CUDA device"
    try:
        from trtllm_mtp_carry.kernels import aot_launcher

        aot_launcher._driver()
        aot_launcher.target_of(device)
    except (RuntimeError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def report(kernel: str, backend: str, n: int, nbytes: int, cuda: bool,
           calls: tuple[list[float], list[float]],
           ktimes: tuple[list[float], list[float], str]) -> None:
    """Human lines and FIGURE lines of one (kernel, backend, rows) cell."""
    ours, base = calls
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    q1, med, q3 = quartiles(ratios)
    o_med, b_med = statistics.median(ours), statistics.median(base)
    print(f"{kernel:20s} {backend:14s} {rows_name(n):>5s} rows  per call {o_med * 1e6:9.1f} us"
          f"  index_copy_ {b_med * 1e6:9.1f} us  x{med:.2f} (IQR {q1:.2f}-{q3:.2f})", flush=True)
    k, d, how = ktimes
    bw = [dd / kk for kk, dd in zip(k, d, strict=True)]
    b1, bmed, b3 = quartiles(bw)
    k_med = statistics.median(k)
    print(f"{'':20s} {'':14s} {'':>5s}       kernel   {k_med * 1e6:9.1f} us"
          f"  {nbytes / k_med / 1e9:8.1f} GB/s  {bmed:.2f} of D2D (IQR {b1:.2f}-{b3:.2f}; {how})",
          flush=True)
    name = f"kernels {kernel} {backend} {rows_name(n)} rows"
    if n == 512:
        verdict = ("PASS" if med <= PER_CALL_TARGET else "MISS") if cuda else "INFO"
        figure(f"{name} per call", f"x{med:.2f} index_copy_ ({o_med * 1e6:.1f} vs {b_med * 1e6:.1f} us,"
               f" IQR x{q1:.2f}-{q3:.2f})", f"<= {PER_CALL_TARGET}x index_copy_", verdict)
    if n >= BW_FROM_ROWS:
        verdict = ("PASS" if bmed >= BW_TARGET else "MISS") if cuda and how == "cuda-graph" else "INFO"
        figure(f"{name} kernel BW", f"{bmed:.2f} of D2D (IQR {b1:.2f}-{b3:.2f})",
               f">= {BW_TARGET} of D2D", verdict)


def bench_copy(n: int, args: argparse.Namespace, device: torch.device, backends: list[str],
               g: torch.Generator) -> None:
    cuda = device.type == "cuda"
    bf16 = torch.bfloat16
    H = args.hidden
    reps, rounds, launches = args.reps, args.rounds, args.launches

    # hidden_row_copy: store rows [3, 3 + n) -> a contiguous buffer (what HiddenStore.read does).
    store = torch.randn(n + 64, H, dtype=bf16, device=device)  # made on the device: fast
    out = torch.empty(n, H, dtype=bf16, device=device)
    idx = torch.arange(n, device=device)
    src_view = store[3 : 3 + n]
    flat_src, flat_dst = src_view.reshape(-1), torch.empty(n * H, dtype=bf16, device=device)
    copy_bytes = 2 * n * H * 2
    base = lambda: out.index_copy_(0, idx, src_view)  # noqa: E731
    d2d = lambda: flat_dst.copy_(flat_src)  # noqa: E731
    from trtllm_mtp_carry.dataplane import triton_kernels as tk

    for backend in backends:
        if backend == "triton-kernel":
            fn = lambda: tk.hidden_row_copy_triton(store, 3, out, 0, n)  # noqa: E731
        else:
            fn = lambda: ops.hidden_row_copy_direct(store, 3, out, 0, n)  # noqa: E731
        with backend_env(backend):
            report("hidden_row_copy", backend, n, copy_bytes, cuda, per_call(fn, base, reps, cuda),
                   kernel_times(fn, d2d, rounds, launches, cuda))


def bench_append(n: int, args: argparse.Namespace, device: torch.device, backends: list[str],
                 g: torch.Generator) -> None:
    cuda = device.type == "cuda"
    bf16 = torch.bfloat16
    reps, rounds, launches = args.reps, args.rounds, args.launches
    # drafter_row_append: n rows, RoPE at key + 1, through a shuffled block table, mid-block start.
    hkv, d, rd, bs = args.kv_heads, args.head_dim, args.rotary_dim, args.block_size
    row0 = 5
    nblocks = (row0 + n + bs - 1) // bs
    k_cache = torch.zeros(2 * nblocks + 1, bs, hkv, d, dtype=bf16, device=device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(2 * nblocks + 1, generator=g)[:nblocks].to(torch.int32).to(device)
    k = torch.randn(n, hkv, d, dtype=bf16, device=device)
    v = torch.randn(n, hkv, d, dtype=bf16, device=device)
    keys = (torch.arange(n) * 2 + 100).to(device)
    keys32 = keys.to(torch.int32)
    rows = torch.arange(row0, row0 + n)
    slots = (table.cpu().long()[rows // bs] * bs + rows % bs).to(device)
    kv_rows = torch.cat([k.reshape(n, -1), v.reshape(n, -1)])  # [2n, Hkv*D]: the same bytes
    kv_flat = torch.empty(2 * k_cache.shape[0] * bs, hkv * d, dtype=bf16, device=device)
    kv_idx = torch.cat([slots, slots + k_cache.shape[0] * bs])
    kv_out = torch.empty_like(kv_rows)
    append_bytes = 4 * n * hkv * d * 2
    base = lambda: kv_flat.index_copy_(0, kv_idx, kv_rows)  # noqa: E731
    d2d = lambda: kv_out.copy_(kv_rows)  # noqa: E731
    for backend in backends:
        if backend == "triton-kernel":
            continue  # the op's default append backend is the Triton kernel already
        keys_b = keys32 if backend == "aot" else keys
        fn = lambda kb=keys_b: ops.drafter_row_append_direct(  # noqa: E731
            k, v, kb, k_cache, v_cache, table, row0, rd, 1e7, False)
        label = backend if backend != "op" else ("triton" if cuda else "reference")
        with backend_env(backend):
            report("drafter_row_append", label, n, append_bytes, cuda, per_call(fn, base, reps, cuda),
                   kernel_times(fn, d2d, rounds, launches, cuda))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 4096, 65536, 262144])
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-Next: 2048)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--rotary-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="per-call samples (default 100 cuda, 5 cpu)")
    p.add_argument("--rounds", type=int, default=7, help="paired kernel-time rounds")
    p.add_argument("--launches", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="default: op and triton-kernel, plus aot where it can run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    for n in args.rows:
        if n < 1:
            p.error(f"--rows must be >= 1, got {n}")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    args.reps = args.reps or (100 if cuda else 5)
    why_not_aot = aot_available(device)
    backends = args.backends or (["op", "triton-kernel"] + ([] if why_not_aot else ["aot"]))
    if "aot" in backends and why_not_aot:
        print(f"aot backend skipped: {why_not_aot}", flush=True)
        backends = [b for b in backends if b != "aot"]
    if not cuda and "triton-kernel" in backends and os.environ.get("TRITON_INTERPRET") != "1":
        backends = [b for b in backends if b != "triton-kernel"]  # Triton needs a GPU here
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device={device} ({name}) rows={args.rows} backends={backends} reps={args.reps} "
          f"rounds={args.rounds} launches/graph={args.launches}", flush=True)
    if why_not_aot and cuda:
        print(f"aot: {why_not_aot}")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for n in args.rows:
        bench_copy(n, args, device, backends, g)
        if cuda:
            torch.cuda.empty_cache()
        bench_append(n, args, device, backends, g)
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
