"""Who comes back: the `returns` eviction policy's online estimate of what each entry is worth.

What it is for: on real chat traffic most carried entries are never adopted
(in the Mooncake conversation trace 28% of first turns get a follow-up within
the idle TTL, 68% of fifth and later ones), so which entry to keep depends on
its conversation's chance to return. The store learns that chance from the
turns it sees itself, never from a table fitted to one trace. An entry's worth
is its chance to still be adopted, per share of the store it takes::

    worth(turn class c, age a, cost n) = P(returns within the horizon | c, not returned by a) / n
    cost = bytes / budget_bytes + 1 / slots     (a term for each bound the store has)

so under a memory budget it is the chance per byte, under a slot cap the chance
per slot (an entry of a few rows takes a whole slot too).

from decayed counts, per turn class (its conversation's 1st, 2nd, 3rd, 4th,
5th+ deposit, the count kept across evictions by the ghost list), of returns
by age bin (four per doubling of the age, up to the horizon) and of deposits that did
not return within the horizon (the idle TTL, else `DEFAULT_HORIZON_S`). The
lowest worth leaves first; a newcomer is admitted only if it is worth more than
every entry it would push out, so first turns, which rarely return, do not
push out conversations that do. A weak prior (`PRIOR_WEIGHT` pseudo-deposits:
a coin flip for first turns, the class below for later turns, the class's own
rate for an age bin with little evidence) decides until the store has seen
turns: an entry's chance then does not fall with age, so equal entries tie
and the incumbent stays (a cyclic workload larger than the
store keeps a fixed set, as `incumbent` does, instead of evicting the entry
needed next, as `lrd` does). (DECISIONS.md, "The `returns` eviction policy", has the
variants measured: the chance per byte-second, LHD's hit density, did worse on the trace; and
what estimates told part of the future would buy, `scripts/trace_ceilings.py`: told who
returns, 93.7%.)

Learning, from the store's own calls:
- `deposited(key, now)`: a turn of `key` deposits (admitted or refused): the
  key's previous deposit, if still unresolved, returned now (the turn that
  came back); the key's turn count goes up by one.
- `adopted(key, now)`: `key`'s entry was taken: its deposit returned at `now`.
- `sweep(now)`: deposits older than the horizon that have not returned count
  as not returning.

Invariants:
- Every deposit is counted at most once, when it resolves: as a return at one
  age, or as a stay. Counts decay by 1/`DECAY_TURNS` per resolution (lazy
  weights, so an update is O(1)).
- The ghost list and the pending deposits are bounded (`memory` keys, oldest
  forgotten first); a forgotten key counts as a first turn again.
- Worth is finite and >= 0; 0 once an entry is as old as the horizon. Ties
  keep the incumbent: `rank` orders equal worth newest first, and the store
  refuses a newcomer that is not worth strictly more than its victims.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_HORIZON_S = 3600.0
"""Horizon of a return when the store has no idle TTL: a deposit not back within it counts as a stay."""

TURN_CLASSES = 5
"""Turn classes: a conversation's 1st, 2nd, 3rd, 4th and 5th-or-later deposit."""

DECAY_TURNS = 4000.0
"""Resolved deposits over which a count decays by 1/e: old traffic fades, the rates follow the new."""

PRIOR_WEIGHT = 1.0
"""Pseudo-deposits at the prior's chance (a coin flip for first turns, the class below for later
ones, the class's rate for an age bin), as heavy as the latest resolved deposit."""

ADMIT_MARGIN = 1.25
"""Hysteresis of the admission test: a newcomer must be worth more than this many times each
victim; a returning key (its rows out in its turn, or replacing its own entry) is refused only
by a victim worth more than this many times it. Near ties (entries a few percent apart in size)
keep what is held, so a cyclic workload does not churn."""

BINS_PER_DOUBLING = 4
"""Age bins per doubling of the age (edges 0, 1, 1.19, 1.41, 1.68, 2, ... s). The chance an entry
still returns falls steeply within one doubling (chat follow-ups mostly come 30 s to 8 min after
the deposit); with one bin per doubling the store adopts 0.9 points fewer follow-ups on the trace
(DECISIONS.md). The bins are of age alone, so each still pools every deposit of its class."""

_RENORM = 1e200


def age_edges(horizon_s: float) -> list[float]:
    """Age bin edges in seconds: 0, then 2**(k / BINS_PER_DOUBLING) for k = 0, 1, ... below the
    horizon, and the horizon last."""
    edges = [0.0]
    k = 0
    while (e := 2.0 ** (k / BINS_PER_DOUBLING)) < horizon_s:
        edges.append(e)
        k += 1
    edges.append(horizon_s)
    return edges


