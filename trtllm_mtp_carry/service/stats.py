"""The carry's one statistics snapshot, and the turn counters every executor feeds.

What it is for: a dashboard built on one executor reads every other unchanged. Every
executor (the reference engine, TensorRT-LLM's resource manager) reports `CarryStats`,
the same fields under the same names; every front end (`attach`, the worker install,
trtllm-serve's worker, Triton, Dynamo) exports each number of it as the gauge
`mtp_carry_runtime{field}` (a dict field as `field.key`), and its counter families
(`metrics.CarryMetrics`) from the same fields. A field an executor cannot observe is 0
there (TensorRT-LLM computes its own rows, so no turn of it is `rebuild`).

Invariants:
- `CarryStats` is frozen: a snapshot read under the service's lock.
- Dict fields list every name of their vocabulary, zeros included, in its order
  (`OUTCOME_KINDS`, `NO_CARRY_REASONS`, `TURN_KINDS`, `SKIP_REASONS`, `EVICTION_CAUSES`,
  `REFUSAL_CAUSES`, `FAULT_STEPS`); `faults` lists the exception classes seen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

TURN_KINDS: tuple[str, ...] = ("cold", "warm", "resumed", "reverted")
"""`CarryStats.turns`: turns admitted cold (nothing reused) or warm (a prefix reused); turns
admitted again after the executor paused them for recompute (`resumed`); prefill chunks seen
that never ran (`reverted`: the executor undid their allocation and scheduled them again)."""

SKIP_REASONS: tuple[str, ...] = (
    "dummy",  # an executor's warm-up or padding request
    "no_conversation",  # no session id: nothing to carry it under
    "not_carried",  # the turn's policy or the carry's state keeps nothing (policy off, rebuild, unarmed)
    "context_unfinished",  # ended before its prefill finished (cancelled, failed, never scheduled)
    "gap",  # its valid rows do not reach its last key (a chunk ran past unwritten rows)
    "no_rows",  # it holds no valid row
    "session_end",  # its session ended (forgotten) while it ran
    "preempted",  # freed after the executor took its pages back (TensorRT-LLM's V2 preemption)
    "fault",  # a fault cost the turn its carry
)
"""Why an ended turn deposited nothing, in the order `CarryStats.skipped` lists them (a deposit
the store refused is counted in `refusals` instead)."""


VETO_STEPS: tuple[str, ...] = (
    "key",  # a turn the peers would not judge with the same carry key and reused depth
    "adopt",  # an adoption some peer could not make: no peer restores
    "deposit",  # rows some peer could not hold: no peer keeps them
)
"""Carry steps an executor's peers (tensor-parallel ranks) did not take because they did not
agree, in the order `CarryStats.vetoed` lists them (always 0 for an executor without peers)."""


@dataclass
class TurnCounters:
    """What executors count per turn, through the service (mutable; read under its lock)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    no_carry: Counter[str] = field(default_factory=Counter)
    turns: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    rows_adopted: int = 0
    rows_appended: int = 0
    rows_prefilled: int = 0
    rows_rebuilt: int = 0
    keys_skipped: int = 0
    rows_deposited: int = 0
    turns_blind: int = 0
    turns_cancelled_kept: int = 0
    sessions_ended: int = 0
    rows_freed: int = 0
    share_ms: float = 0.0


