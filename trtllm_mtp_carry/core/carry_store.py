"""The carry store: carried drafter entries keyed by carry key, bounded by memory.

What it is for: the one carry bookkeeping every executor shares (the reference
engine's runtime, the TensorRT-LLM adapter). The runtime deposits a finished
turn's `CarriedDrafter` under its carry key (`carry_key(session, salt)`) and
takes it back out when that key's next turn adopts it; the executor holds the
rows themselves under the same key. `judge` is the carry decision: the key's
own entry through `decide_adopt`, or `NoCarry` with the reason it is absent.
Plain Python, no torch.

Bounds: `budget_bytes` of rows (each deposit says its size; with a `row_format`
the size must be its rows in that format), an optional cap of `slots` entries,
and an idle time-to-live (`idle_s`). With `block_nbytes` set,
entries are charged by block instead: an entry costs `block_nbytes` per block
of its `block_table`, and a block several entries share (a common prompt
prefix, `DrafterKVPool.share_blocks`) is charged once, so evicting an entry
frees only the blocks no other entry holds. Entries are kept in
deposit order; which one leaves first is the eviction policy's choice::

    | oldest deposit | ... | newest deposit |   <- deposit appends here
      lrd: evicted first                  incumbent: evicted first (and newcomers
      slru: first never-adopted first     are refused while incumbents fill it)

- `lrd` (least recently deposited): the seed's order; under a cyclic workload
  larger than the store it evicts exactly the entry needed next (0 adopted).
- `slru`: entries adopted at least once are protected; never-adopted ones go
  first, oldest first, then protected ones, oldest first.
- `returns` (the default; core/eviction.py; DECISIONS.md, "The `returns` eviction
  policy", has the trace figures): the entry with the lowest learned chance to be adopted per
  share of the bounds it takes (bytes, slot) leaves first, worth within
  `ADMIT_MARGIN` counting as equal (newest first among equals, as
  `incumbent`); a newcomer is admitted only if it is worth more than
  `ADMIT_MARGIN` times every entry it would push out, a returning key unless
  one is worth more than `ADMIT_MARGIN` times it (`not_admitted` otherwise;
  with a host tier the refused newcomer gets the host tier's second chance,
  `deposit_host`). It learns from the deposits and adoptions it sees.
- `incumbent`: keep what is held.
  A newcomer that does not fit is refused (`not_admitted`) instead of evicting
  anything; a returning key (one whose rows a running turn adopted, a lease,
  or that replaces its own entry) makes room by evicting the newest entries
  first. A lease reserves nothing: while the rows are out in a live sequence
  a newcomer may use their room, and gives way (newest first) when they come
  back. Idle expiry, session ends and pool pressure still evict, so entries
  of sessions that never return make room in time.

Invariants:
- At most one entry per key, never key 0; at most `slots` entries and at most
  `budget_bytes` held (adopted rows out in live sequences are not held; a
  shared block counts once).
- An entry leaves exactly once, by `take` (adopted) or an eviction with one
  cause from `EVICTION_CAUSES`; every leave and every refused deposit is counted.
- `candidate(k)` is `k`'s own entry; with one slot, else the slot's entry of
  another key (which `decide_adopt` refuses as ForeignSession: the seed's
  slot); else None, and `miss_reason(k)` says why (`NO_CARRY_REASONS`).

Tiers: the store is one mechanism over two `_Tier` objects, `device` and
(optionally) `host`, each with its entries, its budget and its row format
(`row_format`, core/row_format.py: what an entry's rows cost there; None: what
the executor states, or by block). Both tiers are ranked by the same policy
code (`_victims(tier)`) and the same learned estimate::

    device tier: budget_bytes, slots, by block (shared) | row format | stated bytes
        | demote (memory, capacity, pool_pressure)      ^ take restores
        v                                               |
    host tier:   host_budget_bytes, no slot cap, by block (each its own) | row format | stated bytes

Host tier (`host_budget_bytes > 0`; 0, the default, is the store without one,
bit for bit): an entry that leaves the device budget for room (`memory`,
`capacity`) or for `pool_pressure` is demoted instead of evicted: the store
calls `host_moves.demote(entry)` (the executor copies its rows to host memory
and frees its device rows) and keeps the entry in a second tier bounded by
`host_budget_bytes` (charged each entry's full rows: host copies share
nothing), ordered and evicted by the same policy's victim order (an entry
leaving the host tier is an eviction with its cause, counted once, and the
executor frees the host copy in `host_moves.drop(entry)`). A take of a host
entry counts a host hit and calls `host_moves.restore(entry)`, which brings
the rows back to the device before `take` returns. Device-tier queries
(`entries`, `len`, `bytes_held`, `victim`) see the device tier only; `get`,
`candidate`, `judge`, `nbytes` and `in` see both, so a key has at most one
entry across the tiers. Methods that return evicted entries return only
those whose device rows the caller frees. A deposit the device tier refuses
(`not_admitted`) may go straight to the host tier (`deposit_host`), under the
host tier's own budget and policy.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from ._checks import check_non_negative, check_u64
from .adopt import decide_adopt
from .drafter import CarriedDrafter
from .eviction import ADMIT_MARGIN, ReturnOdds
from .outcome import CarryOutcome, NoCarry
from .row_format import RowFormat
from .settings import EVICTION_POLICIES, check_eviction_policy
from .store_range import StoreRange
from .tokens import Tokens

EVICTION_CAUSES: tuple[str, ...] = (
    "capacity",  # the slot cap was reached: an entry made room for a deposit
    "memory",  # the memory budget was full: an entry made room for a deposit
    "pool_pressure",  # a live sequence needed the blocks (live sequences always win)
    "idle",  # the session did not return within the idle time-to-live
    "session_end",  # the session ended (`evict_session`)
    "replaced",  # the same key deposited newer rows
    "cleared",  # the runtime dropped every entry (`clear`)
    "fault",  # an exception inside the carry lost its rows (`discard`: the executor no longer holds them)
    "moved",  # another worker took the entry's rows (a pull or a drain moved it there): one holder
)
"""Why an entry left the store without being adopted, in the order counters list them."""

DEMOTION_CAUSES: tuple[str, ...] = ("capacity", "memory", "pool_pressure")
"""Causes for which an entry leaving the device budget moves to the host tier (when one is on)."""

TIERS: tuple[str, ...] = ("device", "host")
"""The store's tiers, in the order per-tier counters list them."""

