"""What knowing more about who comes back would buy: the `returns` store told part of the future.

What it is for: issue 23 asks for 70% of a trace's follow-ups adopted at 8 x
1 GiB with the device budget alone; the learned `returns` policy gets about
two thirds. This script measures, through the package's own `CarryStore` and
replay (`trace-replay`'s code, `replay(..., return_odds=...)`), what the same
store and rules reach when the estimate it ranks by is replaced by one fitted
*in hindsight on the whole trace* (every figure here uses the future; no
executor can have them):

    oracle        each deposit's chance is 1 if it is adopted within the TTL, else 0
    <features>    each deposit's chance is the adoption rate of the trace's *other*
                  deposits sharing its features (turn class, size band, previous gap band,
                  new span band; left one out, so a small group does not hand a deposit
                  its own outcome), times how that rate falls with age (the trace-wide
                  wait distribution)

and, with `--chances PATH.npy`, any predictor's chances (one a request, made
by whatever model outside the package), ranked as the tables are; and one
what-if that is not about the estimate: for a Mooncake trace, the
learned policy with every entry charged without the first block's rows (the
system prompt every request shares, as if one copy per worker served every
entry; that copy, 1 MiB, is left out): what sharing it across conversations
would add. The adapter's carried entries do not share rows across conversations
(the reference runtime's pool does, `carry_share`; the replay models the adapter).

An estimate's worth is its chance per share of the budget, ranked and admitted
by the store's own rules, as `returns` is. Rows: the learned policy, then each
hindsight estimate; the clairvoyant bound last.

    python scripts/trace_ceilings.py mooncake-conversation.jsonl --workers 8 --carry-memory 1GiB   # the trace: docs/TRACE-REPLAY.md

By default every replay here deposits each finished turn's rows whole (`--after-miss full`,
the model its figures in BENCHMARKS.md are measured with): the estimates are compared on equal
terms, whatever a missed turn leaves behind; `--after-miss valid-run` replays what the executors
do.

Invariants:
- The stores, the replay and the counting are the package's; only the
  estimate differs (a `ReturnOdds` subclass that does not learn).
- A hindsight table is fitted on the very trace it is replayed on: a ceiling
  for what those features can say, not a policy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from trtllm_mtp_carry.core.eviction import ReturnOdds
from trtllm_mtp_carry.core.settings import parse_carry_host_memory
from trtllm_mtp_carry.traces.reader import MOONCAKE_BLOCK_TOKENS, Trace, read_trace
from trtllm_mtp_carry.traces.replay import (
    AFTER_MISS,
    ReplayConfig,
    clairvoyant_bound,
    next_use,
    replay,
)

GAP_EDGES_S = (30.0, 120.0, 480.0)
"""Previous-gap bands of a later turn (seconds from the previous turn's finish to its arrival)."""

SPAN_EDGES = (50, 200, 1000, 4000)
"""New-span bands of a later turn (tokens its input adds to the previous turn's input and output)."""

FEATURES: dict[str, tuple[str, ...]] = {
    "turn class": ("turn",),
    "turn class x size band": ("turn", "size"),
    "turn class x previous gap": ("turn", "gap"),
    "turn class x size band x previous gap": ("turn", "size", "gap"),
    "turn class x new span band": ("turn", "span"),
    "all four": ("turn", "size", "gap", "span"),
}


def feature_bands(trace: Trace, finish_s: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """Per feature (`turn`, `size`, `gap`, `span`): each request's band, and how many bands there are."""
    turn = np.minimum(trace.turn, 5)
    rows = trace.input_tokens + trace.output_tokens
    size = np.clip(np.floor(np.log2(np.maximum(rows, 1))).astype(np.int64) - 9, 0, 7)  # 512 .. 64k rows
    prev = np.full(len(trace), -1)  # each request's previous turn in its conversation (-1: a first turn)
    order = np.lexsort((np.arange(len(trace)), trace.conversation))  # each conversation in arrival order
    same = trace.conversation[order][1:] == trace.conversation[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    later, p = prev >= 0, np.maximum(prev, 0)
    gap = trace.arrival_s - finish_s[p]
    span = trace.input_tokens - trace.input_tokens[p] - trace.output_tokens[p]
    return {"turn": (turn, 6), "size": (size, 8),
            "gap": (np.where(later, 1 + np.searchsorted(GAP_EDGES_S, gap), 0), len(GAP_EDGES_S) + 2),
            "span": (np.where(later, 1 + np.searchsorted(SPAN_EDGES, span, side="right"), 0), len(SPAN_EDGES) + 2)}


def feature_groups(bands: dict[str, tuple[np.ndarray, int]], features: Sequence[str]) -> np.ndarray:
    """Per request, one integer naming its group under `features` (keys of `feature_bands`)."""
    group = np.zeros(len(bands["turn"][0]), dtype=np.int64)
    for name in features:
        values, base = bands[name]
        group = group * base + values
    return group


def load_chances(path: str, requests: int) -> np.ndarray:
    """A predictor's chances (`--chances`): one finite float in [0, 1] per request; ValueError
    naming the file and what is wrong otherwise."""
    try:
        chance = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--chances {path!r}: not a .npy array ({exc})") from None
    if chance.shape != (requests,) or chance.dtype.kind not in "fiub":
        raise ValueError(f"--chances {path!r}: expected {requests} numbers (one a request), "
                         f"got shape {chance.shape} of {chance.dtype}")
    chance = chance.astype(np.float64)
    if not np.all(np.isfinite(chance) & (chance >= 0) & (chance <= 1)):
        raise ValueError(f"--chances {path!r}: every chance must be a number in [0, 1]")
    return chance


def left_one_out_rate(group: np.ndarray, adopted: np.ndarray) -> np.ndarray:
    """Per deposit, the adoption rate of the *other* deposits of its group (one pseudo-deposit at
    the trace-wide rate), so a small group's rate does not carry its own deposit's outcome."""
    y = adopted.astype(np.float64)
    hits = np.bincount(group, weights=y)[group] - y
    n = np.bincount(group)[group] - 1
    return (hits + y.mean()) / (n + 1)


class HindsightOdds(ReturnOdds):
    """A `ReturnOdds` that does not learn: each deposit's chance at each age is given (module header).

    `chance[i]` is request `i`'s deposit's chance to be adopted; `waits` the
    waits of the adopted deposits, whose share not yet adopted at an age
    scales the chance down as the entry ages (None: age does not matter, as
    for the oracle). A deposit is found by its key and time (the replay
    deposits request `i` at its finish, keyed `conversation + 1`).
    """

    def __init__(self, deposits: dict[tuple[int, float], int], chance: np.ndarray,
                 waits: np.ndarray | None, horizon_s: float) -> None:
        super().__init__(horizon_s, 1)
        self._deposits = deposits
        self._chance_of = chance
        self._waits = None if waits is None else np.sort(waits)
        self._newest = -1  # the request the store is admitting (its `worth` call follows `deposited`)

    def _chance_at(self, request: int, age: float) -> float:
        p = float(self._chance_of[request])
        if self._waits is None or p in (0.0, 1.0):
            return p
        alive = 1.0 - float(np.searchsorted(self._waits, age, side="right")) / len(self._waits)
        return p * alive / (1.0 - p + p * alive)

    def deposited(self, key: int, now: float) -> int:
        self._newest = self._deposits[(key, now)]
        return 0

    def adopted(self, key: int, now: float) -> None:
        return None

    def sweep(self, now: float) -> None:
        return None

    def worth(self, cls: int, age: float, cost: float) -> float:
        return self._chance_at(self._newest, age) / max(cost, 1e-300)

    def rank(self, keys: Sequence[int], deposited_at: Sequence[float], costs: Sequence[float],
             now: float) -> tuple[list[int], list[float]]:
        worth = [self._chance_at(self._deposits[(k, at)], now - at) / max(n, 1e-300)
                 for k, at, n in zip(keys, deposited_at, costs, strict=True)]
        order = sorted(range(len(keys)), key=lambda i: (worth[i], -i))  # equal worth: newest first
        return [keys[i] for i in order], [worth[i] for i in order]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--carry-memory", default="1GiB")
    ap.add_argument("--carry-idle-s", type=float, default=600.0)
    ap.add_argument("--after-miss", choices=AFTER_MISS, default="full",
                    help="what a turn that ran blind deposits (trace-replay --after-miss); default full, "
                         "the model the recorded figures used")
    ap.add_argument("--chances", metavar="PATH.npy", action="append", default=[],
                    help="one float in [0, 1] a request, in the order the trace is read (arrival "
                         "order): a predictor's chance that the request's deposit is adopted, "
                         "ranked as the hindsight tables are (repeatable)")
    args = ap.parse_args(argv)
    try:
        trace = read_trace(args.trace)
        budget = parse_carry_host_memory(args.carry_memory, "--carry-memory")
        config = ReplayConfig(budget, workers=args.workers, idle_s=args.carry_idle_s, after_miss=args.after_miss)
        given = [(path, load_chances(path, len(trace))) for path in args.chances]
    except (OSError, ValueError) as exc:
        print(f"trace_ceilings: error: {exc}", file=sys.stderr)
        return 2
    finish = config.service.finish_s(trace)
    use = next_use(trace, config)
    adopted = ~np.isnan(use)
    deposits = {(int(c) + 1, float(t)): i for i, (c, t) in enumerate(zip(trace.conversation, finish, strict=True))}
    waits = (use - finish)[adopted]
    horizon = args.carry_idle_s

    def run(chance: np.ndarray, with_age: bool) -> float:
        return replay(trace, "returns", config, return_odds=lambda _worker: HindsightOdds(
            deposits, chance, waits if with_age else None, horizon)).adopted_fraction

    print(f"{len(trace)} requests, {trace.follow_ups} follow-ups; {args.workers} worker(s) x "
          f"{args.carry_memory}, idle TTL {horizon:g} s; adopted within the TTL: {int(adopted.sum())} deposits")
    print(f"{'estimate the store ranks by':48s} follow-ups adopted")
    learned = replay(trace, "returns", config).adopted_fraction
    print(f"{'learned online (the returns policy)':48s} {100 * learned:5.1f}%")
    bands = feature_bands(trace, finish)
    for name, features in FEATURES.items():
        group = feature_groups(bands, features)
        print(f"{'hindsight: ' + name:48s} {100 * run(left_one_out_rate(group, adopted), True):5.1f}%")
    for path, chance in given:
        print(f"{'given: ' + Path(path).name:48s} {100 * run(chance, True):5.1f}%")
    print(f"{'oracle: told which deposits are adopted':48s} {100 * run(adopted.astype(float), False):5.1f}%")
    if trace.format == "mooncake":  # every request's first 512-token block is the one system prompt
        shared = replace(trace, input_tokens=np.maximum(trace.input_tokens - MOONCAKE_BLOCK_TOKENS, 0),
                         reused_tokens=np.maximum(trace.reused_tokens - MOONCAKE_BLOCK_TOKENS, 0))
        what_if = replay(shared, "returns", config).adopted_fraction
        print(f"{'what-if: the shared first block held once':48s} {100 * what_if:5.1f}%   (learned online)")
    bound = clairvoyant_bound(trace, config).adopted_fraction
    print(f"{'clairvoyant bound (every next arrival known)':48s} {100 * bound:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
