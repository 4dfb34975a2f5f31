"""A carried entry's bytes, lent to another worker or received from one: entry moves over the service.

What it is for: a session's next turn may land on another worker (a drain, a restart, load).
That worker asks its peers who holds the session; the holder `lend`s the entry (its rows as
ONE contiguous host byte range in the held form, with the format, the keys and a digest), the
new worker `receive`s it (plans first, a transfer fills its landing range, the digest is
verified, then the entry sits in its store like one it deposited itself) and the holder ends
the loan (`end_loan(moved=True)`: the entry leaves, cause `moved`), so a session has one
holder. Everything here goes through one `CarryService` (its store, device home and host
tier), so every executor that runs on the service moves entries alike; the transport (NIXL,
`serve/dynamo/nixl_transport.py`) and the peers' protocol (`serve/dynamo/carry_peers.py`) see
`EntryMoves` and its plain records only.

    holder                                    receiver
    lend(key) -> Loan (raw bytes, EntryMeta)  plan_receive(meta) -> ReceivePlan (landing range)
                                              ... one transfer of loan.raw into plan.landing ...
                                              commit_receive(plan) -> "received" | refusal
    end_loan(loan, moved)                     (the next judge/adopt takes it as any entry)

The held form is the device home's (`RowHome.layout`): a pool home's entry is its whole
blocks, every K block then every V block (what the host tier holds of it); an arena home's is
its rows in the codec's form.

Invariants:
- A loan holds its own copy of the bytes: the holder's store stays free to adopt or evict the
  entry meanwhile. `end_loan(moved=True)` removes the entry only if the store still holds the
  very entry lent (a newer deposit of the key stays).
- `receive` never replaces an entry: a key the receiver holds is refused (`held_locally`);
  nothing enters the store before the landed bytes' digest equals the holder's; the held form
  must be the receiver's own (`format`), and the store's admission decides as for a deposit
  (`no_room` when it refuses, or the executor's blocks cannot take the rows).
- The rows are stored under the meta's carry key, whose salt scope the key itself is
  (`carry_key(session, salt)`): the store's decision adopts them only for that key.
- Every call takes the service's lock; one that touches an executor's pool runs on that
  executor's thread (the caller's duty).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import CarriedDrafter
from ..dataplane.kv_pool import PoolExhaustedError
from .homes import Runs
from .service import CarryService

__all__ = ["PULLABLE_MISSES", "EntryMeta", "EntryMoves", "Loan", "ReceivePlan", "digest_bytes",
           "digest_tokens", "model_identity"]

PULLABLE_MISSES = ("never_carried", "new_salt")
"""A key's local miss reasons for which a peer may hold its entry: this worker never held it.
Any other reason (an eviction, a refusal, a lease) means the rows were here and are gone."""

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

    `key` is the carry key (the salt scope included), `session` the unsalted session it belongs
    to, `tokens` the tokens its rows were built from, `rows`/`last_pair_key`/`runs` its
    bookkeeping (`runs`: key runs `(first_key, count)` in row order), `layout` the held form
    (`EntryMoves.layout()`), `nbytes` the byte range's length and `digest` its blake2b."""

    key: int
    session: int
    tokens: tuple[int, ...]
    rows: int
    last_pair_key: int
    runs: Runs
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
    """A receive planned: `landing` (1-D uint8 CPU, `meta.nbytes`) is where the transfer writes."""

    meta: EntryMeta
    landing: torch.Tensor


