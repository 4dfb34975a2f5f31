"""Session hashes and sequence tickets: the two identities the carry compares.

What it is for: the carry slot adopts drafter rows only for the same session
(a non-zero 64-bit session hash) and reads hidden rows only under the ticket
of the sequence that wrote them. Both are unsigned 64-bit ints where `0`
never matches anything, so neither function ever returns 0.

Invariants:
- `session_hash` is stable across processes and machines (blake2b, not
  Python's salted `hash()`); strings and ints hash in separate domains, so
  `"7"` and `7` are different sessions.
- `carry_key(h, None) == h`: an unsalted session's carry key is its session
  hash; `carry_key(h, salt)` is another non-zero u64 for every salt, so rows
  deposited under one salt are never adopted under another (the salt closes a
  timing side channel between tenants, as TensorRT-LLM and vLLM scope prefix
  reuse by it). A str salt and its UTF-8 bytes are the same salt.
- A `TicketCounter` hands out 1, 2, 3, ... once each, under a lock, and is
  never shared with any other generation counter.
"""

from __future__ import annotations

import hashlib
import threading

from ._checks import U64_LIMIT

_ZERO_STANDIN = 0x9E3779B97F4A7C15  # a digest of 0 maps here (probability 2**-64)


def session_hash(session_id: str | int) -> int:
    """Stable non-zero u64 for a session id: a non-empty str or an int in [0, 2**64).

    TypeError for other types (bool included), ValueError for an empty string
    or an int out of range; both name the value.
    """
    if isinstance(session_id, bool) or not isinstance(session_id, (str, int)):
        raise TypeError(f"session id must be a str or an int, got {session_id!r}")
    if isinstance(session_id, str):
        if not session_id:
            raise ValueError("session id must be a non-empty string, got ''")
        data = b"s" + session_id.encode("utf-8", "surrogatepass")
    else:
        if not 0 <= session_id < U64_LIMIT:
            raise ValueError(f"session id int must be in [0, 2**64), got {session_id}")
        data = b"i" + int(session_id).to_bytes(8, "little")
    digest = hashlib.blake2b(data, digest_size=8, person=b"mtpcarry-session").digest()
    return int.from_bytes(digest, "little") or _ZERO_STANDIN


def carry_key(session: int, cache_salt: str | bytes | None = None) -> int:
    """The carry store's key for session hash `session` under `cache_salt`.

    Every executor (the reference engine, the TensorRT-LLM adapter) derives
    the key here, so a session that switches salt starts fresh everywhere.
    `session` 0 (no session) stays 0: it never carries. None is the unsalted
    namespace (the key is `session` itself). TypeError/ValueError name a salt
    that is not a non-empty str or bytes.
    """
    if type(session) is not int or not 0 <= session < U64_LIMIT:
        raise TypeError(f"session must be a session hash (an int in [0, 2**64)), got {session!r}")
    if cache_salt is None:
        return session
    if isinstance(cache_salt, str):
        salt = cache_salt.encode("utf-8", "surrogatepass")
    elif isinstance(cache_salt, (bytes, bytearray)):
        salt = bytes(cache_salt)
    else:
        raise TypeError(f"cache_salt must be a str, bytes or None, got {cache_salt!r}")
    if not salt:
        raise ValueError("cache_salt must be non-empty (None is the unsalted namespace), got an empty salt")
    if session == 0:
        return 0
    digest = hashlib.blake2b(session.to_bytes(8, "little") + salt, digest_size=8,
                             person=b"mtpcarry-carry").digest()
    return int.from_bytes(digest, "little") or _ZERO_STANDIN


class TicketCounter:
    """Thread-safe source of fresh non-zero u64 sequence tickets, starting at 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def draw(self) -> int:
        """The next ticket: each value once, in increasing order (RuntimeError past 2**64 - 1)."""
        with self._lock:
            if self._last == U64_LIMIT - 1:
                raise RuntimeError("ticket counter exhausted 2**64 - 1 tickets")
            self._last += 1
            return self._last

    @property
    def last(self) -> int:
        """The most recent ticket drawn (0 before the first draw)."""
        return self._last
