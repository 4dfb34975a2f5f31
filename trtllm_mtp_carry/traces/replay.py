"""Replay a chat trace through the package's own `CarryStore`, and a clairvoyant bound beside it.

What it is for: how many follow-up turns of real traffic find their
conversation's carried rows, under each eviction policy, budget and host
tier, measured with the very store every executor uses (no rows: entries are
bookkeeping, `host_moves` unset). The service model gives each turn its
finish time: `arrival + input / prefill_tokens_per_s + output *
decode_s_per_token`.

On the trace's clock, per request (a worker's store, `workers` session-affine
stores split by a hash of the conversation):

    arrival: expire idle entries; a follow-up turn takes its conversation's
             entry (adopted, by tier) or counts the store's miss reason
    finish:  expire; admit + put input + output rows (row_bytes each), or the
             refusal is counted and the rows offered to the host tier
             (`deposit_host`, as the executors do)

Events at equal times: finishes first (a turn that finished at t is there for
one arriving at t), then in trace order.

The bound (`clairvoyant_bound`) knows the future: it stores an entry only if
its conversation's next arrival comes before the idle TTL and before another
deposit of the same conversation replaces it, and when full evicts the entry
reused furthest ahead (refusing the newcomer when it is that one). It is the
figure policies are measured against, not an optimum (sizes differ, so
furthest-first is a heuristic too); with a host tier it gets both budgets as
one.

Invariants:
- Every follow-up turn is counted exactly once: adopted (device or host) or
  one miss under the store's own reason (`NO_CARRY_REASONS`).
- Replays are deterministic: same trace and config, same figures.
- Python touches each event once per policy (two per request); conversation
  bookkeeping is numpy.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..core.carry_store import CarryStore
from ..core.drafter import CarriedDrafter
from ..core.eviction import ReturnOdds
from ..core.outcome import NO_CARRY_REASONS
from .defaults import DECODE_S_PER_TOKEN, PREFILL_TOKENS_PER_S, QWEN3_NEXT_MTP_ROW_BYTES
from .reader import Trace


@dataclass(frozen=True)
class ServiceModel:
    """When a turn finishes: prefill at `prefill_tokens_per_s`, then `decode_s_per_token` per output token."""

    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    decode_s_per_token: float = DECODE_S_PER_TOKEN

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")
        if not self.decode_s_per_token >= 0:
            raise ValueError(f"decode_s_per_token must be >= 0, got {self.decode_s_per_token!r}")

    def finish_s(self, trace: Trace) -> np.ndarray:
        return (trace.arrival_s + trace.input_tokens / self.prefill_tokens_per_s
                + trace.output_tokens * self.decode_s_per_token)


@dataclass(frozen=True)
class ReplayConfig:
    """One replay's stores: `workers` of them, each with these bounds (`None` budget: unbounded)."""

    budget_bytes: int | None
    workers: int = 1
    host_budget_bytes: int = 0
    idle_s: float | None = 600.0
    row_bytes: int = QWEN3_NEXT_MTP_ROW_BYTES
    service: ServiceModel = field(default_factory=ServiceModel)

    def __post_init__(self) -> None:
        if type(self.workers) is not int or self.workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {self.workers!r}")
        if type(self.row_bytes) is not int or self.row_bytes < 1:
            raise ValueError(f"row_bytes must be an int >= 1, got {self.row_bytes!r}")


@dataclass(frozen=True)
class PolicyResult:
    """One policy's replay, all workers summed (peaks: the largest worker's)."""

    policy: str
    follow_ups: int
    adopted: int
    adopted_by_tier: dict[str, int]
    misses: dict[str, int]
    evictions: dict[str, int]
    refusals: dict[str, int]
    deposits: int
    peak_bytes: dict[str, int]
    bytes_restored: int
    demotions: int

    @property
    def adopted_fraction(self) -> float:
        return self.adopted / self.follow_ups if self.follow_ups else 0.0


@dataclass(frozen=True)
class BoundResult:
    """The clairvoyant bound, all workers summed."""

    follow_ups: int
    adopted: int

    @property
    def adopted_fraction(self) -> float:
        return self.adopted / self.follow_ups if self.follow_ups else 0.0


def worker_of(conversation: np.ndarray, workers: int) -> np.ndarray:
    """Session-affine split: a splitmix64 hash of the conversation id, modulo `workers`."""
    z = conversation.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z % np.uint64(workers)).astype(np.int64)


