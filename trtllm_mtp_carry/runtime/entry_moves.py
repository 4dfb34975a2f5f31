"""A carried entry's bytes, lent to another worker or received from one: the seam of entry moves.

What it is for: a session's next turn may land on another worker (a drain, a
restart, load). That worker asks its peers who holds the session; the holder
`lend`s the entry (its rows as ONE contiguous host byte range in the held form,
with the format, the keys and a digest), the new worker `receive`s it (plans
first, a NIXL read fills its landing range, the digest is verified, the entry
then sits in its store like one it deposited itself) and the holder ends the
loan (`end_loan(moved=True)`: the entry leaves, cause `moved`), so a session
has one holder. This module is the only code of the moves written against the
reference runtime's internals (`CarryRuntime`'s store, residence, pool and host
tier); the Dynamo side (`serve/dynamo/carry_peers.py`) sees `EntryMoves` and
its plain records only.

    holder                                    receiver
    lend(key) -> Loan (raw bytes, EntryMeta)  plan_receive(meta) -> ReceivePlan (landing range)
                                              ... NIXL READ of loan.raw into plan.landing ...
                                              commit_receive(plan) -> "received" | refusal
    end_loan(loan, moved)                     (the next judge/take adopts it as any entry)

The held form, by residence:
- rows in the pool (`bf16`, `PoolResidence`): the entry's whole blocks, every K block
  then every V block, `[blocks, block_size, Hkv, D]` each (`DrafterKVPool.export_carried`'s
  layout, what the host tier holds); received into fresh blocks (`import_carried`, the host
  tier's restore copy);
- packed rows (`fp8` and the other codecs, `PackedResidence`): the codec's bytes of
  `[rows, 2, Hkv, D]` (`codec.view` of the range), received as a packed device entry.

Invariants:
- A loan holds its own copy of the bytes: the holder's store stays free to adopt or evict
  the entry meanwhile. `end_loan(moved=True)` removes the entry only if the store still
  holds the very entry lent (a newer deposit of the key stays).
- `receive` never replaces an entry: a key the receiver holds already is refused
  (`held_locally`); nothing is written into the store before the digest of the landed
  bytes equals the holder's; the format (`layout()`: codec, block geometry, dtype) must be
  the receiver's own, and the store's admission policy decides as for a deposit.
- The rows are stored under the meta's carry key, whose salt scope the key itself is
  (`carry_key(session, salt)`): `decide_adopt` then adopts them only for that key.
- Every call that touches the pool runs on the engine's thread (the caller's duty: the
  pool has no lock of its own); each takes the runtime's lock around the store.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import CarriedDrafter
from ..dataplane.kv_pool import HostRows, PoolExhaustedError
from .carry_runtime import CarryRuntime
from .packed_rows import PackedEntry
from .policy import DrafterPolicy
from .residence import PackedResidence, PoolResidence

PULLABLE_MISSES = ("never_carried", "new_salt")
"""A key's local miss reasons for which a peer may hold its entry: this worker never held it.
Any other reason (an eviction, a refusal, `in_use`) means the rows were here and are gone."""

DIGEST_SIZE = 16


def digest_bytes(raw: torch.Tensor) -> str:
    """blake2b-128 of a 1-D uint8 CPU tensor's bytes, hex (the entry digest both sides compute)."""
    return hashlib.blake2b(raw.numpy().data, digest_size=DIGEST_SIZE).hexdigest()


def digest_tokens(tokens: Sequence[int]) -> str:
    """blake2b-128 of the tokens as little-endian int64, hex (the token prefix digest)."""
    buf = torch.tensor(list(tokens), dtype=torch.int64).numpy().astype("<i8").tobytes()
    return hashlib.blake2b(buf, digest_size=DIGEST_SIZE).hexdigest()


