"""The append kernel gets only the block ids its new rows land in, whatever the sequence holds.

A warm turn that adopted 28k rows appends its new span as a blind turn does:
the block table the pool hands `drafter_row_append` starts at the block of the
first new row (its start row is relative to that block), so the upload is as
large as the new rows need, not as the history.
"""

from __future__ import annotations

import torch

from trtllm_mtp_carry.dataplane import kv_pool
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig


def _pool() -> DrafterKVPool:
    return DrafterKVPool(64, 4, 2, 8, RopeConfig(8, 4, 10000.0))


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 8, generator=g).to(torch.bfloat16),
            torch.randn(n, 2, 8, generator=g).to(torch.bfloat16))


def test_the_kernel_gets_the_blocks_from_the_first_new_rows_block_on(monkeypatch):
    pool = _pool()
    pool.allocate_sequence(1)
    k, v = _rows(15, 0)
    pool.append_rows(1, range(10), k[:10], v[:10])  # rows 0..9 in 3 blocks
    seen = []
    real = kv_pool.drafter_row_append

    def spy(k_new, v_new, keys, k_cache, v_cache, table, start_row, *rest):
        seen.append((table.tolist(), start_row, keys.tolist()))
        real(k_new, v_new, keys, k_cache, v_cache, table, start_row, *rest)

    monkeypatch.setattr(kv_pool, "drafter_row_append", spy)
    pool.append_rows(1, torch.arange(10, 15), k[10:], v[10:])  # rows 10..14: blocks 2 and 3
    table = list(pool.sequence(1).block_table)
    assert seen == [(table[2:4], 2, [10, 11, 12, 13, 14])]
    # the rows are where a single append of all 15 puts them
    whole = _pool()
    whole.allocate_sequence(1)
    whole.append_rows(1, range(15), k, v)
    for got, want in zip(pool.gather(1), whole.gather(1), strict=True):
        assert torch.equal(got, want)


def test_an_append_on_a_block_boundary_hands_only_the_fresh_blocks(monkeypatch):
    pool = _pool()
    pool.allocate_sequence(1)
    k, v = _rows(9, 1)
    pool.append_rows(1, range(8), k[:8], v[:8])  # two full blocks
    seen = []
    real = kv_pool.drafter_row_append

    def spy(k_new, v_new, keys, k_cache, v_cache, table, start_row, *rest):
        seen.append((table.tolist(), start_row))
        real(k_new, v_new, keys, k_cache, v_cache, table, start_row, *rest)

    monkeypatch.setattr(kv_pool, "drafter_row_append", spy)
    pool.append_rows(1, [8], k[8:], v[8:])
    assert seen == [([pool.sequence(1).block_table[2]], 0)]
