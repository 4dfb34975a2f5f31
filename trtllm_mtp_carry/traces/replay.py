"""Replay a chat trace through the package's own `CarryStore`, and a clairvoyant bound beside it.

What it is for: how many follow-up turns of real traffic find their
conversation's carried rows, under each eviction policy, budget and host
tier, measured with the very store every executor uses (no rows: entries are
bookkeeping, `host_moves` unset); what a missed turn leaves for the next one
(`after_miss`); and what happens when sessions move between workers
(`Moves`). The service model gives each turn its finish time: `arrival +
input / prefill_tokens_per_s + output * decode_s_per_token`.

On the trace's clock, per request (`workers` stores, one a worker; a
conversation is served by its worker, at first the one a hash of the
conversation names):

    arrival: expire idle entries; a follow-up turn takes its conversation's
             entry (adopted, by tier), or with `pull` the worker of the
             conversation's newest deposit hands it over (adopted, remote),
             or counts the store's miss reason
    finish:  expire; admit + put its rows (row_bytes each), or the refusal
             is counted and the rows offered to the host tier
             (`deposit_host`, as the executors do)

After a miss. A follow-up reuses R = `trace.reused_tokens` of its prompt from
the target's prefix cache (assumed present wherever the turn lands), so the
drafter rows it computes are keys [R, N) of its N = input + output tokens
(the replay counts N rows, one more than the N - 1 complete keys, as it always
has). Each held entry is tracked as the run of keys it covers, [first, N):
adopting an entry restores its keys below R, so the turn's drafter is valid
over [0, N) only if first == 0 and the entry reaches R; a turn that adopted
[first, end) with first < R <= end keeps first; any other follow-up is
blind over [0, R), and `after_miss` says what it deposits:

    valid-run  keys [R, N), N - R rows, the prefix known invalid (both
               executors): the next turn adopts the run, blind below R
    nothing    no deposit (a `gap`): the next turn finds nothing and is
               blind too, while its prefix is reused
    full       all N rows as if valid, as if the blind turn had rebuilt
               its prefix (no executor does this: an upper bound)

`covered_keys` sums, over adopting turns, the keys of [0, R) the adopted run
holds (max(0, min(R, end) - first)), so "adopted" is not read as "full
context".

Moves (`Moves.model`; each worker's store keeps the same bounds):

    drain     every `every_s` seconds one worker (round-robin) stops
              gracefully and restarts empty; its sessions go to a hash of
              the conversation over the other workers. With `pull` its
              entries are first offered to each session's new worker (its
              admission rules and budgets decide; refused ones are lost),
              and its running turns finish and are offered the same way.
    crash     the same schedule, but the worker's rows are lost, and so are
              the deposits of the turns it was running (`lost_in_flight`).
    overflow  least-loaded soft affinity: a turn whose worker has more than
              `load` requests in flight (arrived, not yet finished by the
              service model) goes to the worker with the fewest (the first
              among equals), and its session stays there. With `pull` its
              next adoption reads the entry the old worker still holds.

A pulled or handed-off entry counts its bytes as moved. The clairvoyant bound
models neither moves nor the after-miss rule.

Events at equal times: finishes first (a turn that finished at t is there for
one arriving at t), then restarts, then arrivals in trace order.

The bound (`clairvoyant_bound`) knows the future: it stores an entry only if
its conversation's next arrival comes before the idle TTL and before another
deposit of the same conversation replaces it, and when full evicts the entry
reused furthest ahead (refusing the newcomer when it is that one). It is the
figure policies are measured against, not an optimum (sizes differ, so
furthest-first is a heuristic too); with a host tier it gets both budgets as
one.

Invariants:
- Every follow-up turn is counted exactly once: adopted (device or host,
  local or remote) or one miss under the store's own reason
  (`NO_CARRY_REASONS`).
- With `after_miss="full"` and no moves every finish deposits all its rows
  on its conversation's hash worker: tracking runs adds no store call.
- Replays are deterministic: same trace and config, same figures.
- Python touches each event once per policy (two per request, plus each
  entry of a restarting worker); conversation bookkeeping is numpy.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..core.carry_store import CarryStore
from ..core.drafter import CarriedDrafter
from ..core.eviction import ReturnOdds
from ..core.outcome import NO_CARRY_REASONS
from .defaults import (
    AFTER_MISS,
    DECODE_S_PER_TOKEN,
    MOVE_MODELS,
    PREFILL_TOKENS_PER_S,
    QWEN3_NEXT_MTP_ROW_BYTES,
)
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
class Moves:
    """How sessions move between workers (module header): `model` one of `MOVE_MODELS`; `every_s`
    (drain, crash: seconds between restarts, > 0); `load` (overflow: in-flight requests a worker
    may have before a session leaves it, >= 0); `pull` (a moved session's rows follow it)."""

    model: str = "none"
    every_s: float | None = None
    load: int | None = None
    pull: bool = False

    def __post_init__(self) -> None:
        if self.model not in MOVE_MODELS:
            raise ValueError(f"moves model must be one of {', '.join(MOVE_MODELS)}, got {self.model!r}")
        timed = self.model in ("drain", "crash")
        if timed and (isinstance(self.every_s, bool) or not isinstance(self.every_s, (int, float))
                      or not 0 < self.every_s < math.inf):
            raise ValueError(f"moves model {self.model!r} needs every_s > 0 seconds, got {self.every_s!r}")
        if not timed and self.every_s is not None:
            raise ValueError(f"every_s is for moves model drain or crash, not {self.model!r}")
        if self.model == "overflow" and (type(self.load) is not int or self.load < 0):
            raise ValueError(f"moves model 'overflow' needs load, an int >= 0, got {self.load!r}")
        if self.model != "overflow" and self.load is not None:
            raise ValueError(f"load is for moves model overflow, not {self.model!r}")
        if self.pull and self.model == "none":
            raise ValueError("pull needs a moves model other than 'none' (no session moves)")


@dataclass(frozen=True)
class ReplayConfig:
    """One replay's stores: `workers` of them, each with these bounds (`None` budget: unbounded);
    what a missed turn deposits (`after_miss`, one of `AFTER_MISS`) and how sessions move (`moves`)."""

    budget_bytes: int | None
    workers: int = 1
    host_budget_bytes: int = 0
    idle_s: float | None = 600.0
    row_bytes: int = QWEN3_NEXT_MTP_ROW_BYTES
    service: ServiceModel = field(default_factory=ServiceModel)
    after_miss: str = AFTER_MISS[0]
    moves: Moves = field(default_factory=Moves)

    def __post_init__(self) -> None:
        if type(self.workers) is not int or self.workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {self.workers!r}")
        if type(self.row_bytes) is not int or self.row_bytes < 1:
            raise ValueError(f"row_bytes must be an int >= 1, got {self.row_bytes!r}")
        if self.after_miss not in AFTER_MISS:
            raise ValueError(f"after_miss must be one of {', '.join(AFTER_MISS)}, got {self.after_miss!r}")
        if self.moves.model != "none" and self.workers < 2:
            raise ValueError(f"moves model {self.moves.model!r} needs workers >= 2 (a session moves to "
                             f"another worker), got {self.workers}")


@dataclass(frozen=True)
class AfterMissResult:
    """What missed turns left behind, and how much of the reused prefix adopted rows covered.

    `valid_runs`: deposits of keys [R, N) above an invalid prefix, `replaced_fuller` of them replacing
    their conversation's held entry whose run started lower (one an overlapping turn of the
    conversation deposited while this one ran blind); `gaps`: blind turns that deposited nothing
    (`nothing`); `blind_after_gap`: misses of a conversation whose last finish was a gap;
    `covered_keys`: keys of [0, R) the adopted runs held, over adopting turns;
    `reused_keys_adopted`: R summed over adopting turns; `reused_keys`: R over every follow-up.
    """

    valid_runs: int = 0
    replaced_fuller: int = 0
    gaps: int = 0
    blind_after_gap: int = 0
    covered_keys: int = 0
    reused_keys_adopted: int = 0
    reused_keys: int = 0

    @property
    def coverage_adopted(self) -> float:
        """Share of the adopting turns' reused prefix keys that their adopted rows hold."""
        return self.covered_keys / self.reused_keys_adopted if self.reused_keys_adopted else 0.0

    @property
    def coverage(self) -> float:
        """Share of every follow-up's reused prefix keys that adopted rows hold."""
        return self.covered_keys / self.reused_keys if self.reused_keys else 0.0


@dataclass(frozen=True)
class MoveResult:
    """Sessions moving between workers: all zeros with no moves.

    `restarts`: drains or crashes; `session_moves`: sessions sent to another worker (by a restart
    or by overflow); `moved_follow_ups`: follow-ups served by another worker than their
    conversation's previous turn, `moved_adopted` of them adopted; `entries_moved` and
    `bytes_moved` by way (`handoff`: a draining worker's entries and running turns offered to
    peers; `pull`: a moved session's entry read from its holder); `handoff_refused`: entries a
    peer's store refused; `lost_entries`, `lost_bytes`: entries gone with a restarting worker
    (refused ones included); `lost_in_flight`: deposits of turns whose worker restarted while they
    ran, not offered (crash, or no pull).
    """

    restarts: int = 0
    session_moves: int = 0
    moved_follow_ups: int = 0
    moved_adopted: int = 0
    entries_moved: dict[str, int] = field(default_factory=lambda: {"handoff": 0, "pull": 0})
    bytes_moved: dict[str, int] = field(default_factory=lambda: {"handoff": 0, "pull": 0})
    handoff_refused: int = 0
    lost_entries: int = 0
    lost_bytes: int = 0
    lost_in_flight: int = 0


@dataclass(frozen=True)
class PolicyResult:
    """One policy's replay, all workers summed (every store a restart retired included; peaks: the
    largest store's). `adopted_by_tier`: the tier the entry was found in (the holder's, when pulled);
    `adopted_by_source`: `local` (the serving worker's store) or `remote` (pulled from its holder)."""

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
    adopted_by_source: dict[str, int] = field(default_factory=lambda: {"local": 0, "remote": 0})
    after_miss: AfterMissResult = field(default_factory=AfterMissResult)
    moves: MoveResult = field(default_factory=MoveResult)

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


class _Fleet:
    """One policy's replay state: each worker's store and the runs its entries hold, where each
    conversation is served, and the counts (module header). Per request and per event only."""

    def __init__(self, trace: Trace, policy: str, config: ReplayConfig,
                 return_odds: Callable[[int], ReturnOdds] | None) -> None:
        self.now = 0.0
        self.config = config
        self.moves = config.moves
        self.blind_keeps = config.after_miss != "full"  # a blind turn's invalid prefix is tracked
        self.gap = config.after_miss == "nothing"
        self.threshold = config.moves.load  # overflow's in-flight threshold (None: other models)

        def new_store(w: int) -> CarryStore:
            return CarryStore(None, config.budget_bytes, policy, config.idle_s, self.clock,
                              host_budget_bytes=config.host_budget_bytes,
                              return_odds=None if return_odds is None else return_odds(w))

        self.new_store = new_store
        workers = config.workers
        self.stores = [new_store(w) for w in range(workers)]
        self.retired: list[CarryStore] = []
        self.runs: list[dict[int, tuple[int, int]]] = [{} for _ in range(workers)]  # key -> [first, end)
        self.epoch = [0] * workers
        self.load = [0] * workers
        conversations = trace.conversations
        self.route = worker_of(np.arange(conversations), workers)  # conversation -> its worker now
        self.holder = [-1] * conversations  # conversation -> worker of its newest deposit
        self.last_worker = np.full(conversations, -1, dtype=np.int64)  # of its last turn (-1: none yet)
        self.gapped = [False] * conversations
        self.conv = trace.conversation.tolist()
        self.key = (trace.conversation + 1).tolist()  # carry keys are non-zero
        self.follow_up = (trace.turn > 1).tolist()
        self.rows = (trace.input_tokens + trace.output_tokens).tolist()
        self.reused = trace.reused_tokens.tolist()
        n = len(trace)
        self.served = [0] * n
        self.served_epoch = [0] * n
        self.first_valid = [0] * n
        self.leased = [False] * n  # the turn took its entry from its own worker's store (a lease)
        self.misses: Counter[str] = Counter()
        self.by_tier: Counter[str] = Counter()
        self.by_source: Counter[str] = Counter()
        self.adopted = 0
        self.am = Counter[str]()
        self.mv = Counter[str]()

    def clock(self) -> float:
        return self.now

    def arrive(self, i: int) -> None:
        c, key = self.conv[i], self.key[i]
        w = int(self.route[c])
        if self.threshold is not None and self.load[w] > self.threshold:  # overflow
            load = self.load
            least = load.index(min(load))
            if load[least] < load[w]:
                w = least
                self.route[c] = w
                self.mv["session_moves"] += 1
        self.load[w] += 1
        self.served[i] = w
        self.served_epoch[i] = self.epoch[w]
        store = self.stores[w]
        store.expire()
        last, self.last_worker[c] = int(self.last_worker[c]), w
        if not self.follow_up[i]:
            return
        reused = self.reused[i]
        run: tuple[int, int] | None = None
        tier = store.tier(key)
        if tier is not None:
            store.take(key)
            self.leased[i] = True
            self.by_tier[tier] += 1
            self.by_source["local"] += 1
            run = self.runs[w].pop(key)
        elif self.moves.pull and self.holder[c] not in (-1, w):
            run = self._pull(self.holder[c], key)
        if run is None:
            self.misses[store.miss_reason(key)] += 1
            if self.gapped[c]:
                self.am["blind_after_gap"] += 1
        else:
            self.adopted += 1
            first, end = run
            self.am["covered_keys"] += max(0, min(reused, end) - first)
            self.am["reused_keys_adopted"] += reused
        self.am["reused_keys"] += reused
        if last != w:
            self.mv["moved_follow_ups"] += 1
            self.mv["moved_adopted"] += run is not None
        if self.blind_keeps and reused:
            # valid over [0, N) only through an adopted run reaching R: a turn that adopted
            # [first, end) with first < R <= end keeps first; any other is blind below R
            self.first_valid[i] = run[0] if run is not None and run[0] < reused <= run[1] else reused

    def _pull(self, h: int, key: int) -> tuple[int, int] | None:
        """The holder `h` hands `key`'s entry over (taken, its lease released: one holder); None if
        it no longer holds it. The serving worker's store holds no lease for it, so the turn's
        deposit there is a newcomer's."""
        holder = self.stores[h]
        holder.expire()
        tier = holder.tier(key)
        if tier is None:
            return None
        nbytes = holder.nbytes(key)
        holder.take(key)
        holder.end_lease(key)
        self.by_tier[tier] += 1
        self.by_source["remote"] += 1
        self.mv["entries_moved.pull"] += 1
        self.mv["bytes_moved.pull"] += nbytes
        return self.runs[h].pop(key)

    def finish(self, i: int) -> None:
        w, c, key = self.served[i], self.conv[i], self.key[i]
        self.load[w] -= 1
        store = self.stores[w]
        store.expire()
        first = self.first_valid[i]
        restarted = self.epoch[w] != self.served_epoch[i]
        if first and self.gap:
            self.am["gaps"] += 1
            self.gapped[c] = True
            if self.leased[i] and not restarted:
                store.end_lease(key)
            return
        if first:
            self.am["valid_runs"] += 1
        run = (first, self.rows[i])
        nbytes = (self.rows[i] - first) * self.config.row_bytes
        if restarted:  # its worker stopped while the turn ran
            if self.moves.model == "drain" and self.moves.pull:
                self._hand_off(key, nbytes, run)
            else:
                self.mv["lost_in_flight"] += 1
            return
        held = self.runs[w].get(key) if first and store.tier(key) is not None else None
        if self._deposit(w, key, nbytes, run) and held is not None and held[0] < first:
            self.am["replaced_fuller"] += 1

    def _deposit(self, w: int, key: int, nbytes: int, run: tuple[int, int]) -> bool:
        """`key`'s rows into worker `w`'s store (device, else the host tier's second chance)."""
        store = self.stores[w]
        entry = CarriedDrafter((), 0, None, (), key)
        if store.admit(key, nbytes, key) is not None:
            store.put(entry, nbytes, key)
        elif not store.deposit_host(entry, nbytes, key):  # the executors' second chance
            return False
        self.runs[w][key] = run
        self.holder[key - 1] = w
        self.gapped[key - 1] = False
        return True

    def _hand_off(self, key: int, nbytes: int, run: tuple[int, int]) -> bool:
        """A draining worker offers `key`'s entry to its session's worker now."""
        w = int(self.route[key - 1])
        self.stores[w].expire()
        if self._deposit(w, key, nbytes, run):
            self.mv["entries_moved.handoff"] += 1
            self.mv["bytes_moved.handoff"] += nbytes
            return True
        self.mv["handoff_refused"] += 1
        return False

    def restart(self, d: int, t: float) -> None:
        """Worker `d` drains or crashes at `t` and comes back empty; its sessions move."""
        self.now = t
        old, runs = self.stores[d], self.runs[d]
        old.expire()
        self.mv["restarts"] += 1
        self.epoch[d] += 1
        moving = np.flatnonzero((self.route == d) & (self.last_worker >= 0))  # started sessions
        others = worker_of(moving, self.config.workers - 1)
        self.route[moving] = others + (others >= d)
        self.mv["session_moves"] += len(moving)
        self.retired.append(old)
        self.stores[d], self.runs[d] = self.new_store(d), {}
        handoff = self.moves.model == "drain" and self.moves.pull
        # most wanted first: the device tier in the policy's keep order, then the host tier's newest
        keys = [*reversed(old.victims()), *(e.session_hash for e in reversed(old.host_entries))]
        for key in keys:
            nbytes = old.nbytes(key)
            if handoff and self._hand_off(key, nbytes, runs[key]):
                continue
            self.mv["lost_entries"] += 1
            self.mv["lost_bytes"] += nbytes

    def result(self, policy: str, follow_ups: int) -> PolicyResult:
        ev: Counter[str] = Counter()
        ref: Counter[str] = Counter()
        peaks: Counter[str] = Counter()
        restored = demoted = 0
        stores = [*self.retired, *self.stores]
        for s in stores:
            ev.update(s.evictions())
            ref.update(s.refusals())
            tiers = s.tier_stats()
            for name, b in tiers.peak_bytes.items():
                peaks[name] = max(peaks[name], b)
            restored += tiers.bytes_restored
            demoted += tiers.demotions
        mv = self.mv
        return PolicyResult(
            policy=policy,
            follow_ups=follow_ups,
            adopted=self.adopted,
            adopted_by_tier={"device": self.by_tier["device"], "host": self.by_tier["host"]},
            misses={r: self.misses[r] for r in NO_CARRY_REASONS if self.misses[r]},
            evictions=dict(ev),
            refusals=dict(ref),
            deposits=sum(s.deposits for s in stores),
            peak_bytes={"device": peaks["device"], "host": peaks["host"]},
            bytes_restored=restored,
            demotions=demoted,
            adopted_by_source={"local": self.by_source["local"], "remote": self.by_source["remote"]},
            after_miss=AfterMissResult(**self.am),
            moves=MoveResult(
                restarts=mv["restarts"], session_moves=mv["session_moves"],
                moved_follow_ups=mv["moved_follow_ups"], moved_adopted=mv["moved_adopted"],
                entries_moved={"handoff": mv["entries_moved.handoff"], "pull": mv["entries_moved.pull"]},
                bytes_moved={"handoff": mv["bytes_moved.handoff"], "pull": mv["bytes_moved.pull"]},
                handoff_refused=mv["handoff_refused"], lost_entries=mv["lost_entries"],
                lost_bytes=mv["lost_bytes"], lost_in_flight=mv["lost_in_flight"]),
        )


def replay(trace: Trace, policy: str, config: ReplayConfig,
           return_odds: Callable[[int], ReturnOdds] | None = None) -> PolicyResult:
    """Drive `config.workers` `CarryStore`s of `policy` with `trace` (see the module header).

    `return_odds(worker)`, for policy `returns` only, gives each worker's store
    (a restarted one too) the estimate it ranks by instead of the one it learns
    (a what-if analysis: scripts/trace_ceilings.py).
    """
    reused = trace.reused_tokens
    bad_rows = np.flatnonzero((reused < 0) | ((reused > 0) & (reused >= trace.input_tokens)))
    if len(bad_rows):
        bad = int(bad_rows[0])
        raise ValueError(f"request {bad}: reused_tokens {int(reused[bad])} must be 0 or in [1, input_tokens "
                         f"{int(trace.input_tokens[bad])})")
    fleet = _Fleet(trace, policy, config, return_odds)
    times, is_arrival, reqs = _events(trace, config.service)
    every = config.moves.every_s
    restarts = 0
    next_restart = math.inf if every is None else every
    workers = config.workers
    for t, arrives, i in zip(times.tolist(), is_arrival.tolist(), reqs.tolist(), strict=True):
        while next_restart < t or (arrives and next_restart == t):  # after finishes, before arrivals
            fleet.restart(restarts % workers, next_restart)
            restarts += 1
            assert every is not None
            next_restart = every * (restarts + 1)
        fleet.now = t
        if arrives:
            fleet.arrive(i)
        else:
            fleet.finish(i)
    return fleet.result(policy, trace.follow_ups)


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


__all__ = ["AFTER_MISS", "MOVE_MODELS", "QWEN3_NEXT_MTP_ROW_BYTES", "AfterMissResult", "BoundResult",
           "MoveResult", "Moves", "PolicyResult", "ReplayConfig", "ServiceModel", "clairvoyant_bound",
           "next_use", "replay", "worker_of"]
