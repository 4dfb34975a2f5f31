"""The carry service over an arena home, fed rows directly (no executor, no pages).

What the adapter's manager does with a request's draft pages, these tests do with rows in hand:
`ArenaCarry.deposit(key, tokens, rows)` plans the deposit (admitted or refused before any row
moves) and carries the rows of keys `[0, n)` into the room the plan reserved; `take(key)` adopts
the entry (from the device arena, or copied back from the host tier) into a sink and ends the
turn. The service, its store, its home and its host tier are the package's own
(`service.CarryService`, `ArenaHome`, `HostTier`, `dataplane.arena.Arena`), as the manager
builds them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.row_codec import RowCodec, Rows, codec_for
from trtllm_mtp_carry.service import CarryService, CarryStats
from trtllm_mtp_carry.service.homes import ArenaHome, Runs
from trtllm_mtp_carry.service.host_tier import host_arena


def clone_rows(codec: RowCodec, rows: Rows) -> Rows:
    """A copy of held `rows` in memory of its own (the arena's range may be reused after)."""
    tensors = codec.tensors(rows)
    out = codec.view(torch.empty(sum(t.nbytes for t in tensors), dtype=torch.uint8, device=tensors[0].device),
                     tuple(rows.shape))
    codec.copy_(out, rows)
    return out


class RowsSource:
    """A turn's pages as rows in hand: keys `[0, n)` are rows `0 .. n - 1` (`RowPages`)."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        assert runs == ((0, out.shape[0]),), runs
        codec.copy_(out, codec.head(self.rows, out.shape[0]))


class RowsSink:
    """A turn's pages that keep what an adoption scatters into them (`RowPages`)."""

    def __init__(self) -> None:
        self.rows: Rows | None = None
        self.runs: Runs | None = None

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> None:
        self.rows, self.runs = clone_rows(codec, rows), runs


class ArenaCarry:
    """A `CarryService` over an `ArenaHome` of `[2, Hkv, D]` rows of `row_dtype` for a `pool_dtype`
    pool: a device arena of `budget_bytes` (the store's budget) and, with `host_budget_bytes`, a
    host tier of that many bytes (`arena`, `host_arena_`: given ones instead; the store's budget
    stays `budget_bytes`, so a test may give it more than the arena holds). `device`: the device
    the service and its host tier take the rows to be on (a test recording the CUDA seam,
    `dataplane.streams`, runs CUDA's path over CPU arenas with `cuda:0` here)."""

    def __init__(self, slots: int | None, budget_bytes: int, policy: str = "incumbent", *,
                 host_budget_bytes: int = 0, row_dtype: str = "bf16", pool_dtype: torch.dtype = torch.bfloat16,
                 num_kv_heads: int = 2, head_dim: int = 4, idle_s: float | None = None,
                 arena: Arena | None = None, host_arena_: Arena | None = None,
                 codec: RowCodec | None = None, device: torch.device | None = None) -> None:
        self.codec = codec if codec is not None else codec_for(row_dtype, pool_dtype)
        self.arena = arena if arena is not None else Arena.reserve(budget_bytes, "cpu")
        self.host_arena = host_arena_ if host_arena_ is not None else host_arena(host_budget_bytes,
                                                                                 torch.device("cpu"))
        self.home = ArenaHome(self.codec, self.arena, num_kv_heads, head_dim)
        if device is not None:
            self.home.device = device
        self.service = CarryService(self.home, slots=slots, budget_bytes=budget_bytes, eviction=policy,
                                    idle_s=idle_s, host_arena=self.host_arena)
        self._turns = itertools.count(1)

    def deposit(self, key: int, tokens: Sequence[int], rows: Rows, session: int | None = None) -> bool:
        """Keep `rows` (keys `[0, n)`, held in the codec's form) as `key`'s entry; False if refused."""
        n = rows.shape[0]
        plan = self.service.plan_deposit(key, None, n, session)
        if plan is None:
            return False
        return self.service.deposit(plan, RowsSource(rows), ((0, n),), tokens)

    def take(self, key: int, rows_kept: int | None = None) -> Rows:
        """Adopt `key`'s entry (its first `rows_kept` rows, all by default) and end that turn:
        the rows the adoption scattered, a copy."""
        entry = self.service.store.get(key)
        assert entry is not None, f"no entry 0x{key:016x}"
        sink = RowsSink()
        turn = next(self._turns)
        self.service.adopt(turn, key, entry.rows if rows_kept is None else rows_kept, sink)
        self.service.end_turn(turn)  # the turn is over and carries nothing on: its lease ends
        assert sink.rows is not None
        return sink.rows

    def get(self, key: int) -> CarriedDrafter | None:
        return self.service.store.get(key)

    def forget(self, session: int) -> int:
        return self.service.forget_session(session)

    def clear(self) -> None:
        self.service.clear()

    def check(self) -> None:
        self.service.check()

    def stats(self, **executor: Any) -> CarryStats:
        return self.service.stats(**executor)