def _events(trace: Trace, service: ServiceModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, is_arrival, request) of every event in replay order (finishes first at equal times)."""
    n = len(trace)
    times = np.concatenate([service.finish_s(trace), trace.arrival_s])
    arrival = np.r_[np.zeros(n, dtype=np.int8), np.ones(n, dtype=np.int8)]
    req = np.r_[np.arange(n), np.arange(n)]
    order = np.lexsort((req, arrival, times))
    return times[order], arrival[order], req[order]


def replay(trace: Trace, policy: str, config: ReplayConfig,
           return_odds: Callable[[int], ReturnOdds] | None = None) -> PolicyResult:
    """Drive `config.workers` `CarryStore`s of `policy` with `trace` (see the module header).

    `return_odds(worker)`, for policy `returns` only, gives each worker's store
    the estimate it ranks by instead of the one it learns (a what-if analysis:
    scripts/trace_ceilings.py).
    """
    now = [0.0]

    def clock() -> float:
        return now[0]

    stores = [CarryStore(None, config.budget_bytes, policy, config.idle_s, clock,
                         host_budget_bytes=config.host_budget_bytes,
                         return_odds=None if return_odds is None else return_odds(w))
              for w in range(config.workers)]
    times, is_arrival, reqs = _events(trace, config.service)
    worker = worker_of(trace.conversation, config.workers).tolist()
    key_of = (trace.conversation + 1).tolist()  # carry keys are non-zero
    follow_up = (trace.turn > 1).tolist()
    nbytes = ((trace.input_tokens + trace.output_tokens) * config.row_bytes).tolist()
    misses: Counter[str] = Counter()
    by_tier: Counter[str] = Counter()
    adopted = 0
    for t, arrives, i in zip(times.tolist(), is_arrival.tolist(), reqs.tolist(), strict=True):
        now[0] = t
        store = stores[worker[i]]
        store.expire()
        key = key_of[i]
        if arrives:
            if not follow_up[i]:
                continue
            tier = store.tier(key)
            if tier is None:
                misses[store.miss_reason(key)] += 1
                continue
            store.take(key)
            by_tier[tier] += 1
            adopted += 1
        else:
            entry = CarriedDrafter((), 0, None, (), key)
            if store.admit(key, nbytes[i], key) is not None:
                store.put(entry, nbytes[i], key)
            else:  # refused by the device tier: the host tier's second chance, as the executors do
                store.deposit_host(entry, nbytes[i], key)
    ev: Counter[str] = Counter()
    ref: Counter[str] = Counter()
    peaks: Counter[str] = Counter()
    restored = demoted = 0
    for s in stores:
        ev.update(s.evictions())
        ref.update(s.refusals())
        tiers = s.tier_stats()
        for name, b in tiers.peak_bytes.items():
            peaks[name] = max(peaks[name], b)
        restored += tiers.bytes_restored
        demoted += tiers.demotions
    return PolicyResult(
        policy=policy,
        follow_ups=trace.follow_ups,
        adopted=adopted,
        adopted_by_tier={"device": by_tier["device"], "host": by_tier["host"]},
        misses={r: misses[r] for r in NO_CARRY_REASONS if misses[r]},
        evictions=dict(ev),
        refusals=dict(ref),
        deposits=sum(s.deposits for s in stores),
        peak_bytes={"device": peaks["device"], "host": peaks["host"]},
        bytes_restored=restored,
        demotions=demoted,
    )


def next_use(trace: Trace, config: ReplayConfig) -> np.ndarray:
    """Per request, the arrival time that adopts the rows its finish deposits (NaN: none does).

    The conversation's first arrival after the deposit, if it comes within the
    idle TTL and no other deposit of the conversation comes first (it would
    replace these rows).
    """
    times, is_arrival, reqs = _events(trace, config.service)
    conv = trace.conversation.tolist()
    out = np.full(len(trace), np.nan)
    pending: dict[int, tuple[int, float]] = {}  # conversation -> (request, deposit time) not yet used
    ttl = config.idle_s
    for t, arrives, i in zip(times.tolist(), is_arrival.tolist(), reqs.tolist(), strict=True):
        c = conv[i]
        if arrives:
            dep = pending.pop(c, None)
            if dep is not None and (ttl is None or t - dep[1] < ttl):
                out[dep[0]] = t
        else:
            pending[c] = (i, t)  # an unused earlier deposit is replaced: it keeps NaN
    return out


def clairvoyant_bound(trace: Trace, config: ReplayConfig) -> BoundResult:
    """Follow-ups a store that knows every next arrival adopts (module header), all workers summed."""
    use = next_use(trace, config)
    budget = None if config.budget_bytes is None else config.budget_bytes + config.host_budget_bytes
    times, is_arrival, reqs = _events(trace, config.service)
    worker = worker_of(trace.conversation, config.workers).tolist()
    conv = trace.conversation.tolist()
    nbytes = ((trace.input_tokens + trace.output_tokens) * config.row_bytes).tolist()
    held: list[dict[int, tuple[float, int]]] = [{} for _ in range(config.workers)]  # conv -> (use, bytes)
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(config.workers)]  # (-use, conv), lazy
    used = [0] * config.workers
    adopted = 0
    for arrives, i in zip(is_arrival.tolist(), reqs.tolist(), strict=True):
        w, c = worker[i], conv[i]
        mine = held[w]
        if arrives:
            entry = mine.pop(c, None)
            if entry is not None:
                used[w] -= entry[1]
                adopted += 1
            continue
        u = float(use[i])
        if u != u:  # NaN: never reused in time, never stored
            continue
        b = nbytes[i]
        if budget is not None:
            if b > budget:
                continue
            heap = heaps[w]
            while used[w] + b > budget:
                neg, victim = heap[0]
                if mine.get(victim, (None,))[0] != -neg:  # stale heap item
                    heapq.heappop(heap)
                    continue
                if -neg <= u:  # the newcomer is reused furthest ahead: refuse it
                    break
                heapq.heappop(heap)
                used[w] -= mine.pop(victim)[1]
            if used[w] + b > budget:
                continue
            heapq.heappush(heap, (-u, c))
        mine[c] = (u, b)
        used[w] += b
    return BoundResult(follow_ups=trace.follow_ups, adopted=adopted)


__all__ = ["QWEN3_NEXT_MTP_ROW_BYTES", "BoundResult", "PolicyResult", "ReplayConfig", "ServiceModel",
           "clairvoyant_bound", "next_use", "replay", "worker_of"]
