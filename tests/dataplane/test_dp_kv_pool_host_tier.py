"""The pool's host tier copies: an entry exported to host memory (pinned on CUDA) and imported
back into fresh blocks holds the same rows and keys, bit for bit; an import that finds the
free list short evicts carried entries as a grow does. On CUDA the copy back runs on a side
stream (the host tier, `service.host_tier.HostTier` over a `PoolHome`) and the current stream
waits for it before the rows are read."""

from __future__ import annotations

import pytest
import torch
from dp_helpers import bits, increasing_keys, rand

from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool, PoolExhaustedError
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.service.homes import PoolHome
from trtllm_mtp_carry.service.host_tier import HostTier, host_arena

H, D, B = 2, 32, 16


def pool_with(device, gen, num_blocks, entries):
    """A pool on `device` carrying `entries` ({key: rows}) of random rows at random increasing keys."""
    pool = DrafterKVPool(num_blocks, B, H, D, RopeConfig(D, D // 4, 1e6), device=device)
    for i, (key, rows) in enumerate(entries.items()):
        pool.allocate_sequence(i)
        pool.append_rows(i, increasing_keys(gen, rows).to(device), rand(gen, rows, H, D, device=device),
                         rand(gen, rows, H, D, device=device))
        pool.move_to_carried(i, key)
    return pool


def name_victims(pool, keys):
    """Have the pool's grows evict `keys` first (the pool's one-victim or whole-order hook)."""
    if hasattr(pool, "victims"):
        pool.victims = lambda: list(keys)
    else:
        pool.victim = lambda: next((k for k in keys if k in pool.carried_keys()), None)


def entry_of(pool, key):
    held = pool.carried(key)
    return CarriedDrafter(held.block_table, held.rows, held.last_pair_key,
                          list(range(held.last_pair_key + 2)), key)


def test_a_demote_and_restore_round_trip_keeps_every_row_and_key(device, gen):
    pool = pool_with(device, gen, 12, {5: 37, 6: 20})
    before = [t.clone() for t in pool.gather_carried(5)]
    nbytes = pool.export_nbytes(5)  # a host budget of the entry
    moves = HostTier(PoolHome(pool), host_arena(nbytes, torch.device(device)))
    entry = entry_of(pool, 5)
    assert moves.demote(entry)
    assert pool.carried(5) is None and moves.keys() == [5]
    host = moves.arena.view(5)  # the host copy: a range of the tier's arena (pinned on CUDA)
    assert host.device.type == "cpu" and moves.arena.pinned == host.is_pinned() == (device == "cuda")
    assert host.numel() == moves.arena.capacity == nbytes
    pool.k_cache.fill_(3)  # whatever the freed blocks hold meanwhile
    pool.v_cache.fill_(3)
    back = moves.restore(entry)
    moves.ready(5)
    assert back.rows == 37 and back.block_table == pool.carried(5).block_table and moves.keys() == []
    assert moves.arena.held_bytes == 0
    after = pool.gather_carried(5)
    assert all(torch.equal(bits(a), bits(b)) if a.is_floating_point() else torch.equal(a, b)
               for a, b in zip(after, before, strict=True))
    pool.check()


def test_an_import_short_of_free_blocks_evicts_the_named_victim_first(device, gen):
    pool = pool_with(device, gen, 6, {1: 32, 2: 32, 3: 32})  # 2 blocks each: the pool is full
    rows = pool.export_carried(3)
    pool.free_carried(3)
    pool.allocate_sequence(9)
    pool.append_rows(9, torch.arange(32, device=device), rand(gen, 32, H, D, device=device),
                     rand(gen, 32, H, D, device=device))  # a live sequence takes 3's room
    heard = []
    name_victims(pool, [2])
    pool.on_evict = heard.append
    pool.import_carried(3, rows)
    assert heard == [2] and pool.carried_keys() == (1, 3)
    pool.check()


def test_an_import_that_even_every_carried_block_cannot_serve_is_refused_and_changes_nothing(device, gen):
    pool = pool_with(device, gen, 4, {1: 32})
    rows = pool.export_carried(1)
    pool.free_carried(1)
    pool.allocate_sequence(9)
    pool.append_rows(9, torch.arange(64, device=device), rand(gen, 64, H, D, device=device),
                     rand(gen, 64, H, D, device=device))  # a live sequence holds all 4 blocks
    with pytest.raises(PoolExhaustedError):
        pool.import_carried(1, rows)
    assert pool.carried_keys() == () and pool.num_free_blocks == 0
    pool.check()
    pool.free_sequence(9)
    assert pool.import_carried(1, rows).rows == 32  # the same host rows import once there is room
    pool.check()


def test_bench_host_tier_prints_each_move_against_the_same_run_pinned_copy() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_host_tier.py"
    proc = subprocess.run([sys.executable, str(script), "--rows", "64", "--repeat", "3", "--warmup", "1",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if line.startswith("     64")]
    assert [row[2] for row in table] == ["d2h", "demote", "a_demote", "h2d", "restore", "a_restore"]
    assert table[0][-1] == table[3][-1] == "1.00"  # each ceiling against itself
    figures = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("FIGURE\t")]
    assert [f[1] for f in figures] == [f"host tier {m} at 0.1 MiB / pinned {c} copy" for m, c in (
        ("demote", "d2h"), ("a_demote", "d2h"), ("restore", "h2d"), ("a_restore", "h2d"))]
    assert all(f[3] == ">= 0.85x copy" and f[4] == "INFO" for f in figures)  # the CPU crosses no host link
    checks = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("CHECK\t")]
    assert [(c[1], c[2]) for c in checks] == [("pinned bytes held equal the budgets at 0.1 MiB", "PASS")]
