"""Time the carry store's host tier copies: demote (device -> host) and restore (host -> device).

One carried entry of R rows of Qwen3-Next's MTP layer (2 KV heads x 256, K and V,
bf16: 2,048 bytes a row) in a `DrafterKVPool` of 16-row blocks, moved the way the
reference runtime's host tier moves it (`PoolHostMoves`): `demote` copies its
blocks to host memory (`export_carried`, pinned on CUDA) and frees them;
`restore` allocates fresh blocks and copies them back (`import_carried`). On the
CPU both are memory-to-memory copies; on CUDA the demote is timed to the end of
its device-to-host copy and the restore to the end of its host-to-device copy
(both synchronized, so the figure is the copy, not its launch). Each figure is
the median and p25-p75 of `--repeat` pairs in ms after `--warmup` pairs, with the
rate in GB/s of the entry's bytes. The rows are checked bit for bit after every
round trip.

    python scripts/bench_host_tier.py [--rows 1024 8192 32768] [--repeat 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.runtime.host_moves import PoolHostMoves

BLOCK, HEADS, HEAD_DIM, KEY = 16, 2, 256, 0x5EED


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(rows: int, repeat: int, warmup: int, device: torch.device) -> dict[str, float]:
    blocks = -(-rows // BLOCK)
    pool = DrafterKVPool(blocks + 1, BLOCK, HEADS, HEAD_DIM, RopeConfig.for_qwen3_next(HEAD_DIM),
                         device=device)
    pool.allocate_sequence(1)
    keys = torch.arange(rows, dtype=torch.int64, device=device)
    k = torch.randn(rows, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    v = torch.randn(rows, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    pool.append_rows(1, keys, k, v)
    pool.move_to_carried(1, KEY)
    held = pool.carried(KEY)
    assert held is not None
    entry = CarriedDrafter(held.block_table, rows, rows - 1, list(range(rows + 1)), KEY)
    before = [t.clone() for t in pool.gather_carried(KEY)]
    moves = PoolHostMoves(pool)
    demote, restore = [], []
    for i in range(warmup + repeat):
        _sync(device)
        t0 = time.perf_counter()
        assert moves.demote(entry)
        _sync(device)
        t1 = time.perf_counter()
        entry = moves.restore(entry)
        moves.ready(KEY)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            demote.append((t1 - t0) * 1e3)
            restore.append((t2 - t1) * 1e3)
        after = pool.gather_carried(KEY)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "rows changed"
    nbytes = blocks * pool.block_nbytes
    out: dict[str, float] = {"rows": rows, "mib": nbytes / 2**20}
    for name, xs in (("demote", demote), ("restore", restore)):
        q = statistics.quantiles(xs, n=4)
        med = statistics.median(xs)
        out |= {f"{name}_ms": med, f"{name}_p25": q[0], f"{name}_p75": q[2],
                f"{name}_gbps": nbytes / (med / 1e3) / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"host tier copies on {name} ({torch.get_num_threads()} CPU threads), torch {torch.__version__}; "
          f"median [p25-p75] ms of {args.repeat} round trips after {args.warmup} warm-up")
    print(f"{'rows':>7} {'MiB':>7} {'demote ms':>22} {'GB/s':>6} {'restore ms':>22} {'GB/s':>6}")
    for rows in args.rows:
        r = measure(rows, args.repeat, args.warmup, device)
        print(f"{rows:>7} {r['mib']:>7.1f} "
              f"{r['demote_ms']:>8.3f} [{r['demote_p25']:.3f}-{r['demote_p75']:.3f}] {r['demote_gbps']:>6.2f} "
              f"{r['restore_ms']:>8.3f} [{r['restore_p25']:.3f}-{r['restore_p75']:.3f}] {r['restore_gbps']:>6.2f}")


if __name__ == "__main__":
    main()
