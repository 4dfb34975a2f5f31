"""Token sequences as the core compares them: in C-speed slices, never per token.

The adopt decision runs on every warm turn of sessions that reach 128k tokens,
so a common prefix is found by comparing slices (a C loop), narrowing from
large chunks to single tokens; Python iterates over chunks (at most 32 + 45
at 128k), never tokens.

Two representations, compared like with like:
- a `list` of Python ints: slice compare calls int `==` per element (fast only
  when the objects are identical, which fresh prompts never are);
- a token buffer, `array('q')` (contiguous int64): slice compare is a typed
  memory compare, about 15x faster at 128k. A prompt given as `array('q')`, a
  numpy integer array or an integer torch tensor becomes one buffer with a
  single copy. numpy and torch are never imported here: an object is treated
  as one only when the caller passed one (duck-typed on its module).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

# Chunk widths for narrowing down the first mismatch. The first pass walks the
# whole prefix 4096 tokens at a time (32 steps at 128k); each later pass takes
# at most 15 steps inside the chunk that mismatched.
_NARROWING = (4096, 256, 16, 1)

_TORCH_INT_DTYPES = frozenset(f"torch.{t}" for t in ("int8", "int16", "int32", "int64", "uint8"))


class TokenArray(Protocol):
    """A numpy array or torch tensor of token ids (anything with `tolist()` and a length)."""

    def __len__(self) -> int: ...

    def tolist(self) -> Any: ...


Tokens = Sequence[int] | TokenArray
"""What the core accepts as a prompt: a list, `array('q')`, numpy array, tensor, any sequence of ints."""

TokenSeq = TypeVar("TokenSeq", list[int], "array[int]")


def as_token_list(tokens: Tokens) -> list[int]:
    """`tokens` as a list of Python ints (the same object when it already is a list)."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)  # numpy arrays, torch tensors, array.array
    if callable(tolist):
        out = tolist()
        if isinstance(out, list):
            return out
    return list(tokens)  # type: ignore[arg-type]


def as_token_buffer(tokens: object) -> array[int] | None:
    """`tokens` as an int64 buffer when it already is one (or one copy away), else None.

    `array('q')` is returned as is; a 1-D numpy integer array or integer torch
    tensor is copied once. Lists, other sequences and values that do not fit
    int64 (uint64) give None: the caller compares lists instead.
    """
    if isinstance(tokens, array):
        return tokens if tokens.typecode == "q" else None
    module = type(tokens).__module__.partition(".")[0]
    if module == "numpy":
        return _numpy_buffer(tokens)
    if module == "torch":
        return _torch_buffer(tokens)
    return None


def token_buffer(tokens: list[int]) -> array[int] | None:
    """A new int64 buffer holding `tokens`, or None when a token does not fit int64."""
    try:
        return array("q", tokens)
    except (OverflowError, TypeError):
        return None


def common_prefix_len(a: TokenSeq, b: TokenSeq) -> int:
    """Length of the longest common prefix of two token lists (or two int64 buffers)."""
    if len(a) > len(b):
        a, b = b, a
    n = len(a)
    # Lists: the usual warm turn (the prompt extends the carried tokens) is one
    # whole-prefix compare. Buffers skip it: a fresh 1 MB slice per call at 128k
    # costs more in page faults (glibc hands large blocks back to the OS) than
    # 32 compares of 32 KB chunks, which reuse the same small allocations.
    if isinstance(a, list) and a == b[:n]:
        return n
    lo = 0
    for step in _NARROWING:
        while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
            lo += step
    return lo


def _numpy_buffer(x: Any) -> array[int] | None:
    dtype = getattr(x, "dtype", None)
    if getattr(x, "ndim", None) != 1 or dtype is None or dtype.kind not in "iu":
        return None
    if dtype.kind == "u" and dtype.itemsize >= 8:
        return None  # uint64 ids may not fit int64
    out = array("q")
    out.frombytes(memoryview(x.astype("int64", order="C", copy=False)).cast("B"))  # one copy
    return out


def _torch_buffer(x: Any) -> array[int] | None:
    if str(getattr(x, "dtype", "")) not in _TORCH_INT_DTYPES or x.dim() != 1:
        return None
    try:
        host = x.detach().to("cpu").numpy()  # a view of CPU memory; widened by numpy
    except (RuntimeError, TypeError):  # torch built without numpy
        return None
    return _numpy_buffer(host)
