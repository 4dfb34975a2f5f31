"""The adapter's host arena is the host budget exactly, so a demotion into a full host tier takes
its victims' blocks (issue 42, item 6): the store names them first (`make_room`) and drops them
after the copy. Before, the full arena refused the copy (`torch.OutOfMemoryError`), the store
evicted the entry instead, and the host tier kept its oldest entries for good."""

from __future__ import annotations

import torch

from trtllm_mtp_carry.trtllm.arena import RowArena
from trtllm_mtp_carry.trtllm.carried import CarriedRows

ROW = 2 * 2 * 8 * 2  # one [2, Hkv=2, D=8] bf16 row: 64 bytes
N = 4  # rows an entry


def carried(entries: int = 1) -> CarriedRows:
    """Device and host arenas of `entries` entries each, budgets equal to them."""
    nbytes = entries * N * ROW
    return CarriedRows(None, budget_bytes=nbytes, host_budget_bytes=nbytes, policy="lrd",
                       arena=RowArena.reserve(nbytes, ROW, "cpu"), host_arena=RowArena.reserve(nbytes, ROW, "cpu"),
                       pool_dtype=torch.bfloat16)


def rows_of(seed: int) -> torch.Tensor:
    return torch.randn(N, 2, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_demotion_into_a_full_host_arena_replaces_its_victim_and_comes_back_bit_for_bit():
    c = carried()
    for key in (1, 2, 3):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))
    s = c.stats()
    assert (s["demotions"], s["host_entries"], s["entries"]) == (2, 1, 1)
    assert s["evictions"]["memory"] == 1 and s["refusals"]["oom"] == 0  # 1 left the host tier for 2
    c.check()
    taken = c.take(2)  # from the host arena
    assert torch.equal(taken.head(N), rows_of(2))
    assert c.stats()["hits"] == {"device": 0, "host": 1}


def test_host_entries_keep_rotating_through_a_full_host_arena():
    c = carried(entries=2)
    for key in range(1, 9):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))
        c.check()
    s = c.stats()
    assert (s["demotions"], s["host_entries"], s["evictions"]["memory"]) == (6, 2, 4)
    for key in (5, 6):  # the two newest demoted: in the host arena, rows intact
        assert torch.equal(c.take(key).head(N), rows_of(key))


def test_a_copy_that_fails_after_its_victims_blocks_were_freed_loses_them_as_a_fault(monkeypatch):
    c = carried()
    for key in (1, 2):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))

    def no_room(key, rows):  # a compaction that could not stage
        raise torch.OutOfMemoryError("staging")

    monkeypatch.setattr(c._host, "put", no_room)
    assert c.deposit(3, list(range(N + 1)), rows_of(3))
    s = c.stats()
    # 2 could not be copied (evicted for memory); 1's blocks were freed for it: gone, counted a fault
    assert (s["host_entries"], s["entries"], s["evictions"]["memory"], s["evictions"]["fault"]) == (0, 1, 1, 1)
    c.check()  # the store holds exactly the rows held