@dataclass(frozen=True)
class EntryMeta:
    """One entry as it travels: everything a receiver checks before and after reading its bytes.

    `key` is the carry key (the salt scope included), `session` the unsalted session it
    belongs to, `tokens` the tokens its rows were built from, `rows`/`last_pair_key`/`runs`
    its bookkeeping (`runs`: key runs `(first_key, count)` in row order), `layout` the held
    form (`EntryMoves.layout()`), `nbytes` the byte range's length and `digest` its blake2b."""

    key: int
    session: int
    tokens: tuple[int, ...]
    rows: int
    last_pair_key: int
    runs: tuple[tuple[int, int], ...]
    layout: dict[str, Any]
    nbytes: int
    digest: str

    def entry(self, block_table: Sequence[int] = ()) -> CarriedDrafter:
        """The store's bookkeeping of these rows (the receiver's)."""
        return CarriedDrafter(block_table, self.rows, self.last_pair_key, list(self.tokens), self.key)

    def check(self) -> None:
        """ValueError naming the field unless the bookkeeping is self-consistent (what a peer sent)."""
        if self.key == 0 or self.session == 0:
            raise ValueError(f"key and session must be non-zero, got {self.key}, {self.session}")
        if sum(c for _, c in self.runs) != self.rows or self.rows <= 0:
            raise ValueError(f"runs {self.runs} do not hold the {self.rows} rows")
        if any(c <= 0 or k0 < 0 for k0, c in self.runs) or self.runs[-1][0] + self.runs[-1][1] - 1 \
                != self.last_pair_key:
            raise ValueError(f"runs {self.runs} do not end at last_pair_key {self.last_pair_key}")
        self.entry()  # CarriedDrafter's own checks (keys within the tokens)


@dataclass
class Loan:
    """An entry lent out: its meta and its own copy of the bytes (`raw`, 1-D uint8 CPU, contiguous:
    the one range a peer reads). `entry` is the store's entry as lent (end_loan's identity check)."""

    meta: EntryMeta
    raw: torch.Tensor
    entry: CarriedDrafter = field(repr=False)


@dataclass
class ReceivePlan:
    """A receive planned: `landing` (1-D uint8 CPU, `meta.nbytes`) is where the read writes."""

    meta: EntryMeta
    landing: torch.Tensor


