"""Time `decide_adopt` on warm turns of 1k, 16k and 128k-token sessions.

The adopt decision runs on every warm turn, so it must stay linear and cheap:
the prompt extends the carried tokens (the usual case), and a second case
diverges in the middle (the re-tokenized boundary), which exercises the
narrowing search. A per-token Python loop is timed alongside for scale.

    python scripts/bench_decide_adopt.py [--sizes 1024 16384 131072] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import timeit
from functools import partial

from trtllm_mtp_carry import CarriedDrafter, StoreRange, decide_adopt

SESSION, TICKET = 0x5EED, 7


def naive_common_prefix_len(a: list[int], b: list[int]) -> int:
    """The per-token loop the core avoids (for scale only)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def per_call_us(fn, repeat: int) -> float:
    timer = timeit.Timer(fn)
    best = min(timer.repeat(repeat=5, number=max(1, repeat // 5)))
    return best / max(1, repeat // 5) * 1e6


def bench_history(n: int, new_span: int, repeat: int, rng: random.Random) -> str:
    """One table row: decide_adopt on an extending and a diverging prompt, and the naive loop."""
    tokens = [rng.randrange(1000, 150_000) for _ in range(n)]  # ids past the small-int cache
    entry = CarriedDrafter(list(range(n // 16)), n - 1, n - 2, tokens, SESSION)
    prompt = list(tokens) + [rng.randrange(1000, 150_000) for _ in range(new_span)]
    diverged = list(prompt)
    diverged[n // 2] = -1
    store = StoreRange(TICKET, n - 1, len(prompt))
    full_store = StoreRange(TICKET, 0, len(prompt))
    assert decide_adopt(entry, prompt, SESSION, TICKET, store).adopted
    extend = per_call_us(partial(decide_adopt, entry, prompt, SESSION, TICKET, store), repeat)
    diverge = per_call_us(partial(decide_adopt, entry, diverged, SESSION, TICKET, full_store), repeat)
    loop = per_call_us(partial(naive_common_prefix_len, tokens, prompt), max(5, repeat // 10))
    return f"{n:>8} {extend:>10.1f} {diverge:>11.1f} {loop:>9.1f} {loop / extend:>11.1f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--new-span", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()

    rng = random.Random(0)
    print(f"{'history':>8} {'extend us':>10} {'diverge us':>11} {'loop us':>9} {'loop/extend':>12}")
    for n in args.sizes:
        print(bench_history(n, args.new_span, args.repeat, rng))


if __name__ == "__main__":
    main()
