"""Token sequences as the core compares them: in C-speed slices, never per token.

The adopt decision runs on every warm turn of sessions that reach 128k tokens,
so a common prefix is found by comparing list slices (a C loop), narrowing
from large chunks to single tokens; Python iterates over chunks, not tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

# Chunk widths for narrowing down the first mismatch. The first pass walks the
# whole prefix 4096 tokens at a time (32 steps at 128k); each later pass takes
# at most 15 steps inside the chunk that mismatched.
_NARROWING = (4096, 256, 16, 1)


def as_token_list(tokens: Sequence[int]) -> list[int]:
    """`tokens` as a list of Python ints (the same object when it already is a list)."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)  # numpy arrays, torch tensors, array.array
    if callable(tolist):
        out = tolist()
        if isinstance(out, list):
            return out
    return list(tokens)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    if len(a) > len(b):
        a, b = b, a
    n = len(a)
    if a == b[:n]:  # the usual warm turn: the prompt extends the carried tokens (one copy)
        return n
    lo = 0
    for step in _NARROWING:
        while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
            lo += step
    return lo