class EntryMoves:
    """`lend` / `end_loan` / `receive` over one `CarryService` (see the module header)."""

    def __init__(self, service: CarryService) -> None:
        self.service = service

    # ---- queries (any thread) ------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """The held form of this service's entries: a receiver takes an entry only in its own."""
        return self.service.home.layout()

    def nbytes_for(self, rows: int) -> int:
        """Bytes of the held range of an entry of `rows` rows here."""
        return self.service.home.held_nbytes_for(rows)

    def pullable(self, key: int, session: int) -> bool:
        """Whether `key` has no entry here and never had one (`PULLABLE_MISSES`): a peer may hold it."""
        store = self.service.store
        with self.service.lock:
            return key != 0 and store.get(key) is None and store.miss_reason(key, session) in PULLABLE_MISSES

    def holds(self, key: int) -> bool:
        """Whether `key` has an entry here (either tier)."""
        with self.service.lock:
            return self.service.store.get(key) is not None

    def keys(self) -> list[int]:
        """Every carried key, both tiers (what a drain offers)."""
        store = self.service.store
        with self.service.lock:
            return [e.session_hash for e in (*store.entries(), *store.host_entries)]

    # ---- the holder ----------------------------------------------------------------

    def lend(self, key: int) -> Loan | None:
        """A copy of `key`'s entry as one contiguous host range, with its meta (None: not held)."""
        with self.service.lock:
            entry = self.service.store.get(key)
            if entry is None or entry.last_pair_key is None:
                return None
            raw, runs = self._export(key)
            session = self.service.store.session_of(key)
        meta = EntryMeta(key, session, tuple(entry.tokens), entry.rows, entry.last_pair_key, runs,
                         self.layout(), int(raw.numel()), digest_bytes(raw))
        return Loan(meta, raw, entry)

    def end_loan(self, loan: Loan, moved: bool) -> bool:
        """The loan is over. `moved`: the receiver took the rows, so the entry leaves this worker
        (evicted as `moved`) if the store still holds the very entry lent; returns whether it left."""
        if not moved:
            return False
        service = self.service
        with service.lock:
            if service.store.get(loan.meta.key) is not loan.entry:
                return False
            gone = service.store.evict(loan.meta.key, "moved")
            if gone is not None:  # a device entry: its rows are this worker's to free
                service.home.free(loan.meta.key)
            return True

    def held_digest(self, key: int) -> str | None:
        """The digest of `key`'s held bytes now (None: not held); equals a loan's digest."""
        with self.service.lock:
            if self.service.store.get(key) is None:
                return None
            raw, _ = self._export(key)
        return digest_bytes(raw)

    # ---- the receiver ---------------------------------------------------------------

    def plan_receive(self, meta: EntryMeta) -> ReceivePlan | str:
        """Check `meta` against this service before any byte moves: a plan with its landing range,
        or why not (`format`: another held form or size; `held_locally`: the key has an entry)."""
        try:
            meta.check()
        except ValueError:
            return "format"
        if meta.layout != self.layout() or meta.nbytes != self.nbytes_for(meta.rows):
            return "format"
        with self.service.lock:
            if self.service.store.get(meta.key) is not None:
                return "held_locally"
        return ReceivePlan(meta, torch.empty(meta.nbytes, dtype=torch.uint8))

    def commit_receive(self, plan: ReceivePlan) -> str:
        """Store the landed bytes as `plan.meta.key`'s entry: `received`, or why not
        (`digest_mismatch`, `held_locally`, `no_room`: the store's admission refused it or the
        executor's blocks could not hold it)."""
        meta = plan.meta
        if digest_bytes(plan.landing) != meta.digest:
            return "digest_mismatch"
        service = self.service
        store, home = service.store, service.home
        with service.lock:
            if store.get(meta.key) is not None:
                return "held_locally"
            entry = meta.entry()
            if home.comes_back("device") and service.room_for is not None and not service.room_for(entry):
                return "no_room"  # live sequences hold the executor's blocks
            evicted = store.admit(meta.key, meta.nbytes, meta.session, blocks=home.fresh_blocks(meta.rows))
            if evicted is None:  # the host tier's second chance, as for a deposit (asked before staging)
                if (service.host is None or store.miss_reason(meta.key) != "not_admitted"
                        or not store.host_admits(meta.key, meta.rows, meta.nbytes, entry.block_table)):
                    return "no_room"
                service.host.stage_bytes(meta.key, plan.landing, home.form_for(meta.rows, meta.runs))
                if store.deposit_host(entry, meta.nbytes, meta.session):
                    return "received"
                service.host.unstage(meta.key)
                return "no_room"
            for old in evicted:
                home.free(old.session_hash)
            if not home.reserve(meta.key, meta.rows):
                store.refuse(meta.key)
                return "no_room"
            try:
                blocks = home.receive(meta.key, plan.landing, meta.rows, meta.runs)
            except PoolExhaustedError:  # live sequences took the blocks meanwhile: refused, as a deposit's oom
                store.refuse(meta.key)
                return "no_room"
            store.put(meta.entry(blocks), meta.nbytes, meta.session)
            return "received"

    def receive(self, meta: EntryMeta, fill: Callable[[torch.Tensor], None]) -> str:
        """`plan_receive`, `fill(landing)` (writes the bytes: a transfer), `commit_receive`."""
        plan = self.plan_receive(meta)
        if isinstance(plan, str):
            return plan
        fill(plan.landing)
        return self.commit_receive(plan)

    # ---- internals (caller holds the lock) -----------------------------------------

    def _export(self, key: int) -> tuple[torch.Tensor, Runs]:
        """`key`'s held bytes copied into one fresh host range, and its key runs."""
        service = self.service
        if service.store.tier(key) == "host":
            assert service.host is not None
            return service.host.copy_of(key)
        home = service.home
        raw = torch.empty(home.export_nbytes(key), dtype=torch.uint8)
        form = home.export_into(key, raw)
        if home.device.type == "cuda":  # the export is queued on the device: the bytes must be there
            torch.cuda.synchronize(home.device)
        return raw, home.runs_of(form)


def model_identity(engine: Any) -> str:
    """A digest naming an engine's target and drafter as far as rows depend on them: its class,
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
