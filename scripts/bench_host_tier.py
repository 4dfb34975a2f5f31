"""Time the carry store's host tier copies: demote (device -> host) and restore (host -> device).

One carried entry of R rows of Qwen3-Next's MTP layer (2 KV heads x 256, K and V,
bf16: 2,048 bytes a row) in a `DrafterKVPool` of 16-row blocks, moved the way the
carry's one host tier moves it for the reference runtime (`service.host_tier.HostTier`
over a `PoolHome`): `demote` copies its blocks to host memory (`export_carried`, into
the tier's pinned arena on CUDA) and frees them; `restore` allocates fresh blocks and
copies them back (`import_carried`, on the tier's side stream). On the
CPU both are memory-to-memory copies; on CUDA the demote is timed to the end of
its device-to-host copy and the restore to the end of its host-to-device copy
(both synchronized, so the figure is the copy, not its launch). Each figure is
the median and p25-p75 of `--repeat` pairs in ms after `--warmup` pairs, with the
rate in GB/s of the entry's bytes. The rows are checked bit for bit after every
round trip.

The ceiling, in the same run and the same rounds: a plain `copy_` of the same bytes
between a device tensor and a pinned host tensor, each direction (`d2h`, `h2d`),
synchronized the same way, so each copy's rate is a fraction of what the host link
gives here. The same host tier over the TensorRT-LLM adapter's home (`ArenaHome`: the
entry's `[rows, 2, Hkv, D]` bf16 rows in the carry's device arena, as installed) is timed
the same way on the same bytes (`a_demote`, `a_restore`).

Pinned memory: every pinned buffer here is registered for exactly its bytes: each host
tier is one arena of its host budget (`dataplane/arena.py`, `host_tier.host_arena`), the
ceiling's buffer `pinned.pinned_empty`.

Headline lines (tab-separated; scripts/gpu_smoke.sh collects them), per size:
  FIGURE host tier <move> at <MiB>: the move's rate over the same-run pinned copy's,
         target >= 0.85 (PASS/MISS on CUDA; INFO on the CPU, where no host link is crossed).
  CHECK  pinned bytes held equal the budgets at <MiB>: the bytes registered while the moves
         run are exactly the two host tiers' budgets and the ceiling's buffer (0 on the CPU),
         the host tier reports its budget (`pinned_bytes`), and torch's
         pinned pool does not grow by a host copy after a demotion.

    python scripts/bench_host_tier.py [--rows 1024 8192 32768] [--repeat 30] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane import pinned
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.dataplane.row_codec import RowCodec, Rows, codec_for
from trtllm_mtp_carry.service import CarryService
from trtllm_mtp_carry.service.homes import ArenaHome, PoolHome, Runs
from trtllm_mtp_carry.service.host_tier import HostTier, host_arena

BLOCK, HEADS, HEAD_DIM, KEY = 16, 2, 256, 0x5EED
#: Target (issue 36): each host-tier move at >= 0.85 of the same-run pinned copy of the same bytes.
CEILING_FRACTION = 0.85


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RowsInHand:
    """Rows `[n, 2, Hkv, D]` standing for a request's pages (the adapter's deposit gathers keys [0, n))."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        codec.copy_(out, self.rows)


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
    nbytes = blocks * pool.block_nbytes
    cuda = device.type == "cuda"
    gc.collect()  # an earlier size's buffers unregister now, not while this one counts
    registered0 = pinned.registered_bytes()
    # a host budget of the entry: its arena, pinned on CUDA
    moves = HostTier(PoolHome(pool), host_arena(nbytes, device))  # type: ignore[arg-type]
    # the ceiling: the same bytes between a device tensor and a pinned host tensor
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = pinned.pinned_empty(nbytes) if cuda else torch.empty(nbytes, dtype=torch.uint8)
    # the adapter's home on the same bytes: one entry's rows [rows, 2, Hkv, D], in its device arena
    home = ArenaHome(codec_for("bf16", torch.bfloat16), Arena.reserve(nbytes, device), HEADS, HEAD_DIM)
    adapter = CarryService(home, slots=None, budget_bytes=nbytes, eviction="lrd", idle_s=None,
                           host_arena=host_arena(nbytes, device))
    assert adapter.host is not None
    a_moves = adapter.host
    expected = 3 * nbytes if cuda else 0  # the two host tiers' arenas, the ceiling's buffer
    registered = pinned.registered_bytes() - registered0
    pool0 = pinned.held()["torch_pool"]
    pool_growth = 0
    a_rows = torch.randn(blocks * BLOCK, 2, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    tokens = list(range(a_rows.shape[0] + 1))
    plan = adapter.plan_deposit(KEY, None, a_rows.shape[0])
    assert plan is not None and adapter.deposit(plan, _RowsInHand(a_rows), ((0, a_rows.shape[0]),), tokens)
    a_entry = adapter.store.get(KEY)
    assert a_entry is not None  # held on the device; the moves below are its host tier's own
    times: dict[str, list[float]] = {k: [] for k in ("d2h", "h2d", "demote", "restore", "a_demote", "a_restore")}

    def timed(name: str, i: int, fn: object) -> None:
        _sync(device)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        if i >= warmup:
            times[name].append((time.perf_counter() - t0) * 1e3)

    def pool_demote() -> None:
        nonlocal pool_growth
        moves.demote(entry)
        pool_growth = max(pool_growth, pinned.held()["torch_pool"] - pool0)  # while the host copy lives

    def pool_restore() -> None:
        nonlocal entry
        entry = moves.restore(entry)
        moves.ready(KEY)

    def adapter_restore() -> None:
        a_moves.restore(a_entry)
        a_moves.ready(KEY)

    for i in range(warmup + repeat):
        timed("d2h", i, lambda: host_buf.copy_(dev_buf, non_blocking=True))
        timed("demote", i, pool_demote)
        timed("h2d", i, lambda: dev_buf.copy_(host_buf, non_blocking=True))
        timed("restore", i, pool_restore)
        timed("a_demote", i, lambda: a_moves.demote(a_entry))
        timed("a_restore", i, adapter_restore)
        after = pool.gather_carried(KEY)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "rows changed"
    assert torch.equal(home.rows(KEY), a_rows), "adapter rows changed"  # type: ignore[arg-type]
    out: dict[str, float] = {"rows": rows, "mib": nbytes / 2**20, "registered": registered,
                             "registered_expected": expected, "host_tier_pinned": moves.pinned_bytes,
                             "host_tier_budget": nbytes if cuda else 0, "torch_pool_growth": pool_growth}
    for name, xs in times.items():
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
    print("moves: demote/restore = the host tier over the reference runtime's pool (PoolHome), "
          "a_demote/a_restore = over the TensorRT-LLM adapter's arena (ArenaHome); d2h/h2d = a pinned "
          "copy_ of the same bytes (the ceiling)")
    print(f"{'rows':>7} {'MiB':>7} {'move':>10} {'ms [p25-p75]':>24} {'GB/s':>7} {'/ceiling':>9}")
    figures, checks = [], []
    for rows in args.rows:
        r = measure(rows, args.repeat, args.warmup, device)
        for name, ceiling in (("d2h", "d2h"), ("demote", "d2h"), ("a_demote", "d2h"),
                              ("h2d", "h2d"), ("restore", "h2d"), ("a_restore", "h2d")):
            frac = r[f"{name}_gbps"] / r[f"{ceiling}_gbps"]
            print(f"{rows:>7} {r['mib']:>7.1f} {name:>10} {r[f'{name}_ms']:>9.3f} "
                  f"[{r[f'{name}_p25']:.3f}-{r[f'{name}_p75']:.3f}] {r[f'{name}_gbps']:>7.2f} {frac:>9.2f}")
            if name != ceiling:
                ok = frac >= CEILING_FRACTION if device.type == "cuda" else None
                figures.append("\t".join((
                    "FIGURE", f"host tier {name} at {r['mib']:.1f} MiB / pinned {ceiling} copy",
                    f"{frac:.2f}x ({r[f'{name}_gbps']:.1f} of {r[f'{ceiling}_gbps']:.1f} GB/s)",
                    f">= {CEILING_FRACTION}x copy", "INFO" if ok is None else "PASS" if ok else "MISS")))
        ok = (r["registered"] == r["registered_expected"] and r["host_tier_pinned"] == r["host_tier_budget"]
              and r["torch_pool_growth"] < r["mib"] * 2**20)
        checks.append("\t".join((
            "CHECK", f"pinned bytes held equal the budgets at {r['mib']:.1f} MiB", "PASS" if ok else "FAIL",
            f"registered {int(r['registered'])} B, expected {int(r['registered_expected'])} (two host tier "
            f"arenas, ceiling buffer); host tier pinned_bytes {int(r['host_tier_pinned'])} of "
            f"budget {int(r['host_tier_budget'])}; torch pinned pool grew {int(r['torch_pool_growth'])} B "
            f"after a demotion ({device.type})")))
    for line in figures + checks:
        print(line)
    if any("\tFAIL\t" in line for line in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
