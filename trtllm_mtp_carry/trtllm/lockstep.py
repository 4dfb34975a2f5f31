"""Carry decisions every tensor-parallel rank takes alike: the agreements and the clock they read.

What it is for: under tensor parallelism each rank's PyExecutor runs its own carry over its own
draft pool, which holds the rank's shard of the MTP layer's KV heads. A drafter attends every
head, so a turn whose rows one rank restores and another does not drafts from half its context,
and a store that admits on one rank and refuses on another drifts apart for good. Every rank
must therefore take every carry decision alike: adopt or miss, which key range, which entry is
evicted, when an entry expires.

How ranks stay alike (TensorRT-LLM's own discipline, `py_executor.py` @
0004396720054fd8e205cbf616f21f0b57c6b412): rank 0 broadcasts each iteration's new requests
and cancellations to every rank and every rank schedules by itself, so each rank's resource
managers see the same prepares and frees in the same order. A carry decision that is a
function of those events, the store's state and an agreed clock is the same on every rank.
What can still differ is local: a page a rank cannot resolve, a gather or an allocation that
fails on one rank, a conversation id only one rank received. Those are agreed here, through the
executor's own communicator (`Distributed`, whose `tp_allgather` pairs collectives by call
order over the tensor-parallel group), before anyone acts on them:

- `agree_install` once per executor build: every rank installs, or none does, and only when
  every rank holds the same carry memory (one store's decisions; `KVCacheManagerV2.__init__`
  likewise takes the MIN of every rank's capacity "so the scheduler produces identical
  batches").
- `agree_first_sights` in `prepare_resources` when the batch holds context requests seen for the
  first time: the agreed clock, and per request whether every rank wants to judge it with the
  same carry key and reused depth; then `agree_rows` (when one of them was eligible): per
  request, whether each rank can adopt after its judge and its page lookup, and the rows it can
  restore; the MIN is what every rank does (a rank that cannot: none adopts, the entry stays;
  prefer that all ranks miss over some adopting).
- `agree_deposit` in `free_resources` of a request the carry tracks: deposit only if every rank
  gathered the same rows of the same key, else the skip reason of the lowest rank that could
  not; then `agree_all` on whether every rank placed them (an allocation that failed on one
  rank refuses the deposit on all).

The clock: every agreement carries rank 0's `time.monotonic()` reading, and `now()` is the
newest reading agreed (never going back), the one clock the store's idle TTL and the
`returns` policy's learned return ages read. Every decision that reads time comes right after
an agreement (the judge after `agree_first_sights`, the admission after `agree_deposit`), so
the clock is as fresh as a wall clock and in the same unit (seconds, what `carry_idle_s`
says). An iteration counter, the other clock every rank advances alike, would not do: idle
ranks do not iterate (non-root ranks park in the request broadcast), and a TTL in iterations
would be a TTL in load.

Invariants:
- At TP=1 (`Lockstep.single()`) nothing here makes a collective: every agreement is the rank's
  own values and `now()` is `time.monotonic()`.
- Every rank makes the same agreements in the same order: the carry calls each at a point all
  ranks reach alike (the events above), whatever its own step did; a local fault votes no, it
  never skips a vote. A call whose ranks send vectors of different widths (ranks that
  disagree on what is being voted) raises `LockstepError` on every rank alike.
- `agreements` counts the collectives this rank made (the same count on every rank).
- Votes travel as Python ints through the object all-gather (`tp_allgather`), not an int64
  tensor: carry keys are u64 and do not fit int64.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Lockstep", "LockstepError", "Vote"]

NS = 1_000_000_000
"""Clock readings travel as integer nanoseconds (exact through any communicator)."""


class LockstepError(RuntimeError):
    """The ranks sent vectors of different widths to one agreement: they are not voting on the
    same thing (raised on every rank alike, after the collective)."""


@dataclass(frozen=True, slots=True)
class Vote:
    """What every rank sent to one agreement (`values[r]`: rank r's vector, rank order)."""

    values: list[list[int]]

    def column(self, i: int) -> list[int]:
        """Element `i` of every rank's vector."""
        return [row[i] for row in self.values]


class Lockstep:
    """One executor's carry agreements across its tensor-parallel group; a no-op at TP=1.

    `dist` is the executor's communicator (TensorRT-LLM's `Distributed`: `tp_allgather(obj)`
    returns every TP rank's `obj` in rank order), `tp_size` and `tp_rank` the mapping's.
    `clock` is this rank's time source (seconds): at TP=1 `now()` reads it, at TP>1 only rank 0's
    readings, carried by the agreements, count.
    """

    def __init__(self, dist: Any = None, tp_size: int = 1, tp_rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tp_size > 1 and dist is None:
            raise ValueError(f"tensor parallel size {tp_size} needs the executor's communicator")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is not a rank of a group of {tp_size}")
        self.dist = dist
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self._clock = clock
        self._agreed = 0.0  # the newest agreed clock (TP>1): rank 0's reading at the latest agreement
        self.agreements = 0

    @classmethod
    def single(cls, clock: Callable[[], float] = time.monotonic) -> Lockstep:
        """The lockstep of a single-rank executor: every agreement is local, no collective."""
        return cls(None, 1, 0, clock)

    @property
    def active(self) -> bool:
        """Whether agreements are collectives (TP > 1)."""
        return self.tp_size > 1

    def now(self) -> float:
        """The clock every carry decision reads: `time.monotonic()` at TP=1; at TP>1 rank 0's
        reading as of the newest agreement (the same number on every rank; 0.0 before the first,
        the install agreement, which precedes every decision)."""
        return self._agreed if self.active else self._clock()

    # ---- the one collective --------------------------------------------------------------

    def exchange(self, values: Sequence[int]) -> Vote:
        """Every rank's `values` (ints), in rank order: one `tp_allgather` at TP>1, which also
        carries rank 0's clock reading into `now()`. LockstepError when the widths differ."""
        mine = [int(v) for v in values]
        if not self.active:
            return Vote([mine])
        gathered = self.dist.tp_allgather([round(self._clock() * NS), *mine])
        self.agreements += 1
        if len(gathered) != self.tp_size or any(len(row) != len(mine) + 1 for row in gathered):
            raise LockstepError(f"the carry's agreement got vectors of widths {[len(r) - 1 for r in gathered]} "
                                f"from {len(gathered)} ranks (this rank sent {len(mine)}): the ranks are not "
                                "voting on the same requests")
        # rank 0's monotonic clock never goes back; the max only guards the agreed value
        self._agreed = max(self._agreed, gathered[0][0] / NS)
        return Vote([list(row[1:]) for row in gathered])

    # ---- the carry's agreements ---------------------------------------------------------

    def agree_all(self, ok: bool) -> tuple[bool, bool]:
        """`(every, some)`: whether every rank says `ok`, and whether any does (one agreement)."""
        said = self.exchange([int(bool(ok))]).column(0)
        return min(said) == 1, max(said) == 1

    def agree_install(self, ok: bool, device_bytes: int, host_bytes: int) -> tuple[list[bool], bool]:
        """Whether each rank could install the carry (rank order), and whether every rank that
        could holds the same device and host carry memory: every rank installs iff all could
        with the same budgets (one store's decisions, taken alike)."""
        vote = self.exchange([int(bool(ok)), device_bytes, host_bytes])
        held = {(d, h) for o, d, h in zip(vote.column(0), vote.column(1), vote.column(2), strict=True) if o}
        return [v == 1 for v in vote.column(0)], len(held) <= 1

    def agree_first_sights(self, wants: Sequence[tuple[int, int]]) -> list[int]:
        """Per first-seen context request, `(carry key, reused depth R)` this rank would judge
        (key 0: none, e.g. no conversation id or a dropped request): 1 where every rank would
        judge it with the same key and R, 0 where no rank would, -1 where ranks differ (none
        judges it). Sets `now()` for the judges that follow."""
        vote = self.exchange([x for key_r in wants for x in key_r])
        out = []
        for i in range(len(wants)):
            pairs = set(zip(vote.column(2 * i), vote.column(2 * i + 1), strict=True))
            keys = {key for key, _ in pairs}
            out.append(0 if keys == {0} else 1 if len(pairs) == 1 else -1)
        return out

    def agree_rows(self, rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per adoption, each rank's vote (0: it cannot adopt; else the rows it can restore plus
        one): `(agreed, best)`, the MIN (what every rank then does) and the MAX over ranks (`best >
        agreed == 0`: some rank could adopt and another could not; none does)."""
        vote = self.exchange(rows)
        return ([min(vote.column(i)) for i in range(len(rows))],
                [max(vote.column(i)) for i in range(len(rows))])

    def agree_deposit(self, key: int, status: int, rows: int) -> int:
        """A freed request's deposit: `status` 0 when this rank gathered `rows` rows of carry key
        `key` and would deposit them, else its reason not to (a positive code). Returns 0 when
        every rank would deposit the same rows of the same key, else the first non-zero status
        in rank order (-1 when every rank said 0 but keys or row counts differ)."""
        vote = self.exchange([key, status, rows])
        statuses = vote.column(1)
        first = next((s for s in statuses if s != 0), 0)
        if first:
            return first
        return 0 if len(set(vote.column(0))) == 1 and len(set(vote.column(2))) == 1 else -1