REFUSAL_CAUSES: tuple[str, ...] = ("not_admitted", "too_large", "oom")
"""Why a deposit was refused, in the order counters list them: the store's own decisions
(`not_admitted`, `too_large`: nothing evicted) and the executor's (`oom`: an admitted
deposit whose rows could not be allocated, `refuse`)."""

MISS_MEMORY = 65536
"""How many absent keys the store remembers a miss reason for, and at most how many leases
it keeps (oldest forgotten first)."""

K = TypeVar("K")
V = TypeVar("V")


def remember(log: OrderedDict[K, V], key: K, value: V, limit: int) -> None:
    """`log[key] = value` as the newest of at most `limit` keys (the oldest dropped first): the
    bounded memory of recent keys the store, the fault ledger and the executors keep."""
    log[key] = value
    log.move_to_end(key)
    while len(log) > limit:
        log.popitem(last=False)


@dataclass(slots=True)
class _Held:
    entry: CarriedDrafter
    nbytes: int
    session: int
    deposited_at: float
    adoptions: int  # times this key's rows were adopted and deposited back (slru's protection)


@dataclass(slots=True)
class _Lease:
    nbytes: int
    session: int
    taken_at: float
    adoptions: int


class CarryStore:
    """Carried entries keyed by carry key, bounded by bytes, an optional slot cap and an idle TTL.

    `CarryStore(slots)` alone is the seed-compatible store: no byte budget, no
    TTL, least recently deposited evicted first. One slot is always `lrd` (the
    seed's slot: the newest deposit wins it), whatever `policy` says.
    `block_nbytes` switches the charge from each deposit's stated bytes to its
    blocks (see the module header): `admit` then takes the deposit's `blocks`.
    `host_budget_bytes` > 0 adds the host tier (module header; set `host_moves`
    for the executor's copies). `return_odds` (policy `returns` only) replaces
    the estimate the store learns from its own calls: a what-if analysis gives
    the store an estimate told part of the future (scripts/trace_ceilings.py);
    executors leave it unset. `row_format` (core/row_format.py) is the format both
    tiers hold rows in: without block charging an entry then costs its rows in that
    format, and a deposit's stated bytes must equal them (ValueError otherwise), so the
    store charges what the executor really holds (packed fp8, nvfp4: payload plus scales).
    """

    def __init__(
        self,
        slots: int | None = None,
        budget_bytes: int | None = None,
        policy: str = "lrd",
        idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_nbytes: int | None = None,
        host_budget_bytes: int = 0,
        return_odds: ReturnOdds | None = None,
        row_format: RowFormat | None = None,
    ) -> None:
        if slots is not None and (type(slots) is not int or slots < 1):
            raise ValueError(f"slots must be an int >= 1 or None (no cap), got {slots!r}")
        if budget_bytes is not None:
            check_non_negative("budget_bytes", budget_bytes)
        if idle_s is not None and (isinstance(idle_s, bool) or not isinstance(idle_s, (int, float))
                                   or not idle_s > 0):
            raise ValueError(f"idle_s must be a positive number of seconds or None, got {idle_s!r}")
        if block_nbytes is not None and (type(block_nbytes) is not int or block_nbytes < 1):
            raise ValueError(f"block_nbytes must be an int >= 1 or None, got {block_nbytes!r}")
        if row_format is not None and not isinstance(row_format, RowFormat):
            raise TypeError(f"row_format must be a RowFormat or None, got {type(row_format).__name__}")
        self._device = _Tier("device", budget_bytes, slots, block_nbytes, row_format, shared=True)
        self.policy = check_eviction_policy(policy, "policy")
        if slots == 1:  # the seed's single slot: the newest finished session wins it
            self.policy = "lrd"
        self.idle_s = idle_s
        self._clock = clock
        self._entries = self._device.entries  # the device tier's entries, which most queries read
        self._leases: dict[int, _Lease] = {}
        self._misses: OrderedDict[int, str] = OrderedDict()
        self._last_key: OrderedDict[int, int] = OrderedDict()  # session -> key it last deposited
        self._evictions = dict.fromkeys(EVICTION_CAUSES, 0)
        self._refusals = dict.fromkeys(REFUSAL_CAUSES, 0)
        self.deposits = 0
        self.adoptions = 0
        if type(host_budget_bytes) is not int or host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be an int >= 0 (0: no host tier), got {host_budget_bytes!r}")
        self.host_moves: HostMoves | None = None
        """The executor's row moves between tiers (None: bookkeeping only, as in a trace replay)."""
        if return_odds is not None and not isinstance(return_odds, ReturnOdds):
            raise TypeError(f"return_odds must be a ReturnOdds or None, got {type(return_odds).__name__}")
        if return_odds is not None and self.policy != "returns":
            raise ValueError(f"return_odds is the `returns` policy's estimate, but the policy is {self.policy!r}")
        if self.policy == "returns":
            self._odds: ReturnOdds | None = ReturnOdds(idle_s, MISS_MEMORY) if return_odds is None else return_odds
        else:
            self._odds = None
        """The `returns` policy's chances (core/eviction.py: learned from this store's own calls, unless
        an analysis passed `return_odds`, e.g. one told the future); None under other policies."""
        self._host = (_Tier("host", host_budget_bytes, None, block_nbytes, row_format, shared=False)
                      if host_budget_bytes else None)
        self._counts = _TierCounters()

    # ---- queries -------------------------------------------------------------

    @property
    def slots(self) -> int | None:
        """The device tier's cap on entries (None: no cap)."""
        return self._device.slots

    @property
    def budget_bytes(self) -> int | None:
        """The device tier's budget in bytes (None: unbounded)."""
        return self._device.budget_bytes

    @property
    def block_nbytes(self) -> int | None:
        """Bytes of one block when entries are charged by block, else None."""
        return self._device.block_nbytes

    @property
    def host_budget_bytes(self) -> int:
        """The host tier's budget in bytes (0: no host tier)."""
        return 0 if self._host is None else self._host.budget_bytes or 0

    @property
    def row_format(self) -> RowFormat | None:
        """The row format both tiers hold entries in (None: each costs what its deposit states)."""
        return self._device.row_format

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries or (self._host is not None and key in self._host.entries)

    def get(self, key: int) -> CarriedDrafter | None:
        """The entry carried under `key` in either tier, or None."""
        held = self._entries.get(key) or self._host_held(key)
        return None if held is None else held.entry

    def candidate(self, key: int) -> CarriedDrafter | None:
        """The entry `decide_adopt` judges for `key` (see the module invariants)."""
        held = (self._entries.get(key) or self._host_held(key)) if key != 0 else None
        if held is not None:
            return held.entry
        if self.slots == 1 and self._entries:  # the seed's single slot: whoever holds it
            return next(iter(self._entries.values())).entry
        return None

    def miss_reason(self, key: int, session: int | None = None) -> str:
        """Why `key` has no entry now (a `NO_CARRY_REASONS` name); `session` names its session."""
        if key in self._leases:
            return "in_use"
        reason = self._misses.get(key)
        if reason is not None:
            return reason
        if session is not None and self._last_key.get(session, key) != key:
            return "new_salt"
        return "never_carried"

    def judge(self, key: int, prompt: Tokens, ticket: int, store: StoreRange,
              session: int | None = None) -> CarryOutcome:
        """The carry decision for sequence `ticket` of carry key `key` (call only when armed).

        `decide_adopt` on `candidate(key)`; a `NoCarry` carries `miss_reason(key, session)`.
        """
        outcome = decide_adopt(self.candidate(key), prompt, key, ticket, store)
        if isinstance(outcome, NoCarry):
            return NoCarry(self.miss_reason(key, session))
        return outcome

    def entries(self) -> tuple[CarriedDrafter, ...]:
        """Every entry, least recently deposited first."""
        return tuple(h.entry for h in self._entries.values())

    def newest(self) -> CarriedDrafter | None:
        """The most recently deposited entry, or None."""
        return next((h.entry for h in reversed(self._entries.values())), None)

    def nbytes(self, key: int) -> int:
        """Bytes the entry under `key` was deposited with (0 if none; by block: all its blocks)."""
        held = self._entries.get(key) or self._host_held(key)
        return 0 if held is None else held.nbytes

    @property
    def rows_held(self) -> int:
        return sum(h.entry.rows for h in self._entries.values())

    @property
    def blocks_held(self) -> int:
        """Blocks the entries hold (a block several entries share counts once when charged by block)."""
        if self.block_nbytes is not None:
            return len(self._device.block_refs)
        return sum(len(h.entry.block_table) for h in self._entries.values())

    @property
    def shared_blocks(self) -> int:
        """Blocks two or more entries hold (0 unless charged by block)."""
        return sum(1 for n in self._device.block_refs.values() if n > 1)

    @property
    def bytes_held(self) -> int:
        """Bytes of every entry held (as each deposit stated them, or by distinct block)."""
        return self._device.nbytes

    @property
    def leases(self) -> int:
        """Keys whose rows a running turn adopted and may deposit back."""
        return len(self._leases)

    def evictions(self) -> dict[str, int]:
        """Evictions so far by cause (every cause listed, zeros too)."""
        return dict(self._evictions)

    def refusals(self) -> dict[str, int]:
        """Deposits refused so far by cause (every cause listed, zeros too)."""
        return dict(self._refusals)

    def victim(self) -> int | None:
        """The key the policy evicts first for pool pressure (None when nothing is held)."""
        order = self._victims(self._device)
        return order[0] if order else None

    def victims(self) -> tuple[int, ...]:
        """Every held key in the order the policy evicts them for pool pressure (first: `victim()`).

        A pool grow that needs several victims takes them in this order: it asks
        `victim()` for each, and the store hears of each eviction (`evict`) before
        the next is named (`DrafterKVPool.grow`).
        """
        return tuple(self._victims(self._device))

    # ---- changes -------------------------------------------------------------

    def admit(self, key: int, nbytes: int = 0, session: int | None = None,
              blocks: Sequence[int] | None = None) -> list[CarriedDrafter] | None:
        """Make room for `key`'s deposit of `nbytes` under the policy; return the evicted, in order.

        Charged by block, the deposit is `blocks` (its block table; `nbytes` is
        ignored): it costs only the blocks no entry holds yet. None means refused
        (nothing evicted; `miss_reason(key)` says why, and the key's lease, if any,
        is dropped): `too_large` if the deposit alone exceeds the whole budget,
        `not_admitted` if the policy keeps its incumbents. The caller frees the
        evicted entries' rows, then `put`s the entry.
        """
        check_u64("key", key)
        check_non_negative("nbytes", nbytes)
        room = self._room(nbytes, blocks)
        if self.budget_bytes is not None and room.alone > self.budget_bytes:
            self._refuse(key, "too_large")
            return None
        returning = key in self._entries or key in self._leases or self._host_held(key) is not None
        if self.policy == "incumbent" and not returning and not room.fits():
            self._refuse(key, "not_admitted")
            return None
        worth = None  # `returns`: what a victim may be worth at most (the admission test)
        if self._odds is not None:
            cls = self._odds.deposited(key, self._clock())
            worth = self._odds.worth(cls, 0.0, self._cost(room.alone, self._device))
            # near ties keep the incumbent, unless the key came back (its turn is the evidence)
            worth = worth * ADMIT_MARGIN if returning else worth / ADMIT_MARGIN
        if key in self._entries:
            room.remove(key)  # its own older rows go (`replaced`)
        if not room.fits():
            ranked = self._ranked(self._device) if self._odds is not None else None
            order = self._victims(self._device) if ranked is None else ranked[0]
            for i, k in enumerate(order):
                if k != key:
                    if worth is not None and ranked is not None and ranked[1][i] >= worth:
                        self._refuse(key, "not_admitted")  # it would push out an entry worth more
                        return None
                    room.remove(k)
                    if room.fits():
                        break
            if not room.fits():  # unreachable: the deposit fits alone, all may go
                self._refuse(key, "not_admitted")
                return None
        self._drop_host(key, "replaced")
        gone = (self._remove(k, "replaced") if k == key else self._leave_device(k, self._room_cause())
                for k in room.gone)  # the cause is read per entry, as each leaves
        return [e for e in gone if e is not None]

    def refuse(self, key: int) -> None:
        """The executor could not hold the rows of `key`'s admitted deposit (an allocation
        failed): the refusal is counted as `oom`, `miss_reason(key)` says `oom`, and the key's
        lease is dropped. Call between `admit` and `put`, instead of `put` (what `admit`
        evicted stays evicted)."""
        self._refuse(check_u64("key", key), "oom")

    def make_room(self, session_hash: int, nbytes: int = 0,
                  blocks: Sequence[int] | None = None) -> list[CarriedDrafter]:
        """Evict what must go before `session_hash` deposits (never refuses); return the evicted.

        The key's own older entry goes first (`replaced`), then entries in the
        policy's victim order until the deposit fits (`blocks` as for `admit`).
        Prefer `admit`, which lets the policy refuse a newcomer.
        """
        check_u64("session_hash", session_hash)
        check_non_negative("nbytes", nbytes)
        evicted = []
        if self._odds is not None:
            self._odds.deposited(session_hash, self._clock())
        if session_hash in self._entries:
            evicted.append(self._remove(session_hash, "replaced"))
        self._drop_host(session_hash, "replaced")
        for k in self._victims(self._device):
            if self._room(nbytes, blocks).fits():
                break
            gone = self._leave_device(k, self._room_cause())
            if gone is not None:
                evicted.append(gone)
        return evicted

    def put(self, entry: CarriedDrafter, nbytes: int = 0, session: int | None = None) -> None:
        """Deposit `entry` (of `nbytes`, session `session`, default its key) as the newest.

        Charged by block, its cost is its `block_table`'s blocks no entry holds yet
        (`nbytes` is ignored). RuntimeError unless `admit` or `make_room` made room for it.
        """
        key = entry.session_hash
        check_non_negative("nbytes", nbytes)
        if key == 0:
            raise ValueError("an entry of session 0 never carries (session 0 matches nothing)")
        blocks = entry.block_table if self.block_nbytes is not None else None
        if key in self or not self._room(nbytes, blocks).fits():
            raise RuntimeError(
                f"no room for session 0x{key:016x}: {len(self._entries)} of {self.slots or 'any'} slots, "
                f"{self._device.nbytes} of {self.budget_bytes} bytes held"
                f"{' (its own entry among them)' if key in self._entries else ''}; call admit first"
            )
        self._device.check_nbytes(entry, nbytes)
        lease = self._leases.pop(key, None)
        owner = key if session is None else check_u64("session", session)
        if blocks is not None:
            nbytes = len(blocks) * self.block_nbytes  # type: ignore[operator]
        self._device.add(key, _Held(entry, nbytes, owner, self._clock(),
                                    0 if lease is None else lease.adoptions + 1))
        self._counts.peak_device = max(self._counts.peak_device, self._device.nbytes)
        self._note_deposit(key, owner)

    def take(self, session_hash: int) -> CarriedDrafter:
        """Remove and return `session_hash`'s entry for adoption; RuntimeError if it has none.

        The key holds a lease until it deposits again or `end_lease` drops it.
        A host-tier entry counts a host hit and is restored (`host_moves.restore`)
        first; the entry returned is then the restored one.
        """
        held = self._device.pop(session_hash) if session_hash in self._entries and session_hash != 0 else None
        if held is None:
            restored = self._take_host(session_hash) if session_hash != 0 else None
            if restored is None:
                raise RuntimeError(f"no carried entry for session 0x{session_hash:016x} to take")
            held = restored
        else:
            self._counts.hits["device"] += 1
        if self._odds is not None:
            self._odds.adopted(session_hash, self._clock())
        self._leases[session_hash] = _Lease(held.nbytes, held.session, self._clock(), held.adoptions)
        if len(self._leases) > MISS_MEMORY:  # a caller that never ends its leases stays bounded
            oldest = next(iter(self._leases))
            del self._leases[oldest]
            self._remember(oldest, "not_deposited")
        self.adoptions += 1
        return held.entry

    def end_lease(self, key: int, reason: str = "not_deposited") -> bool:
        """The turn that adopted `key`'s rows ended without depositing them; remember `reason`."""
        if self._leases.pop(key, None) is None:
            return False
        self._remember(key, reason)
        return True

    def evict(self, session_hash: int, cause: str) -> CarriedDrafter | None:
        """Remove `session_hash`'s entry for `cause` and return it (None, uncounted, if it has none).

        With a host tier, a device entry leaving for a `DEMOTION_CAUSES` cause is
        demoted (None: it stays, in host memory), and a host entry leaves with its
        host copy (`host_moves.drop`; None: no device rows to free).
        """
        if cause not in self._evictions:
            raise ValueError(f"cause must be one of {EVICTION_CAUSES}, got {cause!r}")
        if session_hash not in self._entries:
            self._drop_host(session_hash, cause)
            return None
        return self._leave_device(session_hash, cause)

    def discard(self, key: int, cause: str = "fault") -> str | None:
        """Forget `key`'s entry, in whichever tier holds it, without any host move: the executor
        no longer holds its rows (a fault lost them) or frees them itself. Counted under
        `cause` (an `EVICTION_CAUSES` name) and remembered as the key's miss reason; returns
        the tier it left (`TIERS`), or None (nothing held, nothing counted)."""
        if cause not in self._evictions:
            raise ValueError(f"cause must be one of {EVICTION_CAUSES}, got {cause!r}")
        if key in self._entries:
            self._remove(key, cause)
            return "device"
        return "host" if self._drop_host(key, cause, free_copy=False) else None

    def leased(self, key: int) -> bool:
        """Whether `key`'s entry is out on a lease (taken, not yet deposited again nor ended)."""
        return key in self._leases

    def evict_session(self, session: int, cause: str = "session_end") -> list[CarriedDrafter]:
        """Evict every entry of `session` (under any salt) for `cause`; drop its leases too."""
        if cause not in self._evictions:
            raise ValueError(f"cause must be one of {EVICTION_CAUSES}, got {cause!r}")
        keys = [k for k, h in self._entries.items() if h.session == session or k == session]
        for k in [k for k, lease in self._leases.items() if lease.session == session or k == session]:
            del self._leases[k]
            self._remember(k, cause)
        if self._host is not None:
            for k in [k for k, h in self._host.entries.items() if h.session == session or k == session]:
                self._drop_host(k, cause)
        return [self._remove(k, cause) for k in keys]

    def expire(self) -> list[CarriedDrafter]:
        """Evict (`idle`) entries deposited more than `idle_s` ago, and drop leases that old."""
        if self.idle_s is None:
            return []
        cutoff = self._clock() - self.idle_s
        out = []
        while self._entries:  # deposit order is time order: stop at the first young entry
            key, held = next(iter(self._entries.items()))
            if held.deposited_at > cutoff:
                break
            out.append(self._remove(key, "idle"))
        for k in [k for k, lease in self._leases.items() if lease.taken_at <= cutoff]:
            del self._leases[k]
            self._remember(k, "idle")
        while self._host is not None and self._host.entries:  # kept in deposit order too
            key, held = next(iter(self._host.entries.items()))
            if held.deposited_at > cutoff:
                break
            self._drop_host(key, "idle")
        return out

    def clear(self) -> list[CarriedDrafter]:
        """Evict every entry (`cleared`); return the device tier's, oldest first (host copies are dropped)."""
        if self._host is not None:
            for k in list(self._host.entries):
                self._drop_host(k, "cleared")
        return [self._remove(key, "cleared") for key in list(self._entries)]

    # ---- host tier -------------------------------------------------------------

    @property
    def host_entries(self) -> tuple[CarriedDrafter, ...]:
        """Every host-tier entry, least recently deposited first (empty without a host tier)."""
        return () if self._host is None else tuple(h.entry for h in self._host.entries.values())

    @property
    def host_bytes_held(self) -> int:
        """Bytes the host tier holds (each entry's full rows; 0 without a host tier)."""
        return 0 if self._host is None else self._host.nbytes

    def deposit_host(self, entry: CarriedDrafter, nbytes: int = 0, session: int | None = None) -> bool:
        """Deposit `entry` straight into the host tier after the device tier refused it (`admit`
        returned None, `not_admitted`): the second chance a newcomer gets when the policy keeps
        the device's incumbents. The executor holds its rows as a device entry's (carried
        under its key): `host_moves.demote` copies them out and frees them.

        True if the host tier took it (its refusal is forgotten: the key's next turn finds
        it; counted as a deposit and in `TierStats.host_deposits`); False, nothing changed
        (the caller frees the rows), without a host tier, if the key holds an entry, if it
        is larger than the host budget, or if the policy keeps the host's incumbents. Charged
        by block, its cost is every block of its table (`nbytes` is ignored).
        """
        key = entry.session_hash
        check_non_negative("nbytes", nbytes)
        host = self._host
        if host is None or key == 0 or key in self:
            return False
        owner = key if session is None else check_u64("session", session)
        host.check_nbytes(entry, nbytes)
        lease = self._leases.get(key)
        held = _Held(entry, nbytes, owner, self._clock(), 0 if lease is None else lease.adoptions + 1)
        if self._into_host(key, held) != "moved":
            return False
        self._leases.pop(key, None)
        self._note_deposit(key, owner)
        self._counts.host_deposits += 1
        return True

    def host_admits(self, key: int, rows: int, nbytes: int = 0, blocks: Sequence[int] | None = None) -> bool:
        """Whether `deposit_host` would take a deposit of `rows` rows under `key` now (`nbytes` its
        stated bytes, `blocks` its block table where the host tier charges by block): the plan of
        a host-bound deposit, asked before any row moves. Changes nothing."""
        host = self._host
        if host is None or key == 0 or key in self:
            return False
        return self._host_room(host.price_rows(rows, blocks, nbytes)) is not None

    def session_of(self, key: int) -> int:
        """The session `key`'s entry belongs to (its key before the salt); KeyError if none is held."""
        held = self._entries.get(key) or self._host_held(key)
        if held is None:
            raise KeyError(key)
        return held.session

    def tier(self, key: int) -> str | None:
        """Which tier (`TIERS`) holds `key`'s entry, or None."""
        if key in self._entries:
            return "device"
        return "host" if self._host_held(key) is not None else None

    def tier_stats(self) -> TierStats:
        """A frozen snapshot of the per-tier counters (zeros without a host tier)."""
        t = self._counts
        host = self._host
        return TierStats(
            host_budget_bytes=self.host_budget_bytes,
            hits=dict(t.hits),
            demotions=t.demotions,
            demotions_refused=t.demotions_refused,
            host_deposits=t.host_deposits,
            host_evictions=dict(t.host_evictions),
            bytes_demoted=t.bytes_demoted,
            bytes_restored=t.bytes_restored,
            host_entries=0 if host is None else len(host.entries),
            host_bytes_held=self.host_bytes_held,
            peak_bytes={"device": t.peak_device, "host": t.peak_host},
            row_dtypes={tier.name: tier.row_dtype for tier in (self._device, host) if tier is not None},
            demote_ms=t.demote_ms,
            restore_ms=t.restore_ms,
        )

    def _host_held(self, key: int) -> _Held | None:
        return None if self._host is None else self._host.entries.get(key)

    def _host_room(self, nbytes: int) -> list[int] | None:
        """Host keys to leave so `nbytes` fit the host tier, in victim order; None if refused
        (larger than the host budget, or `incumbent` keeps the host's entries; nothing leaves)."""
        host = self._host
        assert host is not None
        room = _Room(host, nbytes, None)
        if host.budget_bytes is not None and room.alone > host.budget_bytes:
            return None
        if self.policy == "incumbent" and not room.fits():
            return None
        for k in self._victims(host):
            if room.fits():
                break
            room.remove(k)
        return list(room.gone)

    def _leave_device(self, key: int, cause: str) -> CarriedDrafter | None:
        """`key`'s device entry leaves for `cause`: demoted when a host tier takes it (None), else
        evicted and returned (the caller frees its device rows)."""
        host = self._host
        if host is None or cause not in DEMOTION_CAUSES:
            return self._remove(key, cause)
        moved = self._into_host(key, self._entries[key])
        if moved == "no_room":  # larger than the host budget, or the policy keeps the host's incumbents
            self._counts.demotions_refused += 1
        if moved != "moved":  # (or the executor no longer has the rows: nothing to copy) evicted
            return self._remove(key, cause)
        self._device.pop(key)
        self._counts.demotions += 1
        return None

    def _into_host(self, key: int, held: _Held) -> str:
        """Put `held` (a device entry leaving, or a deposit the device refused) into the host
        tier at its host price, its rows copied out by `host_moves.demote`: `moved`; else
        nothing changed, `no_room` (larger than the host budget, or the policy keeps the
        host's incumbents) or `gone` (the executor no longer holds the rows)."""
        host = self._host
        assert host is not None
        nbytes = host.price(held.entry, held.nbytes)
        dropped = self._host_room(nbytes)
        if dropped is None:
            return "no_room"
        if self.host_moves is not None:
            make_room = getattr(self.host_moves, "make_room", None)
            if make_room is not None:  # the copy may reuse the victims' host memory (a budget-sized slab)
                make_room([host.entries[k].entry for k in dropped])
            t0 = time.perf_counter()
            moved = self.host_moves.demote(held.entry)
            self._counts.demote_ms += (time.perf_counter() - t0) * 1e3
            if not moved:
                return "gone"
        for k in dropped:
            self._drop_host(k, "memory")  # the host tier has no slot cap: room is always memory
        host.insert(key, replace(held, nbytes=nbytes))
        self._counts.bytes_demoted += nbytes
        self._counts.peak_host = max(self._counts.peak_host, host.nbytes)
        return "moved"

    def _drop_host(self, key: int, cause: str, free_copy: bool = True) -> bool:
        """`key`'s host entry leaves the store for `cause` (counted; `host_moves.drop` frees its copy
        unless `free_copy` is off: `discard`, the executor no longer holds it)."""
        host = self._host
        if host is None or key not in host.entries:
            return False
        held = host.pop(key)
        self._evictions[cause] += 1
        self._counts.host_evictions[cause] += 1
        if cause != "replaced":
            self._remember(key, cause)
        if free_copy and self.host_moves is not None:
            self.host_moves.drop(held.entry)
        return True

    def _take_host(self, key: int) -> _Held | None:
        """Pop `key`'s host entry for adoption, restored to the device (None when it has none)."""
        if self._host is None or key not in self._host.entries:
            return None
        held = self._host.pop(key)
        self._counts.hits["host"] += 1
        self._counts.bytes_restored += held.nbytes
        if self.host_moves is not None:
            t0 = time.perf_counter()
            try:
                restored = self.host_moves.restore(held.entry)
            except BaseException:  # the rows never came back: the entry is gone, counted as pressure
                self._evictions["pool_pressure"] += 1
                self._counts.host_evictions["pool_pressure"] += 1
                self._remember(key, "pool_pressure")
                self.host_moves.drop(held.entry)
                raise
            finally:
                self._counts.restore_ms += (time.perf_counter() - t0) * 1e3
            if restored is not None:
                held = replace(held, entry=restored)
        return held

    # ---- internals -----------------------------------------------------------

    def _victims(self, tier: _Tier) -> list[int]:
        """`tier`'s keys in the order the policy evicts them."""
        entries = tier.entries
        if self.policy == "lrd":
            return list(entries)
        if self.policy == "slru":
            return ([k for k, h in entries.items() if h.adoptions == 0]
                    + [k for k, h in entries.items() if h.adoptions > 0])
        if self._odds is not None:
            return self._ranked(tier)[0]
        return list(reversed(entries))  # incumbent: the newest entry is evicted first

    def _ranked(self, tier: _Tier) -> tuple[list[int], list[float]]:
        """`returns`: `tier`'s keys and their worth (core/eviction.py), lowest first, equal ones newest first."""
        odds = self._odds
        assert odds is not None
        keys = list(tier.entries)
        held = tier.entries.values()
        return odds.rank(keys, [h.deposited_at for h in held], [self._cost(h.nbytes, tier) for h in held],
                         self._clock())

    @staticmethod
    def _cost(nbytes: int, tier: _Tier) -> float:
        """`returns`: the share of `tier`'s bounds an entry of `nbytes` takes (bytes, and a slot)."""
        cost = 0.0
        if tier.budget_bytes:
            cost += nbytes / tier.budget_bytes
        if tier.slots is not None:
            cost += 1.0 / tier.slots
        return cost if cost > 0 else float(max(nbytes, 1))  # unbounded: per byte (it never evicts)

    def _room(self, nbytes: int, blocks: Sequence[int] | None) -> _Room:
        """What a device deposit (`nbytes`, or its `blocks` when charged by block) needs, entry removals aside."""
        if self.block_nbytes is None:
            return _Room(self._device, nbytes, None)
        if blocks is None:
            raise ValueError("a store charged by block needs the deposit's blocks")
        return _Room(self._device, len(blocks) * self.block_nbytes, frozenset(blocks))

    def _room_cause(self) -> str:
        """`capacity` while the slot cap is what is full, else `memory`."""
        if self.slots is not None and len(self._entries) + 1 > self.slots:
            return "capacity"
        return "memory"

    def _note_deposit(self, key: int, owner: int) -> None:
        """A deposit of `owner`'s rows under `key` entered a tier: its miss reason is
        void and `key` is the owner's newest key."""
        self._misses.pop(key, None)
        remember(self._last_key, owner, key, MISS_MEMORY)
        self.deposits += 1

    def _refuse(self, key: int, cause: str) -> None:
        self._refusals[cause] += 1
        self._leases.pop(key, None)
        self._remember(key, cause)

    def _remember(self, key: int, reason: str) -> None:
        remember(self._misses, key, reason, MISS_MEMORY)

    def _remove(self, key: int, cause: str) -> CarriedDrafter:
        self._evictions[cause] += 1
        held = self._device.pop(key)
        if cause != "replaced":
            self._remember(key, cause)
        return held.entry


