"""The carry store: carried drafter entries keyed by session hash, at most `slots` of them.

What it is for: the bookkeeping half of the carry across several sessions. The
runtime deposits a finished turn's `CarriedDrafter` under its session hash and
takes it back out when the session's next turn adopts it; the drafter pool
holds the rows themselves under the same key. Plain Python, no torch.

Order is least recently deposited first (an entry is "used" by its deposit:
adoption takes it out, and the adopting turn deposits it again when it ends)::

    | oldest entry | ... | newest entry |   <- deposit appends here
      ^ evicted first (capacity, pool pressure)

Invariants:
- At most one entry per session hash, at most `slots` entries, never session 0.
- An entry leaves exactly once, by `take` (adopted) or an eviction with one
  cause from `EVICTION_CAUSES`; every leave is counted.
- `candidate(h)` is `h`'s own entry when there is one; else the newest entry
  of another session (which `decide_adopt` refuses as ForeignSession), else
  None. With one slot this is exactly the seed's single slot.
"""

from __future__ import annotations

from collections import OrderedDict

from ._checks import check_u64
from .drafter import CarriedDrafter

EVICTION_CAUSES: tuple[str, ...] = (
    "capacity",  # every slot was held: the least recently deposited entry made room
    "pool_pressure",  # a live sequence needed the blocks (live sequences always win)
    "session_end",  # the session ended (`forget_session`)
    "replaced",  # the same session deposited newer rows
    "cleared",  # the runtime dropped every entry (`clear_slot`)
)
"""Why an entry left the store without being adopted, in the order counters list them."""


class CarryStore:
    """At most `slots` carried entries keyed by session hash, least recently deposited first."""

    def __init__(self, slots: int) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.slots = slots
        self._entries: OrderedDict[int, CarriedDrafter] = OrderedDict()
        self._evictions = dict.fromkeys(EVICTION_CAUSES, 0)
        self.deposits = 0
        self.adoptions = 0

    # ---- queries -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_hash: object) -> bool:
        return session_hash in self._entries

    def get(self, session_hash: int) -> CarriedDrafter | None:
        """The entry carried for `session_hash`, or None."""
        return self._entries.get(session_hash)

    def candidate(self, session_hash: int) -> CarriedDrafter | None:
        """The entry `decide_adopt` judges for `session_hash` (see the module invariants)."""
        own = self._entries.get(session_hash) if session_hash != 0 else None
        if own is not None:
            return own
        return next(reversed(self._entries.values()), None)

    def entries(self) -> tuple[CarriedDrafter, ...]:
        """Every entry, least recently deposited first."""
        return tuple(self._entries.values())

    def newest(self) -> CarriedDrafter | None:
        """The most recently deposited entry, or None."""
        return next(reversed(self._entries.values()), None)

    @property
    def rows_held(self) -> int:
        return sum(e.rows for e in self._entries.values())

    @property
    def blocks_held(self) -> int:
        return sum(len(e.block_table) for e in self._entries.values())

    def evictions(self) -> dict[str, int]:
        """Evictions so far by cause (every cause listed, zeros too)."""
        return dict(self._evictions)

    # ---- changes -------------------------------------------------------------

    def make_room(self, session_hash: int) -> list[CarriedDrafter]:
        """Evict what must go before `session_hash` deposits; return the evicted, in order.

        The session's own older entry goes first (`replaced`), then the least
        recently deposited entries (`capacity`) until a slot is free. The caller
        frees their rows.
        """
        check_u64("session_hash", session_hash)
        evicted = []
        if session_hash in self._entries:
            evicted.append(self._remove(session_hash, "replaced"))
        while len(self._entries) >= self.slots:
            evicted.append(self._remove(next(iter(self._entries)), "capacity"))
        return evicted

    def put(self, entry: CarriedDrafter) -> None:
        """Deposit `entry` as the newest; RuntimeError unless `make_room` made room for it."""
        key = entry.session_hash
        if key == 0:
            raise ValueError("an entry of session 0 never carries (session 0 matches nothing)")
        if key in self._entries or len(self._entries) >= self.slots:
            raise RuntimeError(
                f"no room for session 0x{key:016x}: {len(self._entries)} of {self.slots} slots held"
                f"{' (its own entry among them)' if key in self._entries else ''}; call make_room first"
            )
        self._entries[key] = entry
        self.deposits += 1

    def take(self, session_hash: int) -> CarriedDrafter:
        """Remove and return `session_hash`'s entry for adoption; RuntimeError if it has none."""
        entry = self._entries.pop(session_hash, None) if session_hash != 0 else None
        if entry is None:
            raise RuntimeError(f"no carried entry for session 0x{session_hash:016x} to take")
        self.adoptions += 1
        return entry

    def evict(self, session_hash: int, cause: str) -> CarriedDrafter | None:
        """Remove `session_hash`'s entry for `cause` and return it (None, uncounted, if it has none)."""
        if cause not in self._evictions:
            raise ValueError(f"cause must be one of {EVICTION_CAUSES}, got {cause!r}")
        if session_hash not in self._entries:
            return None
        return self._remove(session_hash, cause)

    def clear(self) -> list[CarriedDrafter]:
        """Evict every entry (`cleared`); return them, oldest first."""
        return [self._remove(key, "cleared") for key in list(self._entries)]

    def _remove(self, key: int, cause: str) -> CarriedDrafter:
        self._evictions[cause] += 1
        return self._entries.pop(key)
