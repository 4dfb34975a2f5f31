#!/usr/bin/env python3
"""The host tier's copy back, read back: rows restored from host memory equal the demoted ones,
bit for bit, read on the current stream with no sync first, with and without delays queued on
each stream (`torch.cuda._sleep`) to widen any race window (issue 42, item 2).

Greedy verification repairs any draft, so identical outputs prove nothing about restored rows:
this reads them. The carry's one host tier (`service.host_tier.HostTier`) over each device home,
as a session runs it:
- the reference runtime's pool (`PoolHome`: the pool's blocks exported to host memory, freed,
  imported back into fresh blocks on a side stream; `ready` orders the current stream after it);
- the TensorRT-LLM adapter's arena (`ArenaHome`: bf16 and fp8 rows demoted to the host tier,
  adopted back through the service, copied on a side stream; the adoption orders the reader).
With delays: one on the current stream before the blocks' previous owner's last write (a poison
fill the copy back must follow), one on the side stream right before the copy back (the reader
must wait for it). On the CPU the copies are synchronous and no delay is queued; the same
comparisons run. Prints `CHECK` lines for scripts/gpu_smoke.sh; exit 1 on a mismatch.

    python3 scripts/gpu_check_restore.py [--device cuda] [--delay-cycles 20000000]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import ExitStack

import torch

from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.dataplane.row_codec import RowCodec, Rows, codec_for
from trtllm_mtp_carry.dataplane.row_format import pack_rows
from trtllm_mtp_carry.service import CarryService
from trtllm_mtp_carry.service.homes import ArenaHome, PoolHome, Runs
from trtllm_mtp_carry.service.host_tier import HostTier, host_arena

H, D, B = 2, 128, 16


class Delays:
    """`torch.cuda._sleep(cycles)` on the current stream (CUDA with cycles > 0; else nothing)."""

    def __init__(self, device: torch.device, cycles: int) -> None:
        self.on = device.type == "cuda" and cycles > 0
        self.cycles = cycles

    def __call__(self) -> None:
        if self.on:
            torch.cuda._sleep(self.cycles)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def pool_restore(device: torch.device, delay: Delays, gen: torch.Generator, rows: int) -> tuple[bool, str]:
    """Demote a pool entry, poison the freed blocks (delayed on the current stream), restore it
    (its copy delayed on the side stream), `ready`, read it back unsynced: equal?"""
    pool = DrafterKVPool(2 * (rows // B + 2), B, H, D, RopeConfig(D, D // 4, 1e6), device=device)
    pool.allocate_sequence(1)
    k = torch.randn(rows, H, D, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(rows, H, D, generator=gen).to(torch.bfloat16).to(device)
    pool.append_rows(1, torch.arange(rows), k, v)
    pool.move_to_carried(1, 5)
    held = pool.carried(5)
    truth = [t.clone() for t in pool.gather_carried(5)]
    _sync(device)
    # a host budget of the entry: its pinned arena on CUDA
    moves = HostTier(PoolHome(pool), host_arena(pool.export_nbytes(5), device))  # type: ignore[arg-type]
    entry = CarriedDrafter(held.block_table, held.rows, held.last_pair_key,
                           list(range(held.last_pair_key + 2)), 5)
    assert moves.demote(entry)
    delay()  # the freed blocks' last writer runs late: the copy back must still follow it
    pool.k_cache.fill_(7.0)
    pool.v_cache.fill_(7.0)
    real = pool._copy_blocks_in

    def late_copy(idx: torch.Tensor, host: object) -> None:  # runs on the side stream
        delay()
        real(idx, host)  # type: ignore[arg-type]

    pool._copy_blocks_in = late_copy  # type: ignore[method-assign]
    moves.restore(entry)
    moves.ready(5)  # the current stream waits for the copy back, on the GPU
    got = pool.gather_carried(5)  # queued on the current stream, no sync before
    _sync(device)
    same = all(torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b)
               for a, b in zip(got, truth, strict=True))
    return same, f"{rows} rows in {len(held.block_table)} blocks"


class _Pages:
    """A turn's pages as rows in hand: a deposit gathers `rows` (keys [0, n)); an adoption's scatter
    reads what it is given on the current stream, no sync first (`got`: copies of its tensors)."""

    def __init__(self, rows: Rows | None = None) -> None:
        self.rows = rows
        self.got: list[torch.Tensor] = []

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        assert self.rows is not None
        codec.copy_(out, self.rows)

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> None:
        self.got = [t.clone() for t in codec.tensors(rows)]


def adapter_restore(device: torch.device, delay: Delays, gen: torch.Generator, rows: int,
                    row_dtype: str) -> tuple[bool, str]:
    """Deposit two entries into a one-entry device arena (the first demoted to the host tier),
    adopt the first back (its copy delayed on the side stream), read it unsynced: equal?"""
    form: Callable[[torch.Tensor], object] = pack_rows if row_dtype == "fp8" else (lambda r: r)
    first = torch.randn(rows, 2, H, D, generator=gen).to(torch.bfloat16).to(device)
    second = torch.randn(rows, 2, H, D, generator=gen).to(torch.bfloat16).to(device)
    a, b = form(first), form(second)
    codec = codec_for(row_dtype, torch.bfloat16)
    per = codec.nbytes(a)  # type: ignore[arg-type]
    home = ArenaHome(codec, Arena.reserve(per, device), H, D)
    service = CarryService(home, slots=None, budget_bytes=per, eviction="lrd", idle_s=None,
                           host_arena=host_arena(4 * per, device))
    truth = [t.clone() for t in codec.tensors(a)]  # type: ignore[arg-type]
    tokens = list(range(rows + 2))
    for key, held in ((11, a), (12, b)):  # 11 goes to host memory
        plan = service.plan_deposit(key, None, rows)
        assert plan is not None and service.deposit(plan, _Pages(held), ((0, rows),), tokens)  # type: ignore[arg-type]
    if service.stats().host_entries != 1:
        return False, "the first entry was not demoted"
    _sync(device)
    real = codec.to
    pages = _Pages()
    with ExitStack() as undo:
        def late_copy(r: Rows, dev: torch.device, non_blocking: bool = False) -> Rows:  # on the side stream
            delay()
            return real(r, dev, non_blocking)

        codec.to = late_copy  # type: ignore[method-assign]  # the codec is shared: put back below
        undo.callback(delattr, codec, "to")
        service.adopt(1, 11, rows, pages)  # the current stream waits for the copy back, then reads
        service.end_turn(1)
    got = pages.got
    _sync(device)
    same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(got, truth, strict=True))
    return same, f"{rows} rows, {row_dtype}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--delay-cycles", type=int, default=20_000_000,
                    help="GPU cycles of each delay (about 10 ms on an H200); 0: none")
    ap.add_argument("--rows", type=int, default=3000)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check_restore.py: error: --device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    if args.delay_cycles < 0 or args.rows < 1:
        print(f"gpu_check_restore.py: error: --delay-cycles must be >= 0 and --rows >= 1, got "
              f"{args.delay_cycles} and {args.rows}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(42)
    failed = 0
    delayed = device.type == "cuda" and args.delay_cycles > 0  # the CPU: no stream to delay
    for cycles in (0, args.delay_cycles) if delayed else (0,):
        delay = Delays(device, cycles)
        suffix = f", {cycles} cycles of delay on both streams" if delay.on else ""
        cases = [("pool host restore", lambda d=delay: pool_restore(device, d, gen, args.rows)),
                 ("adapter host restore bf16", lambda d=delay: adapter_restore(device, d, gen, args.rows, "bf16")),
                 ("adapter host restore fp8", lambda d=delay: adapter_restore(device, d, gen, args.rows, "fp8"))]
        for name, run in cases:
            try:
                ok, detail = run()
            except Exception as exc:  # a crash is this check's failure, reported as its line
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            failed += not ok
            verdict = "PASS" if ok else "FAIL"
            text = "rows read back equal the demoted ones" if ok else "rows read back differ"
            print(f"CHECK\t{name}: read back after restore{suffix}\t{verdict}\t{text} ({detail}, {device})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
