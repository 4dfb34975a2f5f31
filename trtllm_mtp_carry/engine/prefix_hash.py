"""Chained 64-bit prefix keys shared by the block manager and the snapshot cache.

What it is for: naming a token prefix by a stable integer so that KV blocks and
SSM snapshots of the same prefix are found again on a later turn. The key of
the first `n` full blocks is the chain `h_0 = root`,
`h_i = blake2b(h_{i-1} || tokens of block i-1)`, where `root` is `ROOT_HASH`
for an unsalted request and `salt_root(cache_salt)` for a salted one (a
per-request namespace: two salts never share a key, so never a block); the key of an arbitrary depth
`d` continues the chain with the final partial chunk:

```
  | block 0 | block 1 | ... | block n-1 | partial chunk |
  0         B        2B             n*B               d        (n = d // B)
  key(d) = chain(h_n, tokens[n*B : d]) if d % B else h_n
```

Invariants:
- Tokens are encoded once per prompt as little-endian int64 bytes
  (`array('q')`); hashing walks blocks, never single tokens in Python.
- Keys are stable across processes and machines (no Python `hash()`), and
  are unsigned 64-bit ints.
- `salt_root(None) == ROOT_HASH` and `salt_root(s) != ROOT_HASH` for every
  salt, so no salt keeps the unsalted keys exactly.
- Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

ROOT_HASH = 0
"""Key of the empty prefix: the parent of block 0."""

_PERSON = b"mtpcarry-prefix"
_SALT_PERSON = b"mtpcarry-salt"

CacheSalt = str | bytes
"""A prefix-cache namespace: a non-empty str (UTF-8) or bytes; the same salt, the same cache."""


def salt_root(cache_salt: CacheSalt | None) -> int:
    """Root key of `cache_salt`'s prefix namespace: `ROOT_HASH` for None, else a u64 != ROOT_HASH.

    A str and its UTF-8 bytes are the same salt. TypeError/ValueError name a bad salt.
    """
    if cache_salt is None:
        return ROOT_HASH
    if isinstance(cache_salt, str):
        try:
            raw = cache_salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"cache_salt must be valid UTF-8, got {cache_salt!r}") from exc
    elif isinstance(cache_salt, bytes):
        raw = cache_salt
    else:
        raise TypeError(f"cache_salt must be a str or bytes, got {type(cache_salt).__name__} {cache_salt!r}")
    if not raw:
        raise ValueError(f"cache_salt must be non-empty, got {cache_salt!r}")
    digest = hashlib.blake2b(raw, digest_size=8, person=_SALT_PERSON).digest()
    return int.from_bytes(digest, "little") or 1  # never the unsalted root


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """`tokens` as little-endian int64 bytes; ValueError naming a token outside int64."""
    try:
        buf = array("q", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in int64: {exc}") from exc
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def chain_hash(parent: int, chunk: bytes) -> int:
    """Key of `chunk` (encoded tokens) appended to the prefix keyed `parent`: a u64."""
    digest = hashlib.blake2b(
        parent.to_bytes(8, "little") + chunk, digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


class PrefixKeys:
    """Keys of every prefix of one token sequence, computed lazily and at most once.

    `full(n)` is the key of the first `n` full blocks, `key(d)` that of
    `tokens[:d]`; block hashes are cached, so walking a prompt hashes each
    block once however many depths are asked for. Every key chains from
    `root` (`ROOT_HASH` unless the request is salted, see `salt_root`).
    """

    __slots__ = ("block_size", "num_tokens", "root", "_buf", "_full")

    def __init__(self, tokens: Sequence[int], block_size: int, root: int = ROOT_HASH) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        _check_root(root)
        self.block_size = block_size
        self.num_tokens = len(tokens)
        self.root = root
        self._buf = encode_tokens(tokens)
        self._full = [root]

    @staticmethod
    def of(tokens: Sequence[int] | PrefixKeys, block_size: int) -> PrefixKeys:
        """`tokens` itself if it is a `PrefixKeys` of `block_size`, else new keys for it."""
        if not isinstance(tokens, PrefixKeys):
            return PrefixKeys(tokens, block_size)
        if tokens.block_size != block_size:
            raise ValueError(f"PrefixKeys block_size {tokens.block_size} != {block_size}")
        return tokens

    def __len__(self) -> int:
        return self.num_tokens

    def full(self, num_blocks: int) -> int:
        """Key of `tokens[: num_blocks * block_size]` (`root` for 0 blocks)."""
        if not 0 <= num_blocks <= self.num_tokens // self.block_size:
            raise ValueError(
                f"num_blocks={num_blocks} outside [0, {self.num_tokens // self.block_size}] "
                f"for {self.num_tokens} tokens, block_size={self.block_size}"
            )
        step = 8 * self.block_size
        full = self._full
        while len(full) <= num_blocks:
            i = len(full) - 1
            full.append(chain_hash(full[-1], self._buf[i * step : (i + 1) * step]))
        return full[num_blocks]

    def key(self, depth: int) -> int:
        """Key of `tokens[:depth]`: the block chain plus the final partial chunk."""
        if not 0 <= depth <= self.num_tokens:
            raise ValueError(f"depth={depth} outside [0, {self.num_tokens}]")
        n, r = divmod(depth, self.block_size)
        parent = self.full(n)
        return parent if r == 0 else chain_hash(parent, self.chunk(n * self.block_size, depth))

    def chunk(self, lo: int, hi: int) -> bytes:
        """Encoded `tokens[lo:hi]` (a bytes slice, for exact comparisons)."""
        return self._buf[8 * lo : 8 * hi]


def _check_root(root: int) -> None:
    if type(root) is not int or not 0 <= root < 1 << 64:
        raise ValueError(f"root must be a u64 int, got {root!r}")