class _Room:
    """The bytes and entries a tier would hold after a deposit, as entries are removed first.

    `remove(k)` adds one more entry to leave (`gone`, in order); `fits()` says
    whether the deposit then fits the tier's slot cap and budget. Charged by block,
    a removed entry frees only its blocks no remaining entry nor the deposit holds.
    """

    __slots__ = ("_tier", "alone", "_blocks", "gone", "_freed", "_left", "_cost")

    def __init__(self, tier: _Tier, alone: int, blocks: Collection[int] | None) -> None:
        self._tier = tier
        self.alone = alone  # bytes the deposit costs with nothing else held
        self._blocks = blocks
        self.gone: list[int] = []
        self._freed = 0  # bytes freed by the removals so far
        self._left: Counter[int] = Counter()  # block -> removed entries holding it (by block)
        if blocks is None:
            self._cost = alone
        else:
            bnb = tier.block_nbytes or 0
            self._cost = sum(bnb for b in blocks if b not in tier.block_refs)

    def remove(self, key: int) -> None:
        held = self._tier.entries[key]
        self.gone.append(key)
        if self._blocks is None:
            self._freed += held.nbytes
            return
        refs, left, bnb = self._tier.block_refs, self._left, self._tier.block_nbytes or 0
        for b in held.entry.block_table:
            left[b] += 1
            if left[b] == refs[b] and b not in self._blocks:
                self._freed += bnb

    def fits(self) -> bool:
        tier = self._tier
        if tier.slots is not None and len(tier.entries) - len(self.gone) + 1 > tier.slots:
            return False
        return tier.budget_bytes is None or (
            tier.nbytes - self._freed + self._cost <= tier.budget_bytes)