class EntryMoves:
    """`lend` / `end_loan` / `receive` over one `CarryRuntime` (see the module header)."""

    def __init__(self, runtime: CarryRuntime) -> None:
        self.runtime = runtime
        residence = runtime._residence
        if not isinstance(residence, (PoolResidence, PackedResidence)):
            raise TypeError(f"no entry moves for a {type(residence).__name__}")
        self._residence = residence
        self._pool = runtime.backend.drafter_pool

    # ---- queries (any thread) ------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """The held form of this runtime's entries: a receiver takes an entry only in its own."""
        pool = self._pool
        return {"codec": self._residence.codec.name,
                "form": "blocks" if isinstance(self._residence, PoolResidence) else "rows",
                "block_size": pool.block_size, "num_kv_heads": pool.num_kv_heads,
                "head_dim": pool.head_dim, "dtype": str(pool.k_cache.dtype).removeprefix("torch.")}

    def nbytes_for(self, rows: int) -> int:
        """Bytes of the held range of an entry of `rows` rows here."""
        if isinstance(self._residence, PoolResidence):
            return math.ceil(rows / self._pool.block_size) * self._pool.block_nbytes
        return self._residence.codec.row_nbytes(self._pool.num_kv_heads, self._pool.head_dim) * rows

    def carries(self, policy: str | None) -> bool:
        """Whether a turn of drafter policy `policy` (None: the runtime's) makes a carry decision."""
        chosen = self.runtime.policy if policy is None else DrafterPolicy.parse(policy)
        return self.runtime.armed and chosen is DrafterPolicy.CARRY

    def pullable(self, key: int, session: int) -> bool:
        """Whether `key` has no entry here and never had one (`PULLABLE_MISSES`): a peer may hold it."""
        store = self.runtime._store
        with self.runtime._lock:
            return key != 0 and store.get(key) is None and store.miss_reason(key, session) in PULLABLE_MISSES

    def holds(self, key: int) -> bool:
        """Whether `key` has an entry here (either tier)."""
        with self.runtime._lock:
            return self.runtime._store.get(key) is not None

    def keys(self) -> list[int]:
        """Every carried key, both tiers (what a drain offers)."""
        store = self.runtime._store
        with self.runtime._lock:
            return [e.session_hash for e in (*store.entries(), *store.host_entries)]

    # ---- the holder (engine thread) -----------------------------------------------

    def lend(self, key: int) -> Loan | None:
        """A copy of `key`'s entry as one contiguous host range, with its meta (None: not held)."""
        store = self.runtime._store
        with self.runtime._lock:
            entry = store.get(key)
            if entry is None or entry.last_pair_key is None:
                return None
            held = store._entries.get(key) or store._host_held(key)
            assert held is not None
            raw, runs = self._export(key, store.tier(key) == "host")
        meta = EntryMeta(key, held.session, tuple(entry.tokens), entry.rows, entry.last_pair_key, runs,
                         self.layout(), int(raw.numel()), digest_bytes(raw))
        return Loan(meta, raw, entry)

    def end_loan(self, loan: Loan, moved: bool) -> bool:
        """The loan is over. `moved`: the receiver took the rows, so the entry leaves this worker
        (evicted as `moved`) if the store still holds the very entry lent; returns whether it left."""
        if not moved:
            return False
        store = self.runtime._store
        with self.runtime._lock:
            if store.get(loan.meta.key) is not loan.entry:
                return False
            gone = store.evict(loan.meta.key, "moved")
            if gone is not None:  # a device entry: its rows are this worker's to free
                self.runtime._free(gone)
            return True

    def held_digest(self, key: int) -> str | None:
        """The digest of `key`'s held bytes now (None: not held); equals a loan's digest."""
        with self.runtime._lock:
            if self.runtime._store.get(key) is None:
                return None
            raw, _ = self._export(key, self.runtime._store.tier(key) == "host")
        return digest_bytes(raw)

    # ---- the receiver ---------------------------------------------------------------

    def plan_receive(self, meta: EntryMeta) -> ReceivePlan | str:
        """Check `meta` against this runtime before any byte moves: a plan with its landing range,
        or why not (`format`: another held form or size; `held_locally`: the key has an entry)."""
        try:
            meta.check()
        except ValueError:
            return "format"
        if meta.layout != self.layout() or meta.nbytes != self.nbytes_for(meta.rows):
            return "format"
        with self.runtime._lock:
            if self.runtime._store.get(meta.key) is not None:
                return "held_locally"
        return ReceivePlan(meta, torch.empty(meta.nbytes, dtype=torch.uint8))

    def commit_receive(self, plan: ReceivePlan) -> str:
        """Store the landed bytes as `plan.meta.key`'s entry (engine thread): `received`, or why not
        (`digest_mismatch`, `held_locally`, `no_room`: the store's admission refused it or the pool
        could not hold it)."""
        meta = plan.meta
        if digest_bytes(plan.landing) != meta.digest:
            return "digest_mismatch"
        rt, store = self.runtime, self.runtime._store
        with rt._lock:
            if store.get(meta.key) is not None:
                return "held_locally"
            if isinstance(self._residence, PoolResidence):
                return self._commit_blocks(plan)
            return self._commit_packed(plan)

    def receive(self, meta: EntryMeta, fill: Callable[[torch.Tensor], None]) -> str:
        """`plan_receive`, `fill(landing)` (writes the bytes: a NIXL read), `commit_receive`."""
        plan = self.plan_receive(meta)
        if isinstance(plan, str):
            return plan
        fill(plan.landing)
        return self.commit_receive(plan)

    # ---- internals (caller holds the runtime's lock) ------------------------------

    def _export(self, key: int, host: bool) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
        """`key`'s held bytes copied into one fresh host range, and its key runs."""
        pool = self._pool
        if pool.device.type == "cuda":  # host copies and exports may still be in flight
            torch.cuda.synchronize(pool.device)
        if isinstance(self._residence, PoolResidence):
            if not host:
                raw = torch.empty(pool.export_nbytes(key), dtype=torch.uint8)
                rows = pool.export_carried(key, raw)
                if pool.device.type == "cuda":
                    torch.cuda.synchronize(pool.device)
                return raw, rows.runs
            moves = self._residence.moves
            assert moves is not None
            copy: HostRows = moves._host[key]
            raw = torch.empty(copy.nbytes, dtype=torch.uint8)
            half = raw.numel() // 2
            raw[:half].copy_(copy.k.reshape(-1).view(torch.uint8))
            raw[half:].copy_(copy.v.reshape(-1).view(torch.uint8))
            return raw, copy.runs
        packed = self._residence.moves.get(key)
        assert packed is not None
        codec = self._residence.codec
        raw = torch.empty(packed.nbytes, dtype=torch.uint8)
        codec.copy_(codec.view(raw, tuple(packed.packed.shape)), packed.packed)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
        return raw, packed.runs

    def _commit_blocks(self, plan: ReceivePlan) -> str:
        """Rows in the pool: the store admits the entry (as a deposit: the policy may make room or
        refuse), then the blocks are imported fresh (the host tier's restore copy) and put."""
        meta, pool, rt = plan.meta, self._pool, self.runtime
        store = rt._store
        nblocks = math.ceil(meta.rows / pool.block_size)
        if nblocks > pool.num_free_blocks + pool.num_carried_blocks:
            return "no_room"  # live sequences hold the pool
        shape = (nblocks, pool.block_size, pool.num_kv_heads, pool.head_dim)
        half = meta.nbytes // 2
        rows = HostRows(plan.landing[:half].view(pool.k_cache.dtype).view(shape),
                        plan.landing[half:].view(pool.v_cache.dtype).view(shape), meta.rows, meta.runs)
        # fresh blocks share nothing: any ids no entry holds price them (negative ones never do)
        evicted = store.admit(meta.key, meta.nbytes, meta.session, blocks=range(-1, -nblocks - 1, -1))
        if evicted is None:
            return self._receive_host(meta, rows)
        for old in evicted:
            rt._free(old)
        try:
            held = pool.import_carried(meta.key, rows)  # may evict more for pool pressure, as a grow
        except PoolExhaustedError:  # live sequences took the blocks meanwhile: refused, as a deposit's oom
            store.refuse(meta.key)
            return "no_room"
        store.put(meta.entry(held.block_table), meta.nbytes, meta.session)
        return "received"

    def _receive_host(self, meta: EntryMeta, rows: HostRows) -> str:
        """The device tier refused the entry: the host tier's second chance, as for a deposit."""
        store, pool = self.runtime._store, self._pool
        if not store.host_budget_bytes or store.miss_reason(meta.key) != "not_admitted":
            return "no_room"
        if math.ceil(meta.rows / pool.block_size) > pool.num_free_blocks:
            return "no_room"
        held = pool.import_carried(meta.key, rows)
        if store.deposit_host(meta.entry(held.block_table), meta.nbytes, meta.session):
            return "received"
        pool.free_carried(meta.key)
        return "no_room"

    def _commit_packed(self, plan: ReceivePlan) -> str:
        """Packed rows: admitted as a deposit, held as a device copy in the codec's form."""
        meta, rt = plan.meta, self.runtime
        residence = self._residence
        assert isinstance(residence, PackedResidence)
        store, codec = rt._store, residence.codec
        shape = (meta.rows, 2, self._pool.num_kv_heads, self._pool.head_dim)
        packed = PackedEntry(codec.to(codec.view(plan.landing, shape), self._pool.device), meta.runs, codec)
        evicted = store.admit(meta.key, meta.nbytes, meta.session)
        if evicted is None:
            if not store.host_budget_bytes or store.miss_reason(meta.key) != "not_admitted":
                return "no_room"
            residence.moves._device[meta.key] = packed
            if store.deposit_host(meta.entry(), meta.nbytes, meta.session):
                return "received"
            residence.moves.discard(meta.key)
            return "no_room"
        for old in evicted:
            rt._free(old)
        residence.moves._device[meta.key] = packed
        store.put(meta.entry(), meta.nbytes, meta.session)
        return "received"


def model_identity(engine: Any) -> str:
    """A digest naming the engine's target and drafter as far as rows depend on them: its class,
    its model config and the drafter's weights (rows built by another drafter are another
    drafter's). Two workers move entries only when their identities are equal."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(type(engine).__name__.encode())
    model = getattr(engine, "model", None)
    h.update(repr(getattr(model, "cfg", None)).encode())
    drafter = getattr(model, "drafter", None)
    if isinstance(drafter, torch.nn.Module):
        for name, tensor in sorted(drafter.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


__all__ = ["PULLABLE_MISSES", "EntryMeta", "EntryMoves", "Loan", "ReceivePlan", "digest_bytes",
           "digest_tokens", "model_identity"]