class ReturnOdds:
    """Decayed counts of who returns, by turn class and age; the worth of the store's entries."""

    def __init__(self, horizon_s: float | None, memory: int) -> None:
        self.horizon_s = float(horizon_s) if horizon_s else DEFAULT_HORIZON_S
        self.memory = memory
        self.edges = age_edges(self.horizon_s)
        nbins = len(self.edges) - 1
        self._weight = 1.0  # the next count's weight; grows by 1/(1 - 1/DECAY_TURNS) per resolution
        self._grow = 1.0 / (1.0 - 1.0 / DECAY_TURNS)
        self._returns = [[0.0] * nbins for _ in range(TURN_CLASSES)]  # [class][bin], decayed; no prior
        self._stays = [0.0] * TURN_CLASSES
        self._chance: list[list[float]] | None = None  # [class][bin]: P(returns | not by the bin), cached
        self._turns: OrderedDict[int, int] = OrderedDict()  # the ghost list: key -> deposits seen
        self._pending: OrderedDict[int, tuple[float, int]] = OrderedDict()  # key -> (deposited, class)
        self.resolved = 0
        """Deposits resolved so far (returned or stayed)."""

    # ---- learning --------------------------------------------------------------

    def turn_class(self, key: int) -> int:
        """The class (0-based) of `key`'s latest deposit (a key never seen: a first turn's, 0)."""
        return min(self._turns.get(key, 1), TURN_CLASSES) - 1

    def deposited(self, key: int, now: float) -> int:
        """A turn of `key` deposits at `now` (admitted or not); return its class (0-based)."""
        self.sweep(now)
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._resolve(pending[1], now - pending[0])
        turns = self._turns.pop(key, 0) + 1
        self._turns[key] = turns
        if len(self._turns) > self.memory:
            self._turns.popitem(last=False)
        cls = min(turns, TURN_CLASSES) - 1
        self._pending[key] = (now, cls)
        if len(self._pending) > self.memory:  # never resolved: forgotten uncounted
            self._pending.popitem(last=False)
        return cls

    def adopted(self, key: int, now: float) -> None:
        """`key`'s carried entry was taken at `now`: its deposit returned."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._resolve(pending[1], now - pending[0])

    def sweep(self, now: float) -> None:
        """Deposits as old as the horizon that did not return count as stays."""
        cutoff = now - self.horizon_s
        pending = self._pending
        while pending:
            key, (at, cls) = next(iter(pending.items()))
            if at > cutoff:
                break
            del pending[key]
            self._resolve(cls, self.horizon_s)

    def _resolve(self, cls: int, age: float) -> None:
        """One deposit of class `cls` returned at `age` (a stay if `age` reached the horizon)."""
        self.resolved += 1
        self._chance = None
        w = self._weight
        self._weight *= self._grow
        if self._weight > _RENORM:  # keep the lazy weights finite: rescale every count at once
            scale = 1.0 / self._weight
            self._returns = [[r * scale for r in row] for row in self._returns]
            self._stays = [s * scale for s in self._stays]
            w *= scale
            self._weight = 1.0
        if age >= self.horizon_s:
            self._stays[cls] += w
        else:
            self._returns[cls][self._bin(age)] += w

    def _bin(self, age: float) -> int:
        return max(0, min(bisect_right(self.edges, age) - 1, len(self.edges) - 2))

    # ---- worth -----------------------------------------------------------------

    def return_rate(self, cls: int) -> float:
        """The learned chance (0..1) that a deposit of class `cls` (0-based) returns within the horizon
        (the prior and backoff included: `worth` at age 0 per unit cost)."""
        return self._table()[cls][0]

    def _table(self) -> list[list[float]]:
        """[class][bin]: the chance a deposit not returned by the bin's start still returns.

        Shrunk toward the class's own rate (`PRIOR_WEIGHT` pseudo-deposits at it)
        where few deposits are seen at or past the bin: an age the store has seen
        no returns and no stays at says nothing, so it counts as the class's rate,
        not as worse. The class rate itself shrinks toward a coin flip for first
        turns and toward the class below for later ones (a class with few turns
        seen returns as the one before it).
        """
        if self._chance is None:
            prior = PRIOR_WEIGHT * self._weight  # as many pseudo-deposits as recent ones weigh
            table: list[list[float]] = []
            rate = 0.5
            for row, stays in zip(self._returns, self._stays, strict=True):
                total = sum(row)
                rate = (total + prior * rate) / (total + stays + prior)  # backs off to the class below
                later, chance = 0.0, [0.0] * len(row)
                for b in range(len(row) - 1, -1, -1):
                    later += row[b]
                    chance[b] = (later + prior * rate) / (later + stays + prior)
                table.append(chance)
            self._chance = table
        return self._chance

    def worth(self, cls: int, age: float, cost: float) -> float:
        """What an entry of class `cls` (0-based), `age` seconds old, costing `cost` is worth (module
        header; the store's cost: the share of its bounds the entry takes)."""
        if age >= self.horizon_s:
            return 0.0
        return self._table()[cls][self._bin(age)] / max(cost, 1e-300)

    def rank(self, keys: Sequence[int], deposited_at: Sequence[float], costs: Sequence[float],
             now: float) -> tuple[list[int], list[float]]:
        """`keys` (held entries, oldest deposit first) ordered by worth, lowest first, worth equal
        in one band (bands a factor `ADMIT_MARGIN` wide) newest first; and their worth in that order."""
        table, turns, edges, horizon = self._table(), self._turns, self.edges, self.horizon_s
        last = len(edges) - 2
        worth = []
        for k, at, n in zip(keys, deposited_at, costs, strict=True):
            age = now - at
            if age >= horizon:
                worth.append(0.0)
                continue
            b = max(0, min(bisect_right(edges, age) - 1, last))
            worth.append(table[min(turns.get(k, 1), TURN_CLASSES) - 1][b] / max(n, 1e-300))
        # worth within a factor ADMIT_MARGIN counts as equal (log buckets): equal entries leave
        # newest first, the one needed furthest ahead when sessions cycle (as `incumbent` does)
        step = math.log(ADMIT_MARGIN)
        band = [math.floor(math.log(w) / step) if w > 0 else -math.inf for w in worth]
        order = sorted(range(len(keys)), key=lambda i: (band[i], -i))
        return [keys[i] for i in order], [worth[i] for i in order]


__all__ = ["BINS_PER_DOUBLING", "DECAY_TURNS", "DEFAULT_HORIZON_S", "PRIOR_WEIGHT", "TURN_CLASSES", "ReturnOdds", "age_edges"]