class HostMoves(Protocol):
    """What an executor does with an entry's rows when the store moves it between tiers.

    Each is called once per move, under the caller's lock. The store is consistent
    during each call: `restore` may make room on the device, and the executor's
    pool-pressure evictions (`CarryStore.evict`) may re-enter the store meanwhile.
    An executor may also define `make_room(victims)`: called just before a `demote`
    with the host entries the store drops (`drop`) if that demotion succeeds, so the
    copy may reuse their host memory (host memory of exactly the budget); a demotion
    that returns False must leave their copies intact.
    """

    def demote(self, entry: CarriedDrafter) -> bool:
        """Copy `entry`'s rows to host memory and free its device rows; False when the executor
        no longer holds them (nothing copied nor freed: the store evicts the entry instead)."""

    def restore(self, entry: CarriedDrafter) -> CarriedDrafter | None:
        """Bring `entry`'s rows back to device memory (freeing the host copy) before the adopter
        reads them; return the entry as it now is on the device (None: unchanged). An error
        leaves the rows gone: the store counts the entry evicted (`pool_pressure`) and re-raises."""

    def drop(self, entry: CarriedDrafter) -> None:
        """Free `entry`'s host copy: it left the store from the host tier."""


@dataclass(frozen=True, slots=True)
class TierStats:
    """Per-tier counters of a `CarryStore` (all zero without a host tier).

    `hits` are takes by tier (`TIERS`); `demotions` moved an entry from the device
    budget to the host tier, `demotions_refused` evicted it instead (larger than
    the host budget, or the policy kept the host's incumbents); `host_deposits`
    are deposits the device refused that went straight to the host tier
    (`deposit_host`); `host_evictions`
    are the store's evictions (already in `CarryStore.evictions`) that left from
    the host tier, by cause. `bytes_demoted`/`bytes_restored` are the host charge
    moved each way; `peak_bytes` the most each tier held. `demote_ms` and
    `restore_ms` are wall time inside the executor's `host_moves` calls (the
    copies, or their launch where the executor copies asynchronously).
    """

    host_budget_bytes: int
    hits: dict[str, int]
    demotions: int
    demotions_refused: int
    host_deposits: int
    host_evictions: dict[str, int]
    bytes_demoted: int
    bytes_restored: int
    host_entries: int
    host_bytes_held: int
    peak_bytes: dict[str, int]
    demote_ms: float
    restore_ms: float
    row_dtypes: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _TierCounters:
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    demotions: int = 0
    demotions_refused: int = 0
    host_deposits: int = 0
    host_evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_CAUSES, 0))
    bytes_demoted: int = 0
    bytes_restored: int = 0
    peak_device: int = 0
    peak_host: int = 0
    demote_ms: float = 0.0
    restore_ms: float = 0.0


