"""Replay the bench's interleaved workload against the real `CarryStore`, one eviction policy at a time.

What it is for: choosing the carry store's eviction policy (DECISIONS.md) from
the store's own code, in seconds, before the slow engine bench confirms it.
The model is the bench's `--interleave` replay: `sessions` conversations, each
`turns` turns, at most `concurrency` in flight, admitted round-robin and
finishing in admission order (FIFO, as the engine's equal-length turns do);
a turn adopts its session's entry at admission (`take`) and deposits its rows
at the end (`admit` + `put`). An entry's size grows with its conversation:
`history + turn * (span + answer)` rows, in 16-row blocks.

    python scripts/sim_carry_eviction.py --sessions 64 --turns 3 --concurrency 32 --slots 16
    python scripts/sim_carry_eviction.py --sessions 64 --turns 3 --concurrency 32 --budget-entries 16

Prints one line per policy: warm turns adopted, and every miss by reason.
"""

from __future__ import annotations

import argparse
from collections import Counter, deque

from trtllm_mtp_carry import EVICTION_POLICIES, CarriedDrafter, CarryOutcome, CarryStore, StoreRange

BLOCK = 16


def entry_blocks(history: int, turn: int, grow: int) -> int:
    rows = history + turn * grow
    return -(-rows // BLOCK)


def simulate(policy: str, sessions: int, turns: int, concurrency: int, slots: int | None,
             budget_blocks: int | None, history: int, grow: int) -> tuple[int, int, Counter[str]]:
    """(warm turns adopted, warm turns, no_carry reasons of warm turns) under `policy`."""
    store = CarryStore(slots, budget_blocks, policy)
    next_turn = [0] * sessions
    inflight: deque[tuple[int, int]] = deque()  # (session, turn), admission order
    cursor = 0
    adopted = warm = 0
    misses: Counter[str] = Counter()
    prompt = [1, 2, 3, 4]

    def admit_one() -> bool:
        nonlocal cursor, adopted, warm
        busy = {s for s, _ in inflight}
        for i in range(sessions):
            s = (cursor + i) % sessions
            if s not in busy and next_turn[s] < turns:
                cursor = (s + 1) % sessions
                t = next_turn[s]
                key = s + 1
                if t > 0:
                    warm += 1
                    outcome = store.judge(key, prompt, 1, StoreRange.EMPTY)
                    if isinstance(outcome, CarryOutcome.Adopted):
                        store.take(key)
                        adopted += 1
                    elif isinstance(outcome, CarryOutcome.NoCarry):
                        misses[outcome.reason] += 1
                    else:
                        misses[outcome.kind] += 1
                inflight.append((s, t))
                return True
        return False

    while True:
        while len(inflight) < concurrency and admit_one():
            pass
        if not inflight:
            break
        s, t = inflight.popleft()
        key, blocks = s + 1, entry_blocks(history, t, grow)
        evicted = store.admit(key, blocks)
        if evicted is not None:
            store.put(CarriedDrafter((), 3, 2, prompt, key), blocks)
        next_turn[s] += 1
    return adopted, warm, misses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--history", type=int, default=2300, help="rows of a first turn's entry")
    p.add_argument("--grow", type=int, default=160, help="rows each turn adds (new span + answer)")
    p.add_argument("--slots", type=int, default=None, help="slot cap (default: none)")
    p.add_argument("--budget-entries", type=float, default=None,
                   help="memory budget, in first-turn entries (default: none)")
    args = p.parse_args()
    budget = None
    if args.budget_entries is not None:
        budget = int(args.budget_entries * entry_blocks(args.history, 0, args.grow))
    print(f"sessions={args.sessions} turns={args.turns} concurrency={args.concurrency} "
          f"slots={args.slots} budget_blocks={budget}")
    for policy in EVICTION_POLICIES:
        adopted, warm, misses = simulate(policy, args.sessions, args.turns, args.concurrency,
                                         args.slots, budget, args.history, args.grow)
        why = " ".join(f"{k}={v}" for k, v in sorted(misses.items()))
        print(f"{policy:<10} adopted {adopted:>4} of {warm} warm turns ({100 * adopted / warm:.0f}%)  {why}")


if __name__ == "__main__":
    main()
