"""The adapter's carried rows: the core's `CarryStore` for bookkeeping, tensors for the rows.

What it is for: between two turns of a session the MTP layer's rows leave
TensorRT-LLM's draft pool (which frees every page at the end of a request)
and wait here. This module is the adapter's only use of `CarryStore`, so a
change of the store's API is absorbed in one place.

Entries hold TensorRT-LLM-native rows: row `k` is pair key `k` roped at
position `k` (the core's own pool ropes at `k + 1`; the store does not care,
it keeps bookkeeping only). Every entry covers keys `0 ..= last_pair_key`
with no gap (`rows == last_pair_key + 1`), so an adopted prefix is rows
`[0, n)`.

Invariants:
- At most `slots` entries and at most `budget_bytes` of rows; a deposit
  evicts the session's older entry (`replaced`), then the least recently
  deposited entries for slots (`capacity`) or bytes (`pool_pressure`).
- An entry leaves exactly once (taken, or evicted with a cause), and its
  tensor leaves with it; `check()` proves the store and the tensors agree.
- Thread-safe: `stats()` may be read while the executor thread deposits.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import CarriedDrafter, CarryStore


@dataclass(frozen=True, slots=True)
class TakenRows:
    """An adopted entry: its bookkeeping and its rows `[n, 2, Hkv, D]`."""

    entry: CarriedDrafter
    rows: torch.Tensor


class CarriedRows:
    """Carried MTP rows keyed by session, at most `slots` entries and `budget_bytes` bytes."""

    def __init__(self, slots: int, budget_bytes: int) -> None:
        self._store = CarryStore(slots)
        self._rows: dict[int, torch.Tensor] = {}
        self.budget_bytes = budget_bytes
        self.refused_too_large = 0  # deposits larger than the whole budget
        self._lock = threading.RLock()

    def candidate(self, session: int) -> CarriedDrafter | None:
        """The entry `decide_adopt` judges for `session` (CarryStore.candidate)."""
        with self._lock:
            return self._store.candidate(session)

    def take(self, session: int) -> TakenRows:
        """Remove `session`'s entry for adoption; RuntimeError if it has none."""
        with self._lock:
            entry = self._store.take(session)
            return TakenRows(entry, self._rows.pop(session))

    def deposit(self, session: int, tokens: Sequence[int], rows: torch.Tensor) -> bool:
        """Keep `rows` (keys `0 .. n-1`, `n <= len(tokens) - 1`) for `session`; False if over budget."""
        # rows: [n, 2, Hkv, D], a copy owned by the store from now on
        n = rows.shape[0]
        nbytes = rows.numel() * rows.element_size()
        with self._lock:
            if nbytes > self.budget_bytes or n == 0:
                self.refused_too_large += int(n > 0)
                self._evict(session, "replaced")  # the older rows are stale now
                return False
            for old in self._store.make_room(session):
                del self._rows[old.session_hash]
            while self._bytes() + nbytes > self.budget_bytes:
                oldest = self._store.entries()[0].session_hash
                self._evict(oldest, "pool_pressure")
            self._store.put(CarriedDrafter((), n, n - 1, tokens, session))
            self._rows[session] = rows
            return True

    def forget(self, session: int) -> int:
        """Drop `session`'s rows (the session ended); returns the rows dropped."""
        with self._lock:
            entry = self._evict(session, "session_end")
            return 0 if entry is None else entry.rows

    def clear(self) -> None:
        """Drop every entry (`cleared`)."""
        with self._lock:
            for entry in self._store.clear():
                del self._rows[entry.session_hash]

    def stats(self) -> dict[str, object]:
        """Entries, rows and bytes held, deposits, adoptions, evictions by cause."""
        with self._lock:
            return {
                "carry_slots": self._store.slots,
                "entries": len(self._store),
                "rows_held": self._store.rows_held,
                "bytes_held": self._bytes(),
                "budget_bytes": self.budget_bytes,
                "deposits": self._store.deposits,
                "adoptions": self._store.adoptions,
                "evictions": self._store.evictions(),
                "refused_too_large": self.refused_too_large,
            }

    def check(self) -> None:
        """RuntimeError unless every entry has exactly its rows and nothing else is held."""
        with self._lock:
            keys = [e.session_hash for e in self._store.entries()]
            if sorted(keys) != sorted(self._rows):
                raise RuntimeError(f"carried entries {keys} differ from the rows held {list(self._rows)}")
            for e in self._store.entries():
                if self._rows[e.session_hash].shape[0] != e.rows:
                    raise RuntimeError(f"entry 0x{e.session_hash:016x} has {e.rows} rows, "
                                       f"holds {self._rows[e.session_hash].shape[0]}")

    def _evict(self, session: int, cause: str) -> CarriedDrafter | None:
        entry = self._store.evict(session, cause)
        if entry is not None:
            del self._rows[session]
        return entry

    def _bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._rows.values())