class _Tier:
    """One tier of the store (`TIERS`): its entries in deposit order, its bounds, its row format.

    `budget_bytes` (None: unbounded) and `slots` (None: no cap; the host tier has
    none) bound it. What an entry costs here: charged by block (`block_nbytes`),
    the blocks of its table, counted once across entries when `shared` (the
    device tier: pool blocks entries share) or each entry all of its own (the
    host tier: host copies share nothing); else its rows in `row_format` (which
    the executor's stated bytes must equal, `check_nbytes`); else the bytes its
    deposit stated. Victim order is the store's policy over `entries`.
    """

    __slots__ = ("name", "budget_bytes", "slots", "block_nbytes", "row_format", "shared", "entries",
                 "nbytes", "block_refs")

    def __init__(self, name: str, budget_bytes: int | None, slots: int | None, block_nbytes: int | None,
                 row_format: RowFormat | None, shared: bool) -> None:
        self.name = name
        self.budget_bytes = budget_bytes
        self.slots = slots
        self.block_nbytes = block_nbytes
        self.row_format = row_format
        self.shared = shared and block_nbytes is not None
        self.entries: OrderedDict[int, _Held] = OrderedDict()
        self.nbytes = 0
        self.block_refs: Counter[int] = Counter()  # block -> entries holding it (shared by block)

    @property
    def row_dtype(self) -> str:
        """The tier's row format name (`bf16` when none was given: rows as the executor holds them)."""
        return "bf16" if self.row_format is None else self.row_format.dtype

    def price(self, entry: CarriedDrafter, stated: int) -> int:
        """What `entry` costs held alone here (by block: every block of its table)."""
        return self.price_rows(entry.rows, entry.block_table, stated)

    def price_rows(self, rows: int, blocks: Sequence[int] | None, stated: int) -> int:
        """What `rows` rows held in `blocks` cost held alone here (by block: every block; a tier
        charged by block needs `blocks`)."""
        if self.block_nbytes is not None:
            if blocks is None:
                raise ValueError(f"the {self.name} tier charges by block: the deposit names no blocks")
            return len(blocks) * self.block_nbytes
        if self.row_format is not None:
            return self.row_format.nbytes(rows)
        return stated

    def check_nbytes(self, entry: CarriedDrafter, nbytes: int) -> None:
        """ValueError unless `nbytes`, an executor's stated bytes, are `entry`'s rows in the row format."""
        fmt = self.row_format
        if self.block_nbytes is None and fmt is not None and nbytes != fmt.nbytes(entry.rows):
            raise ValueError(f"{entry.rows} rows in {fmt.dtype} take {fmt.nbytes(entry.rows)} bytes "
                             f"({fmt.vectors_per_row} vectors of {fmt.head_dim} a row), the deposit states {nbytes}")

    def add(self, key: int, held: _Held) -> None:
        """Hold `held` as the newest entry, charged `held.nbytes` (shared by block: its new blocks)."""
        self.entries[key] = held
        if not self.shared:
            self.nbytes += held.nbytes
            return
        self.block_refs.update(held.entry.block_table)
        self.nbytes = len(self.block_refs) * (self.block_nbytes or 0)

    def insert(self, key: int, held: _Held) -> None:
        """`add` in deposit-time order (idle expiry stops at the first young one): a demoted entry
        keeps its place among the tier's by when it was deposited."""
        last = next(reversed(self.entries.values()), None)
        self.add(key, held)
        if last is not None and last.deposited_at > held.deposited_at:
            ordered = sorted(self.entries.items(), key=lambda kv: kv[1].deposited_at)  # stable: ties keep order
            self.entries.clear()
            self.entries.update(ordered)

    def pop(self, key: int) -> _Held:
        held = self.entries.pop(key)
        if not self.shared:
            self.nbytes -= held.nbytes
            return held
        refs, table = self.block_refs, held.entry.block_table
        if len(set(table)) == len(table):
            # One pass in C over the table (an adoption at 28k rows drops ~1,750 blocks, and
            # the per-block loop below cost a millisecond of the warm turn's drafter prep):
            # every block leaves, then those other entries still hold come back, one fewer.
            counts = list(map(refs.pop, table))
            if max(counts, default=1) > 1:
                refs.update({b: c - 1 for b, c in zip(table, counts, strict=True) if c > 1})
        else:  # a table naming a block twice (never the pool's): one reference per listing
            for b in table:
                refs[b] -= 1
                if not refs[b]:
                    del refs[b]
        self.nbytes = len(refs) * (self.block_nbytes or 0)
        return held


__all__ = ["DEMOTION_CAUSES", "EVICTION_CAUSES", "EVICTION_POLICIES", "MISS_MEMORY", "REFUSAL_CAUSES",
           "TIERS", "CarryStore", "HostMoves", "TierStats", "remember"]
