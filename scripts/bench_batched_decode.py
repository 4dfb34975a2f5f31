"""Aggregate decode tokens/s of the reference engine at concurrency N versus 1.

The same N chat sessions (random byte prompts of `--prompt-len` tokens, carry on,
the shipped reference weights) decode `--max-new-tokens` each, once one at a time
(concurrency 1) and once all together (concurrency N: one batched draft and one
batched verify forward per step). Only decode is timed: each side first runs every
prefill, then times the steps until every answer is done. Each repeat runs both
sides in one process, back to back (order alternating), after one untimed warm-up;
the figure is the median of the paired per-repeat ratios, with p25-p75.

    python scripts/bench_batched_decode.py [--concurrency 8] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from trtllm_mtp_carry.engine.engine import EngineConfig, ReferenceEngine
from trtllm_mtp_carry.engine.model import load_reference


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(32, 127, (length,), generator=gen).tolist() for _ in range(n)]


def decode_rate(model, tok, batch: list[list[int]], concurrency: int, max_new: int,
                draft_len: int) -> tuple[float, int]:
    """(decode tokens/s, tokens) running `batch` at `concurrency` sequences at a time."""
    eng = ReferenceEngine(model, tok, EngineConfig(max_num_seqs=concurrency, draft_len=draft_len,
                                                   max_model_len=4096))
    elapsed, tokens = 0.0, 0
    for start in range(0, len(batch), concurrency):
        group = batch[start:start + concurrency]
        ids = [eng.submit(f"s{start + i}", p, max_new_tokens=max_new) for i, p in enumerate(group)]
        while any(eng.output_so_far(rid) == [] for rid in ids):  # every prefill, untimed
            for r in eng.step():
                tokens += len(r.output)  # answered by its first token: no decode to time
        t0 = time.perf_counter()
        while eng.has_unfinished():
            tokens += sum(len(r.output) for r in eng.step())
        elapsed += time.perf_counter() - t0
    eng.check()
    return tokens / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_reference()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    n = args.concurrency
    batch = prompts(n, args.prompt_len, seed=0)
    decode_rate(model, tok, batch, n, 8, args.draft_len)  # warm-up
    ones, ns, ratios = [], [], []
    for rep in range(args.repeat):
        order = (1, n) if rep % 2 == 0 else (n, 1)
        got = {c: decode_rate(model, tok, batch, c, args.max_new_tokens, args.draft_len)
               for c in order}
        assert got[1][1] == got[n][1], "the same answers at both concurrencies"
        ones.append(got[1][0])
        ns.append(got[n][0])
        ratios.append(got[n][0] / got[1][0])
        print(f"repeat {rep}: c=1 {got[1][0]:.1f} tok/s, c={n} {got[n][0]:.1f} tok/s, "
              f"ratio {ratios[-1]:.2f} ({got[n][1]} tokens)")

    def q(xs: list[float]) -> str:
        qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return f"{statistics.median(xs):.2f} (p25-p75 {qs[0]:.2f}-{qs[2]:.2f})"

    print(f"decode tok/s c=1: {q(ones)}; c={n}: {q(ns)}; paired ratio c={n}/c=1: {q(ratios)}; "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
