"""The carry core: pure Python, no torch, no GPU library (SPEC.md is its contract).

Owner: the MTP drafter's model layer. Invariants across the core:
- Tickets and session hashes are unsigned 64-bit ints; `0` never matches anything.
- Drafter row `r` holds pair key `k` at RoPE `k + 1`; rows are compacted,
  keys strictly increasing; a prompt of `L` tokens has keys `0 ..= L - 2`.
- Hidden-store row `i` holds `hidden_i` by absolute position, and every
  written interval is stamped with the ticket that wrote it.
"""

from .adopt import decide_adopt
from .carry_store import (
    EVICTION_CAUSES,
    MISS_MEMORY,
    REFUSAL_CAUSES,
    TIERS,
    CarryStore,
    HostMoves,
    TierStats,
)
from .debuglog import log_adopt, log_store
from .drafter import CarriedDrafter
from .outcome import NO_CARRY_REASONS, OUTCOME_KINDS, CarryOutcome
from .plan import AppendPlan, hidden_row_offset, plan_append
from .session import TicketCounter, carry_key, session_hash
from .settings import (
    DEFAULT_CARRY_EVICTION,
    DEFAULT_CARRY_IDLE_S,
    DEFAULT_CARRY_MEMORY,
    DEFAULT_CARRY_SHARE,
    DEFAULT_CARRY_SLOTS,
    DEFAULT_MARCONI_MIN_TOKENS,
    DEFAULT_MTP_MAX_SEQS,
    EVICTION_POLICIES,
    CarryMemory,
    DrafterContext,
    PinnedSetting,
    carry_armed,
    carry_armed_with,
    carry_eviction,
    carry_idle_s,
    carry_memory,
    carry_share,
    carry_slots,
    marconi_min_tokens,
    mtp_carry_debug,
    mtp_carry_drafter_enabled,
    mtp_max_seqs,
    mtp_multi_seq_mode,
    parse_carry_memory,
    set_carry_eviction,
    set_carry_idle_s,
    set_carry_memory,
    set_carry_share,
    set_carry_slots,
    set_marconi_min_tokens,
    set_mtp_max_seqs,
)
from .store_range import StoreRange, merge_interval, stamped_merge
from .tokens import common_prefix_len

__all__ = [
    "DEFAULT_CARRY_EVICTION",
    "DEFAULT_CARRY_IDLE_S",
    "DEFAULT_CARRY_MEMORY",
    "DEFAULT_CARRY_SHARE",
    "DEFAULT_CARRY_SLOTS",
    "EVICTION_POLICIES",
    "MISS_MEMORY",
    "NO_CARRY_REASONS",
    "REFUSAL_CAUSES",
    "CarryMemory",
    "carry_eviction",
    "carry_idle_s",
    "carry_key",
    "carry_memory",
    "carry_share",
    "parse_carry_memory",
    "set_carry_eviction",
    "set_carry_idle_s",
    "set_carry_memory",
    "set_carry_share",
    "DEFAULT_MARCONI_MIN_TOKENS",
    "EVICTION_CAUSES",
    "DEFAULT_MTP_MAX_SEQS",
    "OUTCOME_KINDS",
    "AppendPlan",
    "CarriedDrafter",
    "CarryOutcome",
    "CarryStore",
    "HostMoves",
    "TIERS",
    "TierStats",
    "DrafterContext",
    "PinnedSetting",
    "StoreRange",
    "TicketCounter",
    "carry_armed",
    "carry_armed_with",
    "carry_slots",
    "common_prefix_len",
    "decide_adopt",
    "hidden_row_offset",
    "log_adopt",
    "log_store",
    "marconi_min_tokens",
    "merge_interval",
    "mtp_carry_debug",
    "mtp_carry_drafter_enabled",
    "mtp_max_seqs",
    "mtp_multi_seq_mode",
    "plan_append",
    "session_hash",
    "set_carry_slots",
    "set_marconi_min_tokens",
    "set_mtp_max_seqs",
    "stamped_merge",
]
