"""Time `decide_adopt` on warm turns of 1k, 16k and 128k-token sessions.

The adopt decision runs on every warm turn, so it must stay linear and cheap.
Every compared prompt is built from FRESH int objects (`array.tolist()`), as a
prompt decoded from a request is: a list that shares the carried list's int
objects would let CPython's identity shortcut skip each compare and read
2.7-3.8x too fast.

Cases, for the prompt that extends the carried tokens (the usual warm turn)
and one that diverges in the middle (the re-tokenized boundary, which
exercises the narrowing search):
- `list`:   the prompt as a list of Python ints (an int compare per token);
- `buffer`: the prompt as `array('q')` (a typed memory compare);
- `numpy` / `tensor`: the prompt as an int64 numpy array / torch tensor (one
  copy into a buffer, then as `buffer`); shown when numpy / torch import.
A per-token Python loop is timed alongside for scale. Each figure is the median
and p25-p75 of `--repeat` single calls in microseconds, after a warm-up.

    python scripts/bench_decide_adopt.py [--sizes 1024 16384 131072] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Callable
from functools import partial
from typing import Any

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


def spread_us(fn: Callable[[], Any], repeat: int, warmup: int = 5) -> tuple[float, float, float]:
    """(median, p25, p75) of `repeat` single calls, in microseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[0], q[2]


def fresh(tokens: list[int]) -> list[int]:
    """The same values as new int objects (no identity shortcut in `==`)."""
    out = array("q", tokens).tolist()
    assert all(a is not b for a, b in zip(out[:64], tokens[:64], strict=True))
    return out


def prompt_forms(prompt: list[int]) -> dict[str, Any]:
    """The prompt in every form the core accepts that is installed here."""
    forms: dict[str, Any] = {"list": prompt, "buffer": array("q", prompt)}
    try:
        import numpy as np

        forms["numpy"] = np.array(prompt, dtype=np.int64)
    except ImportError:
        pass
    try:
        import torch

        forms["tensor"] = torch.tensor(prompt, dtype=torch.int64)
    except ImportError:
        pass
    return forms


def bench_history(n: int, new_span: int, repeat: int, rng: random.Random) -> list[str]:
    """Table rows for one history length: each prompt form, extending and diverging."""
    tokens = [rng.randrange(1000, 150_000) for _ in range(n)]  # ids past the small-int cache
    entry = CarriedDrafter(list(range(n // 16)), n - 1, n - 2, tokens, SESSION)
    extend = fresh(tokens + [rng.randrange(1000, 150_000) for _ in range(new_span)])
    diverge = list(extend)
    diverge[n // 2] = -1
    store = StoreRange(TICKET, n - 1, len(extend))
    full_store = StoreRange(TICKET, 0, len(extend))
    rows = []
    for case, prompt, st in (("extend", extend, store), ("diverge", diverge, full_store)):
        expect = decide_adopt(entry, prompt, SESSION, TICKET, st)
        for form, p in prompt_forms(prompt).items():
            assert decide_adopt(entry, p, SESSION, TICKET, st) == expect  # every form decides alike
            med, p25, p75 = spread_us(partial(decide_adopt, entry, p, SESSION, TICKET, st), repeat)
            rows.append(f"{n:>8} {case:<8} {form:<7} {med:>10.1f} {p25:>9.1f} {p75:>9.1f}")
    med, p25, p75 = spread_us(partial(naive_common_prefix_len, tokens, extend), max(5, repeat // 10))
    rows.append(f"{n:>8} {'extend':<8} {'loop':<7} {med:>10.1f} {p25:>9.1f} {p75:>9.1f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--new-span", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()

    rng = random.Random(0)
    print(f"{'history':>8} {'prompt':<8} {'form':<7} {'median us':>10} {'p25 us':>9} {'p75 us':>9}")
    for n in args.sizes:
        for row in bench_history(n, args.new_span, args.repeat, rng):
            print(row)


if __name__ == "__main__":
    main()