@dataclass(frozen=True)
class CarryStats:
    """A frozen snapshot of the carry: configuration, turns, rows, the store, its tiers, faults.

    Configuration: `armed` (the carry runs), `policy` (the drafter policy: `carry`, `rebuild`,
    `blind`, `off`; TensorRT-LLM's adapter runs `carry`), `row_dtype` (the carried rows'
    format), `eviction_policy`, `carry_slots` (None: no cap), `carry_memory_bytes` and
    `carry_host_memory_bytes` (the device and host budgets), `idle_s` (the time-to-live; 0:
    none), `pool_blocks`/`pool_block_size` (the executor's drafter pool, where it has one),
    `reserved_bytes`/`host_reserved_bytes` (the device arena and host tier reserved) and
    `pinned_bytes` (page-locked host memory the host tier holds: its arena exactly; 0 on CPU).

    Turns: `turns` by `TURN_KINDS`; `outcomes` each carry decision by kind (`adopted`, every
    refusal, `fault`: the decision faulted before it was carried out); `no_carry_reasons`
    why a session's own entry was absent; `skipped` why an ended turn deposited nothing
    (`SKIP_REASONS`); `turns_blind` warm turns that adopted nothing (their drafter has no rows
    over the reused prefix); `turns_cancelled_kept` cancelled turns whose rows were deposited;
    `live_turns` turns admitted and not ended.

    Rows: `rows_adopted` (carried rows kept by adopting turns), `rows_appended` (rows computed
    after an adoption), `rows_prefilled` (rows computed by cold and blind turns),
    `rows_rebuilt` (rows recomputed under `rebuild`), `keys_skipped` (pair keys an adoption
    left without a row), `rows_deposited` (rows carried out of ended turns).

    The store: `deposits`, `adoptions`, `leases` (adopted entries whose turn has not ended),
    `evictions` and `refusals` by cause, `entries_held`, `rows_held`, `bytes_held`,
    `blocks_held` (pool blocks held, a shared block once), `shared_blocks`, and with
    `carry_share` the block sharing's `share_merges`, `share_mismatches`, `share_ms`.

    Tiers: `hits_device`/`hits_host` adoptions by the tier their rows came from, `demotions`,
    `host_deposits` (deposits the device refused that the host tier took), `host_entries`,
    `host_bytes_held`, `bytes_demoted`, `bytes_restored`, `peak_device_bytes`,
    `peak_host_bytes`, `demote_ms`, `restore_ms` (the copies' issue time), `restore_wait_ms`
    (how long the device waited for a copy back: CUDA only). Packed formats (fp8, nvfp4):
    `packs`/`unpacks` and their wall `pack_ms`/`unpack_ms`.

    Faults: `faults` by exception class, `fault_steps` by `FAULT_STEPS`, `turns_faulted`.
    Sessions: `sessions_ended` (forgotten sessions) and the carried `rows_freed` with them.
    Peers (tensor-parallel ranks, each carrying its shard of the heads): `tp_size`,
    `agreements` (collectives this executor made with them) and `vetoed` (`VETO_STEPS`).
    """

    armed: bool = False
    policy: str = "carry"
    row_dtype: str = "bf16"
    eviction_policy: str = ""
    carry_slots: int | None = None
    carry_memory_bytes: int = 0
    carry_host_memory_bytes: int = 0
    idle_s: int = 0
    pool_blocks: int = 0
    pool_block_size: int = 0
    reserved_bytes: int = 0
    host_reserved_bytes: int = 0
    pinned_bytes: int = 0
    turns: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    no_carry_reasons: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    turns_blind: int = 0
    turns_cancelled_kept: int = 0
    live_turns: int = 0
    rows_adopted: int = 0
    rows_appended: int = 0
    rows_prefilled: int = 0
    rows_rebuilt: int = 0
    keys_skipped: int = 0
    rows_deposited: int = 0
    deposits: int = 0
    adoptions: int = 0
    leases: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    entries_held: int = 0
    rows_held: int = 0
    bytes_held: int = 0
    blocks_held: int = 0
    carry_share: bool = False
    shared_blocks: int = 0
    share_merges: int = 0
    share_mismatches: int = 0
    share_ms: float = 0.0
    hits_device: int = 0
    hits_host: int = 0
    demotions: int = 0
    host_deposits: int = 0
    host_entries: int = 0
    host_bytes_held: int = 0
    bytes_demoted: int = 0
    bytes_restored: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    demote_ms: float = 0.0
    restore_ms: float = 0.0
    restore_wait_ms: float = 0.0
    packs: int = 0
    unpacks: int = 0
    pack_ms: float = 0.0
    unpack_ms: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    fault_steps: dict[str, int] = field(default_factory=dict)
    turns_faulted: int = 0
    sessions_ended: int = 0
    rows_freed: int = 0
    tp_size: int = 1
    agreements: int = 0
    vetoed: dict[str, int] = field(default_factory=dict)

    @classmethod
    def idle(cls, **fields: object) -> CarryStats:
        """The stats of a carry that did and holds nothing (one standing aside): every dict field
        lists its whole vocabulary at zero, as an armed carry's do, so a scraper reads the same
        gauge names either way; `fields` sets the configuration."""
        from ..core import NO_CARRY_REASONS, OUTCOME_KINDS, REFUSAL_CAUSES
        from ..core.carry_store import EVICTION_CAUSES
        from .ledger import FAULT_STEPS

        vocab: dict[str, tuple[str, ...]] = {
            "turns": TURN_KINDS, "outcomes": OUTCOME_KINDS, "no_carry_reasons": NO_CARRY_REASONS,
            "skipped": SKIP_REASONS, "evictions": EVICTION_CAUSES, "refusals": REFUSAL_CAUSES,
            "fault_steps": FAULT_STEPS, "vetoed": VETO_STEPS}
        zeros: dict[str, object] = {name: dict.fromkeys(names, 0) for name, names in vocab.items()}
        return cls(**{**zeros, **fields})  # type: ignore[arg-type]

    @property
    def rows_computed(self) -> int:
        """Every row the executor computed (appended, prefilled and rebuilt)."""
        return self.rows_appended + self.rows_prefilled + self.rows_rebuilt
